"""Pins the upstream private surface vescale depends on: a torch upgrade fails here first."""

from __future__ import annotations

import importlib
import inspect
import re

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from vescale import _torch_compat as compat

# Resolving every pinned name imports Inductor's modules (the export tracing state among them)
# in this process, and Inductor's first import pulls in torch.utils.mkldnn, whose ScriptModules
# use torch.jit.script_method: torch's own deprecation warnings, not raised by vescale code.
pytestmark = pytest.mark.filterwarnings(
    "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"
)

OWNERS = {
    "DeviceMesh": DeviceMesh,
    "DTensor": DTensor,
    "DTensorSpec": compat.DTensorSpec,
    "OpDispatcher": compat.OpDispatcher,
    "OpSchema": compat.OpSchema,
    "OpOverload": torch._ops.OpOverload,
    "FunctionSchema": torch._C.FunctionSchema,
    "ExplicitRedistributionContext": compat.ExplicitRedistributionContext,
    "ShardingPropagator": type(DTensor._op_dispatcher.sharding_propagator),
    "Tensor": torch.Tensor,
    "Module": torch.nn.Module,
    "Variable": torch.autograd.Variable,
    "Library": torch.library.Library,
    "NormPartial": importlib.import_module("torch.distributed.tensor._ops._math_ops")._NormPartial,
    "make_boxed_func": compat.make_boxed_func,
    "_mesh_resources": compat._mesh_resources,
    "upstream_dispatch_module": compat.upstream_dispatch_module,
    "upstream_loss_module": compat.upstream_loss_module,
}


def _owner(name: str) -> object:
    """An owner of ``PRIVATE_ATTRIBUTES``: a name above, or a torch module's dotted path."""
    return OWNERS[name] if name in OWNERS else importlib.import_module(name)


def _source(obj: object) -> str:
    try:
        return inspect.getsource(obj)  # type: ignore[arg-type]
    except (OSError, TypeError):  # a C++ class or a module without Python source
        return ""


def test_private_names_import():
    for name in compat.__all__:
        assert getattr(compat, name) is not None, name


def test_private_attributes_exist():
    """Each pinned attribute is on its owner, or (instance attributes, parameters, attributes
    set on functions) assigned or named in the owner's own source."""
    for owner, attr in compat.PRIVATE_ATTRIBUTES:
        obj = _owner(owner)
        assert (
            hasattr(obj, attr)
            or attr in getattr(obj, "__slots__", ())
            or re.search(rf"\b{attr}\b", _source(obj))
        ), (owner, attr)


def test_a_missing_attribute_fails():
    assert not hasattr(DeviceMesh, "_not_a_torch_name")
    assert not re.search(r"\b_get_root\b", _source(DeviceMesh))  # whole names only


def test_signatures_we_call():
    sig = inspect.signature(compat.upstream_redistribute_local_tensor)
    assert {"async_op", "is_explicit"} <= set(sig.parameters)
    assert {"_init_backend", "_rank"} <= set(inspect.signature(DeviceMesh.__init__).parameters)
    assert list(inspect.signature(compat.OpDispatcher.wrap).parameters) == ["res", "spec"]
    assert torch.torch_version.TorchVersion(torch.__version__) >= (2, 13)


def test_inductor_pieces_import():
    import torch._inductor.compile_fx as compile_fx

    assert compat.inductor_inner() is compile_fx.compile_fx_inner
    taken = set(inspect.signature(compile_fx.compile_fx).parameters)
    assert {"inner_compile", "config_patches"} <= taken  # inductor_compile_fx's arguments
    names = compat.inductor_config_names()
    assert {"max_autotune", "triton.cudagraphs"} <= set(names)
    patches = compat.inductor_config_patches("max-autotune", {"max_autotune": False})
    assert patches == {
        "max_autotune": False,
        "triton.cudagraphs": True,
        "coordinate_descent_tuning": True,
    }


def test_strided_shard_is_the_interleaved_layout():
    """InterleavedShard(dim, k) rides on _StridedShard(dim, split_factor=k): same rows, not a Shard."""
    strided = compat.StridedShard(0, split_factor=4)
    assert strided.dim == 0 and strided.split_factor == 4 and not strided.is_shard()
    shards, _ = strided._split_tensor(torch.arange(16), 2, with_padding=False)
    assert [s.tolist() for s in shards] == [
        [0, 1, 4, 5, 8, 9, 12, 13],
        [2, 3, 6, 7, 10, 11, 14, 15],
    ]
