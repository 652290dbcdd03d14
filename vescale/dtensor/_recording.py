"""Placement recording onto traced FX nodes, on only while the vescale backend traces.

Every DTensor op output passes ``OpDispatcher.wrap`` (see ``dtensor.py``) and every
redistribution ``_Redistribute.forward``; while recording, the FX node that produced the
local result gets its placements (a tuple of strings such as ``("S(0)", "R")``: plain values
survive AOTAutograd's deep copies) and a redistribution's collective node its reason
(``"S(0) -> R"``), through :mod:`vescale._node_meta`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from vescale._node_meta import get_placements, set_placements, set_redistribute
from vescale._torch_compat import (
    FunctionalTensor,
    from_functional_tensor,
    get_proxy_mode,
    get_proxy_slot,
)

__all__ = ["ACTIVE", "record_placements", "record_redistribute", "recording"]

ACTIVE = [False]  # a list so the hot path reads one global without a function call


@contextlib.contextmanager
def recording() -> Iterator[None]:
    """Record placements on the nodes traced in this scope."""
    prev = ACTIVE[0]
    ACTIVE[0] = True
    try:
        yield
    finally:
        ACTIVE[0] = prev


def _node(t: object) -> torch.fx.Node | None:
    mode = get_proxy_mode()
    if mode is None or not isinstance(t, torch.Tensor):
        return None
    if isinstance(t, FunctionalTensor):
        t = from_functional_tensor(t.elem)
    slot = get_proxy_slot(t, mode.tracer, None, lambda p: p)
    return slot.proxy.node if slot is not None else None


def _short(placements: Sequence[Any]) -> tuple[str, ...]:
    return tuple(str(p) for p in placements)


def record_placements(res: object, spec: Any) -> None:
    """Tag the node(s) producing ``res`` with ``spec``'s placements."""
    if isinstance(res, list | tuple):
        for r, s in zip(res, spec if isinstance(spec, list | tuple) else [spec] * len(res)):
            record_placements(r, s)
        return
    node = _node(res)
    if node is not None and spec is not None and hasattr(spec, "placements"):
        set_placements(node, _short(spec.placements))


def record_redistribute(local: torch.Tensor, src: Sequence[Any], dst: Sequence[Any]) -> None:
    """Tag a redistribution's result node and the collectives feeding it."""
    node = _node(local)
    if node is None:
        return
    set_placements(node, _short(dst))
    reason = f"{' '.join(_short(src))} -> {' '.join(_short(dst))}"
    frontier, seen = [node], set()
    while frontier:  # walk back through waits/views to the collectives of this step
        n = frontier.pop()
        if n in seen or n.op != "call_function":
            continue
        seen.add(n)
        if "_c10d_functional" in str(n.target):
            set_redistribute(n, reason)
        if get_placements(n) is not None and n is not node:
            continue  # reached the op that produced the input
        frontier.extend(a for a in n.all_input_nodes)
