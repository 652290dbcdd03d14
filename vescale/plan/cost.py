"""Communication cost of a redistribution: an alpha-beta model per mesh dim.

A collective over a mesh dim of ``n`` ranks whose input holds ``B`` bytes per rank takes
``alpha + beta * wire(kind, n, B)`` seconds, with the bytes a ring algorithm moves per rank:
all-reduce ``2 (n-1)/n B``, all-gather ``(n-1) B``, reduce-scatter ``(n-1)/n B``. A shard moving
to another tensor dim is priced as the all-gather (and local slice) the eager layer issues.
``alpha`` (latency, s) and ``beta`` (s per byte) are measured per mesh dim by
:func:`calibrate` on the actual process group (all-reduces of two sizes, the slowest rank's
time, so every rank gets the same numbers and makes the same choice), cached per mesh shape
and backend; a user passes :class:`AlphaBeta` values to override. Collectives the placed
program issues together (:func:`bucketed_step`) are merged by the ``bucket`` pass, so the
solver charges their ``alpha`` once per bucket, not once per tensor.

Compute is estimated too, coarsely: ``gamma`` (s per byte, measured with an element-wise op)
times the bytes an op's local inputs and outputs hold on one rank. Without it the cheapest
program in communication alone is often to stop splitting work (e.g. gather the batch and
run every rank on all of it, so no gradient needs reducing); with it, sharding the work
pays for the collectives it needs, as it does on a machine.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

__all__ = [
    "AlphaBeta",
    "CommStep",
    "bucketed_step",
    "calibrate",
    "default_alpha_beta",
    "local_bytes",
    "redistribution_steps",
]

Placements = tuple[Placement, ...]
# Defaults for meshes that cannot communicate (fake or meta): 20 us, 1 GB/s.
DEFAULT_ALPHA = 20e-6
DEFAULT_BETA = 1e-9
DEFAULT_GAMMA = 1e-10  # 10 GB/s of local memory traffic


@dataclass(frozen=True)
class AlphaBeta:
    """Per mesh dim latency ``alpha`` (s) and inverse bandwidth ``beta`` (s/byte)."""

    alpha: tuple[float, ...]
    beta: tuple[float, ...]
    gamma: float = DEFAULT_GAMMA

    def time(self, step: CommStep) -> float:
        return self.alpha[step.mesh_dim] + self.beta[step.mesh_dim] * step.wire_bytes


@dataclass(frozen=True)
class CommStep:
    """One collective of a redistribution: kind, mesh dim, ranks, input bytes per rank."""

    kind: str
    mesh_dim: int
    group_size: int
    bytes: int

    @property
    def wire_bytes(self) -> float:
        n, b = self.group_size, self.bytes
        factor = {"all_reduce": 2 * (n - 1) / n, "all_gather": n - 1}.get(self.kind, (n - 1) / n)
        return factor * b


def local_bytes(
    placements: Placements, shape: tuple[int, ...], itemsize: int, mesh_shape: tuple[int, ...]
) -> int:
    """Bytes one rank holds of a tensor of ``shape`` in ``placements`` (Partial: all of it)."""
    shards = math.prod(n for p, n in zip(placements, mesh_shape) if _is_shard(p))
    return math.ceil(math.prod(shape) / shards) * itemsize


def default_alpha_beta(ndim: int) -> AlphaBeta:
    return AlphaBeta((DEFAULT_ALPHA,) * ndim, (DEFAULT_BETA,) * ndim)


def _is_shard(p: Placement) -> bool:
    return isinstance(p, Shard) or type(p).__name__ == "_StridedShard"


def redistribution_steps(
    src: Placements,
    dst: Placements,
    shape: tuple[int, ...],
    itemsize: int,
    mesh_shape: tuple[int, ...],
) -> list[CommStep] | None:
    """The collectives turning ``src`` into ``dst`` (``None``: not possible, e.g. Partial of
    another reduce op). Mesh dims leaving a Shard or Partial go first (last mesh dim first),
    then the rest; local slices and ``Replicate -> Partial`` cost nothing."""
    cur = list(src)
    steps: list[CommStep] = []

    def held() -> int:
        return local_bytes(tuple(cur), shape, itemsize, mesh_shape)

    order = sorted(range(len(cur)), key=lambda i: (dst[i].is_shard() or dst[i].is_partial(), -i))
    for i in order:
        a, b = cur[i], dst[i]
        if a == b:
            continue
        n = mesh_shape[i]
        kind: str | None
        if isinstance(a, Partial):
            if isinstance(b, Partial):
                return None
            kind = "all_reduce" if isinstance(b, Replicate) else "reduce_scatter"
        elif _is_shard(a):  # to Replicate, another dim (all-gather, then a local slice: what
            kind = "all_gather"  # the eager layer issues on gloo), or Partial through Replicate
        else:  # Replicate -> Shard (slice) or Partial (zeros elsewhere): local
            kind = None
        if kind is not None and n > 1:
            steps.append(CommStep(kind, i, n, held()))
        cur[i] = b
    return steps


_cache: dict[tuple[tuple[int, ...], str], AlphaBeta] = {}


def calibrate(mesh: DeviceMesh, sizes: tuple[int, int] = (256, 262144), reps: int = 5) -> AlphaBeta:
    """Measure ``alpha``/``beta`` per mesh dim with all-reduces of ``sizes`` float32 elements
    and ``gamma`` with an in-place multiply of the larger size (medians of ``reps``, then the
    maximum over all ranks); cached per mesh shape and backend.
    Meshes on the fake or meta backends get the defaults."""
    backend = mesh.device_type if mesh.device_type == "meta" else dist.get_backend()
    key = (tuple(mesh.shape), str(backend))
    if key in _cache:
        return _cache[key]
    if backend in ("meta", "fake"):
        return _cache.setdefault(key, default_alpha_beta(mesh.ndim))
    alphas, betas = [], []
    for d in range(mesh.ndim):
        group, n = mesh.get_group(d), mesh.size(d)
        times = []
        for numel in sizes:
            buf = torch.ones(numel, device=mesh.device_type)
            dist.all_reduce(buf, group=group)  # warm-up
            samples = []
            for _ in range(reps):
                start = time.perf_counter()
                dist.all_reduce(buf, group=group)
                samples.append(time.perf_counter() - start)
            times.append(sorted(samples)[reps // 2])
        wires = [CommStep("all_reduce", d, n, s * 4).wire_bytes for s in sizes]
        beta = max((times[1] - times[0]) / max(wires[1] - wires[0], 1.0), 1e-13)
        alphas.append(max(times[0] - beta * wires[0], 1e-7))
        betas.append(beta)
    x = torch.ones(sizes[1])
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        x.mul_(1.0)
        samples.append(time.perf_counter() - start)
    gamma = sorted(samples)[reps // 2] / (2 * x.numel() * x.element_size())
    slowest = torch.tensor([*alphas, *betas, gamma], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # every rank: the same numbers
    v = slowest.tolist()
    ab = AlphaBeta(tuple(v[: mesh.ndim]), tuple(v[mesh.ndim : 2 * mesh.ndim]), v[-1])
    return _cache.setdefault(key, ab)


def bucketed_step(
    bucket: str,
    src: Placements,
    dst: Placements,
    shape: tuple[int, ...],
    itemsize: int,
    mesh_shape: tuple[int, ...],
) -> CommStep | None:
    """The one collective of ``src -> dst`` that the placed program issues together with the
    others of its ``bucket`` (so the ``bucket`` pass merges them: one latency), or ``None``.

    ``"parameters"``: a parameter with one ``Shard`` (evenly divided) gathered over its mesh
    dim, then local slices; the program issues all of these first. ``"gradients"``: a gradient
    whose only collective is one all-reduce (Partial -> Replicate), then local slices; the
    program issues all of these before any slice, at its end."""
    steps = redistribution_steps(src, dst, shape, itemsize, mesh_shape)
    if steps is None or len(steps) != 1:
        return None
    step = steps[0]
    if bucket == "parameters" and step.kind == "all_gather":
        shards = [(i, p) for i, p in enumerate(src) if not isinstance(p, Replicate)]
        if len(shards) != 1:
            return None
        i, p = shards[0]
        return step if type(p) is Shard and shape[p.dim] % mesh_shape[i] == 0 else None
    if bucket == "gradients" and step.kind == "all_reduce":
        return step
    return None
