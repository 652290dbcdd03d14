"""The collectives of a captured graph, one record each (the ``collectives.json`` format).

A record: ``kind``, ``group_ranks``, ``mesh_dim`` (the mesh dim whose process group it
uses, when a known mesh owns that group), ``dtype``, ``bytes`` (of this rank's input),
``bucket`` (id or None), ``source`` (``file.py:line`` of the user code that caused it),
``graph``, ``waited`` (``"in graph"``, or ``"after graph"`` for a collective whose result
leaves the graph unwaited: its wait lies in a later region).

Graph boundaries: a compiled region may receive the result of a collective issued before it
(an ``AsyncCollectiveTensor`` input: the graph starts with a ``wait_tensor`` on a graph input,
:func:`inflight_inputs`) and may return a collective's result unwaited (:func:`unwaited_outputs`).
"""

from __future__ import annotations

import math
import operator
from typing import Any

import torch
import torch.distributed as dist
from torch.fx.experimental.symbolic_shapes import optimization_hint

from vescale._node_meta import (
    CollectiveRecord,
    get_bucket,
    get_collective,
    get_sources,
    set_collective,
)
from vescale._stack import user_line_of_stack
from vescale._torch_compat import resolve_process_group
from vescale.dtensor.device_mesh import known_meshes

__all__ = [
    "COLLECTIVE_KINDS",
    "WAIT_TENSOR",
    "CollectiveRecord",
    "Records",
    "attach_records",
    "collective_table",
    "group_name",
    "inflight_inputs",
    "mesh_dim_of_group",
    "node_bytes",
    "numel_hint",
    "unwaited_outputs",
    "user_source",
    "waited_node",
]

_c10d = torch.ops._c10d_functional
WAIT_TENSOR = _c10d.wait_tensor.default
COLLECTIVE_KINDS: dict[Any, str] = {
    _c10d.all_reduce.default: "all_reduce",
    _c10d.all_gather_into_tensor.default: "all_gather",
    _c10d.all_gather_into_tensor_out.default: "all_gather",  # what a merged bucket issues
    _c10d.reduce_scatter_tensor.default: "reduce_scatter",
    _c10d.all_to_all_single.default: "all_to_all",
    _c10d.broadcast.default: "broadcast",
    _c10d.all_reduce_coalesced.default: "all_reduce",
    _c10d.all_gather_into_tensor_coalesced.default: "all_gather",
    _c10d.reduce_scatter_tensor_coalesced.default: "reduce_scatter",
}


def user_source(node: torch.fx.Node) -> str:
    """``file.py:line`` of the innermost user frame in ``node``'s stack trace ("" if none)."""
    return user_line_of_stack(node.meta.get("stack_trace") or "")


def waited_node(wait: torch.fx.Node) -> torch.fx.Node:
    """The node whose result ``wait`` (a ``wait_tensor``) waits for."""
    arg = wait.args[0]
    if not isinstance(arg, torch.fx.Node):
        raise TypeError(f"wait_tensor %{wait.name} waits on {arg!r}, not a graph node")
    return arg


