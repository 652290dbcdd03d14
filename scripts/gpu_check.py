"""What one device can show of vescale's GPU paths, one line per check.

    python scripts/gpu_check.py [--device cuda|cpu] [--json summary.json] [--trace-dir DIR]

Three parts, each against the same computation on one device:

(a) a real 1-rank process group (NCCL on CUDA, gloo on CPU): the demo GPT (DDP over a (1, 1)
    mesh, Megatron TP layout) eager and compiled by ``backend="vescale"`` (Inductor: Triton on
    CUDA), CUDA graphs (``mode="reduce-overhead"``, CUDA only), host reads per compiled step
    (none; on CUDA also under ``torch.cuda.set_sync_debug_mode("error")``), a profiler trace,
    dropout on a DTensor, ``vescale.fsdp``'s storage on the parameters' device;
(b) ``LocalTensorMode`` over the ``fake`` process group, 4 simulated ranks on the device's
    tensors: ``scaled_dot_product_attention`` sharded by heads, by batch and both (2x2),
    forward and backward (every SDPA backend the device has), and SDPA dropout with sharded
    heads;
(c) an 8-rank ``fake`` process group: the demo GPT on a (4, 2) mesh compiled through Inductor.

Prints ``PASS``/``FAIL``/``SKIP <reason>`` per check and exits 1 on any FAIL. ``--device cpu``
runs the same checks on CPU (``tests/test_gpu_check.py`` runs it in the suite).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "examples"), str(ROOT)]

import gpt  # noqa: E402
from launch import BACKENDS, default_device  # noqa: E402
from train_demo import gpt_runs  # noqa: E402

import vescale  # noqa: E402
from tests.harness.host_sync import count_host_syncs  # noqa: E402
from vescale import Shard  # noqa: E402
from vescale.ddp import DistributedDataParallel  # noqa: E402

CFG = gpt.GPTConfig(vocab=64, seq=16, dim=32, heads=4, layers=1)


class Skip(Exception):
    """A check that this device cannot run (the reason is printed)."""


def _close(a: torch.Tensor, b: torch.Tensor, what: str, tol: float) -> None:
    err = (a.double() - b.double()).abs().max().item()
    if err > tol:
        raise AssertionError(f"{what}: max error {err:.3g} > {tol:g}")


# (a) a real 1-rank group ---------------------------------------------------------------------


def _mesh11(device: str) -> vescale.DeviceMesh:
    return vescale.init_device_mesh(device, (1, 1), mesh_dim_names=("dp", "tp"))


def check_demo_gpt(device: str) -> str:
    runs = gpt_runs(steps=3, cfg=CFG, device=device, shape=(1, 1))
    ref = runs["1-device"].losses
    for mode in ("vescale", "eager"):
        for step, (got, want) in enumerate(zip(runs[mode].losses, ref)):
            if abs(got - want) > 1e-4:
                raise AssertionError(f"{mode} step {step}: loss {got} vs one device {want}")
    return f"losses {', '.join(f'{x:.4f}' for x in ref)} (compiled = eager = one device)"


def check_cuda_graphs(device: str) -> str:
    if device != "cuda":
        raise Skip("CUDA graphs need a CUDA device")
    runs = gpt_runs(
        steps=3, cfg=CFG, device=device, shape=(1, 1), compile_kwargs={"mode": "reduce-overhead"}
    )
    for got, want in zip(runs["vescale"].losses, runs["1-device"].losses):
        if abs(got - want) > 1e-4:
            raise AssertionError(f"reduce-overhead loss {got} vs one device {want}")
    return "mode='reduce-overhead' equals one device"


@functools.cache
def _compiled_ddp(device: str) -> tuple[torch.nn.Module, Callable[[int], tuple]]:
    """The demo GPT under DDP on a (1, 1) mesh, compiled (shared by the checks that step it)."""
    mesh = _mesh11(device)
    torch._dynamo.reset()
    model = torch.compile(
        DistributedDataParallel(gpt.parallelize(gpt.build_deferred(CFG), mesh)), backend="vescale"
    )
    return model, lambda step: gpt.shard_batch(mesh, *gpt.batch(CFG, step, device=device))


def check_host_syncs(device: str) -> str:
    model, inputs = _compiled_ddp(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(i: int) -> None:
        loss = model(*inputs(i))
        opt.zero_grad()
        loss.backward()
        opt.step()

    step(0)  # compiles, checks ranks once
    step(1)
    batches = [inputs(i) for i in (2, 3)]  # the data loader's work is not the step's
    sync_mode = (
        contextlib.nullcontext() if device != "cuda" else _cuda_sync_debug("error")
    )  # raises on a host sync
    with count_host_syncs() as reads, sync_mode:
        for ids, targets in batches:
            loss = model(ids, targets)
            opt.zero_grad()
            loss.backward()
            opt.step()
    if reads.calls:
        raise AssertionError(f"host reads in 2 compiled steps: {reads.calls}")
    return "0 host reads in 2 compiled DDP steps" + (
        ", none under set_sync_debug_mode('error')" if device == "cuda" else ""
    )


@contextlib.contextmanager
def _cuda_sync_debug(mode: str) -> Iterator[None]:
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def check_profiler_trace(device: str, trace_dir: Path) -> str:
    model, inputs = _compiled_ddp(device)
    model(*inputs(0)).backward()  # compiled (by check_host_syncs or now) outside the trace
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        model(*inputs(1)).backward()
    path = trace_dir / "compiled_step_trace.json"
    prof.export_chrome_trace(str(path))
    events = json.loads(path.read_text())["traceEvents"]
    if not events:
        raise AssertionError(f"{path}: no events")
    return f"{len(events)} events in {path}"


def check_dropout(device: str) -> str:
    mesh = vescale.init_device_mesh(device, (1,))
    x = torch.randn(8, 16, device=device)
    torch.manual_seed(7)
    want = F.dropout(x, p=0.5)
    torch.manual_seed(7)
    got = F.dropout(vescale.distribute_tensor(x, mesh, [Shard(0)]), p=0.5).full_tensor()
    _close(got, want, "dropout on a DTensor vs one device", 0.0)
    return "the mask equals one device's on the same seed"


def check_fsdp_storage(device: str) -> str:
    from vescale.fsdp import flat_group, fully_shard

    mesh = vescale.init_device_mesh(device, (1,))
    model = fully_shard(gpt.build(CFG, device=device), mesh=mesh)
    model(*gpt.batch(CFG, 0, device=device)).backward()
    want = torch.device(device).type
    wrong = [
        name
        for name, p in model.named_parameters()
        if p.to_local().device.type != want or (p.grad is not None and p.grad.device.type != want)
    ]
    group = flat_group(model)
    tensors = [t for t in vars(group).values() if isinstance(t, torch.Tensor)]
    wrong += [f"buffer {t.shape}" for t in tensors if t.device.type != want]
    if wrong:
        raise AssertionError(f"not on {want}: {wrong[:5]}")
    return f"parameters, gradients and {len(tensors)} flat buffers on {want}"


# (b) LocalTensorMode on the device's tensors --------------------------------------------------


@contextlib.contextmanager
def _fake_world(world: int) -> Iterator[None]:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _sdpa_backends(device: str) -> list:
    from torch.nn.attention import SDPBackend

    if device != "cuda":
        return [SDPBackend.MATH]
    return [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]


def check_sdpa_sharded(device: str) -> str:
    from torch.distributed._local_tensor import LocalTensorMode
    from torch.nn.attention import sdpa_kernel

    dtype = torch.bfloat16 if device == "cuda" else torch.float64
    tol = 2e-2 if device == "cuda" else 1e-10
    layouts = {
        "heads": ((4,), [Shard(1)]),
        "batch": ((4,), [Shard(0)]),
        "batch x heads": ((2, 2), [Shard(0), Shard(1)]),
    }
    done = []
    for backend in _sdpa_backends(device):
        for name, (shape, placements) in layouts.items():
            torch.manual_seed(0)
            q, k, v = (torch.randn(4, 8, 16, 64, device=device, dtype=dtype) for _ in range(3))
            grad = torch.randn_like(q)
            with sdpa_kernel([backend]):
                ref = [t.detach().requires_grad_() for t in (q, k, v)]
                out = F.scaled_dot_product_attention(*ref, is_causal=True)
                out.backward(grad)
                with _fake_world(4), LocalTensorMode(4):
                    mesh = vescale.init_device_mesh(device, shape)
                    dts = [
                        vescale.distribute_tensor(t, mesh, placements).requires_grad_()
                        for t in (q, k, v)
                    ]
                    got = F.scaled_dot_product_attention(*dts, is_causal=True)
                    got.backward(vescale.distribute_tensor(grad, mesh, placements))
                    full = [got.full_tensor()] + [d.grad.full_tensor() for d in dts]
                    full = [_plain(t) for t in full]
            for what, a, b in zip(("out", "dq", "dk", "dv"), full, [out] + [r.grad for r in ref]):
                _close(a, b, f"{backend.name} by {name}: {what}", tol)
            done.append(f"{backend.name}/{name}")
    return f"forward + backward equal one device: {', '.join(done)}"


def _plain(t: torch.Tensor) -> torch.Tensor:
    """Rank 0's value of a LocalTensor (every rank holds the full tensor after full_tensor)."""
    from torch.distributed._local_tensor import LocalTensor

    return t._local_tensors[0] if isinstance(t, LocalTensor) else t


