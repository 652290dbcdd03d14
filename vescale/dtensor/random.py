"""Random numbers for sharded tensors: single-device-equivalent on CPU, per shard on CUDA.

**CPU** (the ``mt19937`` generator). A random op on a sharded tensor (a deferred parameter
being materialized, ``nn.init.*``, ``rand_like``, ``bernoulli_`` or dropout on a ``DTensor``)
gives every rank exactly the values the same op gives on one device under the same seed, at
this rank's global indices, and leaves the generator in the state the single-device op leaves
it in, so later random ops agree too. All ranks must start from the same generator state
(``torch.manual_seed(s)`` everywhere). No communication is involved. Under
``LocalTensorMode`` each simulated rank gets its own shard this way, from its own generator
state.

How the stream is partitioned (torch 2.13 kernels):

* ``uniform_`` (hence ``rand``, ``kaiming_uniform_``, ``xavier_uniform_``, ``trunc_normal_``)
  and ``bernoulli_(p)`` (hence CPU dropout) draw a fixed number of 32-bit words per element, in
  storage order (uniform: 1, 2 for float64; bernoulli: 2). Element ``i`` depends only on its
  own words, so the values of any range of elements come from running the same op on a
  buffer of that range's size once the generator is positioned at its first word.
* ``normal_`` on a contiguous float32/float64 tensor of ``n >= 16`` elements (hence ``randn``,
  ``nn.init.normal_``, embeddings) first draws ``n`` uniforms, turns each block of 16 into 16
  normals (Box-Muller pairs ``j``, ``j + 8``), and, when ``16`` does not divide ``n``, draws 16
  more uniforms whose normals overwrite the last 16 elements. So it is reproduced block-wise:
  ``normal_`` on buffers of whole blocks, the uniforms of the final partial block skipped, and
  the at most 16 trailing elements fixed from the 16 extra words at the end.

The global tensor is walked once, in storage order, in pieces of at most
:data:`PIECE_ELEMENTS` elements; each piece is generated, the elements this rank holds are
copied into its shard, and the piece is overwritten by the next. Time is that of generating
the full tensor on one device. **Extra memory is bounded** by two per-thread scratch buffers
of ``PIECE_ELEMENTS + 16`` elements per dtype (1 MiB each for float32; kept between ops so
per-op reallocation cannot fragment the heap), the selected part of one piece (at most a
piece), one int64 per shard row of the leading dims walked, and the per-dim index sets.
Anything else (half/bfloat16 ``normal_``, tensors under 16 elements, non-contiguous global
layouts, ``bernoulli_`` on Intel CPUs where torch uses MKL's stream, other random ops) is
generated in full for that one tensor and sliced: exact by construction, with extra memory
bounded by the size of that single tensor, released before the next one.

**CUDA** (:data:`PHILOX_DEVICES`: a counter-based Philox generator, a seed and an offset,
whose per-element draws depend on the kernel's launch configuration). A random op on a
DTensor, dropout included (``native_dropout``: the fused kernel), runs on the local shard
only: memory and work O(shard). The shard draws at :func:`philox_offsets` past the
generator's offset (shards numbered as upstream's ``OffsetBasedRNGTracker`` numbers them,
spaced by the largest shard's element count), the same on replicas and Partial mesh dims,
disjoint between shards, and every rank then moves the generator by the same amount. The
contract: the values are a deterministic function of the seed, the global shape and how the
tensor is sharded (mesh dims that only replicate it do not matter), independent between
shards; **they are not one device's draw**, and another sharding draws other values. A
tensor that no mesh dim of more than one rank shards runs the op as one device does (same
values, same generator advance). SDPA's flash and memory-efficient kernels with
``dropout_p > 0`` on DTensors draw each (batch, head) shard's mask at the offsets of that
shard of a ``(B, H, L, max(S, 32))`` virtual tensor (:func:`sdpa_dropout_spec`); the kernel
returns its seed and offset, so the backward redraws that mask. Deferred init on CUDA
draws nothing when it records a random op (the generator moves past
:func:`philox_reserve` offsets); materializing a shard draws it alone at its
:func:`philox_offsets` from the recorded state: the values the same op on a DTensor of
that layout gives. ``RaggedShard(dims=(0,))`` (vescale.fsdp's parameters) counts as a
sharding: each rank's slice is a shard, on CPU its rows' single-device values.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor as _UpstreamDTensor

from vescale._torch_compat import (
    DTensorSpec,
    PhiloxState,
    StridedShard,
    TensorMeta,
    enabled_local_tensor_mode,
    for_each_rank_run,
    run_dtensor_rng_op,
    shard_info,
    shard_linear_idx,
)
from vescale.dtensor.dtensor import new_dtensor
from vescale.dtensor.hooks import bypass_dispatch, output_spec, python_dispatch
from vescale.dtensor.inflight import wait_local
from vescale.dtensor.layout import contiguous_strides, local_indices
from vescale.dtensor.placement_types import Partial, Replicate, Shard
from vescale.dtensor.propagation import UnsupportedOpError
from vescale.dtensor.ragged import (
    RaggedShard,
    find_ragged,
    inner_shape,
    ragged_local_range,
    replace_ragged,
)
from vescale.dtensor.redistribute import replicate_to_partial

__all__ = [
    "PHILOX_DEVICES",
    "PIECE_ELEMENTS",
    "RandomOp",
    "draw_on_shard",
    "is_philox",
    "philox_offsets",
    "philox_reserve",
    "random_op_of",
    "reserve_philox",
    "run_at_philox",
    "run_random",
    "sdpa_dropout_spec",
    "shard_indices",
    "take_local",
    "uses_philox",
]

PIECE_ELEMENTS = 1 << 18
"""Elements generated at a time when a sharded random op walks the global stream."""

aten = torch.ops.aten
_UNIFORM, _NORMAL, _BERNOULLI = aten.uniform_.default, aten.normal_.default, aten.bernoulli_.float
RANDOM_OPS = (_UNIFORM, _NORMAL, _BERNOULLI)

Indices = tuple[torch.Tensor, ...]


# ---- a rank's shard of a full tensor ----------------------------------------------------


def _selector(indices: Indices, shape: Sequence[int], first: int = 0) -> tuple[Any, ...]:
    """An index for ``t[...]`` (dims ``first`` on) picking the product of ``indices``."""
    sel: list[Any] = []
    n = len(indices) - first
    for j, (ix, size) in enumerate(zip(indices[first:], shape[first:])):
        if ix.numel() == size:
            sel.append(slice(None))
        else:
            view = [1] * n
            view[j] = -1
            sel.append(ix.view(view))
    if all(isinstance(s, slice) for s in sel):
        return tuple(sel)
    # advanced indices broadcast together; full dims become aranges so the result keeps order
    return tuple(
        torch.arange(size).view([-1 if i == j else 1 for i in range(n)])
        if isinstance(s, slice)
        else s
        for j, (s, size) in enumerate(zip(sel, shape[first:]))
    )


def take_local(full: torch.Tensor, indices: Indices) -> torch.Tensor:
    """The shard of ``full`` at ``indices`` as a new contiguous tensor."""
    return full[_selector(indices, full.shape)].contiguous()


def shard_indices(
    shape: Sequence[int], mesh: Any, placements: Sequence[Any], coordinate: Sequence[int]
) -> Indices | None:
    """Per tensor dim, the global indices the shard at mesh ``coordinate`` holds
    (:func:`~vescale.dtensor.layout.local_indices`); a ``RaggedShard(dims=(0,))`` slice as
    the rows of dim 0 it holds (its local tensor is their flattening). ``None`` for a
    RaggedShard of more dims: its slice is no product of index sets."""
    found = find_ragged(placements)
    if found is None:
        return local_indices(shape, mesh, placements, coordinate)
    if found[1].dims != (0,):
        return None
    indices = local_indices(shape, mesh, replace_ragged(placements, Replicate()), coordinate)
    start, length = ragged_local_range(shape, mesh, placements, coordinate)
    block = math.prod(len(ix) for ix in indices[1:])
    lo, hi = (start // block, (start + length) // block) if block else (0, 0)
    return (indices[0][lo:hi], *indices[1:])


# ---- random ops ------------------------------------------------------------------------


@dataclass(frozen=True)
class RandomOp:
    """An in-place random op: ``op(tensor, *args, generator=generator)``."""

    op: torch._ops.OpOverload
    args: tuple[Any, ...]
    generator: torch.Generator | None = None

    def apply(self, t: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        return self.op(t, *self.args, generator=generator)  # type: ignore[no-any-return]


def random_op_of(
    op: torch._ops.OpOverload, args: Sequence[Any], kwargs: dict[str, Any]
) -> RandomOp:
    """The :class:`RandomOp` of an in-place aten random call ``op(self, *args, **kwargs)``."""
    kw = dict(kwargs)
    gen = kw.pop("generator", None)
    rest = list(args[1:])
    for a in op._schema.arguments[1 + len(rest) :]:
        if a.kwarg_only:
            continue
        rest.append(kw.pop(a.name) if a.name in kw else a.default_value)
    if kw:
        raise TypeError(f"{op}: unexpected arguments {sorted(kw)}")
    return RandomOp(op, tuple(rest), gen)


def default_generator(device: torch.device) -> torch.Generator:
    """The generator an op on ``device`` uses when given none."""
    if device.type == "cpu":
        return torch.default_generator
    mod = torch.get_device_module(device.type)
    index = device.index if device.index is not None else mod.current_device()
    return mod.default_generators[index]  # type: ignore[no-any-return]


@functools.cache
def _bernoulli_is_elementwise() -> bool:
    """Whether CPU ``bernoulli_(p)`` draws 2 words per element (torch's own kernel; on Intel
    CPUs with MKL it seeds an MKL stream from one word instead)."""
    g = torch.Generator().manual_seed(0)
    torch.empty(3).bernoulli_(0.5, generator=g)
    h = torch.Generator().manual_seed(0)
    torch.empty(6).uniform_(generator=h)
    return torch.equal(g.get_state(), h.get_state())


_scratch_cache = threading.local()


def _scratch(dtype: torch.dtype, slot: str) -> torch.Tensor:
    """A per-thread buffer of ``PIECE_ELEMENTS + 16`` elements, kept between ops: freeing and
    reallocating a piece per op lets small long-lived allocations fragment the heap. Under a
    mode making tensors of another type (torch.compile's fake mode): a fresh one, uncached."""
    if type(torch.empty(0)) is not torch.Tensor:
        return torch.empty(PIECE_ELEMENTS + 16, dtype=dtype)
    cache: dict[tuple[torch.dtype, str], torch.Tensor] = _scratch_cache.__dict__.setdefault(
        "buffers", {}
    )
    buf = cache.get((dtype, slot))
    if buf is None or buf.numel() != PIECE_ELEMENTS + 16:
        buf = cache[(dtype, slot)] = torch.empty(PIECE_ELEMENTS + 16, dtype=dtype)
    return buf


class _Stream:
    """Values of one random op over a tensor's elements in storage order, piece by piece,
    generated into a reused scratch buffer of at most :data:`PIECE_ELEMENTS` elements."""

    def __init__(self, rop: RandomOp, numel: int, dtype: torch.dtype, gen: torch.Generator):
        self.rop, self.numel, self.dtype, self.gen = rop, numel, dtype, gen
        self.scratch = _scratch(dtype, "values")

    def take(self, n: int) -> torch.Tensor:
        """The next ``n <= PIECE_ELEMENTS`` values (valid until the next call)."""
        return self.rop.apply(self.scratch[:n], self.gen)

    def finish(self) -> torch.Tensor | None:
        """Values replacing the last ones (consumes their words), if the op has any."""
        return None


class _NormalStream(_Stream):
    """``normal_``'s block-of-16 Box-Muller layout (see the module docstring)."""

    def __init__(self, rop: RandomOp, numel: int, dtype: torch.dtype, gen: torch.Generator):
        super().__init__(rop, numel, dtype, gen)
        self.blocks_left = numel // 16
        self.partial_left = numel % 16
        self.blocks = _scratch(dtype, "blocks")[: 16 * -(-min(numel, PIECE_ELEMENTS) // 16)]
        self.left = self.blocks[:0]  # generated values not yet taken (< 16)

    def take(self, n: int) -> torch.Tensor:
        out = self.scratch[:n]
        done = min(n, self.left.numel())
        out[:done] = self.left[:done]
        self.left = self.left[done:]
        while done < n:
            if self.blocks_left:
                m = min(self.blocks_left, -(-(n - done) // 16), self.blocks.numel() // 16)
                vals = self.rop.apply(self.blocks[: 16 * m], self.gen)
                self.blocks_left -= m
                k = min(16 * m, n - done)
                out[done : done + k] = vals[:k]
                self.left = vals[k:]
                done += k
            else:  # the partial last block: words consumed, values replaced in finish()
                k = min(n - done, self.partial_left)
                self.blocks[:k].uniform_(generator=self.gen)
                self.partial_left -= k
                done += k
        return out

    def finish(self) -> torch.Tensor | None:
        if self.numel % 16 == 0:
            return None
        return self.rop.apply(torch.empty(16, dtype=self.dtype), self.gen)


def _stream(
    rop: RandomOp,
    shape: Sequence[int],
    stride: Sequence[int],
    dtype: torch.dtype,
    device: torch.device,
    gen: torch.Generator,
) -> _Stream | None:
    """A piecewise producer exactly reproducing ``rop`` on the whole tensor, if there is one."""
    numel = math.prod(shape)
    contiguous = tuple(stride) == contiguous_strides(shape)
    if device.type != "cpu" or gen.device.type != "cpu" or not contiguous or numel == 0:
        return None
    if rop.op is _UNIFORM and dtype.is_floating_point:
        return _Stream(rop, numel, dtype, gen)
    if rop.op is _BERNOULLI and _bernoulli_is_elementwise():
        return _Stream(rop, numel, dtype, gen)
    if rop.op is _NORMAL and dtype in (torch.float32, torch.float64) and numel >= 16:
        return _NormalStream(rop, numel, dtype, gen)
    return None


def run_random(
    rop: RandomOp,
    shape: Sequence[int],
    dtype: torch.dtype,
    device: torch.device,
    indices: Indices | None,
    *,
    stride: Sequence[int] | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Run ``rop`` on a virtual tensor of ``shape``: return the values at ``indices`` (into
    ``out`` when given, else a new tensor; ``None`` when ``indices`` is ``None``) and advance
    the generator exactly as the op on the whole tensor does."""
    gen = rop.generator or default_generator(torch.device(device))
    stride = tuple(stride) if stride is not None else contiguous_strides(shape)
    stream = _stream(rop, shape, stride, dtype, torch.device(device), gen)
    if stream is None:  # bounded fallback: this one tensor in full
        full = rop.apply(torch.empty_strided(shape, stride, dtype=dtype, device=device), gen)
        if indices is None:
            return None
        local = take_local(full, indices)
        if out is None:
            return local
        return out.copy_(local)
    if indices is None:
        left = stream.numel
        while left:
            left -= stream.take(min(left, PIECE_ELEMENTS)).numel()
        stream.finish()
        return None
    indices = tuple(ix.contiguous() for ix in indices)
    if out is None:
        out = torch.empty([ix.numel() for ix in indices], dtype=dtype)
    _scatter(stream, list(shape), indices, out)
    return out


def _scatter(stream: _Stream, shape: list[int], indices: Indices, out: torch.Tensor) -> None:
    """Walk ``stream`` over the whole tensor, copying the values at ``indices`` into ``out``."""
    ndim = len(shape)
    lead_dims = next(k for k in range(ndim + 1) if math.prod(shape[k:]) <= PIECE_ELEMENTS)
    block = math.prod(shape[lead_dims:])
    n_lead = math.prod(shape[:lead_dims])
    wanted = torch.zeros(1, dtype=torch.int64)  # flat leading indices this rank holds, sorted
    for d in range(lead_dims):
        wanted = (wanted.view(-1, 1) * shape[d] + indices[d].view(1, -1)).flatten()
    trailing = _selector(indices, shape, lead_dims)
    dst = out.view(wanted.numel(), *out.shape[lead_dims:]) if out.numel() else out
    rows = max(1, PIECE_ELEMENTS // max(block, 1))
    pos = 0
    for r0 in range(0, n_lead, rows):
        r1 = min(n_lead, r0 + rows)
        vals = stream.take((r1 - r0) * block).view(r1 - r0, *shape[lead_dims:])
        end = int(torch.searchsorted(wanted, r1)) if out.numel() else 0
        if end > pos:
            dst[pos:end] = vals[wanted[pos:end] - r0][(slice(None), *trailing)]
        pos = end
    tail = stream.finish()
    if tail is None or out.numel() == 0:
        return
    numel = math.prod(shape)
    lin = torch.arange(numel - tail.numel(), numel)
    where: list[torch.Tensor] = []
    keep = torch.ones_like(lin, dtype=torch.bool)
    for d in reversed(range(ndim)):
        coord = lin % shape[d]
        lin = lin // shape[d]
        at = torch.searchsorted(indices[d], coord).clamp(max=max(indices[d].numel() - 1, 0))
        keep &= indices[d][at] == coord if indices[d].numel() else torch.zeros_like(keep)
        where.insert(0, at)
    out[tuple(w[keep] for w in where)] = tail[keep]


# ---- CUDA: each rank draws its shard from its own Philox offsets -----------------------

PHILOX_DEVICES = frozenset({"cuda"})
"""Device types whose generator is a counter-based Philox stream (a seed and an offset):
random ops on DTensors there run on the local shard only, at per-shard offsets."""


def _philox_layout(spec: Any) -> bool:
    """Whether ``spec``'s placements are ones :func:`philox_offsets` numbers shards of."""
    kinds = Shard | StridedShard | Replicate | Partial | RaggedShard
    return all(isinstance(p, kinds) for p in spec.placements)


def _shard_number(spec: Any, coordinate: Sequence[int]) -> tuple[int, int]:
    """``(number, count)``: the shard at mesh ``coordinate`` and how many shards there are,
    numbered as upstream's ``OffsetBasedRNGTracker`` numbers them; a RaggedShard mesh dim
    (one per spec) splits each shard of the other mesh dims by its coordinate there."""
    coord = list(coordinate)
    found = find_ragged(spec.placements)
    if found is not None:
        placements = replace_ragged(spec.placements, Replicate())
        spec = DTensorSpec(spec.mesh, placements, tensor_meta=spec.tensor_meta)
    idx, counts = shard_info(coord, spec)
    number, count = int(shard_linear_idx(idx, counts)), int(math.prod(counts))
    if found is None:
        return number, count
    n = spec.mesh.size(found[0])
    return number * n + coord[found[0]], count * n


def _largest_shard(spec: Any) -> int:
    """The element count of the largest shard of ``spec`` (mesh coordinate 0's chunk of every
    ``Shard``; the largest of a RaggedShard's slices of it)."""
    zero = [0] * spec.mesh.ndim
    found = find_ragged(spec.placements)
    if found is None:
        first = local_indices(spec.shape, spec.mesh, spec.placements, zero)
        return math.prod(len(ix) for ix in first)
    inner = inner_shape(spec.shape, spec.mesh, spec.placements, zero)
    return max(n for _, n in found[1].local_ranges(inner))


def is_philox(device: torch.device) -> bool:
    """Whether ``device``'s generator is a Philox stream (:data:`PHILOX_DEVICES`)."""
    return device.type in PHILOX_DEVICES


def uses_philox(device: torch.device, spec: Any) -> bool:
    """Whether a random op on a DTensor of ``spec`` with local tensors on ``device`` draws
    per shard from Philox offsets (see the module docstring) rather than single-device."""
    return is_philox(device) and _philox_layout(spec)


def philox_offsets(spec: Any, coordinate: Sequence[int]) -> tuple[int, int]:
    """``(start, end)``: the shard at mesh ``coordinate`` draws from the Philox stream
    ``start`` past the generator's offset, which every rank then moves ``end`` past where it
    was. Shards are numbered as upstream's ``OffsetBasedRNGTracker`` numbers them (its
    ``_calc_shard_info`` / ``_calc_shard_linear_idx``: replicas of a shard, and Partial mesh
    dims, get the same number); shard ``i`` starts at ``i * step``, ``step`` the largest
    shard's element count rounded up to a multiple of 4 (CUDA offsets are), so every shard
    has at least its element count of offsets to itself, and ``end`` covers all shards and
    at least the whole tensor's count (the offset one device's op would move by, rounded)."""
    number, count = _shard_number(spec, coordinate)
    step = -(-_largest_shard(spec) // 4) * 4
    whole = -(-math.prod(spec.shape) // 4) * 4
    return number * step, max(whole, count * step)


def philox_reserve(numel: int) -> int:
    """The Philox offsets a deferred random op on ``numel`` elements reserves (see
    :func:`reserve_philox`): the world size times ``numel`` rounded up to 4, which bounds
    :func:`philox_offsets`' ``end`` for every layout on every mesh of this world (at most
    world-size shards, none larger than the tensor)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    return world * (-(-numel // 4) * 4)


def reserve_philox(numel: int, generator: torch.Generator, device: torch.device) -> int:
    """Move the Philox ``generator`` (on ``device``) past :func:`philox_reserve` offsets without
    drawing (what deferred init does for a random op it records: the op draws per shard from
    the recorded state when materialized); returns that count."""
    n = philox_reserve(numel)
    run_at_philox(0, n, _no_draw, torch.empty(0, device=device), generator=generator)
    return n


def _no_draw(t: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    return t


def run_at_philox(
    start: int,
    end: int,
    op: Callable[..., Any],
    *args: Any,
    generator: torch.Generator | None = None,
    **kwargs: Any,
) -> Any:
    """``op(*args, **kwargs)`` drawing ``start`` past the CUDA generator's offset (the
    default one, or ``generator``), which is then left ``end`` past where it was. The default
    generator goes through upstream's ``run_dtensor_rng_op`` (traceable: the offsets are
    constants of a compiled graph)."""
    if generator is None:
        return run_dtensor_rng_op(start, end, op, *args, **kwargs)
    state = PhiloxState(generator.get_state())
    before = state.offset.clone()
    state.offset = before + start
    generator.set_state(state.state)
    try:
        return op(*args, generator=generator, **kwargs)
    finally:
        state.offset = before + end
        generator.set_state(state.state)


def draw_on_shard(
    spec: Any,
    coordinate: Sequence[int] | None,
    op: Callable[..., Any],
    *args: Any,
    generator: torch.Generator | None = None,
    **kwargs: Any,
) -> Any:
    """``op(*args, **kwargs)`` (``args[0]``: the shard of ``spec`` at mesh ``coordinate``,
    ``None`` off the mesh) on a Philox device: as on one device when no mesh dim shards the
    tensor (every rank holds all of it: the same values and generator advance as one
    device's), else through :func:`run_at_philox` at :func:`philox_offsets`."""
    coord = list(coordinate) if coordinate is not None else [0] * spec.mesh.ndim
    if _shard_number(spec, coord)[1] == 1:
        extra = {} if generator is None else {"generator": generator}
        return op(*args, **kwargs, **extra)
    start, end = philox_offsets(spec, coord)
    return run_at_philox(start, end, op, *args, generator=generator, **kwargs)


def _philox_values(
    rop: RandomOp,
    spec: Any,
    local: torch.Tensor,
    coordinate: list[int] | None,
    p: tuple[torch.Tensor, bool] | None,
) -> torch.Tensor:
    """``rop`` on ``local`` itself at this shard's Philox offsets (off the mesh: on the empty
    local tensor, the generator advanced as on the mesh)."""
    args = rop.args
    if p is not None:
        probs, is_local = p
        if not is_local and coordinate is not None:
            indices = shard_indices(spec.shape, spec.mesh, spec.placements, coordinate)
            assert indices is not None  # _fill refused the others
            probs = take_local(probs.expand(spec.shape), indices).view(local.shape)
        args = (probs, *args[1:])
    draw_on_shard(spec, coordinate, rop.op, local, *args, generator=rop.generator)
    return local


# ---- DTensor random ops ----------------------------------------------------------------

_RANDOM_FROM = getattr(aten.random_, "from")
INPLACE_RANDOM_OPS = (
    *RANDOM_OPS,
    aten.bernoulli_.Tensor,
    aten.exponential_.default,
    aten.cauchy_.default,
    aten.log_normal_.default,
    aten.geometric_.default,
    aten.random_.default,
    _RANDOM_FROM,
    aten.random_.to,
)
"""In-place random ops on a DTensor: each rank fills its shard with the single-device values
(``RaggedShard(dims=(0,))`` inputs included: what ``vescale.fsdp``'s sharded parameters are)."""

_LikeFill = Callable[[tuple[Any, ...]], tuple[torch._ops.OpOverload, tuple[Any, ...]]]
_UNIT = (_UNIFORM, (0.0, 1.0))
_STD = (_NORMAL, (0.0, 1.0))
_LIKE_OPS: dict[torch._ops.OpOverload, tuple[_LikeFill, bool]] = {
    aten.rand_like.default: (lambda a: _UNIT, True),
    aten.rand_like.generator: (lambda a: _UNIT, True),
    aten.randn_like.default: (lambda a: _STD, True),
    aten.randn_like.generator: (lambda a: _STD, True),
    aten.randint_like.default: (lambda a: (_RANDOM_FROM, (0, a[1])), True),
    aten.randint_like.generator: (lambda a: (_RANDOM_FROM, (0, a[1])), True),
    aten.randint_like.Tensor: (lambda a: (_RANDOM_FROM, (0, int(a[1]))), True),
    aten.randint_like.Tensor_generator: (lambda a: (_RANDOM_FROM, (0, int(a[1]))), True),
    aten.randint_like.low_dtype: (lambda a: (_RANDOM_FROM, (a[1], a[2])), True),
    aten.randint_like.low_generator_dtype: (lambda a: (_RANDOM_FROM, (a[1], a[2])), True),
    aten.bernoulli.p: (lambda a: (_BERNOULLI, (a[1],)), False),
    aten.bernoulli.default: (lambda a: (aten.bernoulli_.Tensor, (a[0],)), False),
}
"""Out-of-place random op -> (the in-place op and args ATen fills ``empty_like(self)`` with,
whether ``empty_like`` keeps the input's strides (``preserve_format``) or is contiguous)."""


@functools.cache
def _bernoulli_tensor_is_uniform(dtype: torch.dtype) -> bool:
    """Whether CPU ``bernoulli_(p)`` with a ``dtype`` tensor ``p`` is ``uniform_ < p`` on a
    ``dtype`` buffer, element by element (torch's serial kernel: same words, same values)."""
    p = torch.linspace(0.0, 1.0, 37, dtype=dtype)
    g = torch.Generator().manual_seed(0)
    out = torch.empty(37).bernoulli_(p, generator=g)
    h = torch.Generator().manual_seed(0)
    u = torch.empty(37, dtype=dtype).uniform_(generator=h)
    return torch.equal(g.get_state(), h.get_state()) and torch.equal(out, (u < p).float())


def _bernoulli_by_uniform(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``bernoulli_`` with a ``dtype`` tensor ``p`` on ``device`` is drawn piecewise as
    ``uniform_ < p``."""
    return device.type == "cpu" and _bernoulli_tensor_is_uniform(dtype)


def _probability_source(
    op: torch._ops.OpOverload, p: Any, spec: Any, on_mesh: bool, by_shard: bool
) -> tuple[torch.Tensor, bool]:
    """``bernoulli_``'s probabilities before the per-rank fill: ``(this rank's shard, True)``
    for a DTensor laid out like the output when drawn shard by shard, else ``(a tensor
    broadcasting to the global shape, False)``; any other DTensor is replicated first (its
    collective, on every rank of the mesh). Off the mesh only the words drawn matter."""
    from vescale.dtensor.explicit import redistribute_for

    if not on_mesh:
        return torch.zeros((), dtype=p.dtype), False
    if not isinstance(p, _UpstreamDTensor):
        return torch.as_tensor(p), False
    same = tuple(p._spec.placements) == tuple(spec.placements) and p.shape == spec.shape
    if by_shard and same and not any(x.is_partial() for x in spec.placements):
        return wait_local(p._local_tensor), True
    replicated = redistribute_for(op, p, [Replicate()] * p.device_mesh.ndim)
    return wait_local(replicated._local_tensor), False


def _values(
    rop: RandomOp,
    spec: Any,
    local: torch.Tensor,
    indices: Indices | None,
    p: tuple[torch.Tensor, bool] | None,
) -> torch.Tensor | None:
    """The single-device values of ``rop`` on the global tensor of ``spec`` at ``indices``
    (``None`` off the mesh, where the generator is only advanced); ``p``: ``bernoulli_``'s
    probabilities from :func:`_probability_source`."""
    device = local.device
    if p is None:
        return run_random(rop, spec.shape, local.dtype, device, indices, stride=spec.stride)
    probs, is_local = p
    uniform = _bernoulli_by_uniform(device, probs.dtype)
    if not is_local:
        full = probs.expand(spec.shape)
        probs = full if indices is None or not uniform else take_local(full, indices)
    if uniform:
        u = run_random(
            RandomOp(_UNIFORM, (0.0, 1.0), rop.generator), spec.shape, probs.dtype, device, indices
        )
        return None if u is None else (u < probs).to(local.dtype)
    whole = RandomOp(rop.op, (probs,), rop.generator)  # the bounded fallback: p everywhere
    return run_random(whole, spec.shape, local.dtype, device, indices, stride=spec.stride)


def _per_simulated_rank(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``; under ``LocalTensorMode`` once per simulated rank (LocalTensors and
    per-rank ints given as that rank's values, with the mode off), each from that rank's own
    generator states, which it advances: upstream's ``maybe_run_for_local_tensor`` starts all
    ranks from the one global state and leaves theirs as they were."""
    mode = enabled_local_tensor_mode()
    if mode is None:
        return fn(*args)

    def on_rank(*rank_args: Any) -> Any:
        with mode.disable():
            return fn(*rank_args)

    return for_each_rank_run(on_rank, mode.ranks, args, {}, alias=False)


def _fill_rank(
    rop: RandomOp,
    spec: Any,
    local: torch.Tensor,
    coordinate: list[int] | None,
    p: tuple[torch.Tensor, bool] | None,
    start: torch.Tensor | None,
) -> None:
    """Fill this rank's ``local`` (at mesh ``coordinate``, ``None`` off the mesh) in place;
    ``start``: the state to put ``rop``'s own generator in first (LocalTensorMode runs this
    once per simulated rank, each from the same state)."""
    if start is not None and rop.generator is not None:
        rop.generator.set_state(start)
    if uses_philox(local.device, spec):
        values: torch.Tensor | None = _philox_values(rop, spec, local, coordinate, p)
    else:
        indices = (
            None
            if coordinate is None
            else shard_indices(spec.shape, spec.mesh, spec.placements, coordinate)
        )
        values = _values(rop, spec, local, indices, p)
    if values is None or coordinate is None:
        return
    for mesh_dim, placement in enumerate(spec.placements):
        if isinstance(placement, Partial):
            values = replicate_to_partial(values, placement.reduce_op, coordinate[mesh_dim])
    if values is not local:
        local.copy_(values.view(local.shape))


def _fill(op: torch._ops.OpOverload, rop: RandomOp, dt: _UpstreamDTensor) -> None:
    """Fill ``dt`` in place with ``rop``'s single-device values; a Partial mesh dim holds them
    as :func:`replicate_to_partial` lays a replicated value out. On a meta mesh there are no
    values to draw (shapes only) and no generator advances. Under ``LocalTensorMode`` each
    simulated rank gets its own shard of the values, every rank's generator advancing as one
    device's does."""
    spec = dt._spec
    found = find_ragged(spec.placements)
    if found is not None and found[1].dims != (0,):
        raise UnsupportedOpError(
            f"{op}: not supported on RaggedShard inputs with dims {found[1].dims} "
            f"({tuple(spec.placements)} {list(spec.shape)} on {spec.mesh}): only dims=(0,); "
            f"redistribute them to Shard/Replicate first (x.redistribute(mesh, placements))"
        )
    if spec.mesh.device_type == "meta":
        return
    mesh_coordinate = spec.mesh.get_coordinate()
    on_mesh = mesh_coordinate is not None
    coordinate = list(mesh_coordinate) if mesh_coordinate is not None else None
    p = None
    if rop.op is aten.bernoulli_.Tensor:
        probs = rop.args[0]
        dtype = probs.dtype if isinstance(probs, torch.Tensor) else torch.float32
        device = dt._local_tensor.device
        by_shard = _bernoulli_by_uniform(device, dtype) or uses_philox(device, spec)
        p = _probability_source(op, probs, spec, on_mesh, by_shard)
    simulated = enabled_local_tensor_mode() is not None and rop.generator is not None
    start = rop.generator.get_state() if simulated and rop.generator is not None else None
    _per_simulated_rank(_fill_rank, rop, spec, dt._local_tensor, coordinate, p, start)


def _dtensor_random(
    op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """An in-place random ``op`` on a DTensor (see :data:`INPLACE_RANDOM_OPS`)."""
    _fill(op, random_op_of(op, args, kwargs), args[0])
    return args[0]


def _like_spec(spec: Any, dtype: torch.dtype, stride: Sequence[int]) -> DTensorSpec:
    """The spec of a new tensor laid out like ``spec`` (its Partial mesh dims replicated)."""
    placements = tuple(Replicate() if p.is_partial() else p for p in spec.placements)
    meta = TensorMeta(spec.shape, tuple(stride), dtype)
    return DTensorSpec(spec.mesh, placements, tensor_meta=meta)


def _dtensor_random_like(
    op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """An out-of-place random ``op`` (``rand_like``, ``bernoulli``, ...): a new DTensor laid
    out like the input (Partial mesh dims replicated) with the single-device values."""
    dt = args[0]
    fill, preserve = _LIKE_OPS[op]
    inplace, fill_args = fill(args)
    spec = dt._spec
    dtype = kwargs.get("dtype") or dt.dtype
    fmt = kwargs.get("memory_format") or torch.preserve_format
    keep = preserve and fmt == torch.preserve_format
    stride = spec.stride if keep else contiguous_strides(spec.shape)
    local = torch.empty_like(
        dt._local_tensor, dtype=dtype, memory_format=fmt if keep else torch.contiguous_format
    )
    out = new_dtensor(local, _like_spec(spec, dtype, stride), requires_grad=False)
    _fill(op, RandomOp(inplace, fill_args, kwargs.get("generator")), out)
    return out


def _native_dropout(
    op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Any, Any]:
    """``native_dropout`` as ATen's CPU kernel computes it: a ``bernoulli_(1 - p)`` bool mask
    laid out like the input (Partial mesh dims replicated), ``out = x * mask * 1 / (1 - p)``
    (linear in ``x``, so a Partial input stays Partial). On a Philox device: the device's
    fused kernel on this rank's shard at its offsets (:func:`philox_offsets`)."""
    x, p, train = (*args, None)[:3]
    if uses_philox(x._local_tensor.device, x._spec):
        coordinate = x._spec.mesh.get_coordinate()
        local_out, local_mask = _per_simulated_rank(
            _philox_dropout,
            x._spec,
            wait_local(x._local_tensor),
            list(coordinate) if coordinate is not None else None,
            p,
            train,
        )
        mask_spec = _like_spec(x._spec, torch.bool, x._spec.stride)
        out = new_dtensor(local_out, x._spec, requires_grad=False)
        return out, new_dtensor(local_mask, mask_spec, requires_grad=False)
    mask = _dtensor_random_like(aten.bernoulli.p, (x, 1.0 - p), {"dtype": torch.bool})
    local = x._local_tensor
    if train is False:
        mask._local_tensor.fill_(True)
        out_local = local.clone()
    else:
        scale = 0.0 if p == 1 else 1.0 / (1.0 - p)
        out_local = local.mul(mask._local_tensor).mul_(scale)
    out = new_dtensor(out_local, x._spec, requires_grad=False)
    return out, mask


def _philox_dropout(
    spec: Any, local: torch.Tensor, coordinate: list[int] | None, p: float, train: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """``native_dropout`` on one rank's shard at its Philox offsets."""
    return draw_on_shard(spec, coordinate, aten.native_dropout.default, local, p, train)  # type: ignore[no-any-return]


# ---- SDPA's fused kernels: dropout masks per (batch, head) shard ------------------------

_SDPA_DROPOUT = (
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_efficient_attention.default,
)


def _dropout_p(op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    i = [a.name for a in op._schema.arguments].index("dropout_p")
    return args[i] if i < len(args) else kwargs.get("dropout_p", 0.0)


def _sdpa_draws_per_shard(
    op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> bool:
    q = args[0]
    return (
        isinstance(q, _UpstreamDTensor)
        and _dropout_p(op, args, kwargs) > 0
        and uses_philox(q._local_tensor.device, q._spec)
    )


def sdpa_dropout_spec(out: Any, key_length: int) -> DTensorSpec:
    """The virtual tensor whose shards number SDPA's dropout offsets: ``(B, H, L,
    max(S, 32))`` laid out as the attention output ``out`` (``(B, H, L, E)``). Its shard's
    element count bounds what the local kernel reserves (memory-efficient: ``B * H * L * S``
    offsets, one per attention weight; flash: ``32`` per (batch, head))."""
    b, h, length = out.shape[:3]
    shape = torch.Size((b, h, length, max(key_length, 32)))
    meta = TensorMeta(shape, contiguous_strides(shape), out.tensor_meta.dtype)
    return DTensorSpec(out.mesh, tuple(out.placements), tensor_meta=meta)


@dataclass(frozen=True, eq=False)  # hashed by identity (a simulated coordinate is unhashable)
class _AtShardOffsets:
    """A local kernel run at the Philox offsets of the shard of ``spec`` at ``coordinate``
    (under LocalTensorMode: each simulated rank at its own)."""

    op: torch._ops.OpOverload
    spec: DTensorSpec
    coordinate: tuple[Any, ...]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _per_simulated_rank(self._on_rank, list(self.coordinate), args, kwargs)

    def _on_rank(self, coordinate: list[int], args: Any, kwargs: dict[str, Any]) -> Any:
        return draw_on_shard(self.spec, coordinate, self.op, *args, **kwargs)


@bypass_dispatch(_SDPA_DROPOUT, when=_sdpa_draws_per_shard)
def _sdpa_dropout(op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Flash / memory-efficient attention with dropout: the sharding upstream's strategy picks
    (its ``rng_state`` outputs replicated), each rank's kernel drawing its mask at the Philox
    offsets of its (batch, head) shard, the same on replicas (:func:`sdpa_dropout_spec`).
    The kernel returns the seed and offset it used, so the backward redraws that mask."""
    out = output_spec(op, args, kwargs)[0]
    spec = sdpa_dropout_spec(out, args[1].shape[-2])
    coordinate = tuple(args[0].device_mesh.get_coordinate() or ())  # this process's mesh
    return python_dispatch(op, args, kwargs, local_op=_AtShardOffsets(op, spec, coordinate))


# off_mesh: ranks outside the mesh advance their generator too (same offsets as on it)
for _op in INPLACE_RANDOM_OPS:
    bypass_dispatch(_op, off_mesh=True)(_dtensor_random)
for _op in _LIKE_OPS:
    bypass_dispatch(_op, off_mesh=True)(_dtensor_random_like)
bypass_dispatch(aten.native_dropout.default, off_mesh=True)(_native_dropout)


# ---- veScale legacy's seeding API ------------------------------------------------------


def manual_seed(seed: int, device_mesh: Any = None, tp_dim: int = 0) -> None:
    """veScale legacy's ``manual_seed(seed, device_mesh)``: seed torch's default generator
    with ``seed`` on every rank (random ops on DTensors give the single-device values when all
    ranks start from the same state). Call it on every rank of the default group; a rank
    given a different seed raises ``ValueError`` (one object all-gather)."""
    if dist.is_initialized():
        seeds: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(seeds, int(seed))
        if len(set(seeds)) != 1:
            raise ValueError(f"manual_seed: ranks passed different seeds {seeds} ({device_mesh})")
    torch.manual_seed(seed)


def is_rng_supported_mesh(device_mesh: Any) -> bool:
    """veScale legacy's check; vescale's random ops support every mesh device type."""
    return True


# the kernel probes run here, outside any mode: under torch.compile's fake mode they would
# mix real and fake tensors
_bernoulli_is_elementwise()
for _dtype in (torch.float32, torch.float64):
    _bernoulli_tensor_is_uniform(_dtype)
