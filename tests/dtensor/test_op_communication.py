"""Communication of the ops of docs/concepts.md "Ops on every placement", counted with the profiler, explicit mode on.

* Layouts that need no communication run with zero collectives, forward and backward (and
  values equal single-device torch: the same check as the fuzz test).
* Where communication is inherent, its bytes are pinned far below gathering the input:
  topk over a sharded dim, class-sharded cross-entropy, unique; the vocabulary-parallel
  embedding never moves its table.
* Partial inputs: linear ops keep ``Partial`` with no communication, non-linear ones raise
  the explicit-mode error naming the op and the placements.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import vescale
from tests.dtensor.op_cases import BY_NAME, EVEN, UNEVEN
from tests.dtensor.reference import mesh_of
from tests.dtensor.test_op_fuzz import check_layout
from tests.harness.collectives import count_collectives
from vescale import Partial, Replicate, Shard
from vescale.dtensor.dispatch import ImplicitRedistributionError

R, P, S0, S1 = Replicate(), Partial(), Shard(0), Shard(1)

# (case, mesh, per-input placements): no collective, forward or backward
NO_COMMUNICATION = [
    ("argmax", (4,), ((S0,),)),
    ("argmax", (2, 2), ((S0, S0),)),
    ("argmin", (4,), ((S1,),)),
    ("topk_dim0", (2, 2), ((S1, S1),)),
    ("topk_dim1_smallest", (4,), ((S0,),)),
    ("select_dim1", (4,), ((S0,),)),
    ("select_dim0", (2, 2), ((S1, P),)),
    ("alias", (2, 2), ((S0, P),)),
    ("scatter_src_dim1", (4,), ((S0,), (S0,), (S0,))),
    ("scatter__value_dim1", (2, 2), ((S0, S0), (S0, S0))),
    ("scatter__src_dim0", (4,), ((S1,), (S1,), (S1,))),
    ("index_put", (4,), ((S1,), (R,), (S1,))),
    ("index_put__accumulate", (4,), ((S1,), (R,), (S1,))),
    ("index_add__dim0", (4,), ((S1,), (R,), (S1,))),
    ("index_add__dim0", (4,), ((P,), (R,), (P,))),
    ("index_add__dim1", (2, 2), ((S0, P), (R, R), (S0, P))),
    ("expand_as", (4,), ((S0,), (S0,))),
    ("one_hot", (2, 2), ((S0, S1),)),
    ("where", (4,), ((S0,), (S0,), (S0,))),
    ("where_scalar", (2, 2), ((S1, S0), (S1, S0))),
    ("embedding", (4,), ((R,), (S0,))),  # vocabulary-parallel: Partial output
    ("embedding", (4,), ((R,), (S1,))),  # column-wise
    ("embedding", (2, 2), ((S0, R), (R, S0))),  # batch over mesh dim 0, vocabulary over 1
    ("embedding", (2, 2), ((R, R), (S0, S1))),  # both table dims sharded
    ("cross_entropy_none", (4,), ((S0,), (S0,))),
    ("cross_entropy_sum_ignore", (4,), ((S0,), (S0,))),
    ("nll_loss", (2, 2), ((S0, S1), (S0, R))),  # batch x classes, mean: see the byte test
    ("sdpa_cpu_flash_causal", (2, 2), ((S1, R),) * 3),
    ("sdpa_cpu_flash_causal", (2, 2), ((S0, S1),) * 3),
    ("sdpa_math", (2, 2), ((R, S1),) * 3),  # no empty shard: the math path views (B*H)
]


def _no_communication(cases):
    bad = []
    with vescale.dtensor.explicit_redistribute(True):
        for name, mesh_shape, layout in cases:
            for size in (EVEN, UNEVEN):
                fwd, bwd = check_layout(BY_NAME[name], size, mesh_shape, layout, count_collectives)
                seen = dict(fwd) | ({f"backward {k}": v for k, v in bwd.items()} if bwd else {})
                if name == "nll_loss":  # mean: one scalar all-reduce over the batch mesh dim
                    assert dict(fwd) == {"all_reduce": 1} and fwd.bytes["all_reduce"] == 8
                    seen = {f"backward {k}": v for k, v in bwd.items()}
                if any(seen.values()):
                    bad.append((name, mesh_shape, layout, size, seen))
    return bad


def test_no_communication_where_the_placement_allows(pool4):
    bad = pool4.run(_no_communication, NO_COMMUNICATION)[0]
    assert not bad, "\n".join(map(str, bad))


def _bytes(fn):
    with count_collectives() as counts:
        out = fn()
    return out, dict(counts), dict(counts.bytes)


def _topk_candidates():
    """topk(k=2) over dim 0 of a (64, 32) float64 tensor sharded over it on 4 ranks: each
    rank sends its k candidates per column (values + indices), 2 * 2 * 32 * 8 = 1024 B,
    against 64 * 32 * 8 / 4 = 4096 B for its share of gathering the input."""
    x = torch.randn(64, 32, dtype=torch.float64)
    d = vescale.distribute_tensor(x, mesh_of((4,)), [S0])
    (values, indices), counts, nbytes = _bytes(lambda: d.topk(2, 0))
    assert torch.equal(values.full_tensor(), x.topk(2, 0).values)
    assert torch.equal(indices.full_tensor(), x.topk(2, 0).indices)
    assert counts == {"all_gather": 2} and nbytes == {"all_gather": 2 * 2 * 32 * 8}
    assert nbytes["all_gather"] <= 64 * 32 * 8 / 4 / 4


def _class_sharded_cross_entropy():
    """Cross-entropy of (16, 1024) float64 logits sharded over classes on 4 ranks: forward =
    two all-reduces of 16 row values (max, sum of exponentials), 2 * 16 * 8 = 256 B;
    backward = one (the softmax's row sums), 128 B; gathering the logits would move
    16 * 1024 * 8 / 4 = 32 KiB per rank. The logits' gradient stays class-sharded."""
    n, c = 16, 1024
    logits = torch.randn(n, c, dtype=torch.float64)
    target = torch.randint(0, c, (n,))
    target[3] = -100
    mesh = mesh_of((4,))
    d = vescale.distribute_tensor(logits, mesh, [S1]).requires_grad_(True)
    t = vescale.distribute_tensor(target, mesh, [R])
    loss, counts, nbytes = _bytes(lambda: F.cross_entropy(d, t))
    assert counts == {"all_reduce": 2} and nbytes == {"all_reduce": 2 * n * 8}
    _, bcounts, bbytes = _bytes(loss.backward)
    assert bcounts == {"all_reduce": 1} and bbytes == {"all_reduce": n * 8}
    ref = logits.clone().requires_grad_(True)
    ref_loss = F.cross_entropy(ref, target)
    ref_loss.backward()
    torch.testing.assert_close(loss.full_tensor(), ref_loss.detach(), rtol=1e-12, atol=1e-12)
    assert d.grad.placements == (S1,)
    torch.testing.assert_close(d.grad.full_tensor(), ref.grad, rtol=1e-12, atol=1e-12)
    assert nbytes["all_reduce"] + bbytes["all_reduce"] <= n * c * 8 / 4 / 64


def _vocab_parallel_embedding():
    """A (1000, 16) table sharded over the vocabulary on 4 ranks: lookups, forward and
    backward, move no bytes; the output is Partial until reduced; the gradient arrives in
    the table's placements."""
    table = torch.randn(1000, 16, dtype=torch.float64)
    idx = torch.randint(0, 1000, (8, 5))
    mesh = mesh_of((4,))
    w = vescale.distribute_tensor(table, mesh, [S0]).requires_grad_(True)
    i = vescale.distribute_tensor(idx, mesh, [R])
    out, counts, _ = _bytes(lambda: F.embedding(i, w))
    assert counts == {} and out.placements == (P,)
    _, bcounts, _ = _bytes(lambda: (out * 2.0).sum().backward())
    ref = table.clone().requires_grad_(True)
    (F.embedding(idx, ref) * 2.0).sum().backward()
    assert w.grad.placements == (S0,)
    torch.testing.assert_close(out.full_tensor(), F.embedding(idx, table), rtol=0, atol=0)
    torch.testing.assert_close(w.grad.full_tensor(), ref.grad, rtol=0, atol=0)
    assert bcounts.get("all_gather", 0) == 0  # the table (or its gradient) is never gathered


def _sharded_unique():
    """unique of a (64, 32) int64 tensor with 6 distinct values, sharded over rows on 4
    ranks: each rank sends its unique count (8 B), its padded uniques (<= 6 * 8 B) and the
    counts (6 * 8 B): <= 104 B against 64 * 32 * 8 / 4 = 4096 B for gathering its shard."""
    x = torch.randint(0, 6, (64, 32))
    d = vescale.distribute_tensor(x, mesh_of((4,)), [S0])
    (values, inverse, counts_), counts, nbytes = _bytes(
        lambda: torch.unique(d, return_inverse=True, return_counts=True)
    )
    ref = torch.unique(x, return_inverse=True, return_counts=True)
    assert torch.equal(values.full_tensor(), ref[0])
    assert inverse.placements == (S0,) and torch.equal(inverse.full_tensor(), ref[1])
    assert torch.equal(counts_.full_tensor(), ref[2])
    assert counts == {"all_gather": 2, "all_reduce": 1}
    assert sum(nbytes.values()) <= 8 + 6 * 8 + 6 * 8 < 64 * 32 * 8 / 4


@pytest.mark.parametrize(
    "check",
    [_topk_candidates, _class_sharded_cross_entropy, _vocab_parallel_embedding, _sharded_unique],
    ids=lambda f: f.__name__.strip("_"),
)
def test_communication_far_below_gathering(pool4, check):
    with_explicit(pool4, check)


def with_explicit(pool, check):
    pool.run(check, env={"VESCALE_DISABLE_REDISTRIBUTE": "1"})


def _partial_rules():
    mesh = mesh_of((4,))
    x = torch.randn(8, 6, dtype=torch.float64)
    d = vescale.distribute_tensor(x, mesh, [P])
    idx = vescale.distribute_tensor(torch.tensor([1, 5, 1]), mesh, [R])
    src = vescale.distribute_tensor(torch.randn(3, 6, dtype=torch.float64), mesh, [P])
    linear = {
        "mul": lambda: d * 2.0,
        "alias": lambda: torch.ops.aten.alias(d),
        "select": lambda: d.select(1, 2),
        "index_add": lambda: d.index_add(0, idx, src),
        "embedding": lambda: F.embedding(idx, d),
        "add": lambda: d + d,
    }
    for name, fn in linear.items():
        out, counts, _ = _bytes(fn)
        assert out.placements == (P,) and not counts, (name, out.placements, counts)
    t = vescale.distribute_tensor(torch.tensor([1, 2, 3, 4, 5, 0, 1, 2]), mesh, [R])
    nonlinear = {
        "aten.exp.default": lambda: d.exp(),
        "aten.argmax.default": lambda: d.argmax(1),
        "aten._log_softmax.default": lambda: F.cross_entropy(d, t),
        "aten._unique2.default": lambda: torch.unique(d),
        "aten.topk.default": lambda: d.topk(2, 1),
    }
    for op, fn in nonlinear.items():
        with pytest.raises(ImplicitRedistributionError) as err:
            fn()
        msg = str(err.value)
        assert op in msg and "from (Partial(sum),)" in msg and "explicit mode" in msg, msg


def test_partial_inputs_linear_keep_nonlinear_raise(pool4):
    with_explicit(pool4, _partial_rules)
