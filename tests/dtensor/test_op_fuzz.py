"""Op x placement fuzz: every op of docs/concepts.md (tests/dtensor/op_cases.py) on the
placements of its inputs (Replicate, Shard on each dim, Partial for float data), on even and
uneven sizes, forward and backward, against single-device torch in float64:

* the 1-D mesh of 2 ranks: every placement combination of the inputs on the uneven size (5
  and 7: a long and a short shard), all pairs of input placements on the even size (8 and
  12; as on 2x2 below, its own paths depend on each placement alone);
* the 1-D mesh of 4 ranks: an all-pairs covering set over the inputs and the size, so
  every placement of every input meets both sizes (the uneven one with an empty shard: 5
  rows on 4 ranks hold 2, 2, 1, 0) and every pair of placements of two inputs meets more
  than two ranks;
* the 2x2 mesh, leaving out the layouts whose placements on one mesh dim are all Replicate
  (the 1-D layout on a 2-rank sub-mesh, which the 2-rank product runs): on the uneven size,
  an all-pairs covering set over the (input, mesh dim) factors, so every 2-D placement of
  every input, and every pair of placements of two inputs (on the same or on different
  mesh dims), appears in some layout; on the even size, each placement of each (input,
  mesh dim) factor in some layout (the uneven layouts take every path the even ones take
  but the even shards' own: no padding, no empty shard, which depend on each placement
  alone).

``--full`` runs the full products on 2 and 4 ranks and on the 2x2 mesh.

Each rank compares its own local shards of the outputs and input gradients with the shards
of the single-device results (no gather in the check, and every replica is checked);
outputs with other placements (Partial, interleaved) are compared as full tensors.
Implicit redistribution is allowed here (explicit mode off): the answer must be right
whatever communication it takes; the communication itself is pinned in
test_op_communication.py."""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor as UpstreamDTensor

import vescale
from tests.dtensor.op_cases import BY_NAME, CASES, EVEN, EXTRA_CASES, UNEVEN, OpCase
from tests.dtensor.reference import expected_local, mesh_of
from vescale import InterleavedShard, Partial, Placement, Replicate, Shard

Layout = tuple[tuple[Placement, ...], ...]  # per input, per mesh dim


def _options(t: torch.Tensor, partial: bool) -> list[Placement]:
    opts: list[Placement] = [Replicate(), *(Shard(d) for d in range(t.ndim))]
    return [*opts, Partial()] if partial else opts


FULL_PRODUCT_LIMIT = 600


def all_pairs(options: Sequence[Sequence[Any]]) -> list[tuple[Any, ...]]:
    """A deterministic all-pairs covering set: every value of every input appears with every
    value of every other input in at least one row (greedy, first uncovered pair first)."""
    n = len(options)
    uncovered = {
        (i, a, j, b)
        for i, j in itertools.combinations(range(n), 2)
        for a in range(len(options[i]))
        for b in range(len(options[j]))
    }
    rows = []
    while uncovered:
        i, a, j, b = min(uncovered)
        row: list[int | None] = [None] * n
        row[i], row[j] = a, b
        for k in range(n):
            if row[k] is None:
                row[k] = max(
                    range(len(options[k])),
                    key=lambda c: sum(
                        (min(k, m), c if k < m else v, max(k, m), v if k < m else c) in uncovered
                        for m, v in enumerate(row)
                        if v is not None
                    ),
                )
        uncovered -= {
            (p, row[p], q, row[q])
            for p, q in itertools.combinations(range(n), 2)  # type: ignore[misc]
        }
        rows.append(tuple(options[k][c] for k, c in enumerate(row)))  # type: ignore[index]
    return rows


