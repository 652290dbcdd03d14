"""The ``vescale`` torch.compile backend is reachable by name, with or without importing vescale."""

from __future__ import annotations

import contextlib
import functools
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from typing import Any, NamedTuple

import pytest
import torch

import vescale
from tests.dtensor.reference import mesh_of

# Inductor's first import in this process imports torch.utils.mkldnn, whose ScriptModules
# use torch.jit.script_method: torch's own deprecation warnings, not raised by vescale code.
pytestmark = pytest.mark.filterwarnings(
    "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"
)


def test_backend_by_name_in_process():
    f = torch.compile(lambda x: torch.sin(x) * 2, backend="vescale")
    x = torch.randn(8, dtype=torch.float64, requires_grad=True)
    y = f(x)
    y.sum().backward()
    assert torch.allclose(y, torch.sin(x) * 2)
    assert torch.allclose(x.grad, 2 * torch.cos(x))


def test_backend_entry_point_without_import():
    """In a fresh interpreter (FX codegen: the entry point is the subject, not Inductor, which
    test_backend_by_name_in_process runs)."""
    code = textwrap.dedent(
        """
        import torch
        fx = {"codegen": "fx"}
        f = torch.compile(lambda x: x.relu() + 1, backend="vescale", options=fx)
        x = torch.randn(4)
        assert torch.equal(f(x), x.relu() + 1)
        import vescale  # importing afterwards must not clash with the entry point
        g = torch.compile(lambda x: x * 3, backend="vescale", options=fx)
        assert torch.equal(g(x), x * 3)
        print("OK")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-3000:]


def test_failed_capture_falls_back_to_eager_with_one_warning(monkeypatch):
    from vescale import backend
    from vescale.passes import PassManager

    def unsupported(gm, ctx):
        raise NotImplementedError("aten.frobnicate on (Shard(dim=0),) is not supported")

    monkeypatch.setattr(backend, "PIPELINE", PassManager([("unsupported", unsupported)]))
    x = torch.randn(8, dtype=torch.float64)
    torch._dynamo.reset()
    f = torch.compile(lambda t: torch.sin(t) * 2, backend="vescale", options={"codegen": "fx"})
    with pytest.warns(
        UserWarning,
        match=r"graph\d+ runs eagerly, its capture failed: NotImplementedError: aten.frobnicate on \(Shard\(dim=0\),\)",
    ):
        out = f(x)
    assert torch.equal(out, torch.sin(x) * 2)
    torch._dynamo.reset()
    g = torch.compile(
        lambda t: torch.cos(t), backend="vescale", options={"codegen": "fx", "strict": True}
    )
    with pytest.raises(Exception, match=r"aten\.frobnicate"):
        g(x)
    torch._dynamo.reset()


def test_passes_read_the_resolved_options_object():
    """``capture_graphs`` hands out every compiled graph; its passes saw the one
    ``BackendOptions`` the backend resolved (given values, else the field defaults)."""
    from vescale.backend import BackendOptions, capture_graphs

    torch._dynamo.reset()
    given = {"codegen": "fx", "bucket_cap_mb": 3.0, "overlap": False}
    with capture_graphs() as outer, capture_graphs() as graphs:
        f = torch.compile(lambda t: torch.sin(t) * 2, backend="vescale", options=given)
        f(torch.randn(4, requires_grad=True)).sum().backward()
    torch._dynamo.reset()
    assert [g.name.rsplit(".", 1)[1] for g in graphs] == ["forward", "backward"]
    assert [g.name for g in outer] == [g.name for g in graphs]
    for g in graphs:
        assert g.ctx.options == BackendOptions.resolve(given)
        assert g.ctx.options.eliminate is True and g.ctx.options.overlap_cap_mb == 256.0
        assert "fingerprint" in g.ctx.reports and isinstance(g.gm, torch.fx.GraphModule)
    with capture_graphs() as later:
        pass
    assert later == []


def test_backend_options_defaults_and_docs_in_one_place():
    """Every option is documented on its field; a bare ``PassContext`` and eager DDP use the
    same defaults as the backend."""
    import dataclasses
    import inspect

    from vescale.ddp import DistributedDataParallel
    from vescale.passes import BackendOptions, PassContext

    for f in dataclasses.fields(BackendOptions):
        assert f.metadata["doc"].strip(), f.name
        assert f.metadata["env"] is None or f.metadata["env"].startswith("VESCALE_"), f.name
    assert PassContext("g").options == BackendOptions()
    # DDP's None: DEFAULT_BUCKET_CAP_MB eagerly, the backend's option compiled
    ddp_default = inspect.signature(DistributedDataParallel).parameters["bucket_cap_mb"].default
    assert ddp_default is None
    assert DistributedDataParallel(torch.nn.Module())._reducer.cap_bytes == int(
        BackendOptions().bucket_cap_mb * 2**20
    )


class Inner(NamedTuple):
    """One ``compile_fx_inner`` call: its keywords (boxes unpacked), input shapes, and the
    Inductor config values of ``CONFIG`` during the call."""

    kwargs: dict[str, Any]
    shapes: list[tuple[int, ...]]
    config: dict[str, Any]
    boxes: tuple[Any, Any]  # (cudagraphs, boxed_forward_device_index) objects


CONFIG = ("max_autotune", "coordinate_descent_tuning", "triton.cudagraphs")


@contextlib.contextmanager
def _inner_spy() -> Iterator[list[Inner]]:
    """Every ``compile_fx_inner`` call in the block, whoever makes it: Inductor's
    ``_compile_fx_inner`` (which ``compile_fx_inner`` calls) spied; AOTAutograd's cache off,
    so that ``backend="inductor"`` compiles again rather than loading."""
    from torch._functorch import config as aot_config
    from torch._inductor import compile_fx, config

    calls: list[Inner] = []
    real = compile_fx._compile_fx_inner

    def spy(gm, example_inputs, **kwargs):
        unboxed = {
            k: getattr(v, "value", v)
            for k, v in kwargs.items()
            if k not in ("get_decomp_fn", "compile_region_name")
        }
        shapes = [tuple(x.shape) for x in example_inputs]
        now = {
            name: getattr(config, name) if "." not in name else config.triton.cudagraphs
            for name in CONFIG
        }
        boxes = (kwargs.get("cudagraphs"), kwargs.get("boxed_forward_device_index"))
        calls.append(Inner(unboxed, shapes, now, boxes))
        return real(gm, example_inputs, **kwargs)

    compile_fx._compile_fx_inner = spy
    try:
        with aot_config.patch(enable_autograd_cache=False):
            yield calls
    finally:
        compile_fx._compile_fx_inner = real
        torch._dynamo.reset()


@pytest.fixture
def inner_calls():
    with _inner_spy() as calls:
        yield calls


class _Net(torch.nn.Module):
    """Parameters, a buffer and one data input (the only input of shape (3, 4))."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(4, 8, dtype=torch.float64)
        self.b = torch.nn.Linear(8, 2, dtype=torch.float64)
        self.register_buffer("scale", torch.full((8,), 0.5, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)) * self.scale)


