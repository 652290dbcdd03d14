"""``bucket``: merge collectives of the same kind, process group, reduce op and dtype into one.

Selection is ours, deterministic from graph order alone (so every rank, holding the same
graph, makes the same buckets and issues them in the same order):

* candidates are all-reduce, all-gather and reduce-scatter nodes whose only user is their
  ``wait_tensor``: never a collective the graph returns unwaited (its wait lies in a later
  region), and a collective issued before the graph (an input waited in it) is not in the
  graph to merge;
* walking the graph in order, a candidate joins the open bucket of its key under the one
  bucket rule of eager DDP and this pass (:mod:`vescale.ddp.bucketing`: while the bucket's
  bytes, the largest of input/output bytes of each member, stay within the cap), it does not
  depend on a member, and it comes before every node computing with a member's result
  (seen through views, which move after the bucket with the result: a parameter gathered
  and sliced back to its rows before the next one's gather still shares its bucket);
  the merged collective is issued where the last member was (after every wait its members'
  inputs follow, in-flight inputs' included). A collective consuming a member's result
  (e.g. the tensor-parallel all-reduce after the data-parallel one of a ``(Partial,
  Partial)`` gradient) moves after the bucket (stable topological sort), where it can bucket
  with its own kind;
* a bucket closes when a candidate does not fit; one-member buckets stay as they are;
* the cap: ``bucket_cap_mb`` of the ``DistributedDataParallel`` that traced a gradient
  reduction when it gave one (its ``bucket_cap_mb`` node fact, part of the key: a
  reduction never shares a bucket with collectives under another cap), else the backend's
  ``bucket_cap_mb`` option; 0 leaves those collectives unbucketed.

The rewrite (flatten, concatenate, one collective, split, restore shapes) is upstream
Inductor's ``merge_{all_reduce,all_gather,reduce_scatter}_bucket``. Every node of a merge
(packing, collective, wait, unpacking) gets the ``bucket`` node fact (the bucket's id in this
graph, shown in dumps), the collective also ``sources`` (the user lines of its members;
:mod:`vescale._node_meta`); ``ctx.reports["buckets"]`` lists member counts.
"""

from __future__ import annotations

import itertools
import math
import operator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._ops import OpOverload

from vescale._node_meta import get_bucket_cap_mb, set_bucket, set_sources
from vescale._torch_compat import bucket_merge_fns, stable_topological_sort
from vescale.ddp.bucketing import cap_bytes, joins
from vescale.fx.collectives import (
    COLLECTIVE_KINDS,
    WAIT_TENSOR,
    group_name,
    node_bytes,
    user_source,
)
from vescale.passes.manager import PassContext

__all__ = ["bucket"]

_c10d = torch.ops._c10d_functional
_FREE = {torch.ops.aten._unsafe_view.default, operator.getitem}  # views by another name
_BUCKETABLE: dict[Any, str] = {
    _c10d.all_reduce.default: "all_reduce",
    _c10d.all_gather_into_tensor.default: "all_gather",
    _c10d.reduce_scatter_tensor.default: "reduce_scatter",
}


@dataclass
class _Bucket:
    members: list[torch.fx.Node] = field(default_factory=list)
    nbytes: int = 0
    first_use: float = math.inf
    descendants: set[torch.fx.Node] = field(default_factory=set)


def _cap(node: torch.fx.Node, default_mb: float) -> int:
    """The bucket cap (bytes) of collective ``node``: its DDP's, else ``default_mb`` MiB."""
    cap_mb = get_bucket_cap_mb(node)
    return cap_bytes(default_mb if cap_mb is None else cap_mb)


def _key(node: torch.fx.Node, cap: int) -> tuple[Any, ...]:
    val = node.meta["val"]
    reduce_op = node.args[1] if _BUCKETABLE[node.target] != "all_gather" else None
    return (_BUCKETABLE[node.target], group_name(node), reduce_op, val.dtype, cap)


def _size(node: torch.fx.Node) -> int:
    return max(node_bytes(node), node_bytes(node.all_input_nodes[0]))


def _descendants(node: torch.fx.Node, into: set[torch.fx.Node]) -> None:
    stack = [node]
    while stack:
        for user in stack.pop().users:
            if user not in into:
                into.add(user)
                stack.append(user)


def _is_view(node: torch.fx.Node) -> bool:
    target = node.target
    return target in _FREE or (isinstance(target, OpOverload) and target.is_view)


def _first_compute_use(wait: torch.fx.Node, pos: dict[torch.fx.Node, int]) -> float:
    """Graph position of the first node computing with ``wait``'s result, seen through views
    (they move after the bucket with the result, as a collective consuming it does)."""
    first, stack = math.inf, list(wait.users)
    while stack:
        user = stack.pop()
        if user.target in _BUCKETABLE:
            continue
        if _is_view(user):
            stack.extend(user.users)
        else:
            first = min(first, pos[user])
    return first


def select_buckets(gm: torch.fx.GraphModule, cap_mb: float) -> list[list[torch.fx.Node]]:
    """Buckets of two or more collectives (see module docstring; ``cap_mb``: the cap of
    collectives no DDP tagged), in graph order."""
    pos = {n: i for i, n in enumerate(gm.graph.nodes)}
    open_buckets: dict[tuple[Any, ...], _Bucket] = {}
    done: list[list[torch.fx.Node]] = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in _BUCKETABLE:
            continue
        users = list(node.users)
        if len(users) != 1 or users[0].target is not WAIT_TENSOR or "val" not in node.meta:
            continue
        cap = _cap(node, cap_mb)
        if cap == 0:
            continue
        key, size = _key(node, cap), _size(node)
        first_use = _first_compute_use(users[0], pos)
        b = open_buckets.get(key)
        if (
            b is None
            or pos[node] > b.first_use
            or node in b.descendants
            or not joins(b.nbytes, size, cap)
        ):
            if b is not None and len(b.members) > 1:
                done.append(b.members)
            b = open_buckets[key] = _Bucket()
        b.members.append(node)
        b.nbytes += size
        b.first_use = min(b.first_use, first_use)
        _descendants(node, b.descendants)
    done += [b.members for b in open_buckets.values() if len(b.members) > 1]
    return sorted(done, key=lambda members: pos[members[-1]])


def bucket(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    """Merge collectives into buckets of at most their cap (see module docstring)."""
    buckets = select_buckets(gm, ctx.options.bucket_cap_mb)
    merge = bucket_merge_fns()
    ids = itertools.count()
    for members in buckets:
        sources = sorted({s for m in members if (s := user_source(m))})
        new_nodes, _ = merge[_BUCKETABLE[members[0].target]](gm.graph, members)
        bucket_id = next(ids)
        for n in new_nodes:  # the packing, the collective, its wait and the unpacking
            set_bucket(n, bucket_id)
        merged = next(n for n in new_nodes if n.target in COLLECTIVE_KINDS)
        set_sources(merged, sources)
        stable_topological_sort(gm.graph)  # collectives fed by a bucket move after it
    gm.graph.lint()
    ctx.reports["buckets"] = [len(m) for m in buckets]
    return gm
