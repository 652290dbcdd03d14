"""Rank consistency: metadata that differs per rank is one clear error on every rank.

``from_local`` with ``run_check`` (the default) gathers every rank's metadata before any data
collective, so a per-rank ``shape=``, local shape, unsharded size or dtype raises the same
error everywhere (before: an error on some ranks only, a gloo abort or a hang). The compiled
rank check names each rank's first differing collective, and an uneven ``from_local`` inside
a compiled region; meshes print their ranks; a mesh on a device type this machine lacks is
a clear error.
"""

from __future__ import annotations

import re
import socket

import pytest
import torch
import torch.distributed as dist

import vescale
from tests.dtensor.reference import coord_of, expected_local, mesh_of
from tests.harness.collectives import C10D_KINDS, KINDS, count_collectives
from tests.harness.fresh import run_fresh
from tests.harness.misuse import error_everywhere
from tests.harness.pool import scoped_environ
from vescale import Replicate, Shard
from vescale.dtensor.local_metadata import LocalRecord, check_records

ROWS = [3, 3, 2, 2]  # uneven local row counts per rank


def _mismatched_shape() -> None:
    # shape=(8, 3) fits ranks 2-3 (2 rows each) but not ranks 0-1 (3 rows)
    local = torch.zeros(ROWS[dist.get_rank()], 3)
    vescale.from_local(local, mesh_of((4,)), [Shard(0)], shape=(8, 3), stride=(3, 1))


