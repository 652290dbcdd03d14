"""GPU cost models by name, FLOPs from ``torch.utils.flop_counter``, and device-correct
calibration, all checked on CPU.

FLOPs: every counted op's FLOPs equal ``FlopCounterMode``'s count of the same op on the same
(fake, CUDA) tensors, halved for a causal attention. Collectives: a named GPU's ring times
equal upstream's analytic NCCL estimate (``torch._inductor.comm_analysis``) told the same
machine (Hopper, NVLink, 8 GPUs per node), and hand-computed NCCL ring times across nodes.
Calibration: every tensor its probes touch is on the mesh's device, CUDA probes are timed
with CUDA events after a synchronize, and a CUDA mesh without ``cost=`` takes its GPU's spec.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

import vescale
from tests.harness.simulated import fake_world
from vescale.cost import calibration
from vescale.cost.flops import node_flops
from vescale.cost.gpus import GPUS, MATMUL_EFFICIENCY, detect_gpu, gpu_cost_model
from vescale.cost.model import CostModel, wire_bytes
from vescale.plan import PlanError

aten = torch.ops.aten


def _graph_node(op: Any, *args: Any) -> tuple[torch.fx.Node, Any]:
    """A one-op FX graph of ``op(*args)`` (tensors become placeholders, every value in
    ``meta["val"]``) and the op's output."""
    graph = torch.fx.Graph()
    out = op(*args)
    fx_args = []
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            ph = graph.placeholder(f"a{i}")
            ph.meta["val"] = a
            fx_args.append(ph)
        else:
            fx_args.append(a)
    node = graph.call_function(op, tuple(fx_args))
    node.meta["val"] = out
    return node, out


def _counted(op: Any, *args: Any) -> int:
    with FlopCounterMode(display=False) as counter:
        op(*args)
    return counter.get_total_flops()


def _attention_cases() -> list[tuple[str, Callable[[], tuple[Any, ...]], bool]]:
    """(name, fake-CUDA op and arguments, causal)."""
    bf16 = torch.bfloat16

    def qkv() -> list[torch.Tensor]:
        return [torch.empty(2, 8, 128, 64, device="cuda", dtype=bf16) for _ in range(3)]

    def flash(causal: bool) -> tuple[Any, ...]:
        return (aten._scaled_dot_product_flash_attention.default, *qkv(), 0.0, causal)

    def efficient(causal: bool) -> tuple[Any, ...]:
        return (
            aten._scaled_dot_product_efficient_attention.default,
            *qkv(),
            None,
            True,
            0.0,
            causal,
        )

    def cudnn(causal: bool) -> tuple[Any, ...]:
        return (aten._scaled_dot_product_cudnn_attention.default, *qkv(), None, True, 0.0, causal)

    return [
        (name, lambda f=f, c=c: f(c), c)
        for name, f in (("flash", flash), ("efficient", efficient), ("cudnn", cudnn))
        for c in (False, True)
    ]


@pytest.mark.parametrize(("name", "case", "causal"), _attention_cases())
def test_attention_flops_are_flop_counter_modes_halved_when_causal(name, case, causal) -> None:
    with FakeTensorMode():
        op, *args = case()
        node, out = _graph_node(op, *args)
        want = _counted(op, *args)
        assert want == 4 * 2 * 8 * 128 * 128 * 64  # QK^T and PV, 2 FLOPs a multiply-add
        assert node_flops(node) == (want / 2 if causal else want), name
        # the backward (flash's: grad_out, q, k, v, out, logsumexp, ...): 5 products
        if name == "flash":
            q, k, v = args[:3]
            grad = torch.empty_like(out[0])
            back = aten._scaled_dot_product_flash_attention_backward.default
            b_args = (grad, q, k, v, out[0], out[1], *out[2:6], 0.0, causal, out[6], out[7])
            b_node, _ = _graph_node(back, *b_args)
            b_want = _counted(back, *b_args)
            assert b_want == 10 * 2 * 8 * 128 * 128 * 64
            assert node_flops(b_node) == (b_want / 2 if causal else b_want)


