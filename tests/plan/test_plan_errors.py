"""A bad plan fails in ``vescale.parallelize`` before anything is traced or communicated, with
an error naming the parameter (or pattern), the placement and the mesh."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import vescale
from vescale import InterleavedShard, Replicate, Shard
from vescale.plan import PlanError


def _mesh() -> vescale.DeviceMesh:
    return vescale.DeviceMesh("meta", torch.arange(4).view(2, 2), mesh_dim_names=("dp", "tp"))


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x).sum()


def _parallelize(plan: dict, inputs: list | None = None) -> None:
    vescale.parallelize(
        Tiny(),
        _mesh(),
        plan,
        inputs=inputs or [{"dp": Shard(0)}],
        example_inputs=[torch.randn(4, 8)],
    )


@pytest.mark.parametrize(
    ("plan", "pieces"),
    [
        (
            {"fc.wieght": {"tp": Shard(0)}},
            ["'fc.wieght'", "matches no parameter", "Shard(dim=0)", "mesh(dp=2, tp=2)"],
        ),
        (
            {"fc.bias": {"tp": Shard(1)}},
            ["'fc.bias'", "Shard(dim=1)", "mesh(dp=2, tp=2)", "shape (6,)"],
        ),
        (
            {"fc.weight": {"pp": Shard(0)}},
            ["fc.weight", "mesh dim 'pp' does not exist", "mesh(dp=2, tp=2)"],
        ),
        (
            {"fc.weight": {"tp": InterleavedShard(0, 4)}},
            ["'fc.weight'", "InterleavedShard", "mesh(dp=2, tp=2)", "size 6", "4 groups"],
        ),
        (
            {"fc.weight": (Replicate(),)},
            ["fc.weight", "not one placement per dim", "mesh(dp=2, tp=2)"],
        ),
    ],
)
def test_bad_plan_is_refused_naming_parameter_placement_and_mesh(plan, pieces):
    with pytest.raises(PlanError) as err:
        _parallelize(plan)
    for piece in pieces:
        assert piece in str(err.value), (piece, str(err.value))


def test_bad_input_placement_is_refused():
    with pytest.raises(
        PlanError, match=r"inputs\[0\].*Shard\(dim=2\).*mesh\(dp=2, tp=2\).*shape \(4, 8\)"
    ):
        _parallelize({}, inputs=[{"dp": Shard(2)}])
