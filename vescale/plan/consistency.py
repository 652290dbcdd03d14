"""The first step's check that the ranks agree on what must be the same everywhere.

:func:`vescale.parallelize` assumes every rank holds the same replicated parameters and
buffers (the same seed at init: ``deferred_init``, ``fsdp.fully_shard`` and plain modules
alike) and is given the same whole (plain) inputs (the plan path takes each rank's rows
itself). At the first call each rank digests those tensors on their device (:func:`digests`:
byte sums per row and row-weighted, no copy to the host but the one small result) and the
digests travel with the input-shape check's one gather; :func:`first_difference` then names,
identically on every rank, the first tensor whose digests differ among ranks that should
agree (the same coordinates on the mesh dims where it is not ``Replicate``).
``VESCALE_CHECK_RANKS=0`` skips the digests (strict boolean, default on).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor as _UpstreamDTensor
from torch.distributed.tensor.placement_types import Replicate

from vescale._env import env_flag

__all__ = ["ENV", "Digest", "digests", "enabled", "first_difference"]

ENV = "VESCALE_CHECK_RANKS"

Digest = tuple[str, tuple[int | None, ...], tuple[int, int]]
"""(the tensor's name, the coordinates it must agree over, its digest)."""


def enabled() -> bool:
    """``VESCALE_CHECK_RANKS`` (default on; a value that is not a boolean raises)."""
    return env_flag(ENV, True)


def _digest(t: torch.Tensor) -> torch.Tensor:
    """Two int64 sums of ``t``'s bytes on its device: per row, then plain and row-weighted."""
    if t.numel() == 0:
        return torch.zeros(2, dtype=torch.int64, device=t.device)
    data = t.detach().contiguous().reshape(t.shape[0] if t.dim() else 1, -1)
    rows = data.view(torch.uint8).sum(1, dtype=torch.int64)
    weights = torch.arange(1, rows.numel() + 1, dtype=torch.int64, device=t.device)
    return torch.stack([rows.sum(), (rows * weights).sum()])


def _key(t: torch.Tensor) -> tuple[int | None, ...] | None:
    """This rank's coordinates on the mesh dims where ``t`` is not replicated (``()``: none;
    ``None``: nothing to compare, e.g. not on ``mesh``)."""
    if not isinstance(t, _UpstreamDTensor):
        return ()
    coord = t.device_mesh.get_coordinate()
    if coord is None:
        return None
    return tuple(None if isinstance(p, Replicate) else c for c, p in zip(coord, t.placements))


def digests(
    state: Sequence[tuple[str, torch.Tensor]], inputs: Sequence[tuple[str, Any]]
) -> list[Digest]:
    """(name, key, digest) of each named parameter or buffer in ``state`` and each whole
    (plain tensor) input, read to the host once."""
    tensors: list[tuple[str, tuple[int | None, ...], torch.Tensor]] = []
    for name, t in state:
        key = _key(t)
        if key is not None:
            local = t._local_tensor if isinstance(t, _UpstreamDTensor) else t
            tensors.append((name, key, local))
    tensors += [
        (n, (), a)
        for n, a in inputs
        if isinstance(a, torch.Tensor) and not isinstance(a, _UpstreamDTensor)
    ]
    if not tensors:
        return []
    device = tensors[0][2].device
    stacked = torch.stack([_digest(t).to(device) for _, _, t in tensors])
    values = stacked.tolist()  # the one host read
    return [(n, k, (int(a), int(b))) for (n, k, _), (a, b) in zip(tensors, values)]


def first_difference(per_rank: Sequence[Sequence[Digest]]) -> str | None:
    """The first tensor whose digests differ among ranks with the same key, as an error text
    (the same on every rank given the same ``per_rank``); ``None`` when all agree."""
    for i, (name, _, _) in enumerate(per_rank[0]):
        groups: dict[Any, dict[tuple[int, int], list[int]]] = {}
        for rank, items in enumerate(per_rank):
            if i >= len(items) or items[i][0] != name:
                return f"vescale.parallelize: rank {rank} has no {name} to compare"
            _, key, digest = items[i]
            groups.setdefault(key, {}).setdefault(digest, []).append(rank)
        for by_digest in groups.values():
            if len(by_digest) > 1:
                ranks = " vs ".join(str(r) for r in by_digest.values())
                is_input = name.startswith("input")
                fix = (
                    "every rank must be given the same whole batch (the plan path takes each "
                    "rank's rows of it itself): give every rank the same batch, or pass "
                    "DTensors already laid out as the plan's inputs"
                    if is_input
                    else "replicated parameters and buffers must be equal on every rank: seed "
                    "every rank the same (torch.manual_seed(s) before building or deferred "
                    "init) or copy the same weights on every rank"
                )
                return (
                    f"vescale.parallelize: {name} differs across ranks (ranks {ranks} hold "
                    f"different values): {fix}; {ENV}=0 skips this check"
                )
    return None