def _replicate_local_shape() -> None:
    local = torch.zeros(4 + dist.get_rank() // 2, 3)  # 4 rows on ranks 0-1, 5 on ranks 2-3
    vescale.from_local(local, mesh_of((4,)), [Replicate()])


def _unsharded_dim_size() -> None:
    rank = dist.get_rank()  # dim 1 is not sharded: 3 columns on even ranks, 4 on odd ones
    vescale.from_local(torch.zeros(2, 3 + rank % 2), mesh_of((2, 2)), [Shard(0), Replicate()])


def _dtype() -> None:
    dtype = torch.float64 if dist.get_rank() == 3 else torch.float32
    vescale.from_local(torch.zeros(4, 3, dtype=dtype), mesh_of((4,)), [Replicate()])


def _local_argument_error() -> None:
    # rank 1's placements are out of range for its tensor: its own check fails, before any
    # collective; the other ranks must not wait for it in one
    dim = 2 if dist.get_rank() == 1 else 0
    vescale.from_local(torch.zeros(2, 3), mesh_of((4,)), [Shard(dim)])


def test_mismatched_shape_raises_on_every_rank(pool4):
    err = error_everywhere(pool4, _mismatched_shape, timeout_s=60)
    assert err.kind == "ValueError"
    assert "does not match the shard of global shape (8, 3)" in err.message, err.message
    assert "on ranks [0, 1]: rank 0 has (3, 3), expected (2, 3)" in err.message, err.message
    assert "(Shard(dim=0),)" in err.message and "ranks=[0, 1, 2, 3]" in err.message


def test_replicate_local_shape_differs_raises_on_every_rank(pool4):
    err = error_everywhere(pool4, _replicate_local_shape, timeout_s=60)
    assert err.kind == "ValueError"
    assert "local shapes differ across the ranks of DeviceMesh((4,)" in err.message, err.message
    assert "in tensor dims [0], which placements (Replicate(),) do not shard" in err.message
    assert "(4, 3) on ranks [0, 1], (5, 3) on ranks [2, 3]" in err.message, err.message


def test_unsharded_dim_size_differs_raises_on_every_rank(pool4):
    err = error_everywhere(pool4, _unsharded_dim_size, timeout_s=60)
    assert "in tensor dims [1], which placements (Shard(dim=0), Replicate()) do not shard" in (
        err.message
    ), err.message
    assert "(2, 3) on ranks [0, 2], (2, 4) on ranks [1, 3]" in err.message, err.message


def test_dtype_differs_raises_on_every_rank(pool4):
    err = error_everywhere(pool4, _dtype, timeout_s=60)
    assert "local tensor dtypes (placements (Replicate(),)) differ" in err.message, err.message
    assert "torch.float32 on ranks [0, 1, 2], torch.float64 on rank 3" in err.message


def test_one_rank_argument_error_raises_on_every_rank(pool4):
    err = error_everywhere(pool4, _local_argument_error, timeout_s=60)
    assert err.kind == "ValueError"
    assert err.message.startswith("from_local failed on rank 1 of the 4 ranks"), err.message
    assert "rank 1: from_local: Shard(dim=2) on mesh dim 0 is out of range" in err.message


def _records(placements, shapes, given=None):
    return [
        LocalRecord(r, s, "torch.float32", "cpu", str(placements), given, None)
        for r, s in enumerate(shapes)
    ]


def test_records_checked_on_a_2d_mesh():
    """The rules every rank applies to the gathered records, on a 2-D mesh (one process)."""
    mesh = vescale.DeviceMesh("meta", [[0, 1], [2, 3]])

    def check(placements, shapes, given=None):
        pl = tuple(placements)
        return check_records(_records(pl, shapes, given), mesh, pl, lambda _: pl)

    # torch.chunk(10, 2) = 5, 5, each torch.chunk(5, 2) = 3, 2: nested shards sum up
    s00 = (Shard(0), Shard(0))
    assert check(s00, [(3, 4), (2, 4), (3, 4), (2, 4)]) == (10, 4)
    with pytest.raises(ValueError, match=r"local sizes \[2, 3\] of tensor dim 0 along mesh dim 1 "):
        check(s00, [(3, 4), (2, 4), (2, 4), (3, 4)])  # ranks 2, 3 swapped their chunks
    s01 = (Shard(0), Shard(1))
    assert check(s01, [(3, 2), (3, 1), (2, 2), (2, 1)]) == (5, 3)
    with pytest.raises(ValueError) as err:  # rank 3's line sums to 3, the global size is 4
        check(s01, [(3, 2), (3, 2), (2, 2), (2, 1)])
    assert "sizes [2, 1] of tensor dim 1 along mesh dim 1 (ranks [2, 3])" in str(err.value)
    assert "torch.chunk split of 4 over 2 ranks ([2, 2])" in str(err.value)
    rr = (Replicate(), Replicate())
    assert check(rr, [(4, 3)] * 4, ((4, 3), (3, 1))) == (4, 3)
    with pytest.raises(ValueError, match=r"does not match the shard of global shape \(5, 3\)"):
        check(rr, [(4, 3)] * 4, ((5, 3), (3, 1)))


def _uneven(mesh_shape, placements, names=None):
    """A consistent uneven from_local (run_check on): the global tensor, and its collectives."""
    full = torch.arange(10 * 7, dtype=torch.float64).reshape(10, 7)
    local = expected_local(full, mesh_shape, coord_of(mesh_shape), placements).clone()
    mesh = vescale.init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    vescale.from_local(local, mesh, placements)  # any first-use setup outside the count
    with count_collectives({**KINDS, **C10D_KINDS}) as counts:  # metadata: a host all-gather
        d = vescale.from_local(local, mesh, placements)
    assert d.shape == full.shape and d.stride() == full.stride()
    assert torch.equal(d.full_tensor(), full)
    assert d.to_local().data_ptr() == local.data_ptr()  # sharded: no copy
    return dict(counts)


def test_consistent_uneven_from_local_still_works(pool4):
    # one small all-gather of metadata: no more collectives than the size gather it replaces
    assert pool4.run(_uneven, (4,), [Shard(0)]) == [{"all_gather": 1}] * 4
    # 2-D: one per mesh dim, as the size gathers took; one over the flattened group of a
    # named mesh (vescale.init_device_mesh makes it)
    assert pool4.run(_uneven, (2, 2), [Shard(0), Shard(1)]) == [{"all_gather": 2}] * 4
    two_d = pool4.run(_uneven, (2, 2), [Shard(0), Shard(1)], ("dp", "tp"))
    assert two_d == [{"all_gather": 1}] * 4


# ---- the compiled rank check ------------------------------------------------------------


_COMPILE = r"\(compile \d+/0\)"  # Dynamo's compile id: frame/compile, each rank's first


def _blank_graph_ids(text: str) -> str:
    return re.sub(r"graph\d+", "graph_", text)


def _more_collectives_on_even_ranks() -> None:
    mesh = mesh_of((4,))
    x = vescale.distribute_tensor(torch.ones(8, 6), mesh, [Shard(0)])

    def f(x):
        y = x.redistribute(placements=[Replicate()]) * 2
        if dist.get_rank() % 2 == 0:  # a rank-dependent program: one all-reduce more
            y = y + x.sum().redistribute(placements=[Replicate()])
        return y

    torch._dynamo.reset()
    torch.compile(f, backend="vescale", options={"codegen": "fx"})(x)


def test_rank_check_shows_each_ranks_first_differing_collective(pool4):
    err = error_everywhere(
        pool4, _more_collectives_on_even_ranks, timeout_s=120, normalize=_blank_graph_ids
    )
    text = _blank_graph_ids(err.message)
    assert err.kind == "RankDivergenceError", err
    # the first collective (an all-gather) is the same on every rank; #1 differs
    even = r"#1: all_reduce float32\[\] over mesh dim 0 of 4 @ test_rank_consistency\.py:\d+"
    for rank in (0, 2):
        assert re.search(rf"rank {rank}: graph_\.forward {_COMPILE}, 2 collectives, {even}", text)
    for rank in (1, 3):
        one = (
            rf"rank {rank}: graph_\.forward {_COMPILE}, 1 collectives, #1: \(no more collectives\)"
        )
        assert re.search(one, text), text


def _uneven_from_local_compiled() -> None:
    mesh = mesh_of((4,))

    def f(t):
        x = vescale.from_local(t, mesh, [Shard(0)])  # uneven: even shards assumed here
        return x.redistribute(placements=[Replicate()]).to_local()

    torch._dynamo.reset()
    torch.compile(f, backend="vescale", options={"codegen": "fx"})(
        torch.ones(ROWS[dist.get_rank()], 6)
    )


def test_rank_check_names_uneven_from_local_in_compiled_region(pool4):
    err = error_everywhere(
        pool4, _uneven_from_local_compiled, timeout_s=120, normalize=_blank_graph_ids
    )
    text = _blank_graph_ids(err.message)
    assert err.kind == "RankDivergenceError", err
    site = r"from_local float32\[{}, 6\] as \(Shard\(dim=0\),\) @ test_rank_consistency\.py:\d+"
    assert re.search(r"rank 0: .*call #0: " + site.format(3), text), text
    assert re.search(r"rank 3: .*call #0: " + site.format(2), text), text
    assert "inside a compiled region from_local communicates nothing" in text, text


# ---- meshes -----------------------------------------------------------------------------


def test_meshes_print_their_ranks():
    a = vescale.DeviceMesh("meta", [0, 1, 2, 3])
    b = vescale.DeviceMesh("meta", [3, 2, 1, 0])
    assert repr(a) == "DeviceMesh((4,), 'meta', stride=(1,), ranks=[0, 1, 2, 3])"
    assert repr(b) == "DeviceMesh((4,), 'meta', stride=(1,), ranks=[3, 2, 1, 0])"
    x = vescale.from_local(torch.empty(2, 3, device="meta"), a, [Shard(0)])
    y = vescale.from_local(torch.empty(2, 3, device="meta"), b, [Shard(0)])
    with pytest.raises(
        RuntimeError, match=r"Cannot run aten\.add\.Tensor on inputs with different"
    ) as err:
        x + y
    assert "ranks=[0, 1, 2, 3]" in str(err.value) and "ranks=[3, 2, 1, 0]" in str(err.value)
    big = repr(vescale.DeviceMesh("meta", list(range(100))))
    assert big.endswith(
        "ranks=[0, 1, 2, 3, 4, 5, 6, 7, ..., 92, 93, 94, 95, 96, 97, 98, 99] (100 ranks))"
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_mesh_on_missing_device_type_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a machine without CUDA
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    for k, v in {**env, "MASTER_PORT": str(_free_port())}.items():
        monkeypatch.setenv(k, v)  # as torchrun sets them: upstream then calls set_device(0)
    assert not dist.is_initialized()
    with pytest.raises(
        RuntimeError, match=r"init_device_mesh: device type 'cuda' is not available"
    ):
        vescale.init_device_mesh("cuda", (1,))
    with pytest.raises(RuntimeError, match=r"DeviceMesh: device type 'cuda' is not available"):
        vescale.DeviceMesh("cuda", [0])
    assert not dist.is_initialized()  # raised before any process group was made


# ---- explicit mode set differently on different ranks ------------------------------------


def _explicit_differs_compiled(how: str) -> None:
    """Rank 0 in explicit mode, rank 1 not (backend option or env var), on a graph with an
    implicit redistribution: rank 0's capture fails, rank 1's graph would communicate."""
    mesh = mesh_of((2,))
    a = vescale.distribute_tensor(torch.ones(4, 4), mesh, [Shard(0)])
    b = vescale.distribute_tensor(torch.ones(4, 4), mesh, [Shard(1)])
    on = dist.get_rank() == 0
    options = {"codegen": "fx", **({"explicit": on} if how == "option" else {})}
    env = {"VESCALE_DISABLE_REDISTRIBUTE": "1" if on else "0"} if how == "env" else {}
    torch._dynamo.reset()
    with scoped_environ(env):
        torch.compile(lambda x, y: x + y, backend="vescale", options=options)(a, b)


@pytest.mark.parametrize(
    ("how", "setting"),
    [
        ("option", "the vescale backend option explicit={}"),
        ("env", "VESCALE_DISABLE_REDISTRIBUTE='{:d}'"),
    ],
)
def test_explicit_mode_differing_per_rank_is_one_error_when_compiled(pool2, how, setting):
    err = error_everywhere(
        pool2,
        _explicit_differs_compiled,
        how,
        env={"VESCALE_TIMEOUT_S": "60"},  # rank 0 waits there while rank 1 compiles
        within_s=60,
        timeout_s=120,
        normalize=_blank_graph_ids,
    )
    text = _blank_graph_ids(err.message)
    assert err.kind == "RankDivergenceError", err
    on, off = setting.format(True), setting.format(False)
    assert re.search(
        rf"rank 0: graph_\.forward {_COMPILE}, explicit mode on \({re.escape(on)}\), its capture failed: aten\.add\.Tensor",
        text,
    ), text
    assert re.search(
        rf"rank 1: graph_\.forward {_COMPILE}, explicit mode off \({re.escape(off)}\), 1 collectives, #0: all_gather",
        text,
    ), text
    assert "explicit mode differs across ranks" in text, text
    assert "While executing" not in text, text  # the failure's first line only


def _mesh_with_env(values: list[str | None]) -> str:
    value = values[dist.get_rank()]
    with scoped_environ({"VESCALE_DISABLE_REDISTRIBUTE": value}):
        return repr(vescale.init_device_mesh("cpu", (2,)))


def test_explicit_env_var_differing_per_rank_is_one_error_at_mesh_creation():
    """Eagerly: the first mesh agrees VESCALE_DISABLE_REDISTRIBUTE (fresh ranks: a process
    checks at its first mesh only)."""
    outcomes = run_fresh(2, _mesh_with_env, ["0", None], env={"VESCALE_TIMEOUT_S": "10"})
    assert [o[0] for o in outcomes] == ["err", "err"], outcomes
    assert outcomes[0][1] == outcomes[1][1], outcomes
    assert outcomes[0][1] == (
        "ValueError: vescale: VESCALE_DISABLE_REDISTRIBUTE differs across ranks (rank 0: '0' "
        "(off), rank 1: unset (on)); explicit mode must be the same on every rank (else an op "
        "raises on some ranks while the others wait for its collective): set it the same on "
        "every rank, e.g. in the launcher's environment"
    )
    assert all(seconds < 20 for *_, seconds in outcomes), outcomes
    # the same value spelled differently is the same mode: the mesh is made
    same = run_fresh(2, _mesh_with_env, ["1", None], env={"VESCALE_TIMEOUT_S": "10"})
    assert [o[0] for o in same] == ["ok", "ok"], same
