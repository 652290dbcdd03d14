"""``annotate``: record on every collective node why it exists, and verify the graph.

Each collective gets ``node.meta["custom"]["vescale_collective"]`` (its ``collectives.json``
record) and the pass reports the table as ``ctx.reports["collectives"]``. Verification:
every collective's result is consumed by a ``wait_tensor`` before any other use.
"""

from __future__ import annotations

import operator

import torch

from vescale.fx.collectives import COLLECTIVE_KINDS, collective_table
from vescale.passes.manager import PassContext

__all__ = ["annotate"]

_WAIT = torch.ops._c10d_functional.wait_tensor.default


def annotate(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    """Annotate and verify collectives (see module docstring)."""
    table = collective_table(gm, ctx.graph_name)
    nodes = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in COLLECTIVE_KINDS]
    for node, record in zip(nodes, table):
        node.meta.setdefault("custom", {})["vescale_collective"] = dict(record)
        direct = [u for u in node.users if u.target not in (_WAIT, operator.getitem)]
        if direct:
            raise RuntimeError(
                f"{ctx.graph_name}: {node.target} result %{node.name} is used by "
                f"{[u.name for u in direct]} without a wait_tensor"
            )
    ctx.reports["collectives"] = table
    return gm