def _compiled_calls(inner_calls: list[Inner], backend: Any, grad: bool, **compile_kw):
    """(the compile_fx_inner calls, output, parameter grads) of ``_Net`` compiled with
    ``backend`` and run forward (and backward with ``grad``) on a (3, 4) batch."""
    torch._dynamo.reset()
    inner_calls.clear()
    torch.manual_seed(0)
    net = _Net()
    x = torch.randn(3, 4, dtype=torch.float64)
    f = torch.compile(net, backend=backend, **compile_kw)
    with torch.set_grad_enabled(grad):
        out = f(x)
        if grad:
            out.sum().backward()
    grads = [p.grad for p in net.parameters()] if grad else []
    return list(inner_calls), out.detach(), grads


def _eager(grad: bool):
    torch.manual_seed(0)
    net = _Net()
    x = torch.randn(3, 4, dtype=torch.float64)
    with torch.set_grad_enabled(grad):
        out = net(x)
        if grad:
            out.sum().backward()
    return out.detach(), [p.grad for p in net.parameters()] if grad else []


def _without_graph_id(calls: list[Inner]) -> list[dict[str, Any]]:
    return [{k: v for k, v in c.kwargs.items() if k != "graph_id"} for c in calls]


@pytest.mark.parametrize("grad", [True, False], ids=["training", "inference"])
def test_compile_fx_inner_gets_what_inductor_gives_it(inner_calls, grad):
    """``mode="reduce-overhead"``: each graph gets the ``compile_fx_inner`` keywords that
    ``backend="inductor"`` gives it (the graph id aside: one counter for both), so CUDA graphs
    would see parameters and buffers as static inputs (the forward's every input but the data
    batch; the backward's every input but the tangent), one graph id and one device-index box
    shared by forward and backward; cudagraphs asked for (Inductor itself skips them on CPU:
    the box reads False by the backward); the backward as a backward, no-grad as inference."""
    want_out, want_grads = _eager(grad)
    by_backend = {}
    for backend in ("inductor", "vescale"):
        calls, out, grads = _compiled_calls(inner_calls, backend, grad, mode="reduce-overhead")
        torch.testing.assert_close(out, want_out)
        for g, w in zip(grads, want_grads, strict=True):
            torch.testing.assert_close(g, w)
        by_backend[backend] = calls
    inductor, ours = by_backend["inductor"], by_backend["vescale"]
    assert _without_graph_id(ours) == _without_graph_id(inductor)
    forward = ours[0]
    assert forward.kwargs["static_input_idxs"] == [
        i for i, shape in enumerate(forward.shapes) if shape != (3, 4)
    ]
    assert forward.kwargs["is_inference"] is (not grad) and forward.kwargs["cudagraphs"] is True
    assert forward.kwargs["graph_id"] is not None and forward.boxes[1] is not None
    if grad:
        backward = ours[1]
        assert len(ours) == 2 and backward.kwargs["is_backward"] is True
        assert backward.kwargs["static_input_idxs"] == list(range(len(backward.shapes) - 1))
        assert backward.kwargs["graph_id"] == forward.kwargs["graph_id"]
        assert backward.boxes[0] is forward.boxes[0] and backward.boxes[1] is forward.boxes[1]
    else:
        assert len(ours) == 1