def _is_collective(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target in COLLECTIVE_KINDS


def _issued_in_graph(node: torch.fx.Node) -> bool:
    """``node`` is a collective, or an item of a coalesced collective's result list."""
    return _is_collective(node) or (
        node.target is operator.getitem
        and isinstance(node.args[0], torch.fx.Node)
        and _is_collective(node.args[0])
    )


def inflight_inputs(gm: torch.fx.GraphModule) -> dict[torch.fx.Node, list[torch.fx.Node]]:
    """Tensors whose collective was issued before this graph (typically graph inputs that
    arrived as an ``AsyncCollectiveTensor``) -> the ``wait_tensor`` nodes on them, in graph
    order. Until waited, such a tensor's buffer is still being written: every other use of
    it must come after its first wait."""
    out: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is WAIT_TENSOR:
            arg = waited_node(node)
            if not _issued_in_graph(arg):
                out.setdefault(arg, []).append(node)
    return out


def unwaited_outputs(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """Collectives whose result the graph returns without waiting for it (their wait lies in
    a later region), in graph order."""
    output = next(iter(reversed(gm.graph.nodes)))
    returned = set(output.all_input_nodes) if output.op == "output" else set()
    out = []
    for node in gm.graph.nodes:
        if not _is_collective(node):
            continue
        results = [node] + [u for u in node.users if u.target is operator.getitem]
        waited = any(u.target is WAIT_TENSOR for r in results for u in r.users)
        if not waited and any(r in returned for r in results):
            out.append(node)
    return out


def group_name(node: torch.fx.Node) -> str:
    """The process group name a collective node runs on."""
    for a in list(node.args) + list(node.kwargs.values()):
        if isinstance(a, str) and a not in ("sum", "avg", "max", "min", "product"):
            return a
    raise ValueError(f"{node.target}: no process group name in {node.args}")


def mesh_dim_of_group(group_name: str) -> int | None:
    """The mesh dim whose process group is ``group_name`` (of a mesh vescale knows), or None."""
    for mesh in known_meshes():
        names = getattr(mesh, "_dim_group_names", None) or []
        if group_name in names:
            return int(names.index(group_name))
    return None


def node_bytes(node: object) -> int:
    """Bytes of the tensor an FX node produces (its ``meta["val"]``); 0 if it has none."""
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return numel_hint(val) * val.element_size() if isinstance(val, torch.Tensor) else 0


def numel_hint(t: torch.Tensor) -> int:
    """``t.numel()`` of a graph value, symbolic sizes at their example value, adding no
    guard (an estimate that read a dynamic size as an int would specialize it)."""
    return math.prod(optimization_hint(s) for s in t.shape)


def _nbytes(node: torch.fx.Node) -> tuple[str, int]:
    inp = node.args[0]
    vals = inp if isinstance(inp, list | tuple) else [inp]
    tensors = [v.meta.get("val") for v in vals if isinstance(v, torch.fx.Node)]
    dtypes = [str(t.dtype).removeprefix("torch.") for t in tensors if isinstance(t, torch.Tensor)]
    return (dtypes[-1] if dtypes else ""), sum(node_bytes(v) for v in vals)


def collective_table(gm: torch.fx.GraphModule, graph: str) -> list[CollectiveRecord]:
    """One record per collective node of ``gm``, in graph order."""
    out: list[CollectiveRecord] = []
    after = set(unwaited_outputs(gm))
    for node in gm.graph.nodes:
        kind = COLLECTIVE_KINDS.get(node.target) if node.op == "call_function" else None
        if kind is None:
            continue
        name = group_name(node)
        dtype, nbytes = _nbytes(node)
        out.append(
            CollectiveRecord(
                kind=kind,
                group_ranks=dist.get_process_group_ranks(resolve_process_group(name)),  # type: ignore[arg-type]
                mesh_dim=mesh_dim_of_group(name),
                dtype=dtype,
                bytes=nbytes,
                bucket=get_bucket(node),
                source=", ".join(get_sources(node) or [user_source(node)]),
                graph=graph,
                waited="after graph" if node in after else "in graph",
            )
        )
    return out


def attach_records(gm: torch.fx.GraphModule, graph: str) -> list[CollectiveRecord]:
    """``collective_table(gm, graph)``, each record also stored on its node
    (:func:`vescale._node_meta.set_collective`, read by the graph dumps and ``fingerprint``)."""
    table = collective_table(gm, graph)
    nodes = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in COLLECTIVE_KINDS]
    for node, record in zip(nodes, table):
        set_collective(node, record)
    return table


def _record_inputs(gm: torch.fx.GraphModule) -> str:
    """Everything :func:`attach_records` reads from ``gm``, as text: every node (name, op,
    target, arguments: the waits and outputs that decide ``waited``, the group names), and
    each collective's dtype and bytes, bucket, sources, stack trace and attached record."""
    parts: list[object] = []
    for node in gm.graph.nodes:
        args = torch.fx.node.map_arg((node.args, node.kwargs), lambda a: a.name)
        parts.append((node.name, node.op, str(node.target), args))
        if _is_collective(node):
            facts = (get_bucket(node), get_sources(node), get_collective(node))
            parts.append((_nbytes(node), node.meta.get("stack_trace"), facts))
    return repr(parts)


class Records:
    """The collective records of one graph as passes rewrite it: :meth:`refresh` recomputes
    and re-attaches them only when what they are computed from changed since the last
    refresh (:func:`_record_inputs`). The change is read from the graph, not reported by the
    pass, so none goes unnoticed: a node added, removed, moved or rewired, a collective's
    input bytes, bucket or sources changed, or its attached record lost or edited. A copy of
    the graph with its node facts (e.g. a new ``GraphModule``) is no change."""

    def __init__(self, graph: str) -> None:
        self.graph = graph
        self.table: list[CollectiveRecord] = []
        self._inputs: str | None = None

    def refresh(self, gm: torch.fx.GraphModule) -> list[CollectiveRecord]:
        """The records of ``gm`` (attached to its nodes), recomputed if ``gm`` changed."""
        if _record_inputs(gm) != self._inputs:
            self.table = attach_records(gm, self.graph)
            self._inputs = _record_inputs(gm)
        return self.table
