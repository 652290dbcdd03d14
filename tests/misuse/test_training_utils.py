"""``torch.nn.utils.clip_grad_norm_`` on vescale DTensors in explicit mode (issue 27 item 13).

Parameters on a 2x2 ``(dp, tp)`` mesh with mixed placements (Shard over tp, Replicate,
Shard over both, Shard over dp only; uneven shards): the total norm and the clipped
gradients equal the one-device float64 result for ``foreach`` True/False, ``norm_type`` 2,
3, inf, -inf, with explicit mode on (the default) and off. A norm's reductions are what the
caller asked for, so reducing a norm's own pending partial is no implicit redistribution;
explicit mode still rejects real ones. ``error_if_nonfinite`` raises the same error on
every rank when a NaN sits in one rank's shard.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import vescale
from tests.harness.collectives import count_collectives
from tests.harness.misuse import error_everywhere
from vescale.dtensor.explicit import ImplicitRedistributionError
from vescale.dtensor.placement_types import Partial, Replicate, Shard

INF = float("inf")
LAYOUTS = [  # (global shape, placements on (dp, tp))
    ((5, 3), [Replicate(), Shard(0)]),  # Shard over tp, uneven (3, 2)
    ((4,), [Replicate(), Replicate()]),
    ((6, 7), [Shard(0), Shard(1)]),  # Shard over both, uneven over tp (4, 3)
    ((5, 3), [Shard(0), Shard(0)]),  # one dim over both: 2, 1, 1, 1 rows
    ((3, 5), [Shard(1), Replicate()]),  # Shard over dp only
]
MAX_NORM = 1.0


def _mesh():
    return vescale.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


def _grads(nan: bool = False) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    grads = [torch.randn(*shape, generator=gen, dtype=torch.float64) for shape, _ in LAYOUTS]
    if nan:
        grads[2][5, 6] = float("nan")  # in one rank's shard only
    return grads


def _parameters(grads: list[torch.Tensor]) -> list[nn.Parameter]:
    mesh, out = _mesh(), []
    for g, (shape, placements) in zip(grads, LAYOUTS):
        p = nn.Parameter(
            vescale.distribute_tensor(torch.zeros(shape, dtype=g.dtype), mesh, placements)
        )
        p.grad = vescale.distribute_tensor(g, mesh, placements)
        out.append(p)
    return out


def _reference(norm_type: float, foreach: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    params = [nn.Parameter(torch.zeros_like(g)) for g in _grads()]
    for p, g in zip(params, _grads()):
        p.grad = g
    total = nn.utils.clip_grad_norm_(params, MAX_NORM, norm_type, foreach=foreach)
    return total, [p.grad for p in params]


def clip_equals_one_device(norm_type: float, foreach: bool, explicit: bool) -> None:
    ref_total, ref_grads = _reference(norm_type, foreach)
    params = _parameters(_grads())
    with vescale.dtensor.explicit_redistribute(explicit), count_collectives() as counts:
        total = nn.utils.clip_grad_norm_(params, MAX_NORM, norm_type, foreach=foreach)
    what = (norm_type, foreach, explicit, dict(counts))
    assert isinstance(total, vescale.DTensor), what
    torch.testing.assert_close(
        total.full_tensor(), ref_total, rtol=1e-12, atol=1e-12, msg=str(what)
    )
    assert ref_total > MAX_NORM or norm_type == -INF, what  # the gradients were clipped
    # the per-parameter norms' reductions, deferred and done once (over the flattened mesh)
    assert dict(counts) == {"all_reduce": 1}, what
    mesh = _mesh()
    for p, ref, (_, placements) in zip(params, ref_grads, LAYOUTS):
        assert tuple(p.grad.placements) == tuple(placements), what
        # this rank's shard of the one-device result (full_tensor() of the nested uneven
        # (Shard(0), Shard(0)) layout loses a row, upstream's DTensors' too: not this test's)
        mine = vescale.distribute_tensor(ref, mesh, placements).to_local()
        torch.testing.assert_close(p.grad.to_local(), mine, rtol=1e-12, atol=1e-12, msg=str(what))


@pytest.mark.parametrize("norm_type", [2.0, 3.0, INF, -INF])
@pytest.mark.parametrize("foreach", [False, True], ids=["loop", "foreach"])
def test_clip_grad_norm_equals_one_device(pool4, norm_type, foreach):
    for explicit in (True, False):
        pool4.run(clip_equals_one_device, norm_type, foreach, explicit)


def clip_nonfinite(norm_type: float, foreach: bool) -> None:
    params = _parameters(_grads(nan=True))
    nn.utils.clip_grad_norm_(params, MAX_NORM, norm_type, error_if_nonfinite=True, foreach=foreach)


@pytest.mark.parametrize("norm_type", [2.0, 3.0])
@pytest.mark.parametrize("foreach", [False, True], ids=["loop", "foreach"])
def test_error_if_nonfinite_raises_on_every_rank(pool4, norm_type, foreach):
    err = error_everywhere(pool4, clip_nonfinite, norm_type, foreach)
    assert err.kind == "RuntimeError", err
    assert f"The total norm of order {norm_type} for gradients" in err.message, err
    assert "non-finite" in err.message, err


def explicit_mode_still_rejects() -> None:
    """Only a norm's own pending partial is exempt: a user's Partial, a sharded input and a
    max the caller did not ask to reduce still raise, naming op and placements."""
    mesh = _mesh()
    x = torch.arange(24.0).reshape(4, 6)
    cases = {
        "aten.mm.default": lambda: torch.mm(
            vescale.distribute_tensor(x, mesh, [Replicate(), Shard(1)]),
            vescale.distribute_tensor(x.t().contiguous(), mesh, [Replicate(), Shard(1)]),
        ),
        "aten.exp.default": lambda: torch.exp(
            vescale.distribute_tensor(x, mesh, [Partial(), Replicate()])
        ),
        "aten.add.Tensor": lambda: (
            torch.amax(vescale.distribute_tensor(x, mesh, [Shard(0), Replicate()])) + 1.0
        ),
    }
    rank = dist.get_rank()
    for op, fn in cases.items():
        with pytest.raises(ImplicitRedistributionError, match=op) as info:
            fn()
        assert "explicit mode is on" in str(info.value), (rank, op)


def test_explicit_mode_still_rejects_implicit_redistribution(pool4):
    pool4.run(explicit_mode_still_rejects)
