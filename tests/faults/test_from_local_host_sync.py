"""``from_local``'s metadata exchange (``run_check``, ``support_uneven``) happens on the host:
no tensor value is read back, and the all-gathers carry CPU tensors over a group with a CPU
backend (the mesh's own, or vescale's side group when the mesh's groups have none)."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import vescale
from tests.dtensor.reference import mesh_of
from tests.harness.host_sync import count_host_syncs
from vescale import Shard, _agree
from vescale.dtensor import local_metadata


def _exchange(run_check: bool, cpu_backend: bool) -> tuple[list[str], list[str], list[int]]:
    mesh = mesh_of((2,))
    rank = dist.get_rank()
    local = torch.full((3 - rank, 3), float(rank))  # uneven: 3 and 2 rows
    args = (local, mesh, [Shard(0)])
    kwargs = {"run_check": run_check, "support_uneven": True}
    vescale.from_local(*args, **kwargs)  # first call: the side group, the coordinates cache
    used: list[str] = []
    real = dist.all_gather_single

    def recording(out: torch.Tensor, inp: torch.Tensor, group: object = None) -> object:
        side = _agree.side_group() if not cpu_backend else None
        name = "mesh" if group is mesh.get_group(0) else "side" if group is side else "other"
        used.append(f"{out.device.type}/{inp.device.type} over {name}")
        return real(out, inp, group=group)

    def refused(*a: object, **k: object) -> object:
        raise AssertionError("a device all-gather of from_local's metadata")

    with (
        mock.patch.object(local_metadata, "has_cpu_backend", lambda g: cpu_backend),
        mock.patch.object(dist, "all_gather_single", recording),
        mock.patch.object(funcol, "all_gather_single", refused),
        count_host_syncs() as syncs,
    ):
        dt = vescale.from_local(*args, **kwargs)
    return syncs.calls, used, list(dt.shape)


@pytest.mark.parametrize("run_check", [True, False])
@pytest.mark.parametrize("cpu_backend", [True, False])
def test_from_local_metadata_stays_on_the_host(pool2, run_check, cpu_backend):
    where = "mesh" if cpu_backend else "side"
    assert (
        pool2.run(_exchange, run_check, cpu_backend)
        == [([], [f"cpu/cpu over {where}"], [5, 3])] * 2
    )


def _error(local: torch.Tensor, run_check: bool, cpu_backend: bool) -> str:
    with mock.patch.object(local_metadata, "has_cpu_backend", lambda g: cpu_backend):
        try:
            vescale.from_local(local, mesh_of((2,)), [Shard(0)], run_check=run_check)
        except ValueError as err:
            return str(err)
    return "no error"


def _errors_alike(run_check: bool) -> list[str]:
    local = torch.zeros(2 + 2 * dist.get_rank(), 3)  # 2 and 4 rows: not a torch.chunk split
    return [_error(local, run_check, cpu_backend) for cpu_backend in (True, False)]


@pytest.mark.parametrize("run_check", [True, False])
def test_from_local_errors_are_the_same_over_either_group(pool2, run_check):
    (mesh, side), other = pool2.run(_errors_alike, run_check)
    assert mesh == side and [mesh, side] == other
    assert mesh.startswith("from_local: local sizes [2, 4] of tensor dim 0 along mesh dim 0")
