"""Collective time on NVIDIA GPUs: NCCL's ring model, with NCCL's tuning constants.

A ring collective of ``kind`` over ``n`` ranks on ``nodes`` nodes takes, per protocol (LL
for small messages, LL128 within a node, Simple for large; the fastest is NCCL's choice),
``base + (steps - inter) * intra_hop + inter * net_hop + wire / bus_bw``: ``steps`` ring
steps (all-reduce ``2 (n-1)``, others ``n-1``), ``inter`` of them crossing nodes, ``wire``
the bytes a rank sends (:func:`vescale.cost.model.wire_bytes`: NCCL's bytes times
``steps / n``), ``bus_bw`` NVLink's within a node, InfiniBand's across nodes (LL: half of it,
capped). This is the Ring branch of ``torch._inductor.comm_analysis`` (which mirrors NCCL's
``ncclTopoTuneModel``), without the tree algorithm and upstream's InfiniBand NIC-efficiency
corrections; upstream's function reads the GPU and topology of the machine it
runs on, this one a named GPU's generation and the mesh's node layout, so a plan for an H100
cluster can be priced anywhere. The constants are upstream's
(:func:`vescale._torch_compat.nccl_tuning`).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from vescale._torch_compat import nccl_tuning
from vescale.cost.model import CostModel, wire_bytes

__all__ = ["NcclCostModel", "group_nodes", "nccl_links", "ring_s"]

# Simple protocol across nodes: NCCL's per-step network overhead (us) and its multiplier
_NET_OVERHEAD_US = 1.0
_SIMPLE_NET_FACTOR = 3.0
_LL128_EFFICIENCY = 120.0 / 128.0  # LL128's payload per line


@functools.cache
def _tuning() -> dict[str, Any]:
    return nccl_tuning()


def ring_s(kind: str, n: int, nodes: int, nbytes: float, generation: str) -> float:
    """Seconds of one ring collective (module docstring); ``nbytes``: this rank's input;
    ``generation``: ``"AMPERE"``, ``"HOPPER"`` or ``"BLACKWELL"``. A group of one rank: 0."""
    if n <= 1:
        return 0.0
    t = _tuning()
    gen = t["generation"][generation]
    steps = 2 * (n - 1) if kind == "all_reduce" else n - 1
    inter = 0 if nodes == 1 else (2 * (nodes - 1) if kind == "all_reduce" else nodes - 1)
    bw = t["nvlink_bw"][gen] if nodes == 1 else t["inter_node_bw"][gen]
    wire = wire_bytes(kind, n, nbytes)
    ring, hw = t["algo"].RING, t["hw"]
    best = math.inf
    scale = min(nodes - 1, 2)  # NCCL's index: 1, 2, more nodes
    protos = t["proto"]
    for proto in (protos.LL, protos.LL128, protos.SIMPLE):
        if proto == protos.LL:
            bus = min(t["ll_max_bw"][gen if nodes == 1 else 0][scale], bw * 0.5)
        elif proto == protos.LL128:
            if nodes > 1:  # NCCL disables it over InfiniBand
                continue
            bus = min(
                bw * _LL128_EFFICIENCY, t["channels"][gen] * t["ll128_channel_bw"][gen][scale]
            )
        else:
            bus = bw
        net = 0.0 if nodes == 1 else _NET_OVERHEAD_US
        if proto == protos.SIMPLE:
            net *= _SIMPLE_NET_FACTOR
        hop = max(t["hw_lat"][hw.NVLINK][ring][proto], net)
        lat_us = t["base_lat"][ring][proto] + (steps - inter) * hop
        lat_us += inter * t["hw_lat"][hw.NET][ring][proto]
        best = min(best, lat_us * 1e-6 + wire / (bus * 1e9))
    return best


def group_nodes(ranks: torch.Tensor, dims: Sequence[int], gpus_per_node: int) -> int:
    """The most nodes one group over mesh ``dims`` spans (rank ``r`` on node
    ``r // gpus_per_node``); ``ranks``: the mesh's rank tensor."""
    rest = [d for d in range(ranks.ndim) if d not in dims]
    groups = ranks.permute(*rest, *dims).reshape(-1, math.prod(ranks.shape[d] for d in dims))
    return max(len(set((g // gpus_per_node).tolist())) for g in groups)


@dataclass(frozen=True)
class NcclCostModel(CostModel):
    """A :class:`CostModel` whose collectives are priced by :func:`ring_s` on ``generation``
    hardware: ``nodes`` holds ``(dims, nodes its groups span)`` for every set of mesh dims
    (NVLink within a node, InfiniBand across). ``alpha``/``beta`` hold each mesh dim's
    all-reduce latency and NVLink or InfiniBand inverse bandwidth (for reports)."""

    generation: str = "HOPPER"
    nodes: tuple[tuple[tuple[int, ...], int], ...] = field(default=())

    def comm_s(self, kind: str, dims: Sequence[int], n: int, nbytes: float) -> float:
        spans = dict(self.nodes)[tuple(sorted(dims))]
        return ring_s(kind, n, spans, nbytes, self.generation)


def nccl_links(
    generation: str, mesh_ranks: torch.Tensor, gpus_per_node: int
) -> tuple[tuple[float, ...], tuple[float, ...], tuple[tuple[tuple[int, ...], int], ...]]:
    """(alpha, beta) per mesh dim and the nodes of every set of dims, for
    :class:`NcclCostModel`, of a mesh whose ranks are ``mesh_ranks``."""
    t = _tuning()
    gen = t["generation"][generation]
    ndim = mesh_ranks.ndim
    nodes = tuple(
        (dims, group_nodes(mesh_ranks, dims, gpus_per_node))
        for k in range(1, ndim + 1)
        for dims in itertools.combinations(range(ndim), k)
    )
    spans = dict(nodes)
    alpha = tuple(
        ring_s("all_reduce", int(mesh_ranks.shape[d]), spans[(d,)], 0, generation)
        for d in range(ndim)
    )
    beta = tuple(
        1e-9 / (t["nvlink_bw"][gen] if spans[(d,)] == 1 else t["inter_node_bw"][gen])
        for d in range(ndim)
    )
    return alpha, beta, nodes