def test_matmul_and_convolution_flops_are_flop_counter_modes() -> None:
    x, w = torch.randn(2, 3, 16, 16), torch.randn(4, 3, 3, 3)
    a, b = torch.randn(64, 32), torch.randn(32, 16)
    cases = [
        (aten.mm.default, a, b),
        (aten.addmm.default, torch.randn(16), a, b),
        (aten.bmm.default, torch.randn(3, 8, 4), torch.randn(3, 4, 5)),
        (aten.convolution.default, x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1),
    ]
    for op, *args in cases:
        node, _ = _graph_node(op, *args)
        want = _counted(op, *args)
        assert want > 0 and node_flops(node) == want, op
    # CPU's fused attention (not in upstream's registry): the flash kernel's formula
    q = torch.randn(2, 4, 8, 16)
    cpu, _ = _graph_node(
        aten._scaled_dot_product_flash_attention_for_cpu.default, q, q, q, 0.0, True
    )
    assert node_flops(cpu) == 4 * 2 * 4 * 8 * 8 * 16 / 2
    relu, _ = _graph_node(aten.relu.default, q)
    assert node_flops(relu) == 0.0


# --- named GPUs ------------------------------------------------------------------------


def test_names_map_to_their_datasheet_rates_per_dtype() -> None:
    mesh = vescale.DeviceMesh("meta", torch.arange(16).view(2, 8), mesh_dim_names=("dp", "tp"))
    h100 = gpu_cost_model("h100", mesh)
    a = torch.empty(4096, 4096, dtype=torch.bfloat16)
    node, _ = _graph_node(aten.mm.default, a, a)
    flops = 2 * 4096**3
    assert h100.op_time(node, 0) == pytest.approx(3e-6 + flops / (989.5e12 * MATMUL_EFFICIENCY))
    assert h100.rate(torch.float8_e4m3fn) == pytest.approx(1979e12 * MATMUL_EFFICIENCY)
    assert torch.get_float32_matmul_precision() == "highest"  # torch's default: no TF32
    assert h100.rate(torch.float32) == pytest.approx(67e12 * MATMUL_EFFICIENCY)
    # as after torch.set_float32_matmul_precision("high"), without setting it: a set changes
    # torch's fp32-precision state, which keys Inductor's FX graph cache for later tests
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "get_float32_matmul_precision", lambda: "high")
        tf32 = gpu_cost_model("h100", mesh).rate(torch.float32)
    assert tf32 == pytest.approx(494.5e12 * MATMUL_EFFICIENCY)
    assert gpu_cost_model("a100", mesh).rate(torch.bfloat16) == pytest.approx(312e12 * 0.7)
    assert gpu_cost_model("h200", mesh).gamma < h100.gamma  # HBM3e 4.8 vs HBM3 3.35 TB/s
    assert detect_gpu("NVIDIA H100 80GB HBM3") == "h100"
    assert detect_gpu("NVIDIA A100-SXM4-80GB") == "a100"
    assert detect_gpu("NVIDIA H100 PCIe") is None and detect_gpu("NVIDIA L4") is None
    assert set(GPUS) == {"a100", "h100", "h200", "b200"}


