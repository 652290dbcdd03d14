"""The facts vescale keeps on FX graph nodes: every key and its typed get/set, in one place.

Each fact lives in ``node.meta["custom"]`` under its ``vescale_*`` key (``custom`` survives
AOTAutograd's re-tracing and deep copies; values are plain Python so they copy too). Writers
and readers use the accessors below, never the keys:

* ``placements`` (``("S(0)", "R")``): written by ``dtensor._recording`` while the backend
  traces and by ``passes.annotate`` (with ``placements_from``, the op output a decomposition
  node inherited them from); read by ``passes.annotate`` and ``fx.dump``;
* ``redistribute`` (``"S(0) -> R"``, on a redistribution's collectives): ``dtensor._recording``;
  read by ``fx.dump``;
* ``bucket_cap_mb``: the cap ``ddp.distributed_data_parallel`` asks for its traced gradient
  reductions; read by ``passes.bucket``;
* ``bucket`` (id in its graph) and ``sources`` (a merged collective's user lines): written by
  ``passes.bucket``; read by ``fx.collectives`` and ``fx.dump``;
* ``collective`` (a :class:`CollectiveRecord`): written by ``fx.collectives``; read by
  ``fx.dump`` and ``passes.fingerprint``.

A getter returns ``None`` when the node has no such fact.
"""

from __future__ import annotations

from typing import Any, TypedDict

import torch

__all__ = [
    "BUCKET",
    "BUCKET_CAP_MB",
    "COLLECTIVE",
    "KEYS",
    "PLACEMENTS",
    "PLACEMENTS_FROM",
    "REDISTRIBUTE",
    "SOURCES",
    "CollectiveRecord",
    "get_bucket",
    "get_bucket_cap_mb",
    "get_collective",
    "get_placements",
    "get_placements_from",
    "get_redistribute",
    "get_sources",
    "set_bucket",
    "set_bucket_cap_mb",
    "set_collective",
    "set_placements",
    "set_redistribute",
    "set_sources",
]

PLACEMENTS = "vescale_placements"
PLACEMENTS_FROM = "vescale_placements_from"
REDISTRIBUTE = "vescale_redistribute"
BUCKET_CAP_MB = "vescale_bucket_cap_mb"
BUCKET = "vescale_bucket"
SOURCES = "vescale_sources"
COLLECTIVE = "vescale_collective"
KEYS = (PLACEMENTS, PLACEMENTS_FROM, REDISTRIBUTE, BUCKET_CAP_MB, BUCKET, SOURCES, COLLECTIVE)


class CollectiveRecord(TypedDict):
    """One collective of a compiled graph (the ``collectives.json`` format, see
    :mod:`vescale.fx.collectives`)."""

    kind: str
    group_ranks: list[int]
    mesh_dim: int | None
    dtype: str
    bytes: int
    bucket: int | None
    source: str
    graph: str
    waited: str


def _get(node: torch.fx.Node, key: str) -> Any:
    return (node.meta.get("custom") or {}).get(key)


def _set(node: torch.fx.Node, key: str, value: Any) -> None:
    node.meta.setdefault("custom", {})[key] = value


def get_placements(node: torch.fx.Node) -> tuple[str, ...] | None:
    """The placements of ``node``'s result, one string per mesh dim (``("S(0)", "R")``)."""
    return _get(node, PLACEMENTS)


def get_placements_from(node: torch.fx.Node) -> str | None:
    """The name of the node whose placements ``node`` inherited (``None``: its own)."""
    return _get(node, PLACEMENTS_FROM)


def set_placements(
    node: torch.fx.Node, placements: tuple[str, ...], inherited_from: str | None = None
) -> None:
    """Tag ``node`` with its result's placements, and the node they came from if inherited."""
    _set(node, PLACEMENTS, placements)
    if inherited_from is not None:
        _set(node, PLACEMENTS_FROM, inherited_from)


def get_redistribute(node: torch.fx.Node) -> str | None:
    """The redistribution a collective implements (``"S(0) -> R"``)."""
    return _get(node, REDISTRIBUTE)


def set_redistribute(node: torch.fx.Node, reason: str) -> None:
    _set(node, REDISTRIBUTE, reason)


def get_bucket_cap_mb(node: torch.fx.Node) -> float | None:
    """The bucket cap (MiB) the DDP that traced collective ``node`` asks for."""
    return _get(node, BUCKET_CAP_MB)


def set_bucket_cap_mb(node: torch.fx.Node, cap_mb: float) -> None:
    _set(node, BUCKET_CAP_MB, float(cap_mb))


def get_bucket(node: torch.fx.Node) -> int | None:
    """The id (in its graph) of the bucket ``node`` packs, issues, waits for or unpacks."""
    return _get(node, BUCKET)


def set_bucket(node: torch.fx.Node, bucket_id: int) -> None:
    _set(node, BUCKET, bucket_id)


def get_sources(node: torch.fx.Node) -> list[str] | None:
    """The user lines (``file.py:line``) of the collectives a merged collective replaces."""
    return _get(node, SOURCES)


def set_sources(node: torch.fx.Node, sources: list[str]) -> None:
    _set(node, SOURCES, list(sources))


def get_collective(node: torch.fx.Node) -> CollectiveRecord | None:
    """The record of collective ``node`` (attached by :mod:`vescale.fx.collectives`)."""
    return _get(node, COLLECTIVE)


def set_collective(node: torch.fx.Node, record: CollectiveRecord) -> None:
    _set(node, COLLECTIVE, CollectiveRecord(**record))