def covering(
    options: Sequence[Sequence[Any]], strength: int = 2, avoid: Sequence[Sequence[int]] = ()
) -> list[tuple[Any, ...]]:
    """A covering set of rows: every combination of values of every ``strength`` factors
    (2: all pairs; 1: each value of each factor) appears in some row, and no row takes
    value 0 on every factor of a group in ``avoid`` (combinations that would force that are
    left out). Deterministic greedy: the row that covers the most uncovered combinations
    (the first such row), until every one is covered."""
    n = len(options)
    strength = min(strength, n)

    def allowed(row: Sequence[int]) -> bool:
        return not any(all(row[k] == 0 for k in group) for group in avoid)

    def parts(row: Sequence[int]) -> set[tuple[tuple[int, int], ...]]:
        return {tuple((k, row[k]) for k in ks) for ks in itertools.combinations(range(n), strength)}

    every = [row for row in itertools.product(*(range(len(o)) for o in options)) if allowed(row)]
    covers = [parts(row) for row in every]
    uncovered = set().union(*covers)
    rows = []
    while uncovered:
        best = max(range(len(every)), key=lambda r: len(covers[r] & uncovered))
        uncovered -= covers[best]
        rows.append(tuple(options[k][c] for k, c in enumerate(every[best])))
    return rows


def layouts(case: OpCase, inputs: Sequence[torch.Tensor], mesh_ndim: int) -> list[Layout]:
    """Every placement combination of the inputs (one shared combination for ``shared``);
    above ``FULL_PRODUCT_LIMIT`` combinations (ops of three or four inputs on the 2x2 mesh),
    an all-pairs covering set of them."""
    per_input = [
        list(itertools.product(_options(t, i in case.partial), repeat=mesh_ndim))
        for i, t in enumerate(inputs)
    ]
    if case.shared:
        return [(pl,) * len(inputs) for pl in per_input[0]]
    if math.prod(len(o) for o in per_input) > FULL_PRODUCT_LIMIT:
        return all_pairs(per_input)
    return list(itertools.product(*per_input))


def _sub_mesh_1d(layout: Layout) -> bool:
    """Whether every input is Replicate on some one mesh dim of a 2-D layout: the 1-D
    layout of the other mesh dim on a 2-rank sub-mesh."""
    return any(all(isinstance(pl[m], Replicate) for pl in layout) for m in range(len(layout[0])))


Size = tuple[int, int]


def pairwise_layouts(case: OpCase, mesh: MeshKey) -> list[tuple[Size, Layout]]:
    """The default (size, layout) runs of ``case`` on ``mesh`` (see the module docstring):
    on 2 ranks every combination on the uneven size and all pairs of the inputs on the even
    one; both sizes of every shared placement on 1-D; on other 1-D meshes, all pairs of the
    inputs and the size; on a 2-D mesh, without the
    2-rank sub-mesh layouts (``_sub_mesh_1d``), all pairs of the (input, mesh dim) factors
    on the uneven size and each placement of each factor on the even size (``shared``
    inputs count as one)."""
    ndim = mesh_ndim(mesh)
    inputs = make_inputs(case, EVEN)
    if ndim == 1 and case.shared:
        return [(size, lay) for size in (EVEN, UNEVEN) for lay in layouts(case, inputs, 1)]
    opts = [_options(t, i in case.partial) for i, t in enumerate(inputs)]
    if tuple(mesh) == (2,):
        pairs = [tuple((p,) for p in row) for row in covering(opts)]
        return [(EVEN, lay) for lay in pairs] + [(UNEVEN, lay) for lay in layouts(case, inputs, 1)]
    if ndim == 1:
        rows = covering([*opts, [EVEN, UNEVEN]])
        return sorted(((row[-1], tuple((p,) for p in row[:-1])) for row in rows), key=str)
    n = 1 if case.shared else len(inputs)
    factors = [o for o in opts[:n] for _ in range(ndim)]  # (input, mesh dim), input-major
    avoid = [[i * ndim + m for i in range(n)] for m in range(ndim)]
    runs = []
    for size, strength in ((EVEN, 1), (UNEVEN, 2)):
        for r in covering(factors, strength, avoid):
            lay = tuple(tuple(r[i * ndim : (i + 1) * ndim]) for i in range(n))
            runs.append((size, lay * len(inputs) if case.shared else lay))
    return runs


def make_inputs(case: OpCase, size: tuple[int, int]) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(zlib.crc32(case.name.encode()) + size[0])
    return case.make(*size, gen)


def _tensors(out: Any) -> list[torch.Tensor]:
    return list(out) if isinstance(out, (tuple, list)) else [out]


