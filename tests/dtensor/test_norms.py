"""Norms and reductions over every dim of sharded inputs (issue 18), against one device in
float64 (1e-10): infinity norms' gradients (their backward counts the extrema with
``sum(dim=[])``), reductions given an empty dim list, and the ``_foreach_norm(..., inf)``
layout on 2x2 that left two ranks waiting in a collective (a hang now fails by the pool's
timeout)."""

from __future__ import annotations

import pytest
import torch

import vescale
from tests.dtensor.op_cases import EVEN
from tests.dtensor.reference import compared, local_dtensor
from tests.dtensor.strategy_validation import CASE_BY_NAME
from tests.dtensor.test_op_fuzz import check_layout
from tests.harness.collectives import count_collectives
from vescale import Replicate, Shard

INF = float("inf")
LAYOUTS = [
    ((4,), [Shard(0)]),
    ((4,), [Shard(1)]),
    ((2, 2), [Shard(0), Replicate()]),
    ((2, 2), [Shard(0), Shard(1)]),
    ((2, 2), [Shard(1), Shard(1)]),
]


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-10, atol=1e-10)


def _check_inf_norms(shape: tuple[int, int], explicit: bool) -> None:
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    for order in (INF, -INF):
        ref_x = x.clone().requires_grad_(True)
        ref = torch.linalg.vector_norm(ref_x, order)
        ref.backward()
        for mesh_shape, placements in LAYOUTS:
            dx = local_dtensor(x, mesh_shape, placements).requires_grad_()
            with vescale.dtensor.explicit_redistribute(explicit):
                with count_collectives() as forward:
                    out = torch.linalg.vector_norm(dx, order)
                with count_collectives() as backward:
                    out.backward()
            what = (order, mesh_shape, placements)
            _close(*compared(out, ref.detach()))
            _close(*compared(dx.grad, ref_x.grad))
            assert tuple(dx.grad.placements) == tuple(placements), what
            if explicit:  # even shards: local extrema, no gather; backward: the norm and
                # the count of extrema all-reduced, one all-reduce per sharded mesh dim each
                sharded = sum(p.is_shard() for p in placements)
                expected = ({}, {"all_reduce": 2 * sharded})
                assert (dict(forward), dict(backward)) == expected, (what, forward, backward)


def test_inf_norm_over_all_dims_gradient(pool4):
    """``vector_norm(x, ±inf)`` over all dims of a sharded x: the gradient was NaN on every
    shard (each rank divided by the count of extrema in its own shard, 0 on most)."""
    pool4.run(_check_inf_norms, (8, 12), True)  # even: no implicit forward redistribution
    pool4.run(_check_inf_norms, (5, 7), False)  # uneven, an empty shard on 4 ranks


REDUCTIONS = {
    "sum": lambda x: torch.sum(x, []),
    "sum_keepdim": lambda x: torch.sum(x, [], keepdim=True),
    "mean": lambda x: torch.mean(x, []),
    "nansum": lambda x: torch.nansum(x, []),
    "amax": lambda x: torch.amax(x, [], keepdim=True),
    "amin": lambda x: torch.amin(x, []),
    "var": lambda x: torch.var(x, []),
    "std": lambda x: torch.std(x, [], keepdim=True),
    "var_mean": lambda x: torch.var_mean(x, [])[0],
    "vector_norm": lambda x: torch.linalg.vector_norm(x, 3, dim=[]),
    "powsum": lambda x: torch.ops.aten.linalg__powsum(x, 2.0, []),
}


def _check_empty_dim_list(name: str, shape: tuple[int, int]) -> None:
    fn = REDUCTIONS[name]
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    ref = fn(x)
    for mesh_shape, placements in LAYOUTS:
        dx = local_dtensor(x, mesh_shape, placements)
        with vescale.dtensor.explicit_redistribute(False):
            out = fn(dx)
            assert out.shape == ref.shape, (name, placements, out.shape)
            _close(*compared(out, ref))


@pytest.mark.parametrize("name", sorted(REDUCTIONS))
def test_reduction_over_empty_dim_list(pool4, name):
    """An empty dim list reduces every dim (upstream's strategies reduced none: the result
    kept the input's shards and had the wrong global shape)."""
    pool4.run(_check_empty_dim_list, name, (8, 12))
    pool4.run(_check_empty_dim_list, name, (5, 7))  # amax/amin: an empty shard replicated


def _foreach_inf_on_2x2() -> None:
    layout = ((Replicate(), Shard(0)), (Shard(1), Shard(1)))
    with vescale.dtensor.explicit_redistribute(False):
        check_layout(CASE_BY_NAME["foreach_norm"], EVEN, (2, 2), layout)


def test_foreach_inf_norm_on_2x2(pool4):
    """The validation's ``_foreach_norm([x, y], inf)`` layout that hung (ranks 0-1 waited in
    a collective): outputs and both gradients equal one device."""
    pool4.run(_foreach_inf_on_2x2, timeout_s=120)
