"""The reshape check of vescale/dtensor/ops/view.py (does a view strategy map every rank's
elements to its own?) decided by layout algebra, against the element-by-element reference it
replaced (kept here only): the same decision over a sweep of shapes, meshes (uneven, size-1
dims, 3-D) and placements; and its work does not grow with tensor sizes."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import pytest
import torch

import vescale
from vescale._torch_compat import DTensorSpec, StridedShard, TensorMeta
from vescale.dtensor.layout import contiguous_strides, local_indices
from vescale.dtensor.ops import view
from vescale.dtensor.placement_types import Partial, Placement, Replicate, Shard

aten = torch.ops.aten

SHAPES = [  # (src, dst): flatten, split, regroup, size-1 dims, uneven, the known mislaid ones
    ((4, 6), (24,)),
    ((24,), (4, 6)),
    ((4, 6), (6, 4)),
    ((2, 3, 4), (6, 4)),
    ((6, 4), (2, 3, 4)),
    ((16, 3), (2, 8, 3)),
    ((2, 8, 3), (16, 3)),
    ((8, 2), (16,)),
    ((1, 8), (8,)),
    ((8,), (2, 1, 4)),
    ((5, 3), (15,)),
    ((15,), (5, 3)),
    ((12, 2), (3, 4, 2)),
    ((3, 4, 2), (12, 2)),
]
MESHES = [(2,), (3,), (4,), (2, 2), (1, 2), (2, 3), (2, 1, 2)]
FULL_MESHES = [*MESHES, (2, 2, 2), (3, 2)]


def _layouts(ndim: int, mesh_ndim: int, full: bool) -> list[tuple[Placement, ...]]:
    """Every layout of a tensor of ``ndim`` dims from per mesh dim Replicate, Partial,
    Shard(d), interleaved (factors 2 and 3); by default on a 3-D mesh without Partial and
    factor 3, dims 0 and last only."""
    small = mesh_ndim == 3 and not full
    dims = sorted({0, ndim - 1}) if small else range(ndim)
    out: list[Placement] = [Replicate(), *(Shard(d) for d in dims)]
    out += [StridedShard(d, split_factor=k) for d in dims for k in ((2,) if small else (2, 3))]
    if not small:
        out.append(Partial())
    return list(itertools.product(out, repeat=mesh_ndim))


def _flat(indices: Sequence[torch.Tensor], shape: Sequence[int], dims: list[int]) -> tuple:
    flat = torch.zeros(1, dtype=torch.int64)
    for d in dims:
        flat = (flat.view(-1, 1) * shape[d] + indices[d].view(1, -1)).flatten()
    return tuple(flat.tolist())


def _reference_layout(shape: Sequence[int], mesh: Any, placements: Any, groups: list) -> Any:
    """Per mesh coordinate, per group of dims, the flat global indices the shard holds (the
    check's former element-by-element arithmetic); ``None`` where it raised."""
    try:
        return tuple(
            tuple(_flat(local_indices(shape, mesh, placements, coord), shape, g) for g in groups)
            for coord in itertools.product(*(range(n) for n in mesh.shape))
        )
    except RuntimeError:
        return None


def _even(shape: Sequence[int], mesh_shape: Sequence[int], placements: Any) -> bool:
    """Powers of two only, every shard step even: what the digits must decide."""
    if any(n & (n - 1) for n in (*shape, *mesh_shape)):
        return False
    left = list(shape)
    for n, p in zip(mesh_shape, placements):
        if isinstance(p, Shard | StridedShard):
            k = getattr(p, "split_factor", 1)
            if left[p.dim] % (k * n):
                return False
            left[p.dim] //= n
    return True


def _spec(mesh: Any, placements: tuple[Placement, ...], shape: Sequence[int]) -> DTensorSpec:
    meta = TensorMeta(torch.Size(shape), contiguous_strides(shape), torch.float32)
    return DTensorSpec(mesh, placements, tensor_meta=meta)


def _accepts(src: DTensorSpec, dst: DTensorSpec, shape: Sequence[int]) -> bool:
    try:
        return view._maps_elements(src, dst, shape)
    except RuntimeError:
        return False


def _sweep(full: bool) -> None:
    """Every (src layout, dst layout) pair of every shape pair and mesh: the digits' decision
    equals the reference's wherever they decide, they decide every even power-of-two case,
    and the check's own fallback (uneven shards) equals it on every 5th case it leaves (all
    with ``--full``)."""
    cases = decided = mismatches = 0
    wrong, undecided = [], []
    for (src_shape, dst_shape), mesh_shape in itertools.product(
        SHAPES, FULL_MESHES if full else MESHES
    ):
        n = math.prod(mesh_shape)
        mesh = vescale.DeviceMesh("meta", torch.arange(n).view(mesh_shape))
        groups = view._dim_groups(src_shape, dst_shape)
        ins = {
            p: _reference_layout(src_shape, mesh, p, [a for a, _ in groups])
            for p in _layouts(len(src_shape), len(mesh_shape), full)
        }
        outs = {
            p: _reference_layout(dst_shape, mesh, p, [b for _, b in groups])
            for p in _layouts(len(dst_shape), len(mesh_shape), full)
        }
        for (sp, si), (dp, do) in itertools.product(ins.items(), outs.items()):
            expected = si is not None and do is not None and si == do
            algebra = view._maps_by_digits(mesh_shape, sp, dp, src_shape, dst_shape)
            cases += 1
            decided += algebra is not None
            if (
                algebra is None
                and _even(src_shape, mesh_shape, sp)
                and _even(dst_shape, mesh_shape, dp)
            ):
                undecided.append((src_shape, dst_shape, mesh_shape, sp, dp))
            if algebra is None and (full or cases % 5 == 0):  # the check's own fallback
                src, dst = _spec(mesh, sp, src_shape), _spec(mesh, dp, dst_shape)
                algebra = _accepts(src, dst, dst_shape)
            if algebra is not None and algebra != expected:
                mismatches += 1
                wrong.append((src_shape, dst_shape, mesh_shape, sp, dp, expected))
    print(f"\n{cases} cases, {decided} decided by the digits, {mismatches} mismatches")
    assert not wrong, wrong[:10]
    assert not undecided, undecided[:10]  # the fallback only for uneven shards


def test_algebra_decides_as_the_element_reference_on_every_case():
    _sweep(full=False)


@pytest.mark.full
def test_algebra_decides_as_the_element_reference_on_every_case_full():
    _sweep(full=True)


def test_known_mislaid_views_are_refused():
    mesh = vescale.DeviceMesh("meta", torch.arange(4).view(2, 2))
    src = _spec(mesh, (Shard(0), Shard(0)), (16, 3))
    dst = _spec(mesh, (Shard(1), Shard(1)), (2, 8, 3))
    assert not view._maps_elements(src, dst, (2, 8, 3))
    assert view._maps_elements(src, _spec(mesh, (Shard(0), Shard(0)), (16, 3)), (16, 3))
    ring = vescale.DeviceMesh("meta", torch.arange(4))
    strided = _spec(ring, (StridedShard(0, split_factor=4),), (96, 30))
    assert not view._maps_elements(strided, _spec(ring, (Shard(1),), (8, 12, 30)), (8, 12, 30))


def _check_work(monkeypatch: pytest.MonkeyPatch, batch: int, seq: int) -> int:
    """Index elements the reshape check builds for ``flatten(0, 1)`` of a ``(batch, seq)``
    tensor sharded on dim 0 over both dims of an (8, 8) mesh (the logits' case of issue 39)."""
    built = [0]

    def counted(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, ...]:
        out = local_indices(*args, **kwargs)
        built[0] += sum(t.numel() for t in out)
        return out

    monkeypatch.setattr(view, "local_indices", counted)
    if hasattr(view, "_maps_by_digits"):  # each size decided afresh
        view._maps_by_digits.cache_clear()
    mesh = vescale.DeviceMesh("meta", torch.arange(64).view(8, 8))
    x = _spec(mesh, (Shard(0), Shard(0)), (batch, seq))
    flat = _spec(mesh, (Shard(0), Shard(0)), (batch * seq,))
    assert view._maps_elements(x, flat, (batch * seq,))
    strided = _spec(mesh, (Shard(1), Shard(1)), (batch, seq))
    assert not view._maps_elements(strided, flat, (batch * seq,))
    return built[0]


def test_reshape_check_work_does_not_grow_with_tensor_size(monkeypatch):
    small = _check_work(monkeypatch, 64, 64)
    large = _check_work(monkeypatch, 64, 8192)
    assert small == large == 0, (small, large)


def test_reshape_check_decides_each_distinct_case_once(monkeypatch):
    calls = [0]
    digits = view.shard_digits

    def counted(*args: Any) -> Any:
        calls[0] += 1
        return digits(*args)

    monkeypatch.setattr(view, "shard_digits", counted)
    view._maps_by_digits.cache_clear()
    mesh = vescale.DeviceMesh("meta", torch.arange(64).view(8, 8))
    x = _spec(mesh, (Shard(0), Shard(0)), (64, 8192))
    flat = _spec(mesh, (Shard(0), Shard(0)), (64 * 8192,))
    for _ in range(10):
        assert view._maps_elements(x, flat, (64 * 8192,))
    assert 0 < calls[0] <= 2 * 2, calls  # both sides' dims, once