@pytest.fixture
def hopper_node(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Upstream's estimate, told this is one node of 8 NVLink Hopper GPUs."""
    from torch._inductor import comm_analysis as ca

    monkeypatch.setattr(ca, "get_gpu_type", lambda: ca.NVIDIA_GPU_TYPE.HOPPER)
    monkeypatch.setattr(ca, "_has_nvlink", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    return ca


def test_intra_node_collectives_are_upstreams_nccl_estimate(hopper_node) -> None:
    ca = hopper_node
    mesh = vescale.DeviceMesh("meta", torch.arange(16).view(2, 8), mesh_dim_names=("dp", "tp"))
    h100 = gpu_cost_model("h100", mesh)
    for nbytes in (1 << 10, 1 << 20, 1 << 26):
        for kind, coll, nccl_bytes in (
            ("all_gather", ca.NCCL_COLL.ALL_GATHER, 8 * nbytes),  # NCCL counts the output
            ("reduce_scatter", ca.NCCL_COLL.REDUCE_SCATTER, nbytes),
        ):
            want = ca.estimate_nccl_collective_runtime_impl(nccl_bytes, 8, coll) / 1e3
            assert h100.comm_s(kind, (1,), 8, nbytes) == pytest.approx(want, rel=1e-9)


def test_a_mesh_dim_across_nodes_is_priced_on_infiniband() -> None:
    mesh = vescale.DeviceMesh("meta", torch.arange(16).view(2, 8), mesh_dim_names=("dp", "tp"))
    h100 = gpu_cost_model("h100", mesh)
    assert dict(h100.nodes) == {(0,): 2, (1,): 1, (0, 1): 2}
    big = 1 << 28
    # dp (2 ranks, 2 nodes): ring all-reduce, 2 steps both across nodes, Simple protocol:
    # 8.4 us base + 2 * 14 us network hops + 2 (n-1)/n B over 50 GB/s NDR
    want = (8.4 + 2 * 14.0) * 1e-6 + wire_bytes("all_reduce", 2, big) / 50e9
    assert h100.comm_s("all_reduce", (0,), 2, big) == pytest.approx(want)
    # tp (8 ranks, one node): NVLink's 370 GB/s bus, Simple: 8.4 + 14 hops of 3.4 us
    want = (8.4 + 14 * 3.4) * 1e-6 + wire_bytes("all_reduce", 8, big) / 370e9
    assert h100.comm_s("all_reduce", (1,), 8, big) == pytest.approx(want)
    # the same mesh with 4 GPUs per node: tp's groups now span 2 nodes
    assert dict(gpu_cost_model("h100", mesh, gpus_per_node=4).nodes)[(1,)] == 2


def test_a_meta_mesh_needs_a_cost_model_named() -> None:
    """No silent CPU constants: a meta mesh without ``cost=`` is a PlanError naming the fix;
    with ``cost="h100"`` the plan is made (and schedule.json's constants are the H100's)."""
    mesh = vescale.DeviceMesh("meta", torch.arange(2), mesh_dim_names=("tp",))
    kwargs: dict[str, Any] = {
        "inputs": [{"tp": vescale.Replicate()}],
        "example_inputs": [torch.randn(4, 8)],
        "compile": False,
        "progress": False,
    }
    with pytest.raises(PlanError, match=r"cost='h100'") as err:
        vescale.parallelize(torch.nn.Linear(8, 4), mesh, {}, **kwargs)
    assert "meta device" in str(err.value) and "(2,)" in str(err.value)
    with pytest.raises(PlanError, match=r"cost='v100' is no known GPU.*'h100'"):
        vescale.parallelize(torch.nn.Linear(8, 4), mesh, {}, cost="v100", **kwargs)
    vescale.parallelize(torch.nn.Linear(8, 4), mesh, {}, cost="h100", **kwargs)
    assert calibration.calibrated(mesh) == gpu_cost_model("h100", mesh)


# --- calibration on the mesh's device ----------------------------------------------------


class _Devices(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        for a in torch.utils._pytree.tree_leaves((args, kwargs or {})):
            if isinstance(a, torch.Tensor):
                self.seen.add(str(a.device))
        return func(*args, **(kwargs or {}))


def test_every_probe_and_buffer_is_on_the_mesh_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the default device elsewhere (meta), every tensor the probes and collectives use
    is the mesh's (cpu): none is made on the default device."""
    monkeypatch.setattr(calibration, "timer", lambda device: lambda fn: 1e-3)
    with fake_world(2):
        mesh = vescale.init_device_mesh("cpu", (2,))
        torch.set_default_device("meta")
        try:
            with _Devices() as mode:
                model = calibration._measure(mesh)
        finally:
            torch.set_default_device(None)
    assert mode.seen == {"cpu"}, mode.seen
    assert isinstance(model, CostModel)


def test_cuda_probes_are_timed_by_events_after_a_synchronize(monkeypatch) -> None:
    calls: list[str] = []
    names = iter(["start", "end"])

    class Event:
        def __init__(self, enable_timing: bool) -> None:
            assert enable_timing
            self.name = next(names)

        def record(self) -> None:
            calls.append(f"{self.name}.record")

        def synchronize(self) -> None:
            calls.append(f"{self.name}.synchronize")

        def elapsed_time(self, end: Any) -> float:
            return 250.0  # ms

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: calls.append("synchronize"))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    timed = calibration.timer(torch.device("cuda", 0))
    assert timed(lambda: calls.append("probe")) == 0.25
    assert calls == ["synchronize", "start.record", "probe", "end.record", "end.synchronize"]
    assert calibration.timer(torch.device("cpu")) is calibration._timed
    cuda_mesh = types.SimpleNamespace(device_type="cuda")
    assert calibration.probe_device(cuda_mesh) == torch.device("cuda", 3)  # type: ignore[arg-type]


def test_a_cuda_mesh_defaults_to_its_gpus_spec(monkeypatch: pytest.MonkeyPatch) -> None:
    mesh = types.SimpleNamespace(
        device_type="cuda", mesh=torch.arange(16).view(2, 8), shape=(2, 8), ndim=2
    )
    measured = CostModel((1.0, 1.0), (1.0, 1.0))
    monkeypatch.setattr(calibration, "calibrate", lambda m: measured)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "NVIDIA H100 80GB HBM3")
    assert calibration.default_cost(mesh) == gpu_cost_model("h100", mesh)  # type: ignore[arg-type]
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "NVIDIA L4")
    with pytest.warns(UserWarning, match=r"no cost model is known for GPU 'NVIDIA L4'.*cost="):
        assert calibration.default_cost(mesh) is measured  # type: ignore[arg-type]
