"""``annotate``: placements on every compute node, a reason on every collective, verify.

* Nodes that decompositions created inside one DTensor op (e.g. gelu's ``erf``/``mul``) carry
  no placements from tracing; they get the placements of the op output they feed
  (``placements``) and its name (``placements_from``; :mod:`vescale._node_meta`), when all
  their users agree.
* Verification: every collective's result is consumed by a ``wait_tensor`` (placed after the
  collective) before any other use, or returned unwaited (a later region waits for it); a
  graph input whose collective was issued before the graph is read only after its wait.
  ``ctx.reports["boundary"]``: those inputs and the collectives returned unwaited.
  Collective records (``collectives.json``) are attached by the pass manager after every pass
  that changes the graph.
"""

from __future__ import annotations

import operator
from typing import Any

import torch

from vescale._node_meta import get_placements, get_placements_from, set_placements
from vescale.fx.collectives import (
    COLLECTIVE_KINDS,
    WAIT_TENSOR,
    inflight_inputs,
    unwaited_outputs,
)
from vescale.passes.manager import PassContext

__all__ = ["annotate"]


def _agreeing(nodes: list[torch.fx.Node]) -> tuple[Any, str] | None:
    """The one (placements, owner) that all tagged ``nodes`` share, if they agree."""
    tags = {
        (placements, get_placements_from(n) or n.name)
        for n in nodes
        if (placements := get_placements(n)) is not None
    }
    if len(tags) != 1 or len({t[0] for t in tags}) != 1:
        return None
    return tags.pop()


def _inherit_placements(gm: torch.fx.GraphModule) -> int:
    """Give decomposition intermediates their op's placements: from the consumers they feed
    when all are tagged and agree, else (values only saved for backward) from their tagged
    inputs when those agree. Returns how many nodes got placements."""
    count = 0
    order = list(gm.graph.nodes)
    sweeps = (  # (nodes in visiting order, neighbours to inherit from, all must be tagged)
        (order[::-1], lambda n: [u for u in n.users if u.op != "output"], True),
        (order, lambda n: [a for a in n.all_input_nodes if a.op == "call_function"], False),
    )
    for nodes, neighbours, require_all in sweeps:
        for node in nodes:
            if node.op != "call_function" or get_placements(node) is not None:
                continue
            if node.target in COLLECTIVE_KINDS or node.target is WAIT_TENSOR:
                continue
            near = neighbours(node)
            tagged = [n for n in near if get_placements(n) is not None]
            if not near or (require_all and len(tagged) != len(near)):
                continue
            agreed = _agreeing(tagged)
            if agreed is None:
                continue
            set_placements(node, agreed[0], inherited_from=agreed[1])
            count += 1
    return count


def annotate(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    """Annotate placements and verify (see module docstring)."""
    ctx.reports["inherited_placements"] = _inherit_placements(gm)
    verify_waits(gm, ctx.graph_name)
    ctx.reports["boundary"] = {
        "inflight_inputs": [n.name for n in inflight_inputs(gm)],
        "unwaited_outputs": [n.name for n in unwaited_outputs(gm)],
    }
    return gm


def verify_waits(gm: torch.fx.GraphModule, graph_name: str) -> None:
    """Every collective's result reaches its users only through a ``wait_tensor`` that comes
    after the collective, or leaves the graph unwaited (returned: a later region waits). A
    tensor whose collective was issued before the graph is read only after its first wait.
    ``RuntimeError`` naming the node otherwise."""
    seen: set[torch.fx.Node] = set()
    first_wait = {v: ws[0] for v, ws in inflight_inputs(gm).items()}
    for node in gm.graph.nodes:
        seen.add(node)
        early = [a for a in node.all_input_nodes if a in first_wait and first_wait[a] not in seen]
        if early and node.target is not WAIT_TENSOR:
            raise RuntimeError(
                f"{graph_name}: %{node.name} reads %{early[0].name}, whose collective was "
                f"issued before this graph, before its wait_tensor %{first_wait[early[0]].name}"
            )
        if node.op != "call_function" or node.target not in COLLECTIVE_KINDS:
            if node.target is WAIT_TENSOR and node.args[0] not in seen:
                raise RuntimeError(f"{graph_name}: %{node.name} waits before its collective")
            continue
        allowed = (WAIT_TENSOR, operator.getitem)
        direct = [u for u in node.users if u.target not in allowed and u.op != "output"]
        if direct:
            raise RuntimeError(
                f"{graph_name}: {node.target} result %{node.name} is used by "
                f"{[u.name for u in direct]} without a wait_tensor"
            )
