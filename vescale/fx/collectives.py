"""The collectives of a captured graph, one record each (the ``collectives.json`` format).

A record: ``kind``, ``group_ranks``, ``mesh_dim`` (the mesh dim whose process group it
uses, when a known mesh owns that group), ``dtype``, ``bytes`` (of this rank's input),
``bucket`` (id or None), ``source`` (``file.py:line`` of the user code that caused it),
``graph``.
"""

from __future__ import annotations

import os
import re
from typing import Any, TypedDict

import torch
import torch.distributed as dist

from vescale.dtensor._torch_compat import resolve_process_group
from vescale.dtensor.device_mesh import known_meshes

__all__ = [
    "COLLECTIVE_KINDS",
    "WAIT_TENSOR",
    "CollectiveRecord",
    "attach_records",
    "collective_table",
    "group_name",
    "node_bytes",
    "user_line_of_stack",
    "user_source",
]

_c10d = torch.ops._c10d_functional
WAIT_TENSOR = _c10d.wait_tensor.default
COLLECTIVE_KINDS: dict[Any, str] = {
    _c10d.all_reduce.default: "all_reduce",
    _c10d.all_gather_into_tensor.default: "all_gather",
    _c10d.reduce_scatter_tensor.default: "reduce_scatter",
    _c10d.all_to_all_single.default: "all_to_all",
    _c10d.broadcast.default: "broadcast",
    _c10d.all_reduce_coalesced.default: "all_reduce",
    _c10d.all_gather_into_tensor_coalesced.default: "all_gather",
    _c10d.reduce_scatter_tensor_coalesced.default: "reduce_scatter",
}

_FRAME = re.compile(r'File "([^"]+)", line (\d+)')
_INTERNAL = (
    os.path.dirname(torch.__file__) + os.sep,
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,  # the vescale package
)


class CollectiveRecord(TypedDict):
    kind: str
    group_ranks: list[int]
    mesh_dim: int | None
    dtype: str
    bytes: int
    bucket: int | None
    source: str
    graph: str


def user_source(node: torch.fx.Node) -> str:
    """``file.py:line`` of the innermost user frame in ``node``'s stack trace ("" if none)."""
    return user_line_of_stack(node.meta.get("stack_trace") or "")


def user_line_of_stack(stack_trace: str) -> str:
    """``file.py:line`` of the innermost frame outside torch and vescale, else (a vescale
    module such as the DDP wrapper at the top of the traced region) outside torch; "" if none."""
    frames = _FRAME.findall(stack_trace)
    user = [f for f in frames if not f[0].startswith(_INTERNAL)]
    user = user or [f for f in frames if not f[0].startswith(_INTERNAL[0])]
    if not user:
        return ""
    path, line = user[-1]
    return f"{path.rsplit('/', 1)[-1]}:{line}"


def group_name(node: torch.fx.Node) -> str:
    """The process group name a collective node runs on."""
    for a in list(node.args) + list(node.kwargs.values()):
        if isinstance(a, str) and a not in ("sum", "avg", "max", "min", "product"):
            return a
    raise ValueError(f"{node.target}: no process group name in {node.args}")


def _mesh_dim(group_name: str) -> int | None:
    for mesh in known_meshes():
        names = getattr(mesh, "_dim_group_names", None) or []
        if group_name in names:
            return int(names.index(group_name))
    return None


def node_bytes(node: object) -> int:
    """Bytes of the tensor an FX node produces (its ``meta["val"]``); 0 if it has none."""
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return int(val.numel()) * val.element_size() if isinstance(val, torch.Tensor) else 0


def _nbytes(node: torch.fx.Node) -> tuple[str, int]:
    inp = node.args[0]
    vals = inp if isinstance(inp, list | tuple) else [inp]
    tensors = [v.meta.get("val") for v in vals if isinstance(v, torch.fx.Node)]
    dtypes = [str(t.dtype).removeprefix("torch.") for t in tensors if isinstance(t, torch.Tensor)]
    return (dtypes[-1] if dtypes else ""), sum(node_bytes(v) for v in vals)


def collective_table(gm: torch.fx.GraphModule, graph: str) -> list[CollectiveRecord]:
    """One record per collective node of ``gm``, in graph order."""
    out: list[CollectiveRecord] = []
    for node in gm.graph.nodes:
        kind = COLLECTIVE_KINDS.get(node.target) if node.op == "call_function" else None
        if kind is None:
            continue
        name = group_name(node)
        dtype, nbytes = _nbytes(node)
        custom = node.meta.get("custom") or {}
        out.append(
            CollectiveRecord(
                kind=kind,
                group_ranks=dist.get_process_group_ranks(resolve_process_group(name)),  # type: ignore[arg-type]
                mesh_dim=_mesh_dim(name),
                dtype=dtype,
                bytes=nbytes,
                bucket=custom.get("vescale_bucket"),
                source=", ".join(custom.get("vescale_sources") or [user_source(node)]),
                graph=graph,
            )
        )
    return out


def attach_records(gm: torch.fx.GraphModule, graph: str) -> list[CollectiveRecord]:
    """``collective_table(gm, graph)``, each record also stored on its node
    (``custom["vescale_collective"]``, read by the graph dumps)."""
    table = collective_table(gm, graph)
    nodes = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in COLLECTIVE_KINDS]
    for node, record in zip(nodes, table):
        node.meta.setdefault("custom", {})["vescale_collective"] = dict(record)
    return table