def check_sdpa_dropout(device: str) -> str:
    from torch.distributed._local_tensor import LocalTensorMode

    q, k, v = (torch.randn(2, 4, 8, 16, device=device) for _ in range(3))
    torch.manual_seed(3)
    want = F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    with _fake_world(4), LocalTensorMode(4):
        mesh = vescale.init_device_mesh(device, (4,))
        dts = [vescale.distribute_tensor(t, mesh, [Shard(1)]) for t in (q, k, v)]
        torch.manual_seed(3)
        got = _plain(F.scaled_dot_product_attention(*dts, dropout_p=0.5).full_tensor())
    if device == "cuda":  # fused kernels draw per (batch, head) block: not one device's mask
        heads = [got[:, h] for h in range(4)]
        same = [h for h in range(1, 4) if torch.equal(heads[0], heads[h])]
        if same:
            raise AssertionError(f"heads {same} drew the same dropout mask as head 0")
        return "ranks' heads draw different masks"
    _close(got, want, "SDPA dropout by heads vs one device", 1e-6)
    return "equals one device on the same seed"


# (c) an 8-rank fake-PG compile ----------------------------------------------------------------


def check_fake_pg_compile(device: str) -> str:
    with _fake_world(8):
        mesh = vescale.init_device_mesh(device, (4, 2), mesh_dim_names=("dp", "tp"))
        torch._dynamo.reset()
        model = torch.compile(
            DistributedDataParallel(gpt.parallelize(gpt.build(CFG, device=device), mesh)),
            backend="vescale",
        )
        inputs = gpt.shard_batch(mesh, *gpt.batch(CFG, 0, device=device))
        t0 = time.perf_counter()
        model(*inputs).backward()
        elapsed = time.perf_counter() - t0
    return f"(4, 2) mesh compiled through Inductor and ran in {elapsed:.1f} s"


