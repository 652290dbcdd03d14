"""The ``vescale`` torch.compile backend.

For now it captures forward and backward graphs through AOTAutograd and runs them as
plain FX graphs (the compiler pipeline and its passes land on top of this entry point).
"""

from __future__ import annotations

from importlib.metadata import entry_points
from typing import Any

import torch
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.backends.registry import register_backend
from torch._functorch.aot_autograd import make_boxed_func

from vescale.dtensor._torch_compat import DYNAMO_COMPILER_FNS

__all__ = ["register", "vescale_backend"]

BACKEND_NAME = "vescale"


def _run_graph(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
    return make_boxed_func(gm.forward)


_aot = aot_autograd(fw_compiler=_run_graph, bw_compiler=_run_graph)


def vescale_backend(gm: torch.fx.GraphModule, example_inputs: list[Any], **kwargs: Any) -> Any:
    """``torch.compile(model, backend="vescale")``."""
    return _aot(gm, example_inputs, **kwargs)


def register() -> None:
    """Register ``vescale`` with Dynamo unless the installed entry point will do it lazily.

    Dynamo loads the ``torch_dynamo_backends`` entry point and then registers it itself;
    registering here as well would make that lookup fail with "duplicate name".
    """
    if any(ep.name == BACKEND_NAME for ep in entry_points(group="torch_dynamo_backends")):
        return
    if BACKEND_NAME not in DYNAMO_COMPILER_FNS:
        register_backend(vescale_backend, name=BACKEND_NAME)
