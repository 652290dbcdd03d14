"""How the examples and benchmarks start on the machine they run on.

``--device cpu|cuda`` (:func:`add_device_argument`); without it, CUDA + NCCL when
``torch.cuda.is_available()`` and this host has a GPU for each of its local ranks
(``LOCAL_WORLD_SIZE``, set by torchrun), else CPU + gloo. :func:`init_distributed` starts the
default process group for the device (on CUDA after ``torch.cuda.set_device(LOCAL_RANK)``) and
returns the device type to build meshes and tensors on.
"""

from __future__ import annotations

import argparse
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from vescale.dtensor.device_mesh import check_device_type

BACKENDS = {"cpu": "gloo", "cuda": "nccl"}


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise SystemExit(f"{name}={value!r}: expected an integer (set by torchrun)") from None


def default_device() -> str:
    """``"cuda"`` when this host has a CUDA device for each local rank, else ``"cpu"``."""
    local_ranks = _env_int("LOCAL_WORLD_SIZE", 1)
    if torch.cuda.is_available() and torch.cuda.device_count() >= local_ranks:
        return "cuda"
    return "cpu"


def add_device_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device",
        choices=sorted(BACKENDS),
        default=None,
        help="cuda (NCCL) or cpu (gloo); default: cuda when every local rank has a GPU",
    )


def select_device(device: str | None) -> str:
    """``device`` checked to exist here (``None``: :func:`default_device`); on CUDA, this
    rank's GPU (``LOCAL_RANK``) becomes the current device."""
    device = device or default_device()
    if device not in BACKENDS:
        raise SystemExit(f"--device {device!r}: expected one of {sorted(BACKENDS)}")
    check_device_type(device, "--device")
    if device == "cuda":
        torch.cuda.set_device(_env_int("LOCAL_RANK", 0))
    return device


def init_distributed(device: str | None, timeout: timedelta | None = None) -> str:
    """:func:`select_device`, then the default process group on its backend (NCCL for CUDA,
    gloo for CPU); returns the device type."""
    device = select_device(device)
    if timeout is None:
        dist.init_process_group(BACKENDS[device])
    else:
        dist.init_process_group(BACKENDS[device], timeout=timeout)
    return device


def synchronize(device: str) -> None:
    """Wait for the work queued on ``device`` (CUDA runs asynchronously): before reading a
    timer."""
    if device == "cuda":
        torch.cuda.synchronize()
