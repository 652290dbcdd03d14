"""argmax/argmin on every Shard/Replicate layout, uneven shards with empty local shards
included: equal to single-device torch (first occurrence on ties), no communication over an
unsharded dim, and only candidate-sized gathers over a sharded one."""

from __future__ import annotations

import itertools

import pytest
import torch

import vescale
from tests.dtensor.reference import compared, equals_full, local_dtensor
from tests.harness.collectives import count_collectives
from vescale import Replicate, Shard

LAYOUTS = [((4,), [p]) for p in (Replicate(), Shard(0), Shard(1))] + [
    ((2, 2), list(pl)) for pl in itertools.product([Replicate(), Shard(0), Shard(1)], repeat=2)
]


def _check(shape):
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 4, shape, generator=g).double()  # many ties: first occurrence matters

    def run(mesh_shape, placements, op, dim, keepdim):
        out = getattr(local_dtensor(x, mesh_shape, placements), op)(dim, keepdim=keepdim)
        case = (mesh_shape, placements, op, dim, keepdim)
        assert equals_full(out, getattr(x, op)(dim, keepdim=keepdim)), case

    for mesh_shape, placements in LAYOUTS:
        cases = list(itertools.product(("argmax", "argmin"), (0, 1, -1), (False, True)))
        local = [c for c in cases if not any(p.is_shard(c[1] % 2) for p in placements)]
        with count_collectives() as counts:  # over an unsharded dim: none, for all together
            for c in local:
                run(mesh_shape, placements, *c)
        assert sum(counts.values()) == 0, (mesh_shape, placements, counts)
        for c in [c for c in cases if c not in local]:
            with count_collectives() as counts:
                run(mesh_shape, placements, *c)
            sharded = sum(p.is_shard(c[1] % 2) for p in placements)
            case = (mesh_shape, placements, *c)
            assert sum(counts.values()) == 2 * sharded, (
                case,
                counts,
            )  # values + indices per mesh dim


@pytest.mark.parametrize("shape", [(8, 12), (5, 7), (3, 2)])  # even; uneven; empty shards
def test_arg_extremum_on_every_layout(pool4, shape):
    pool4.run(_check, shape)


def _check_topk(shape, k):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(*shape, generator=g, dtype=torch.float64)  # no ties
    for (mesh_shape, placements), dim, largest in itertools.product(LAYOUTS, (0, 1), (True, False)):
        d = local_dtensor(x, mesh_shape, placements).requires_grad_(True)
        with count_collectives() as counts:
            values, indices = d.topk(k, dim, largest=largest)
        ref = x.clone().requires_grad_(True)
        ref_values, ref_indices = ref.topk(k, dim, largest=largest)
        case = (mesh_shape, placements, dim, largest)
        assert equals_full(values, ref_values.detach()), case
        assert equals_full(indices, ref_indices), case
        sharded = sum(p.is_shard(dim) for p in placements)
        assert sum(counts.values()) == 2 * sharded, (case, counts)  # k candidates, not the dim
        weights = torch.arange(1.0, ref_values.numel() + 1, dtype=torch.float64).view_as(ref_values)
        (ref_values * weights).sum().backward()
        dw = local_dtensor(weights, mesh_shape, values.placements)
        with vescale.dtensor.explicit_redistribute(False):
            (values * dw).sum().backward()
        torch.testing.assert_close(*compared(d.grad, ref.grad))


@pytest.mark.parametrize("shape", [(8, 12), (5, 7), (3, 2)])
def test_topk_on_every_layout(pool4, shape):
    pool4.run(_check_topk, shape, 2)
