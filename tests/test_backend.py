"""The ``vescale`` torch.compile backend is reachable by name, with or without importing vescale."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

import vescale  # noqa: F401

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


def test_mode_and_backward_reach_compile_fx_inner(monkeypatch):
    """``mode="max-autotune"`` reaches Inductor as its config (seen inside compile_fx_inner),
    and the backward graph is compiled with ``is_backward=True`` (the forward with False)."""
    from torch._inductor import config

    from vescale import backend

    seen = []
    real = backend.inductor_pieces()

    def spy(gm, example_inputs, **kwargs):
        seen.append((kwargs.get("is_backward", False), config.max_autotune))
        return real[0](gm, example_inputs, **kwargs)

    monkeypatch.setattr(backend, "inductor_pieces", lambda: (spy, *real[1:]))
    torch._dynamo.reset()
    f = torch.compile(
        lambda t: torch.sin(t) * 2, backend="vescale", mode="max-autotune-no-cudagraphs"
    )
    x = torch.randn(8, dtype=torch.float64, requires_grad=True)
    f(x).sum().backward()
    assert torch.allclose(x.grad, 2 * torch.cos(x))
    assert seen == [(False, True), (True, True)]
    assert config.max_autotune is False  # patched only while compiling


def test_unknown_mode_names_it():
    torch._dynamo.reset()
    f = torch.compile(lambda t: t + 1, backend="vescale", mode="fastest")
    with pytest.raises(Exception, match="unknown mode 'fastest'"):
        f(torch.randn(2))
