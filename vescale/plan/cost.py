"""Prices of the plan path's choices, in the one cost model of :mod:`vescale.cost`.

A redistribution is the collectives the eager layer issues for it
(:func:`redistribution_steps`), one :class:`CommStep` per mesh dim leaving a ``Shard`` or
``Partial``, each priced ``alpha + beta * wire`` (a shard moving to another tensor dim: the
all-gather and local slice the eager layer issues). Collectives the placed program issues
together (:func:`bucketed_steps`) are merged by the ``bucket`` pass, so the solver charges
their ``alpha`` once per bucket, not once per tensor. An op's strategy costs
:func:`strategy_compute_s`: its FLOPs split over the mesh dims its output is sharded or
partial on (matrix products and attention) or the bytes its local inputs and outputs hold,
at the calibrated rates, plus the per-op overhead. Without compute the cheapest program in
communication alone is often to stop splitting work (e.g. gather the batch and run every rank
on all of it, so no gradient needs reducing).

``AlphaBeta`` is :class:`vescale.cost.CostModel` (the name the plan API has used);
:func:`calibrate` measures it (cached per machine and mesh, :mod:`vescale.cost.calibration`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh as UpstreamMesh
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from vescale._torch_compat import DTensorSpec, StridedShard, TensorMeta, gen_transform_infos
from vescale.cost.calibration import Unmeasurable, calibrate, default_cost, remember
from vescale.cost.gpus import GPUS, gpu_cost_model
from vescale.cost.model import (
    CommStep,
    CostModel,
    default_cost_model,
    is_free,
    node_dtype,
    node_flops,
)
from vescale.dtensor.device_mesh import DeviceMesh
from vescale.plan.validate import PlanError

__all__ = [
    "AlphaBeta",
    "CommStep",
    "bucket_copy_s",
    "bucketed_steps",
    "calibrate",
    "cost_model_of",
    "default_alpha_beta",
    "local_bytes",
    "redistribution_steps",
    "strategy_compute_s",
]

Placements = tuple[Placement, ...]
AlphaBeta = CostModel


def local_bytes(
    placements: Placements, shape: tuple[int, ...], itemsize: int, mesh_shape: tuple[int, ...]
) -> int:
    """Bytes one rank holds of a tensor of ``shape`` in ``placements`` (Partial: all of it)."""
    shards = math.prod(n for p, n in zip(placements, mesh_shape) if _is_shard(p))
    return math.ceil(math.prod(shape) / shards) * itemsize


def tensor_bytes(t: torch.Tensor, placements: Placements, mesh: Any) -> int:
    """:func:`local_bytes` of tensor ``t`` (shape and dtype) in ``placements`` on ``mesh``."""
    return local_bytes(placements, tuple(t.shape), t.element_size(), tuple(mesh.shape))


def default_alpha_beta(ndim: int) -> AlphaBeta:
    return default_cost_model(ndim)


def cost_model_of(cost: CostModel | str | None, mesh: UpstreamMesh) -> CostModel:
    """The cost model ``vescale.parallelize(cost=...)`` prices with: a :class:`CostModel`
    as given; a GPU name (:data:`vescale.cost.gpus.GPUS`) that GPU's model of ``mesh``;
    ``None`` the machine's (:func:`vescale.cost.calibration.default_cost`: a meta or fake
    mesh, which nothing measures, is a :class:`PlanError` naming ``cost=``). Every rank
    reaches the same outcome."""
    if isinstance(cost, CostModel):
        model = cost
    elif isinstance(cost, str):
        if cost.lower() not in GPUS:
            raise PlanError(
                f"vescale.parallelize: cost={cost!r} is no known GPU; pass one of "
                f"{sorted(GPUS)} or a vescale.cost.CostModel"
            )
        model = gpu_cost_model(cost, mesh)
    elif cost is None:
        try:
            return default_cost(mesh)
        except Unmeasurable as e:
            raise PlanError(str(e)) from None
    else:
        raise PlanError(
            "vescale.parallelize: cost must be a GPU name "
            f"({sorted(GPUS)}), a vescale.cost.CostModel or None, got {type(cost).__name__}"
        )
    remember(mesh, model)
    return model


def _is_shard(p: Placement) -> bool:
    return isinstance(p, Shard | StridedShard)


def redistribution_steps(
    src: Placements,
    dst: Placements,
    shape: tuple[int, ...],
    itemsize: int,
    mesh_shape: tuple[int, ...],
) -> list[CommStep] | None:
    """The collectives turning ``src`` into ``dst`` (``None``: not possible, e.g. Partial of
    another reduce op), in the order and sizes eager issues them: upstream's transform plan
    (:func:`gen_transform_infos`, which the eager layer runs), one step per mesh dim that
    changes. ``Shard -> Replicate / Shard / Partial``: an all-gather of the local chunk (gloo
    has no all-to-all: the eager layer gathers and slices); ``Partial -> Replicate``: an
    all-reduce, ``-> Shard``: a reduce-scatter; from ``Replicate``: a local slice, free."""
    if any(isinstance(a, Partial) and isinstance(b, Partial) and a != b for a, b in zip(src, dst)):
        return None
    strided = any(isinstance(p, StridedShard) for p in (*src, *dst))
    # upstream's greedy plan (no strided shard) reads the shape only for its logical shapes
    plan = _collectives(tuple(src), tuple(dst), shape if strided else len(shape), mesh_shape)
    if plan is None:
        return None
    numel = math.prod(shape)
    return [
        CommStep(kind, i, n, math.ceil(numel / shards) * itemsize) for kind, i, n, shards in plan
    ]


@functools.lru_cache(maxsize=65536)
def _collectives(
    src: Placements, dst: Placements, shape: tuple[int, ...] | int, mesh_shape: tuple[int, ...]
) -> tuple[tuple[str, int, int, int], ...] | None:
    """Per collective of ``src -> dst``: (kind, mesh dim, group size, the number of shards
    its input is one of: a rank holds ``ceil(numel / shards)`` elements then). ``shape``: the
    tensor's, or its rank where the plan does not depend on it."""
    plan_shape = shape if isinstance(shape, tuple) else (math.prod(mesh_shape),) * shape
    infos = _transform_infos(src, dst, plan_shape, mesh_shape)
    if infos is None:
        return None
    out = []
    cur = list(src)
    for i, (a, b) in infos:  # each collective's input: this rank's local tensor then
        n = mesh_shape[i]
        if not isinstance(a, Replicate) and n > 1:
            shards = math.prod(m for p, m in zip(cur, mesh_shape) if _is_shard(p))
            kind = "all_gather"
            if isinstance(a, Partial):
                kind = "all_reduce" if isinstance(b, Replicate) else "reduce_scatter"
            out.append((kind, i, n, shards))
        cur[i] = b
    return tuple(out)


