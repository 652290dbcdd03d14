"""Measure the cost model's constants on the actual machine and process groups, once.

:func:`calibrate` (a collective: every rank of the world calls it) times ``TRIALS``
interleaved rounds (a drifting load hits every probe alike) of the compute probes: 1000
one-element adds (the per-op overhead), 8 matmuls of 256x256x256 and 8 element-wise
multiplies of 4 MiB, each sample long enough that a shared CPU's time slicing is in it, as
it is in a training step. Then, after a barrier (so no rank waits for another's compute),
``TRIALS`` interleaved rounds of all-reduces of 1 KiB and 4 MiB over each mesh dim's group
and over the whole mesh (a flattened group, 2+ dims), and an all-reduce, a reduce-scatter and
an all-gather of 32 MiB (a bucket's size) over the widest of these groups (each kind's seconds
per wire byte over that all-reduce's, timed in the same rounds, rounded to a power of 2:
``CostModel.kinds``). Each rank takes the median of each
probe; the ranks agree on the maximum of the medians (one all-reduce), so every rank holds
identical constants; ``alpha``/``beta`` come from the two sizes (``alpha + beta * wire``),
and every constant is rounded to a power of ``2 ** (1/4)``
(:func:`vescale.cost.model.quantize`).

Cached: in the process, and on disk in ``$VESCALE_CACHE_DIR`` (default
``~/.cache/vescale``), one JSON file per machine (the ranks' host names), mesh shape, backend
and world size: rank 0 reads it and broadcasts it, so a later run on the same machine and
mesh reuses the same constants and makes the same choice. ``VESCALE_RECALIBRATE=1``
measures again (and rewrites the file) on every call.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import socket
import statistics
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from vescale._env import env_flag
from vescale.cost.gpus import GPUS, detect_gpu, gpu_cost_model
from vescale.cost.model import CostModel, quantize, wire_bytes

__all__ = [
    "TRIALS",
    "Unmeasurable",
    "cache_path",
    "cache_root",
    "calibrate",
    "calibrated",
    "default_cost",
    "probe_device",
    "remember",
    "timer",
    "unmeasurable",
    "write_atomic",
]

TRIALS = 25
SIZES = (256, 1 << 20)  # float32 elements of the small and the large all-reduce
# float32 elements of the kinds' probes (reduce-scatter's input, all-gather's output, an
# all-reduce's): a bucket's size, where gloo's all-gather and reduce-scatter cost 3-4x an
# all-reduce per wire byte on a 2-core machine (4 MiB: about 1-2x)
KINDS_SIZE = 1 << 23
_MM = 256  # matmul side
# Compute probes run ~5-10 ms of work per sample, several scheduler time slices: on a CPU
# shared with other processes their median includes the share of time the process is not
# running, as a training step's ops do (a probe shorter than a slice would not).
_ADDS = 1000  # one-element adds per sample of the per-op overhead
_REPEAT = 8  # matmuls / multiplies per sample
_FORMAT = 6  # of the cache file; a change invalidates every file
_cache: dict[str, CostModel] = {}
_by_shape: dict[tuple[tuple[int, ...], str], CostModel] = {}  # for readers off the mesh


def calibrate(mesh: DeviceMesh) -> CostModel:
    """The :class:`CostModel` of ``mesh`` on this machine, measured (see module docstring).
    Every failure (a mesh on the meta or fake backend: nothing to measure; an unusable cache
    folder) raises the same error on every rank."""
    backend = "meta" if mesh.device_type == "meta" else _backend(mesh)
    if backend in ("meta", "fake"):
        raise Unmeasurable(unmeasurable(mesh, backend))
    key = _key(mesh, backend)
    fresh = env_flag("VESCALE_RECALIBRATE", False)
    if not fresh and key in _cache:
        return _cache[key]
    path = cache_path(key)
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        box = [_usable(path.parent) or (None if fresh else _read(path, mesh.ndim))]
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], str):
        raise RuntimeError(box[0])
    if box[0] is None:
        model = _measure(mesh)
        box = [_write(path, model) if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(box, src=0)
        if box[0] is not None:
            raise RuntimeError(box[0])
    else:
        model = box[0]
    _cache[key] = model
    remember(mesh, model)
    return model


class Unmeasurable(ValueError):
    """A mesh on the meta device or the fake backend: nothing to calibrate on."""


def unmeasurable(mesh: DeviceMesh, backend: str) -> str:
    """The error for a mesh no calibration can measure, naming the fix."""
    where = "the meta device" if backend == "meta" else f"the {backend!r} backend"
    return (
        f"vescale: cannot calibrate the cost model of mesh {tuple(mesh.shape)} on {where} "
        "(nothing runs there to measure): pass the hardware to plan for, e.g. "
        "vescale.parallelize(..., cost='h100') (one of "
        f"{sorted(GPUS)}) or cost=vescale.cost.CostModel(...)"
    )


def default_cost(mesh: DeviceMesh) -> CostModel:
    """The cost model of ``mesh`` when none is given: on CUDA the :data:`GPUS` spec of the
    GPU (``torch.cuda.get_device_name``), no measurement; a GPU not listed, or another
    device, :func:`calibrate` (a GPU not listed warns, naming ``cost=``)."""
    if mesh.device_type == "cuda":
        device = torch.cuda.get_device_name()
        name = detect_gpu(device)
        if name is not None:
            model: CostModel = gpu_cost_model(name, mesh)
            remember(mesh, model)
            return model
        warnings.warn(
            f"vescale: no cost model is known for GPU {device!r} (known: {sorted(GPUS)}); "
            "measuring this machine instead. Pass cost='<name>' or a vescale.cost.CostModel "
            "to choose one.",
            stacklevel=3,
        )
    return calibrate(mesh)


def remember(mesh: DeviceMesh, model: CostModel) -> None:
    """Record ``model`` as the one priced for meshes of ``mesh``'s shape and device type
    (:func:`calibrated`: ``schedule.json``'s constants)."""
    _by_shape[(tuple(mesh.shape), mesh.device_type)] = model


def _backend(mesh: DeviceMesh) -> str:
    """The backend of ``mesh``'s groups for its device type (``dist.get_backend`` reads
    "undefined" for a default group ``init_device_mesh`` made from its device-type map)."""
    config = dist.get_backend_config(mesh.get_group(0))  # "gloo" or "cpu:gloo,cuda:nccl"
    by_device = dict(part.split(":", 1) for part in config.split(",") if ":" in part)
    return by_device.get(mesh.device_type, config)


def cache_root() -> Path:
    """vescale's on-disk cache folder: ``$VESCALE_CACHE_DIR``, default ``~/.cache/vescale``."""
    return Path(os.environ.get("VESCALE_CACHE_DIR") or Path.home() / ".cache" / "vescale")


def cache_path(key: str) -> Path:
    return cache_root() / f"calibration-{key}.json"


def write_atomic(path: Path, text: str) -> None:
    """``text`` into ``path`` (its folder made): written beside it, then renamed over it, so
    a reader (another rank, another run) never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _key(mesh: DeviceMesh, backend: str) -> str:
    """``<mesh shape>-<backend>-w<world size>-<hash of the hosts, device type, torch>``."""
    hosts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, socket.gethostname())
    what = [sorted(set(hosts)), mesh.device_type, torch.__version__, _FORMAT]
    digest = hashlib.sha1(json.dumps(what).encode()).hexdigest()[:10]
    shape = "x".join(str(n) for n in mesh.shape)
    return f"{shape}-{backend}-w{dist.get_world_size()}-{digest}"


def _usable(folder: Path) -> str | None:
    """Why the cache ``folder`` cannot hold calibration files (made if absent), or ``None``."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if not os.access(folder, os.W_OK):
            raise PermissionError(f"[Errno 13] Permission denied: {str(folder)!r}")
    except OSError as e:
        return (
            f"vescale calibration: the cache folder {str(folder)!r} (VESCALE_CACHE_DIR, "
            f"default ~/.cache/vescale) is not a writable folder ({type(e).__name__}: {e}): "
            "point VESCALE_CACHE_DIR at a writable folder"
        )
    return None


def _read(path: Path, ndim: int) -> CostModel | None:
    """The cached constants of ``path`` for a mesh of ``ndim`` dims; ``None`` when absent or
    not a valid entry (then measured again and rewritten)."""
    try:
        data = json.loads(path.read_text())
        groups = tuple(
            (tuple(int(d) for d in ds), float(a), float(b)) for ds, a, b in data["groups"]
        )
        model = CostModel(
            tuple(float(a) for a in data["alpha"]),
            tuple(float(b) for b in data["beta"]),
            float(data["gamma"]),
            float(data["flops_rate"]),
            float(data["op_s"]),
            groups,
            tuple((str(k), float(f)) for k, f in data["kinds"]),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None  # absent or unreadable: measure
    numbers = [*model.alpha, *model.beta, model.gamma, model.flops_rate, model.op_s]
    numbers += [x for _, a, b in groups for x in (a, b)] + [f for _, f in model.kinds]
    if len(model.alpha) != ndim or len(model.beta) != ndim:
        return None
    if not all(x > 0 and math.isfinite(x) for x in numbers):
        return None
    return model


def _write(path: Path, model: CostModel) -> str | None:
    """``model`` into ``path``; the error text when that fails, else ``None``."""
    data = {
        "alpha": model.alpha,
        "beta": model.beta,
        "gamma": model.gamma,
        "flops_rate": model.flops_rate,
        "op_s": model.op_s,
        "groups": [[list(d), a, b] for d, a, b in model.groups],
        "kinds": [[k, f] for k, f in model.kinds],
        "measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    try:
        write_atomic(path, json.dumps(data, indent=1) + "\n")
    except OSError as e:
        return f"vescale calibration: cannot write {str(path)!r} ({type(e).__name__}: {e})"
    return None


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _cuda_timed(fn: Callable[[], object]) -> float:
    """Seconds of the CUDA work ``fn`` queues: CUDA events around it, after the queue drained."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def timer(device: torch.device) -> Callable[[Callable[[], object]], float]:
    """How a probe on ``device`` is timed: CUDA events on CUDA, the host clock elsewhere."""
    return _cuda_timed if device.type == "cuda" else _timed


def probe_device(mesh: DeviceMesh) -> torch.device:
    """The device the probes and collective buffers of ``mesh`` live on: this rank's."""
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def _measure(mesh: DeviceMesh) -> CostModel:
    groups: list[tuple[tuple[int, ...], Any, int]] = [
        ((d,), mesh.get_group(d), mesh.size(d)) for d in range(mesh.ndim)
    ]
    if mesh.ndim > 1 and mesh.size() == dist.get_world_size():
        groups.append((tuple(range(mesh.ndim)), dist.group.WORLD, mesh.size()))
    device = probe_device(mesh)
    timed = timer(device)
    bufs = [torch.ones(n, device=device) for n in SIZES]
    one = torch.ones(1, device=device)
    a = torch.randn(_MM, _MM, device=device)
    big = torch.randn(SIZES[1], device=device)
    probes: list[Callable[[], object]] = [  # each ~as long as a time slice (see _REPEAT)
        lambda: [torch.add(one, one) for _ in range(_ADDS)],
        lambda: [torch.mm(a, a) for _ in range(_REPEAT)],
        lambda: [torch.mul(big, 2.0) for _ in range(_REPEAT)],
    ]
    for _, group, _ in groups:
        for buf in bufs:
            probes.append(functools.partial(dist.all_reduce, buf, group=group))
    _, widest, n = groups[-1]  # the other kinds: against an all-reduce, at bucket size
    full = torch.ones(KINDS_SIZE, device=device)
    shard = torch.ones(KINDS_SIZE // n, device=device)
    probes.append(functools.partial(dist.all_reduce, full, group=widest))
    probes.append(functools.partial(dist.reduce_scatter_single, shard, full, group=widest))
    probes.append(functools.partial(dist.all_gather_single, full, shard, group=widest))
    for probe in probes:  # warm-up
        probe()
    samples: list[list[float]] = [[] for _ in probes]
    # compute, then (after a barrier) the groups' all-reduces, then the kinds' probes: a
    # probe timed right after a long one (a compute probe, a 32 MiB collective) would wait
    # for the slowest rank to finish that one, not for the network
    kinds = len(probes) - 3
    for phase in (range(3), range(3, kinds), range(kinds, len(probes))):
        dist.barrier()
        for _ in range(TRIALS):  # interleaved: a load change affects every probe alike
            for i in phase:
                samples[i].append(timed(probes[i]))
    medians = torch.tensor(
        [statistics.median(s) for s in samples], dtype=torch.float64, device=device
    )
    dist.all_reduce(medians, op=dist.ReduceOp.MAX)  # every rank: the same numbers
    t = medians.tolist()
    op_s = t[0] / _ADDS
    flops_rate = 2.0 * _MM**3 / max(t[1] / _REPEAT - op_s, 1e-9)
    gamma = max(t[2] / _REPEAT - op_s, 1e-9) / (2 * big.numel() * big.element_size())
    fits = []
    for j, (_, _, n) in enumerate(groups):
        if n == 1:  # a group of one rank moves nothing: its collectives are never priced
            fits.append((quantize(1e-7), quantize(1e-13)))
            continue
        small, large = t[3 + 2 * j], t[4 + 2 * j]
        wires = [wire_bytes("all_reduce", n, s * 4) for s in SIZES]
        beta = max((large - small) / (wires[1] - wires[0]), 1e-13)
        fits.append((quantize(max(small - beta * wires[0], 1e-7)), quantize(beta)))
    per_dim = fits[: mesh.ndim]
    # each kind's time per wire byte over the all-reduce's, both at the large size over the
    # widest group, timed in the same rounds: a ratio, steady under a load that slows both
    by_kind = (
        ("reduce_scatter", t[-2], KINDS_SIZE * 4),
        ("all_gather", t[-1], KINDS_SIZE // n * 4),
    )
    if n == 1:  # one rank: no wire to compare on
        factors = [(kind, 1.0) for kind, _, _ in by_kind]
    else:
        per_byte = t[-3] / wire_bytes("all_reduce", n, KINDS_SIZE * 4)
        factors = [  # each a power of 2
            (kind, quantize(seconds / wire_bytes(kind, n, nbytes) / per_byte, steps_per_octave=1))
            for kind, seconds, nbytes in by_kind
        ]
    return CostModel(
        tuple(a for a, _ in per_dim),
        tuple(b for _, b in per_dim),
        quantize(gamma),
        quantize(flops_rate),
        quantize(op_s),
        tuple((dims, a, b) for (dims, _, _), (a, b) in zip(groups[mesh.ndim :], fits[mesh.ndim :])),
        tuple(factors),
    )


def calibrated(mesh: DeviceMesh) -> CostModel | None:
    """The cost model last priced for a mesh of ``mesh``'s shape and device type in this
    process (:func:`calibrate`, :func:`remember`; no communication), or ``None``."""
    return _by_shape.get((tuple(mesh.shape), mesh.device_type))
