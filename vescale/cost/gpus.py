"""Cost models of named NVIDIA GPUs (``vescale.parallelize(..., cost="h100")``): the one
registry of names (:data:`GPUS`).

Each :class:`GpuSpec` holds the datasheet's dense (no sparsity) tensor-core TFLOP/s per
dtype and its HBM bandwidth; :func:`gpu_cost_model` prices a matmul at
:data:`MATMUL_EFFICIENCY` of its dtype's peak, memory traffic at :data:`HBM_EFFICIENCY` of
the bandwidth, :data:`KERNEL_LAUNCH_S` per op, and collectives by NCCL's ring model
(:mod:`vescale.cost.nccl`: NVLink within a node, InfiniBand across; a mesh dim whose groups
fit in ``gpus_per_node`` consecutive ranks is intra-node). ``float32`` matmuls run on TF32
tensor cores unless ``torch.get_float32_matmul_precision()`` is ``"highest"``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh

from vescale.cost.nccl import NcclCostModel, nccl_links

__all__ = [
    "GPUS",
    "HBM_EFFICIENCY",
    "KERNEL_LAUNCH_S",
    "MATMUL_EFFICIENCY",
    "GpuSpec",
    "detect_gpu",
    "gpu_cost_model",
]

# Achievable fractions of the peaks: large GEMMs reach 60-80% of dense tensor-core peak,
# streaming kernels ~85-90% of HBM bandwidth (cuBLAS / STREAM-like measurements).
MATMUL_EFFICIENCY = 0.7
HBM_EFFICIENCY = 0.85
KERNEL_LAUNCH_S = 3e-6  # per op: a CUDA kernel launch


@dataclass(frozen=True)
class GpuSpec:
    """One GPU: dense peak TFLOP/s by kind (``"bf16"``, ``"fp16"``, ``"tf32"``, ``"fp32"``
    (CUDA cores), ``"fp8"``), HBM GB/s, NCCL generation, GPUs per node."""

    name: str
    tflops: tuple[tuple[str, float], ...]
    hbm_gbps: float
    generation: str
    gpus_per_node: int = 8


# Dense figures: the datasheets' "with sparsity" tensor-core numbers halved.
GPUS: dict[str, GpuSpec] = {
    # NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB): FP32 19.5, TF32 156, BF16/FP16 312
    # TFLOPS; HBM2e 2,039 GB/s; no FP8
    "a100": GpuSpec(
        "a100",
        (("fp32", 19.5), ("tf32", 156.0), ("bf16", 312.0), ("fp16", 312.0)),
        2039.0,
        "AMPERE",
    ),
    # NVIDIA H100 Tensor Core GPU datasheet (SXM5): FP32 67, TF32 494.5, BF16/FP16 989.5,
    # FP8 1,979 TFLOPS; HBM3 3.35 TB/s
    "h100": GpuSpec(
        "h100",
        (("fp32", 67.0), ("tf32", 494.5), ("bf16", 989.5), ("fp16", 989.5), ("fp8", 1979.0)),
        3350.0,
        "HOPPER",
    ),
    # NVIDIA H200 Tensor Core GPU datasheet (SXM): the H100 SXM's compute; HBM3e 4.8 TB/s
    "h200": GpuSpec(
        "h200",
        (("fp32", 67.0), ("tf32", 494.5), ("bf16", 989.5), ("fp16", 989.5), ("fp8", 1979.0)),
        4800.0,
        "HOPPER",
    ),
    # NVIDIA HGX B200 datasheet, per GPU (the 8-GPU figures / 8): FP32 75, TF32 1,125,
    # BF16/FP16 2,250, FP8 4,500 TFLOPS; HBM3e 8 TB/s
    "b200": GpuSpec(
        "b200",
        (("fp32", 75.0), ("tf32", 1125.0), ("bf16", 2250.0), ("fp16", 2250.0), ("fp8", 4500.0)),
        8000.0,
        "BLACKWELL",
    ),
}

_DTYPES = {
    "bf16": (torch.bfloat16,),
    "fp16": (torch.float16,),
    "fp8": (torch.float8_e4m3fn, torch.float8_e5m2),
}


def detect_gpu(device_name: str) -> str | None:
    """The :data:`GPUS` name of a ``torch.cuda.get_device_name()``, or ``None`` for a GPU not
    listed (PCIe and NVL variants included: their rates differ from the SXM datasheets')."""
    upper = device_name.upper()
    if "PCIE" in upper or "NVL" in upper:
        return None
    for name in GPUS:
        if name.upper() in upper:
            return name
    return None


def gpu_cost_model(name: str, mesh: DeviceMesh, gpus_per_node: int | None = None) -> NcclCostModel:
    """The cost model of ``mesh`` on GPUs ``name`` (a :data:`GPUS` key; module docstring),
    ranks ``r`` on node ``r // gpus_per_node`` (default: the spec's)."""
    spec = GPUS.get(name.lower())
    if spec is None:
        raise ValueError(
            f"vescale: unknown GPU cost model {name!r}; known: {sorted(GPUS)} "
            "(or pass a vescale.cost.CostModel)"
        )
    peak = dict(spec.tflops)
    fp32 = "fp32" if torch.get_float32_matmul_precision() == "highest" else "tf32"
    rates = [
        (str(d), peak[k] * 1e12 * MATMUL_EFFICIENCY)
        for k, ds in _DTYPES.items()
        if k in peak
        for d in ds
    ]
    rates.append((str(torch.float32), peak[fp32] * 1e12 * MATMUL_EFFICIENCY))
    ranks = mesh.mesh.reshape(mesh.shape)
    alpha, beta, nodes = nccl_links(spec.generation, ranks, gpus_per_node or spec.gpus_per_node)
    return NcclCostModel(
        alpha,
        beta,
        gamma=1.0 / (spec.hbm_gbps * 1e9 * HBM_EFFICIENCY),
        flops_rate=peak["fp32"] * 1e12 * MATMUL_EFFICIENCY,
        op_s=KERNEL_LAUNCH_S,
        dtype_rates=tuple(rates),
        generation=spec.generation,
        nodes=nodes,
    )
