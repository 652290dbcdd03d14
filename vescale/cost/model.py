"""One cost model for the plan path's solver, ``schedule.json`` and the benchmarks.

Compute (roofline, per op): ``op_s + max(flops / rate(dtype), bytes * gamma)``: the FLOPs
of matrix products, convolutions and attention (:func:`vescale.cost.flops.node_flops`) at
the matmul rate of the op's dtype, or the
bytes the op reads and writes at the calibrated memory rate, whichever is slower, plus a
per-op launch overhead. ``flops_rate=inf`` prices every op by its bytes.

Collectives (alpha-beta): over a process group of ``n`` ranks whose input holds ``B`` bytes
per rank, ``alpha + beta * f(kind) * wire(kind, n, B)`` with the bytes a ring moves per rank
(:func:`wire_bytes`) and ``f`` the kind's measured factor (``CostModel.kinds``). ``alpha``/``beta`` are per mesh dim, and per flattened group of several
mesh dims (``groups``, keyed by the sorted dims) where calibrated; an uncalibrated flattened
group at the largest ``alpha`` and ``beta`` of its dims. Buckets
(:meth:`CostModel.bucket_s`): the members the ``bucket`` pass merges pay one ``alpha`` per
bucket, the cap splitting them by the pass's own policy (:mod:`vescale.ddp.bucketing`: a
member that would push the bucket past the cap, sized as the larger of its input and
output, opens a new one).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from vescale.cost.flops import node_flops
from vescale.ddp.bucketing import joins

__all__ = [
    "DEFAULT_ALPHA",
    "DEFAULT_BETA",
    "DEFAULT_FLOPS",
    "DEFAULT_GAMMA",
    "CommStep",
    "CostModel",
    "bucket_sizes",
    "default_cost_model",
    "is_free",
    "node_dtype",
    "node_flops",
    "quantize",
    "tensor_args",
    "wire_bytes",
]

# Defaults for meshes that cannot communicate (fake or meta) and graphs of no known mesh:
# 20 us, 1 GB/s links; 10 GB/s local memory traffic; 20 GFLOP/s matmuls; 5 us per op.
DEFAULT_ALPHA = 20e-6
DEFAULT_BETA = 1e-9
DEFAULT_GAMMA = 1e-10
DEFAULT_FLOPS = 20e9
DEFAULT_OP_S = 5e-6


def wire_bytes(kind: str, n: int, nbytes: float) -> float:
    """Bytes a ring collective of ``kind`` over ``n`` ranks moves per rank, ``nbytes`` being
    this rank's input: all-reduce ``2 (n-1)/n B``, all-gather ``(n-1) B``, reduce-scatter and
    all-to-all ``(n-1)/n B``, broadcast ``B``."""
    if n <= 1:
        return 0.0
    factor = {"all_reduce": 2 * (n - 1) / n, "all_gather": n - 1.0, "broadcast": 1.0}
    return factor.get(kind, (n - 1) / n) * nbytes


@dataclass(frozen=True)
class CommStep:
    """One collective over mesh dim ``mesh_dim`` (``group_size`` ranks) of ``bytes`` input
    per rank; ``dims``: the mesh dims of its group (a subclass over a flattened group
    returns several)."""

    kind: str
    mesh_dim: int
    group_size: int
    bytes: int

    @property
    def dims(self) -> tuple[int, ...]:
        return (self.mesh_dim,)

    @property
    def wire_bytes(self) -> float:
        return wire_bytes(self.kind, self.group_size, self.bytes)

    @property
    def bucket_bytes(self) -> int:
        """The size the ``bucket`` pass counts: the larger of input and output."""
        return self.bytes * self.group_size if self.kind == "all_gather" else self.bytes


def quantize(x: float, steps_per_octave: int = 4) -> float:
    """``x`` rounded to the nearest power of ``2 ** (1 / steps_per_octave)`` (19% apart for
    4): calibrated constants that differ by less than the noise become equal."""
    if x <= 0 or not math.isfinite(x):
        return x
    return float(2.0 ** (round(math.log2(x) * steps_per_octave) / steps_per_octave))


@dataclass(frozen=True)
class CostModel:
    """Per mesh dim latency ``alpha`` (s) and inverse bandwidth ``beta`` (s/byte); ``gamma``
    (s per byte of memory traffic), ``flops_rate`` (FLOP/s of matrix products), ``op_s``
    (launch overhead per op, s); ``groups``: ``(dims, alpha, beta)`` of flattened groups;
    ``kinds``: ``(kind, factor)``: a kind's seconds per wire byte as a multiple of the
    all-reduce's ``beta``, measured at a bucket's size (the backend's implementation: gloo's
    reduce-scatter and all-gather of 32 MiB cost 3-4x an all-reduce per wire byte on a
    2-core machine, not what their ring wire says); 1 for a kind not listed;
    ``dtype_rates``: ``(str(dtype), FLOP/s)`` of matrix products in that dtype (a GPU's
    tensor cores), ``flops_rate`` for a dtype not listed."""

    alpha: tuple[float, ...]
    beta: tuple[float, ...]
    gamma: float = DEFAULT_GAMMA
    flops_rate: float = math.inf
    op_s: float = 0.0
    groups: tuple[tuple[tuple[int, ...], float, float], ...] = field(default=())
    kinds: tuple[tuple[str, float], ...] = field(default=())
    dtype_rates: tuple[tuple[str, float], ...] = field(default=())

    def comm_s(self, kind: str, dims: Sequence[int], n: int, nbytes: float) -> float:
        """Seconds of one collective over the group of ``dims`` (``n`` ranks)."""
        dims = tuple(sorted(dims))
        wire = wire_bytes(kind, n, nbytes) * dict(self.kinds).get(kind, 1.0)
        if len(dims) == 1:
            d = dims[0]
            return self.alpha[d] + self.beta[d] * wire
        for gdims, a, b in self.groups:
            if gdims == dims:
                return a + b * wire
        # not calibrated: at the largest latency and inverse bandwidth of its dims
        alpha, beta = max(self.alpha[d] for d in dims), max(self.beta[d] for d in dims)
        return alpha + beta * wire

    def time(self, step: CommStep) -> float:
        """Seconds of ``step`` alone (its own latency)."""
        return self.comm_s(step.kind, step.dims, step.group_size, step.bytes)

    def latency(self, step: CommStep) -> float:
        """The latency part of :meth:`time` (what a bucket pays once)."""
        return self.comm_s(step.kind, step.dims, step.group_size, 0)

    def bucket_s(self, steps: Sequence[CommStep], cap_bytes: float = math.inf) -> float:
        """Seconds of ``steps`` (one kind and group) merged by the ``bucket`` pass in this
        order: one latency per bucket the cap leaves, bandwidth per member."""
        if not steps:
            return 0.0
        buckets = bucket_sizes([s.bucket_bytes for s in steps], cap_bytes)
        return len(buckets) * self.latency(steps[0]) + sum(
            self.time(s) - self.latency(s) for s in steps
        )

    def rate(self, dtype: torch.dtype | None) -> float:
        """FLOP/s of matrix products in ``dtype`` (``dtype_rates``; else ``flops_rate``)."""
        return dict(self.dtype_rates).get(str(dtype), self.flops_rate)

    def compute_s(self, flops: float, nbytes: float, dtype: torch.dtype | None = None) -> float:
        """Seconds of one op doing ``flops`` in ``dtype`` and moving ``nbytes`` (roofline +
        overhead)."""
        return self.op_s + max(flops / self.rate(dtype), nbytes * self.gamma)

    def op_time(self, node: torch.fx.Node, nbytes: float) -> float:
        """Seconds of one op (:meth:`compute_s` of :func:`vescale.cost.flops.node_flops` in
        its inputs' dtype); views and ``getitem`` move no data and launch nothing: 0."""
        if is_free(node.target):
            return 0.0
        return self.compute_s(node_flops(node), nbytes, node_dtype(node))


def bucket_sizes(sizes: Sequence[int], cap_bytes: float) -> list[int]:
    """The bytes of each bucket the ``bucket`` pass makes of members of ``sizes`` (in order),
    by the one bucket policy (:func:`vescale.ddp.bucketing.joins`)."""
    out: list[int] = []
    for size in sizes:
        if out and joins(out[-1], size, int(min(cap_bytes, 2**62))):
            out[-1] += size
        else:
            out.append(size)
    return out


def default_cost_model(ndim: int) -> CostModel:
    """The defaults (above) for ``ndim`` mesh dims."""
    return CostModel(
        (DEFAULT_ALPHA,) * ndim, (DEFAULT_BETA,) * ndim, DEFAULT_GAMMA, DEFAULT_FLOPS, DEFAULT_OP_S
    )


_FREE = {operator.getitem, torch.ops.aten._unsafe_view.default}


def tensor_args(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The tensor arguments of ``node`` in argument order, repeats kept (``op_flops`` reads
    them by position: ``sdpa(q, q, q)`` has three)."""
    out: list[torch.fx.Node] = []
    for a in node.args:
        for x in a if isinstance(a, list | tuple) else (a,):
            if isinstance(x, torch.fx.Node) and isinstance(x.meta.get("val"), torch.Tensor):
                out.append(x)
    return out


def is_free(target: object) -> bool:
    """Whether an op is a view (or ``getitem``, ``_unsafe_view``): no data moved."""
    return bool(getattr(target, "is_view", False)) or target in _FREE


def node_dtype(node: torch.fx.Node) -> torch.dtype | None:
    """The dtype an op computes in: its first tensor argument's."""
    args = tensor_args(node)
    return args[0].meta["val"].dtype if args else None