@functools.lru_cache(maxsize=65536)
def _transform_infos(
    src: Placements, dst: Placements, shape: tuple[int, ...], mesh_shape: tuple[int, ...]
) -> list[tuple[int, tuple[Placement, Placement]]] | None:
    mesh = _meta_mesh(mesh_shape)
    stride = tuple(math.prod(shape[d + 1 :]) for d in range(len(shape)))
    meta = TensorMeta(torch.Size(shape), stride, torch.float32)
    try:
        infos = gen_transform_infos(DTensorSpec(mesh, src, meta), DTensorSpec(mesh, dst, meta))
    except (AssertionError, NotImplementedError, RuntimeError, ValueError):
        return None
    return [(t.mesh_dim, (t.src_dst_placements[0], t.src_dst_placements[1])) for t in infos]


@functools.cache
def _meta_mesh(mesh_shape: tuple[int, ...]) -> DeviceMesh:
    """A mesh of ``mesh_shape`` on the meta device: upstream's planner reads only its shape."""
    return DeviceMesh("meta", torch.arange(math.prod(mesh_shape)).reshape(mesh_shape))


@functools.lru_cache(maxsize=65536)  # pure; the solver asks per value of a shape
def bucketed_steps(
    bucket: str,
    src: Placements,
    dst: Placements,
    shape: tuple[int, ...],
    itemsize: int,
    mesh_shape: tuple[int, ...],
) -> tuple[CommStep, ...]:
    """The collectives of ``src -> dst`` that the placed program issues together with the
    others of its ``bucket``, so the ``bucket`` pass merges each with the bucket's others of
    its kind and group (one latency per kind and group); ``()`` when none is.

    ``"parameters"``: a parameter with one ``Shard`` (evenly divided) gathered over its mesh
    dim, then local slices; the program issues all of these first. ``"gradients"``: a gradient
    whose collectives are all reductions (all-reduces, reduce-scatters), then local slices;
    the program issues, at its end, every gradient's first reduction, then every second one,
    then the slices."""
    steps = redistribution_steps(src, dst, shape, itemsize, mesh_shape)
    if not steps:
        return ()
    if bucket == "gradients":
        return tuple(steps) if all(s.kind in _REDUCTIONS for s in steps) else ()
    if bucket != "parameters" or len(steps) != 1 or steps[0].kind != "all_gather":
        return ()
    shards = [(i, p) for i, p in enumerate(src) if not isinstance(p, Replicate)]
    if len(shards) != 1:
        return ()
    i, p = shards[0]
    return tuple(steps) if type(p) is Shard and shape[p.dim] % mesh_shape[i] == 0 else ()


_REDUCTIONS = ("all_reduce", "reduce_scatter")


@dataclass(frozen=True)
class FlatStep(CommStep):
    """One collective over the flattened group of ``mesh_dims`` (``group_size`` ranks), as the
    eager layer issues a same-kind step over several mesh dims when their flattened mesh
    exists; ``mesh_dim`` is the first of them."""

    mesh_dims: tuple[int, ...] = ()

    @property
    def dims(self) -> tuple[int, ...]:
        return self.mesh_dims


