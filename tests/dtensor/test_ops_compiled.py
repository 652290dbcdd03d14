"""A representative subset of the docs/concepts.md ops under ``torch.compile(backend="vescale")``:
the compiled program gives single-device values and gradients (the fuzz test's check) and
issues exactly the collectives eager issues (zero for the layouts that need none).

Functions that *return* a view of a DTensor input (``select``, ``expand_as``, ``alias`` alone)
are not in the subset: AOTAutograd regenerates such outputs with ``as_strided``, which
upstream DTensor does not support."""

from __future__ import annotations

import torch

from tests.dtensor.op_cases import BY_NAME, UNEVEN
from tests.dtensor.test_op_fuzz import check_layout
from tests.harness.collectives import count_collectives
from vescale import Partial, Replicate, Shard

R, P, S0, S1 = Replicate(), Partial(), Shard(0), Shard(1)

COMPILED = [
    ("topk_dim0", (4,), ((S0,),)),  # candidate gather inside the graph
    ("scatter_src_dim1", (4,), ((S0,), (S0,), (S0,))),
    ("index_add__dim0", (4,), ((S1,), (R,), (S1,))),
    ("index_put__accumulate", (4,), ((S1,), (R,), (S1,))),
    ("one_hot", (4,), ((S0,),)),
    ("where", (4,), ((S0,), (S0,), (S0,))),
    ("embedding", (4,), ((R,), (S0,))),  # vocabulary-parallel
    ("cross_entropy", (4,), ((S1,), (R,))),  # class-sharded logits
    ("nll_loss", (2, 2), ((S0, S1), (S0, R))),
    ("sdpa_cpu_flash_causal", (2, 2), ((S0, S1),) * 3),
]


def _counts(fwd, bwd):
    return dict(fwd), dict(bwd or {})


def _compiled_subset():
    out = []
    for name, mesh_shape, layout in COMPILED:
        case = BY_NAME[name]
        torch._dynamo.reset()
        compiled = torch.compile(case.fn, backend="vescale", options={"codegen": "fx"})
        eager = _counts(*check_layout(case, UNEVEN, mesh_shape, layout, count_collectives))
        check_layout(case, UNEVEN, mesh_shape, layout, run=compiled)  # compiles, then checks
        ran = _counts(*check_layout(case, UNEVEN, mesh_shape, layout, count_collectives, compiled))
        out.append((name, eager, ran))
    return out


def test_ops_compiled_equal_single_device_and_eager_collectives(pool4):
    for name, eager, compiled in pool4.run(_compiled_subset, timeout_s=900)[0]:
        assert compiled == eager, (name, eager, compiled)