SUBMESH = ("ranks", 0, 2)
"""A mesh key: the 1-D sub-mesh of ranks 0 and 2 of a 4-rank world (ranks 1 and 3 outside)."""

MeshKey = tuple[Any, ...]


def mesh_for(key: MeshKey) -> vescale.DeviceMesh:
    """The mesh of a shape (``mesh_of``) or of an explicit rank list (``("ranks", *ranks)``)."""
    if key and key[0] == "ranks":
        return _rank_mesh(key[1:])
    return mesh_of(key)


@functools.cache
def _rank_mesh(ranks: tuple[int, ...]) -> vescale.DeviceMesh:
    return vescale.DeviceMesh("cpu", list(ranks))


def mesh_ndim(key: MeshKey) -> int:
    return 1 if key and key[0] == "ranks" else len(key)


def _by_shard(t: UpstreamDTensor) -> bool:
    """Whether ``t``'s local shards follow from its global value alone (``expected_local``):
    Replicate or plain Shard (not interleaved, not strided) on every mesh dim."""
    return all(type(p) in (Replicate, Shard) for p in t.placements)


def _shard_of(t: UpstreamDTensor, full: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``full`` laid out as ``t``."""
    mesh = t.device_mesh
    return expected_local(full, mesh.shape, mesh.get_coordinate() or (), t.placements)


def _weights(shape: Sequence[int]) -> torch.Tensor:
    return torch.linspace(-1.0, 2.0, math.prod(shape), dtype=torch.float64).view(tuple(shape))


def _seed_loss(outs: Sequence[Any], refs: Sequence[torch.Tensor]) -> torch.Tensor:
    """sum(out * w) over the differentiable outputs, with fixed non-uniform weights ``w``.
    A DTensor laid out by shard contributes its local shard times ``w``'s matching shard, so
    backward seeds it with ``w`` in its own placements (no collective); others contribute
    their full tensor."""
    loss = torch.zeros((), dtype=torch.float64)
    for o, r in zip(outs, refs):
        if not (isinstance(o, torch.Tensor) and o.requires_grad):
            continue
        w = _weights(r.shape)
        if isinstance(o, UpstreamDTensor) and _by_shard(o):
            loss = loss + (o.to_local() * _shard_of(o, w)).sum()
        else:
            loss = loss + (_full(o) * w).sum()
    return loss


def _full(o: Any) -> Any:
    return o.full_tensor() if isinstance(o, UpstreamDTensor) else o


def _mismatch(got: Any, want: Any) -> str | None:
    """How ``got`` (a DTensor output or gradient, or a plain value) differs from the
    single-device ``want``, or None. A DTensor laid out by shard is compared on this rank's
    shard; others as full tensors (a collective, taken on every rank alike)."""
    if got is None:
        return "missing"
    if isinstance(got, UpstreamDTensor):
        if got.shape != want.shape:
            return f"global shape {tuple(got.shape)}, single device {tuple(want.shape)}"
        where = f" ({got.placements}, local shard)" if _by_shard(got) else f" ({got.placements})"
        got, want = (got.to_local(), _shard_of(got, want)) if _by_shard(got) else (_full(got), want)
    else:
        where = ""
    try:
        if isinstance(want, torch.Tensor):
            torch.testing.assert_close(got, want.detach(), rtol=1e-10, atol=1e-10)
        else:
            assert got == want, (got, want)
    except AssertionError as e:
        return f"{where} {e}".strip()
    return None


def check_layout(
    case: OpCase,
    size: tuple[int, int],
    mesh_shape: MeshKey,
    layout: Layout,
    counted: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
    run: Callable[..., Any] | None = None,
) -> tuple[Any, Any]:
    """One case on one layout: outputs and input gradients equal single-device torch, shard
    by shard on every rank (``_mismatch``). Returns what ``counted()`` yielded around the op
    and around its backward. ``run`` replaces ``case.fn`` on the DTensor inputs (e.g. its
    compiled form). Mismatches are raised together after backward, so a rank whose shard
    differs still joins every collective. On a rank outside the mesh the op must run
    without communicating and leave empty local tensors."""
    inputs = make_inputs(case, size)
    ref_in = [x.clone().requires_grad_(i in case.grad) for i, x in enumerate(inputs)]
    ref_out = _tensors(case.fn(*ref_in))
    mesh = mesh_for(mesh_shape)
    d_in = [  # every rank made the same inputs: each takes its shard of its own copy
        vescale.distribute_tensor(x, mesh, list(pl), src_data_rank=None).requires_grad_(
            i in case.grad
        )
        for i, (x, pl) in enumerate(zip(inputs, layout))
    ]
    with counted() as forward:
        out = _tensors((run or case.fn)(*d_in))
    if mesh.get_coordinate() is None:
        # upstream's rule: empty local tensors (zeros for 0-d outputs), no communication
        locals_ = [o.to_local() for o in out if isinstance(o, UpstreamDTensor)]
        assert all(t.numel() == 0 or t.ndim == 0 for t in locals_)
        return forward, None
    assert len(out) == len(ref_out), (len(out), len(ref_out))
    wrong = [(f"output {k}", _mismatch(o, r)) for k, (o, r) in enumerate(zip(out, ref_out))]
    backward = None
    if case.grad:
        _seed_loss(ref_out, ref_out).backward()
        loss = _seed_loss(out, ref_out)
        with counted() as backward:
            loss.backward()
        wrong += [(f"grad {i}", _mismatch(d_in[i].grad, ref_in[i].grad)) for i in case.grad]
    errors = [f"{what}: {msg}" for what, msg in wrong if msg is not None]
    if errors:
        raise AssertionError(f"rank {torch.distributed.get_rank()}: " + "; ".join(errors))
    return forward, backward


def _runs(case: OpCase, mesh: MeshKey, full: bool) -> list[tuple[Size, Layout]]:
    """``pairwise_layouts``, or with ``full`` every combination (``layouts``) on both sizes."""
    if mesh_ndim(mesh) == 2 and not case.mesh_2d:
        return []
    if not full:
        return pairwise_layouts(case, mesh)
    return [
        (size, lay)
        for size in (EVEN, UNEVEN)
        for lay in layouts(case, make_inputs(case, size), mesh_ndim(mesh))
    ]


def fuzz(
    name: str, mesh_shapes: Sequence[tuple[int, ...]], full: bool = False
) -> tuple[int, list[str]]:
    """Run ``name`` on the runs of every mesh (``_runs``); (cases run, this rank's failures)."""
    case = BY_NAME[name]
    ran, failures = 0, []
    with vescale.dtensor.explicit_redistribute(False):
        for mesh_shape in mesh_shapes:
            for size, layout in _runs(case, mesh_shape, full):
                ran += 1
                try:
                    check_layout(case, size, mesh_shape, layout)
                except Exception as e:
                    msg = str(e).strip().splitlines()
                    failures.append(f"{mesh_shape} {size} {layout}: {type(e).__name__}: {msg[:3]}")
    return ran, failures


def layout_count(name: str, mesh_shapes: Sequence[tuple[int, ...]], full: bool = False) -> int:
    return sum(len(_runs(BY_NAME[name], mesh, full)) for mesh in mesh_shapes)


def _verdict(name: str, results: Sequence[Sequence[tuple[int, list[str]]]], want: int) -> None:
    """Every rank ran ``want`` layouts and none failed on any rank."""
    assert sum(ranks[0][0] for ranks in results) == want
    failures = [f for ranks in results for _, fails in ranks for f in fails]
    assert not failures, f"{name}: {len(failures)} failures in {want} layouts:\n" + "\n".join(
        failures[:15]
    )


ALL_NAMES = [c.name for c in (*CASES, *EXTRA_CASES)]


@pytest.mark.parametrize("name", ALL_NAMES)
def test_op_on_every_placement(pool2, pool4, name):
    """Every combination on 2 ranks, all pairs of inputs on 4, all pairs of (input, mesh
    dim) factors on 2x2 (``pairwise_layouts``)."""
    r2 = pool2.submit(fuzz, name, [(2,)], timeout_s=900)  # both pools at once
    r4 = pool4.run(fuzz, name, [(4,), (2, 2)], timeout_s=900)
    _verdict(name, [r2(), r4], layout_count(name, [(2,), (4,), (2, 2)]))


@pytest.mark.full
@pytest.mark.parametrize("name", ALL_NAMES)
def test_op_on_every_placement_combination(pool2, pool4, name):
    """The full product on 2 and 4 ranks and on the 2x2 mesh (all-pairs above
    FULL_PRODUCT_LIMIT)."""
    r2 = pool2.submit(fuzz, name, [(2,)], True, timeout_s=3600)
    r4 = pool4.run(fuzz, name, [(4,), (2, 2)], True, timeout_s=3600)
    _verdict(name, [r2(), r4], layout_count(name, [(2,), (4,), (2, 2)], full=True))


def _covered(runs: Sequence[tuple[Size, Layout]], ndim: int, strength: int) -> set[Any]:
    """The combinations of ``strength`` (factor, value)s the runs hold; factors: the size
    and each (input, mesh dim)."""
    out = set()
    for size, layout in runs:
        row = [("size", size), *(((i, m), p[m]) for i, p in enumerate(layout) for m in range(ndim))]
        out |= {frozenset(c) for c in itertools.combinations(row, strength)}
    return out


@pytest.mark.parametrize("name", ALL_NAMES)
def test_default_layouts_cover_what_they_promise(name):
    """The default runs (``pairwise_layouts``) against the full product (``layouts``): on 2
    ranks every combination on the uneven size; on 2 and 4 ranks every pair of (input
    placement, input placement or size); on 2x2 no 2-rank
    sub-mesh layout, and every pair (uneven size) and every single (even size) of (input,
    mesh dim) placements that a layout without a 2-rank sub-mesh holds."""
    case = BY_NAME[name]
    assert _covered(pairwise_layouts(case, (4,)), 1, 2) >= _covered(_runs(case, (4,), True), 1, 2)
    on_2 = pairwise_layouts(case, (2,))
    assert [r for r in on_2 if r[0] == UNEVEN] == [
        r for r in _runs(case, (2,), True) if r[0] == UNEVEN
    ]
    assert _covered(on_2, 1, 2) >= _covered(_runs(case, (2,), True), 1, 2)
    if case.mesh_2d:
        runs = pairwise_layouts(case, (2, 2))
        assert not any(_sub_mesh_1d(lay) for _, lay in runs)
        for size, strength in ((EVEN, 1), (UNEVEN, 2)):
            every = [
                r for r in _runs(case, (2, 2), True) if r[0] == size and not _sub_mesh_1d(r[1])
            ]
            mine = [r for r in runs if r[0] == size]
            assert _covered(mine, 2, strength) >= _covered(every, 2, strength), size


def _alias_off_on_rank_1(x: Any) -> Any:
    """``alias(x)`` with rank 1's local tensor off by 1e-3 (a wrong shard or replica)."""
    y = torch.ops.aten.alias.default(x)
    bump = 1e-3 if torch.distributed.get_rank() == 1 else 0.0
    return UpstreamDTensor.from_local(
        y.to_local() + bump, y.device_mesh, y.placements, shape=y.shape, stride=y.stride()
    )


def _caught(layouts_: Sequence[Layout]) -> list[str | None]:
    out: list[str | None] = []
    for layout in layouts_:
        try:
            check_layout(BY_NAME["alias"], EVEN, (2,), layout, run=_alias_off_on_rank_1)
            out.append(None)
        except AssertionError as e:
            out.append(str(e))
    return out


def test_check_layout_fails_a_wrong_shard_on_one_rank(pool2):
    """The shard-by-shard check fails the rank whose Shard or Replicate piece is wrong (a
    gathered check would miss a wrong replica), and that rank still joins the backward;
    a Partial output, compared as a full tensor, fails on every rank."""
    r, s, p = Replicate(), Shard(0), Partial()
    rank0, rank1 = pool2.run(_caught, [((r,),), ((s,),), ((p,),)])
    assert rank0[:2] == [None, None], rank0
    assert all(m is not None and m.startswith("rank 1: output 0:") for m in rank1), rank1
    assert rank0[2] is not None and "output 0" in rank0[2], rank0


if __name__ == "__main__":  # the case count per op: python -m tests.dtensor.test_op_fuzz
    from tests.dtensor.op_cases import EVEN, UNEVEN
    from tests.dtensor.test_crashes import META_NOT_APPLICABLE, _meta_layouts

    total, full, meta = 0, 0, 0
    for c in (*CASES, *EXTRA_CASES):
        counts = [layout_count(c.name, [m]) for m in ((2,), (4,), (2, 2))]
        full_more = layout_count(c.name, [(2,), (4,), (2, 2)], full=True) - sum(counts)
        on_meta = sum(
            len(_meta_layouts(c, c.make(*size, torch.Generator().manual_seed(0))))
            for size in (EVEN, UNEVEN)
            if c.name not in META_NOT_APPLICABLE
        )
        total, full, meta = total + sum(counts), full + full_more, meta + on_meta
        print(
            f"{c.name:26s} 1-D x2 {counts[0]:4d}  1-D x4 {counts[1]:4d}  2x2 {counts[2]:4d}"
            f"  meta x4 {on_meta:3d}  (--full adds {full_more:4d})"
        )
    print(f"{'total':26s} {total}  meta mesh {meta} (test_crashes)  (--full adds {full})")

# (case, input, dim): that input InterleavedShard(dim, 2) on 2 ranks, the others replicated
INTERLEAVED = [
    ("argmax", 0, 1),
    ("argmin", 0, 0),
    ("topk_dim0", 0, 0),
    ("unique", 0, 0),
    ("cross_entropy", 0, 1),
    ("cross_entropy_none", 0, 0),
    ("nll_loss", 0, 1),
    ("embedding", 1, 0),
    ("index_add__dim0", 0, 1),
    ("scatter_src_dim1", 0, 0),
]


def _interleaved(cases):
    failures = []
    with vescale.dtensor.explicit_redistribute(False):
        for name, i, dim in cases:
            case = BY_NAME[name]
            n = len(make_inputs(case, EVEN))
            layout = tuple(
                (InterleavedShard(dim, 2),) if j == i else (Replicate(),) for j in range(n)
            )
            try:
                check_layout(case, EVEN, (2,), layout)
            except Exception as e:
                failures.append(f"{name} {layout}: {type(e).__name__}: {str(e)[:300]}")
    return failures


def test_ops_on_interleaved_shards(pool2):
    """Ops that locate a shard by its global offset must not treat an interleaved shard as
    a contiguous chunk."""
    failures = pool2.run(_interleaved, INTERLEAVED)[0]
    assert not failures, "\n".join(failures)


SUBMESH_LAYOUTS = 6


def _on_submesh(names: Sequence[str]) -> tuple[int, list[str]]:
    """Each case on the 2-rank sub-mesh of a 4-rank world, on a spread sample of its layouts:
    ranks on it get single-device answers, ranks outside it run without communicating."""
    ran, failures = 0, []
    with vescale.dtensor.explicit_redistribute(False):
        for name in names:
            case = BY_NAME[name]
            every = layouts(case, make_inputs(case, UNEVEN), 1)
            for layout in every[:: max(1, len(every) // SUBMESH_LAYOUTS)][:SUBMESH_LAYOUTS]:
                ran += 1
                try:
                    check_layout(case, UNEVEN, SUBMESH, layout)
                except Exception as e:
                    failures.append(f"{name} {layout}: {type(e).__name__}: {str(e)[:300]}")
    return ran, failures


def test_ops_on_a_submesh_with_ranks_outside(pool4):
    """Ranks on the sub-mesh get single-device answers; ranks outside it never run vescale's
    op handlers (upstream's rule: no communication, empty local results) and never crash."""
    names = [c.name for c in (*CASES, *EXTRA_CASES)]
    results = pool4.run(_on_submesh, names, timeout_s=900)
    assert results[0][0] >= 2 * len(names)
    inside = [f for r in (0, 2) for f in results[r][1]]
    assert not inside, "\n".join(inside[:15])  # ranks on the mesh: single-device answers
    outside = [f for r in (1, 3) for f in results[r][1]]
    assert not outside, "\n".join(outside[:15])