def group_of(step: CommStep) -> tuple[int, ...]:
    """The mesh dims whose (flattened) group runs ``step``."""
    return step.mesh_dims if isinstance(step, FlatStep) else (step.mesh_dim,)


def flattened_steps(
    src: Placements,
    dst: Placements,
    shape: tuple[int, ...],
    itemsize: int,
    mesh_shape: tuple[int, ...],
) -> list[CommStep] | None:
    """:func:`redistribution_steps`, except that a redistribution whose steps are all one
    kind over several mesh dims with the same source (``Partial`` sum/avg, or the same
    ``Shard``) and the same target (``(P, P) -> (R, R)``, ``(S(d), S(d)) -> (R, R)``,
    ``(P, P) -> (S(d), S(d))``, evenly divided) is one :class:`FlatStep` over their flattened
    group, as upstream's planner merges it."""
    steps = redistribution_steps(src, dst, shape, itemsize, mesh_shape)
    if steps is None or len(steps) < 2 or len({s.kind for s in steps}) != 1:
        return steps
    dims = tuple(sorted(s.mesh_dim for s in steps))
    kind, n = steps[0].kind, math.prod(mesh_shape[d] for d in dims)
    if len({dst[d] for d in dims}) != 1:
        return steps
    sources = {src[d] for d in dims}
    if kind == "all_gather":
        (s,) = sources if len(sources) == 1 else (None,)
        if type(s) is not Shard or shape[s.dim] % n or not isinstance(dst[dims[0]], Replicate):
            return steps
    elif not all(isinstance(p, Partial) and p.reduce_op in ("sum", "avg") for p in sources):
        return steps
    elif kind == "reduce_scatter":
        target = dst[dims[0]]
        if type(target) is not Shard or shape[target.dim] % n:
            return steps
    return [FlatStep(kind, dims[0], n, steps[0].bytes, dims)]


def step_time(ab: AlphaBeta, step: CommStep) -> float:
    """Seconds of ``step``: :meth:`vescale.cost.CostModel.time` (a :class:`FlatStep` at its
    flattened group's calibrated constants, else its mesh dims' largest)."""
    return ab.time(step)


def bucket_copy_s(ab: AlphaBeta, step: CommStep) -> float:
    """Seconds of the local copies the ``bucket`` pass adds around ``step`` as a bucket
    member, each byte read and written at ``gamma``: its input concatenated into the
    bucket's buffer; an all-gather's also copied into its slice of the output and its
    result copied out of the interleaved buffer (an all-reduce's or a reduce-scatter's
    result is a view of the buffer)."""
    copied = step.bytes
    if step.kind == "all_gather":
        copied += step.bytes + step.bytes * step.group_size
    return 2 * copied * ab.gamma


@functools.lru_cache(maxsize=65536)
def flat_bucketed_steps(
    bucket: str,
    src: Placements,
    dst: Placements,
    shape: tuple[int, ...],
    itemsize: int,
    mesh_shape: tuple[int, ...],
) -> tuple[CommStep, ...]:
    """:func:`bucketed_steps` over :func:`flattened_steps`: also a parameter sharded on one
    tensor dim over several mesh dims gathered by one all-gather of their flattened group."""
    steps = flattened_steps(src, dst, shape, itemsize, mesh_shape)
    if steps and bucket == "gradients":
        return tuple(steps) if all(s.kind in _REDUCTIONS for s in steps) else ()
    if steps and len(steps) == 1 and isinstance(steps[0], FlatStep) and bucket == "parameters":
        sharded = [p for p in src if not isinstance(p, Replicate)]
        gathers = steps[0].kind == "all_gather" and len(sharded) == len(steps[0].mesh_dims)
        return tuple(steps) if gathers else ()
    return bucketed_steps(bucket, src, dst, shape, itemsize, mesh_shape)


def strategy_compute_s(
    model: CostModel,
    node: torch.fx.Node,
    out_placements: Placements,
    mesh_shape: tuple[int, ...],
    held_bytes: int,
) -> float:
    """Seconds of ``node`` on one rank under a strategy whose (first) output has
    ``out_placements`` and whose local inputs and outputs hold ``held_bytes``: its FLOPs
    (global, :func:`vescale.cost.flops.node_flops`) divided over the mesh dims on which the
    output is sharded or partial (each rank does that share of the products), or the bytes,
    whichever is slower at the model's rates, plus its per-op overhead; views: 0."""
    if is_free(node.target):
        return 0.0
    flops = node_flops(node)
    split = math.prod(
        n for p, n in zip(out_placements, mesh_shape) if _is_shard(p) or isinstance(p, Partial)
    )
    return model.compute_s(flops / split, held_bytes, node_dtype(node))
