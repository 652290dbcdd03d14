"""Readable graph text: one line per node, with placements and collectives marked."""

from __future__ import annotations

import torch

from vescale._node_meta import (
    get_bucket,
    get_collective,
    get_placements,
    get_placements_from,
    get_redistribute,
)
from vescale.fx.collectives import COLLECTIVE_KINDS, inflight_inputs, user_source

__all__ = ["graph_text"]


def _fmt(arg: object) -> str:
    if isinstance(arg, torch.fx.Node):
        return f"%{arg.name}"
    if isinstance(arg, list | tuple):
        inner = ", ".join(_fmt(a) for a in arg)
        return f"[{inner}]" if isinstance(arg, list) else f"({inner})"
    return repr(arg)


def graph_text(gm: torch.fx.GraphModule, title: str) -> str:
    """``gm`` as text: ``%name = target(args)``, then shape/dtype, placements, the bucket a
    node packs or unpacks and, for a collective, ``<< kind  N B  mesh dim d  @ file.py:line``
    (``, waited after this graph`` when the graph returns it unwaited). Graph boundaries: an
    input whose collective was issued before the graph is marked ``in flight``, its wait
    ``wait on input %x: collective issued before this graph``."""
    lines = [f"# {title}"]
    inflight = inflight_inputs(gm)
    before = {w: v for v, ws in inflight.items() for w in ws}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            text = f"%{node.name} = input"
        elif node.op == "output":
            text = f"return {_fmt(node.args[0])}"
        elif node.op == "get_attr":
            text = f"%{node.name} = self.{node.target}"
        else:
            args = ", ".join(
                [_fmt(a) for a in node.args] + [f"{k}={_fmt(v)}" for k, v in node.kwargs.items()]
            )
            text = f"%{node.name} = {node.target}({args})"
        val = node.meta.get("val")
        notes = []
        if isinstance(val, torch.Tensor):
            notes.append(f"{str(val.dtype).removeprefix('torch.')}{list(val.shape)}")
        if (placements := get_placements(node)) is not None:
            via = f" of %{owner}" if (owner := get_placements_from(node)) is not None else ""
            notes.append("(" + ", ".join(placements) + ")" + via)
        if (reason := get_redistribute(node)) is not None:
            notes.append(f"redistribute {reason}")
        if node in inflight:
            notes.append(
                f"in flight: collective issued before this graph, waited by "
                f"%{inflight[node][0].name}"
            )
        if node in before:
            notes.append(f"wait on input %{before[node].name}: collective issued before this graph")
        if (bucket_id := get_bucket(node)) is not None:
            notes.append(f"bucket {bucket_id}")
        coll = get_collective(node)
        if node.target in COLLECTIVE_KINDS and coll:
            mesh_dim = "" if coll["mesh_dim"] is None else f"  mesh dim {coll['mesh_dim']}"
            after = ", waited after this graph" if coll.get("waited") == "after graph" else ""
            notes.append(
                f"<< {coll['kind']}{after}  {coll['bytes']} B{mesh_dim}  @ {coll['source'] or '?'}"
            )
        elif node.op == "call_function" and (src := user_source(node)):
            notes.append(f"@ {src}")
        lines.append(text + ("  # " + "  ".join(notes) if notes else ""))
    return "\n".join(lines) + "\n"
