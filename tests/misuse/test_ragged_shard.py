"""RaggedShard misuse: the same clear error on every rank, within seconds, never a hang."""

from __future__ import annotations

import torch
import torch.distributed as dist

import vescale
from tests.dtensor.reference import mesh_of
from tests.harness.misuse import error_everywhere
from vescale import RaggedShard, Replicate, Shard


def _units_do_not_divide():
    vescale.distribute_tensor(torch.zeros(5, 3), mesh_of((4,)), [RaggedShard((0,), (1, 1, 1, 1))])


def _wrong_number_of_units():
    vescale.distribute_tensor(torch.zeros(6, 3), mesh_of((4,)), [RaggedShard((0,), (1, 2))])


def _redistribute_to_bad_units():
    x = vescale.distribute_tensor(torch.zeros(6, 3), mesh_of((2, 2)), [Shard(0), Replicate()])
    x.redistribute(mesh_of((2, 2)), [Shard(0), RaggedShard((0,), (1, 1))])  # 3 rows per chunk


def _from_local_wrong_slice():
    rows = [1, 1, 2, 2][dist.get_rank()]  # units say 1, 0, 3, 2
    local = torch.zeros(rows * 3)
    vescale.from_local(
        local, mesh_of((4,)), [RaggedShard((0,), (1, 0, 3, 2))], shape=(6, 3), stride=(3, 1)
    )


def _from_local_no_shape():
    local = torch.zeros(3 * (dist.get_rank() + 1))
    vescale.from_local(local, mesh_of((2, 2)), [RaggedShard((0,), (1, 1)), Shard(1)])


def _unsupported_op():
    x = vescale.distribute_tensor(
        torch.zeros(6, 3), mesh_of((4,)), [RaggedShard((0,), (1, 0, 3, 2))]
    )
    torch.mm(x, x.t())


def test_units_that_do_not_divide_the_rows(pool4):
    e = error_everywhere(pool4, _units_do_not_divide)
    assert e.kind == "ValueError"
    assert "cannot split the 5 rows of shape (5, 3)" in e.message
    assert "sum(local_units) = 4" in e.message and "DeviceMesh" in e.message


def test_wrong_number_of_units(pool4):
    e = error_everywhere(pool4, _wrong_number_of_units)
    assert "2 local_units for the 4 ranks" in e.message and "distribute_tensor" in e.message


def test_redistribute_to_units_that_do_not_split_a_chunk(pool4):
    e = error_everywhere(pool4, _redistribute_to_bad_units)
    assert "redistribute" in e.message and "cannot split the 3 rows of shape (3, 3)" in e.message


def test_from_local_slices_that_are_not_the_units(pool4):
    e = error_everywhere(pool4, _from_local_wrong_slice)
    assert "rank 1 has (3,), expected (0,)" in e.message
    assert "rank 2 has (6,), expected (9,)" in e.message


def test_from_local_without_shape(pool4):
    e = error_everywhere(pool4, _from_local_no_shape)
    assert "pass shape= and stride=" in e.message


def test_unsupported_op(pool4):
    e = error_everywhere(pool4, _unsupported_op)
    assert e.kind == "UnsupportedOpError" and e.message.startswith("aten.")
    assert (
        "not supported on RaggedShard inputs" in e.message and "RaggedShard(dims=(0,)" in e.message
    )