def _tp_inner_kwargs() -> dict[str, list[dict[str, Any]]]:
    """Per backend, the ``compile_fx_inner`` keywords (graph id aside) of a column- then
    row-parallel MLP whose weights are DTensor parameters, ``mode="reduce-overhead"``, after
    checking its output and gradients against one device."""
    from vescale import Replicate, Shard

    mesh = mesh_of((2,))
    torch.manual_seed(0)
    w1, w2 = torch.randn(8, 4, dtype=torch.float64), torch.randn(2, 8, dtype=torch.float64)
    x = torch.randn(3, 4, dtype=torch.float64)
    ref = [w.clone().requires_grad_() for w in (w1, w2)]
    want = torch.relu(x @ ref[0].t()) @ ref[1].t()
    want.sum().backward()
    out = {}
    for backend in ("inductor", "vescale"):
        net = torch.nn.Module()
        net.w1 = torch.nn.Parameter(vescale.distribute_tensor(w1, mesh, [Shard(0)]))
        net.w2 = torch.nn.Parameter(vescale.distribute_tensor(w2, mesh, [Shard(1)]))
        xd = vescale.distribute_tensor(x, mesh, [Replicate()])

        def mlp(t, net=net):
            y = torch.relu(t @ net.w1.t()) @ net.w2.t()
            return y.redistribute(mesh, [Replicate()])

        with _inner_spy() as calls:
            y = torch.compile(mlp, backend=backend, mode="reduce-overhead")(xd)
            y.to_local().sum().backward()
        torch.testing.assert_close(y.full_tensor(), want)
        for p, r in zip((net.w1, net.w2), ref, strict=True):
            torch.testing.assert_close(p.grad.full_tensor(), r.grad)
        out[backend] = _without_graph_id(calls) + [{"shapes": c.shapes} for c in calls]
    return out


def test_compile_fx_inner_gets_what_inductor_gives_it_for_dtensor_parameters(pool2):
    """On 2 ranks, DTensor parameters: the same keywords as ``backend="inductor"`` (the
    vescale passes change the graphs' collectives, never their inputs), the forward's static
    inputs exactly the parameters' flattened DTensors (local shard, then mesh: w1's (4, 4),
    w2's (2, 4)), not the data batch's (3, 4)."""
    for per_backend in pool2.run(_tp_inner_kwargs):
        inductor, ours = per_backend["inductor"], per_backend["vescale"]
        assert ours == inductor and len(ours) == 4  # (forward, backward) keywords, shapes
        forward, shapes = ours[0], ours[2]["shapes"]
        assert forward["cudagraphs"] is True and ours[1]["is_backward"] is True
        static = [shapes[i] for i in forward["static_input_idxs"]]
        assert static == [(4, 4), (2,), (2, 4), (2,)] and (3, 4) in shapes, shapes