# driver -----------------------------------------------------------------------------------------


@contextlib.contextmanager
def _one_rank_group(device: str) -> Iterator[None]:
    with tempfile.NamedTemporaryFile() as f:
        store = dist.FileStore(f.name, 1)
        dist.init_process_group(BACKENDS[device], store=store, rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=sorted(BACKENDS), default=None)
    parser.add_argument("--json", type=Path, default=None, help="write the summary here")
    parser.add_argument("--trace-dir", type=Path, default=None, help="profiler trace folder")
    args = parser.parse_args()
    device = args.device or default_device()
    if device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: torch.cuda.is_available() is False")
        torch.cuda.set_device(0)
    trace_dir = args.trace_dir or Path(tempfile.mkdtemp(prefix="vescale-gpu-check-"))
    trace_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("VESCALE_PROGRESS", "0")
    torch.set_num_threads(max(1, torch.get_num_threads()))

    one_rank = {
        "demo_gpt": check_demo_gpt,
        "cuda_graphs": check_cuda_graphs,
        "host_syncs": check_host_syncs,
        "profiler_trace": lambda d: check_profiler_trace(d, trace_dir),
        "dropout": check_dropout,
        "fsdp_storage": check_fsdp_storage,
    }
    simulated = {
        "sdpa_sharded": check_sdpa_sharded,
        "sdpa_dropout_heads": check_sdpa_dropout,
        "fake_pg_compile_8": check_fake_pg_compile,
    }
    results: dict[str, dict[str, str]] = {}

    def run(name: str, check: Callable[[str], str]) -> None:
        t0 = time.perf_counter()
        try:
            status, detail = "PASS", check(device)
        except Skip as why:
            status, detail = "SKIP", str(why)
        except Exception as err:  # a check's failure is its line, the others still run
            status = "FAIL"
            detail = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            if os.environ.get("VESCALE_GPU_CHECK_TRACEBACK") == "1":
                traceback.print_exc()
        seconds = time.perf_counter() - t0
        results[name] = {"status": status, "detail": detail, "seconds": f"{seconds:.1f}"}
        print(f"{status:4} {name:20} {seconds:6.1f} s  {detail}", flush=True)

    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"vescale gpu_check on {device} ({name}), torch {torch.__version__}", flush=True)
    with _one_rank_group(device):
        for check_name, check in one_rank.items():
            run(check_name, check)
        _compiled_ddp.cache_clear()
    for check_name, check in simulated.items():
        run(check_name, check)
    if args.json:
        summary = {"device": device, "device_name": name, "torch": torch.__version__}
        args.json.write_text(json.dumps({**summary, "checks": results}, indent=2) + "\n")
    return int(any(r["status"] == "FAIL" for r in results.values()))


if __name__ == "__main__":
    sys.exit(main())
