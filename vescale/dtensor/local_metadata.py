"""``from_local``'s ``run_check``: every rank's metadata in one small all-gather, checked alike.

Before any data collective, each rank of the mesh contributes one record (its global rank;
its local shape, dtype and device type; its placements; the ``shape``/``stride`` it passed;
the error its own argument checks raised, if any) to one all-gather of a fixed-size byte
buffer over the mesh: one collective over a group spanning the mesh (a 1-D mesh's group, or
the flattened group of a mesh spanning the world), else one per mesh dim, each passing on
what the previous gathered. Every rank then applies the same rules to the same records
(:func:`check_records`) and raises the same error, naming the ranks that differ and what
differs, or derives the same global shape. A record longer than the buffer (a huge shape or
error text) costs every rank a second all-gather, sized by the longest record.

The bytes travel on the host (:func:`host_groups`): CPU tensors over the mesh's groups when
they have a CPU backend (gloo, ``"cuda:nccl,cpu:gloo"``), else over vescale's gloo side group
(:func:`vescale._agree.side_group`) when the mesh spans the world; no device tensor is read
back. Only a sub-mesh whose groups have no CPU backend gathers a device tensor (then ``.cpu()``).
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from vescale import _agree
from vescale._torch_compat import compute_local_shape_at, has_cpu_backend
from vescale.dtensor.flat_groups import flattened_mesh
from vescale.dtensor.inflight import wait_local
from vescale.dtensor.layout import contiguous_shards, local_range

__all__ = [
    "RECORD_BYTES",
    "LocalRecord",
    "check_records",
    "gather_records",
    "gathered_shapes",
    "host_groups",
    "mesh_coordinates",
]

RECORD_BYTES = 256
"""Bytes per rank in the first all-gather (a 4-byte length, then the record's JSON)."""

_ERRORS: dict[str, type[Exception]] = {"TypeError": TypeError, "ValueError": ValueError}


@dataclass(frozen=True)
class LocalRecord:
    """One rank's ``from_local`` call as every rank sees it."""

    rank: int
    shape: tuple[int, ...] | None  # None: the local tensor is not a tensor
    dtype: str
    device: str
    placements: str
    given: tuple[tuple[int, ...], tuple[int, ...]] | None  # shape=, stride=
    error: tuple[str, str] | None  # (class name, message) of a local argument check

    @staticmethod
    def of(
        local: Any,
        placements: Any,
        given: tuple[Sequence[int], Sequence[int]] | None,
        error: Exception | None,
    ) -> LocalRecord:
        """This rank's record; ``error`` is what its own argument checks raised."""
        tensor = isinstance(local, torch.Tensor)
        err = None
        if error is not None:
            kind = next((c.__name__ for c in type(error).__mro__ if c.__name__ in _ERRORS), None)
            err = (kind or "RuntimeError", str(error))
        return LocalRecord(
            rank=dist.get_rank(),
            shape=tuple(int(s) for s in local.shape) if tensor else None,
            dtype=str(local.dtype) if tensor else "",
            device=local.device.type if tensor else "",
            placements=str(tuple(placements)) if placements is not None else "None",
            given=(tuple(given[0]), tuple(given[1])) if given is not None else None,
            error=err,
        )

    def encode(self) -> bytes:
        return json.dumps(
            [
                self.rank,
                self.shape,
                self.dtype,
                self.device,
                self.placements,
                self.given,
                self.error,
            ]
        ).encode()

    @staticmethod
    def decode(data: bytes) -> LocalRecord:
        rank, shape, dtype, device, placements, given, error = json.loads(data)
        return LocalRecord(
            rank,
            tuple(shape) if shape is not None else None,
            dtype,
            device,
            placements,
            (tuple(given[0]), tuple(given[1])) if given is not None else None,
            (error[0], error[1]) if error is not None else None,
        )


def _groups(mesh: Any) -> list[dist.ProcessGroup]:
    """Groups whose chained all-gathers reach every rank of ``mesh``: one where one spans it."""
    if mesh.ndim > 1 and mesh.size() == dist.get_world_size():
        flat = flattened_mesh(mesh, range(mesh.ndim))
        if flat is not None:
            return [flat.get_group(0)]
    return [mesh.get_group(d) for d in range(mesh.ndim) if mesh.size(d) > 1]


def host_groups(mesh: Any) -> list[dist.ProcessGroup] | None:
    """Groups whose chained all-gathers of CPU tensors reach every rank of ``mesh``: its own
    when each has a CPU backend, else vescale's gloo side group when ``mesh`` spans the world;
    ``None``: neither (a sub-mesh on device-only groups)."""
    groups = _groups(mesh)
    if all(has_cpu_backend(g) for g in groups):
        return groups
    if mesh.size() == dist.get_world_size():
        return [_agree.side_group()]
    return None


def _all_gather(data: bytes, size: int, mesh: Any, device: torch.device) -> list[bytes]:
    """Every rank's ``data`` (zero-padded to ``size`` bytes), in no particular order."""
    groups = host_groups(mesh)
    raw: bytes | bytearray
    if groups is None:  # device-only groups: a device tensor, read back once
        row = torch.zeros(size, dtype=torch.uint8)
        row[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        out = row.to(device)
        for group in _groups(mesh):
            out = wait_local(funcol.all_gather_single(out.contiguous(), 0, group))
        raw = out.cpu().numpy().tobytes()
    else:  # host bytes in a bytearray a CPU tensor views: nothing is read from a tensor
        raw = bytearray(data.ljust(size, b"\0"))
        for group in groups:
            gathered = bytearray(len(raw) * dist.get_world_size(group))
            dist.all_gather_single(
                torch.frombuffer(gathered, dtype=torch.uint8),
                torch.frombuffer(raw, dtype=torch.uint8),
                group=group,
            )
            raw = gathered
    return [bytes(raw[i : i + size]) for i in range(0, len(raw), size)]


def gather_records(mine: LocalRecord, mesh: Any, device: torch.device) -> list[LocalRecord]:
    """Every rank of ``mesh``'s record, by rank (one all-gather, see the module doc)."""
    data = mine.encode()
    head = len(data).to_bytes(4, "little") + data[: RECORD_BYTES - 4]
    rows = _all_gather(head, RECORD_BYTES, mesh, device)
    lengths = [int.from_bytes(r[:4], "little") for r in rows]
    if max(lengths) <= RECORD_BYTES - 4:
        payloads = [r[4 : 4 + n] for r, n in zip(rows, lengths)]
    else:  # every rank sees the same lengths, so every rank takes this branch
        rows = _all_gather(data, max(lengths), mesh, device)
        payloads = [r[:n] for r, n in zip(rows, lengths)]
    records = {r.rank: r for r in map(LocalRecord.decode, payloads)}
    return [records[r] for r in sorted(records)]


def gathered_shapes(shape: Sequence[int], mesh: Any) -> dict[int, tuple[int, ...]] | None:
    """Every rank of ``mesh``'s local ``shape`` by rank, exchanged on the host (one all-gather,
    :func:`host_groups`); ``None`` where no host route exists (or the ``fake`` group, whose
    collectives move nothing)."""
    if dist.get_backend() == "fake" or host_groups(mesh) is None:
        return None
    mine = [dist.get_rank(), *shape]
    data = b"".join(int(v).to_bytes(8, "little", signed=True) for v in mine)
    rows = _all_gather(data, len(data), mesh, torch.device("cpu"))
    out = {}
    for row in rows:
        values = [
            int.from_bytes(row[i : i + 8], "little", signed=True) for i in range(0, len(row), 8)
        ]
        out[values[0]] = tuple(values[1:])
    return out


def _ranks(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {list(ranks)}"


def _by_value(values: dict[int, Any]) -> str:
    """``"A on ranks [0, 1], B on rank 2"`` (values in order of their first rank)."""
    groups: dict[Any, list[int]] = {}
    for rank, v in sorted(values.items()):
        groups.setdefault(v, []).append(rank)
    return ", ".join(f"{v} on {_ranks(r)}" for v, r in groups.items())


def _local_errors(records: list[LocalRecord], mesh: Any, own: Exception | None) -> None:
    failed = [(r.rank, r.error) for r in records if r.error is not None]
    if not failed:
        return
    if own is not None and len(failed) == len(records) and len({e for _, e in failed}) == 1:
        raise own  # the same error everywhere: each rank raises its own, as is
    cls = _ERRORS.get(failed[0][1][0], RuntimeError)
    shown = "; ".join(f"rank {rank}: {text}" for rank, (_, text) in failed)
    raise cls(
        f"from_local failed on {_ranks([rank for rank, _ in failed])} of the {len(records)} "
        f"ranks of {mesh} (every rank raises this): {shown}"
    )


Shapes = dict[int, tuple[int, ...]]  # rank -> local shape


_COORDS: weakref.WeakKeyDictionary[Any, dict[int, tuple[int, ...]]] = weakref.WeakKeyDictionary()


def mesh_coordinates(mesh: Any) -> dict[int, tuple[int, ...]]:
    """Rank -> its mesh coordinate, for every rank of ``mesh`` (cached: ``mesh.mesh`` is
    rebuilt on every read upstream)."""
    if mesh not in _COORDS:
        grid = mesh.mesh
        coords: list[tuple[int, ...]] = [()]
        for n in grid.shape:
            coords = [(*c, k) for c in coords for k in range(n)]
        _COORDS[mesh] = dict(zip(grid.flatten().tolist(), coords))
    return _COORDS[mesh]


def _global_shape(
    shapes: Shapes, coords: dict[int, tuple[int, ...]], placements: Sequence[Any]
) -> tuple[int, ...]:
    """Each tensor dim: the sum of the local sizes over the mesh dims sharding it (the other
    mesh coordinates at 0), else the (common) local size."""
    out = []
    for d in range(len(next(iter(shapes.values())))):
        other = [m for m, p in enumerate(placements) if not p.is_shard(d)]
        out.append(sum(shapes[r][d] for r, c in coords.items() if not any(c[m] for m in other)))
    return tuple(out)


def _local_shape_at(
    gshape: tuple[int, ...], mesh: Any, placements: Sequence[Any], coord: tuple[int, ...]
) -> tuple[int, ...]:
    """The shard's shape at mesh ``coord``: ``local_range`` for contiguous shards (plain
    integers, fast), upstream's helper for interleaved ones."""
    if not contiguous_shards(placements):
        return compute_local_shape_at(gshape, mesh.shape, coord, placements)
    return tuple(local_range(gshape, mesh, placements, d, coord)[1] for d in range(len(gshape)))


def _misfit(
    shapes: Shapes,
    coords: dict[int, tuple[int, ...]],
    mesh: Any,
    placements: Sequence[Any],
    gshape: tuple[int, ...],
    spec_placements: Sequence[Any],
    derived: bool,
) -> None:
    """Raise if any rank's local shape is not its shard of ``gshape``."""
    sharding = [m for m, p in enumerate(placements) if p.is_shard()]
    by_coord: dict[tuple[int, ...], tuple[int, ...]] = {}  # by the sharding mesh coordinates
    want: dict[int, tuple[int, ...]] = {}
    for rank in sorted(shapes):
        c = coords[rank]
        key = tuple(c[m] for m in sharding)
        if key not in by_coord:
            by_coord[key] = _local_shape_at(gshape, mesh, spec_placements, c)
        want[rank] = by_coord[key]
    bad = {r: (shapes[r], want[r]) for r in sorted(shapes) if shapes[r] != want[r]}
    if not bad:
        return
    rank = min(bad)
    dim = next(d for d, (a, b) in enumerate(zip(*bad[rank])) if a != b)
    dims = [m for m, p in enumerate(placements) if p.is_shard(dim)]
    if derived and dims:  # the sizes along the innermost mesh dim sharding ``dim``
        m = dims[-1]
        mine = coords[rank]
        line = sorted(
            (r for r, c in coords.items() if all(c[k] == mine[k] for k in range(len(c)) if k != m)),
            key=lambda r: coords[r][m],
        )
        sizes = [shapes[r][dim] for r in line]
        chunks = [want[r][dim] for r in line]
        raise ValueError(
            f"from_local: local sizes {sizes} of tensor dim {dim} along mesh dim {m} (ranks "
            f"{line}) of {mesh} are not the torch.chunk split of {sum(chunks)} over "
            f"{len(line)} ranks ({chunks}) for placements {tuple(placements)} (global size "
            f"{gshape[dim]}); rank i must hold chunk i (or pass shape= and stride=)"
        )
    shown = "; ".join(f"rank {r} has {h}, expected {w}" for r, (h, w) in bad.items())
    raise ValueError(
        f"from_local: local shape does not match the shard of global shape {tuple(gshape)} "
        f"with placements {tuple(placements)} on {mesh} on {_ranks(sorted(bad))}: {shown}; "
        f"shape= and stride= must describe the tensor the local shards form"
    )


def check_records(
    records: list[LocalRecord],
    mesh: Any,
    placements: Sequence[Any] | None,
    spec_placements: Callable[[tuple[int, ...]], Sequence[Any]],
    *,
    own_error: Exception | None = None,
) -> tuple[int, ...]:
    """The global shape every rank agrees on, or the same error on every rank.

    Rules, in order: no rank's own argument checks failed; placements, dtype, device type,
    ``shape=``/``stride=`` and ``ndim`` are the same everywhere; tensor dims no mesh dim
    shards have the same size everywhere; every rank's local shape is its shard of the global
    shape (``shape=``, else the sum of the local sizes along the sharding mesh dims).
    ``placements``: this rank's (normalized; ``None`` only where its checks failed).
    ``spec_placements(global_shape)`` gives the placements of the spec (and raises, the same
    everywhere, for a global shape they cannot lay out). ``own_error``: what this rank's
    argument checks raised (re-raised as is when every rank raised the same).
    """
    _local_errors(records, mesh, own_error)
    assert placements is not None  # this rank's checks passed
    pl = tuple(placements)

    def same(field: Callable[[LocalRecord], Any], what: str, fix: str) -> None:
        values = {r.rank: field(r) for r in records}
        if len(set(values.values())) > 1:
            raise ValueError(
                f"from_local: {what} differ across the ranks of {mesh}: {_by_value(values)}; {fix}"
            )

    same(lambda r: r.placements, "placements", "pass the same placements on every rank")
    same(lambda r: r.dtype, f"local tensor dtypes (placements {pl})", "use one dtype")
    same(
        lambda r: r.device,
        f"local tensor device types (placements {pl})",
        f"put every local tensor on {mesh.device_type}",
    )
    same(
        lambda r: "none" if r.given is None else f"shape={r.given[0]}, stride={r.given[1]}",
        f"shape=/stride= (placements {pl})",
        "pass the same global shape and stride on every rank",
    )
    shapes: Shapes = {r.rank: r.shape for r in records if r.shape is not None}
    same(
        lambda r: len(shapes[r.rank]),
        f"local tensor ndims (placements {pl})",
        "every rank's local tensor must have the same number of dims",
    )
    ndim = len(shapes[records[0].rank])
    whole = [d for d in range(ndim) if not any(p.is_shard(d) for p in pl)]
    differ = [d for d in whole if len({s[d] for s in shapes.values()}) > 1]
    if differ:
        raise ValueError(
            f"from_local: local shapes differ across the ranks of {mesh} in tensor dims "
            f"{differ}, which placements {pl} do not shard: {_by_value(shapes)}; those dims "
            f"must have the same size on every rank"
        )
    given = records[0].given
    coords = mesh_coordinates(mesh)
    gshape = given[0] if given is not None else _global_shape(shapes, coords, pl)
    _misfit(shapes, coords, mesh, pl, gshape, spec_placements(gshape), given is None)
    return gshape