def test_joint_graph_passes_run_before_the_vescale_passes(inner_calls):
    """Inductor's joint-graph passes run on the joint graph (forward and backward, before the
    partition), and the vescale passes see their result: a joint custom pass (an Inductor
    option) rewriting ``t * 2`` into ``t + t`` sees tangents, and the forward graph the
    passes get holds ``add``, not ``mul``."""
    from torch._inductor import config

    from vescale.backend import capture_graphs

    seen = []

    def double_as_add(graph: torch.fx.Graph) -> None:
        seen.append(sorted(n.name for n in graph.nodes if n.op == "placeholder"))
        for node in graph.nodes:
            if node.target is torch.ops.aten.mul.Tensor and node.args[1] == 2:
                node.target, node.args = torch.ops.aten.add.Tensor, (node.args[0], node.args[0])

    torch._dynamo.reset()
    with capture_graphs() as graphs, config.patch(joint_custom_pre_pass=double_as_add):
        f = torch.compile(lambda t: torch.sin(t) * 2, backend="vescale")
        x = torch.randn(8, dtype=torch.float64, requires_grad=True)
        y = f(x)
        y.sum().backward()
    torch.testing.assert_close(y, torch.sin(x) * 2)
    torch.testing.assert_close(x.grad, 2 * torch.cos(x))
    assert len(seen) == 1 and any(name.startswith("tangents") for name in seen[0])
    forward = [n.target for n in graphs[0].gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.aten.add.Tensor in forward and torch.ops.aten.mul.Tensor not in forward


def test_inductor_options_reach_inductor(inner_calls):
    """``options={"inductor": {...}}`` is Inductor's config while each graph compiles (the
    backward too, compiled after ``torch.compile`` returned) as ``backend="inductor"``'s
    ``options`` are, and only then; given with a mode (``torch.compile`` takes one or the
    other; ``vescale_backend`` both), they are merged over the mode's."""
    from torch._inductor import config

    from vescale.backend import vescale_backend

    options = {"max_autotune": True, "triton.cudagraphs": True}
    seen = {}
    for backend, kw in (
        ("inductor", {"options": options}),
        ("vescale", {"options": {"inductor": options}}),
    ):
        calls, out, grads = _compiled_calls(inner_calls, backend, True, **kw)
        want_out, want_grads = _eager(True)
        torch.testing.assert_close(out, want_out)
        torch.testing.assert_close(grads, want_grads)
        assert calls[0].kwargs["cudagraphs"] is True, backend
        seen[backend] = [c.config for c in calls]
    assert (
        seen["vescale"]
        == seen["inductor"]
        == 2
        * [{"max_autotune": True, "coordinate_descent_tuning": False, "triton.cudagraphs": True}]
    )
    both = functools.partial(
        vescale_backend,
        mode="max-autotune-no-cudagraphs",
        options={"inductor": {"coordinate_descent_tuning": False}},
    )
    calls, out, _ = _compiled_calls(inner_calls, both, True)
    torch.testing.assert_close(out, _eager(True)[0])
    assert [c.config for c in calls] == 2 * [
        {"max_autotune": True, "coordinate_descent_tuning": False, "triton.cudagraphs": False}
    ]
    assert config.max_autotune is False and config.triton.cudagraphs is False


def test_unknown_or_mistyped_inductor_option_is_a_value_error():
    from vescale.backend import BackendOptions

    with pytest.raises(
        ValueError, match=r"unknown Inductor options \['max_autotun'\].*known: \[.*'max_autotune'"
    ):
        BackendOptions.resolve({"inductor": {"max_autotun": True}})
    with pytest.raises(ValueError, match=r"option inductor: Unexpected type of attr max_autotune"):
        BackendOptions.resolve({"inductor": {"max_autotune": "yes"}})
    with pytest.raises(ValueError, match=r"option inductor must be a dict, got 1"):
        BackendOptions.resolve({"inductor": 1})
    assert BackendOptions.resolve({"inductor": {"max-autotune": True}}).inductor == {
        "max-autotune": True
    }
    torch._dynamo.reset()
    f = torch.compile(lambda t: t + 1, backend="vescale", options={"inductor": {"fast": 1}})
    with pytest.raises(Exception, match=r"unknown Inductor options \['fast'\]") as err:
        f(torch.randn(2))
    assert isinstance(err.value.inner_exception, ValueError)
    fx = {"codegen": "fx", "inductor": {"max_autotune": True}}
    torch._dynamo.reset()
    g = torch.compile(lambda t: t + 2, backend="vescale", options=fx)
    with pytest.raises(Exception, match=r"configures Inductor; it needs codegen='inductor'"):
        g(torch.randn(2))
    torch._dynamo.reset()


def test_unknown_mode_names_it():
    torch._dynamo.reset()
    f = torch.compile(lambda t: t + 1, backend="vescale", mode="fastest")
    with pytest.raises(Exception, match="unknown mode 'fastest'"):
        f(torch.randn(2))
