"""Placement strategies for every node of a global (single-device) aten graph.

For each ``call_function`` node the op's strategies come from the op registry eager dispatch
reads (:func:`vescale.dtensor.ops._registry.strategies`: vescale's strategies and rules,
upstream's tables): tensor arguments are given as ``OpStrategy`` of every placement their
producer may take, so the answer lists every strategy of the op. Ops the registry does not
cover (factories, ops without a rule) get the always-valid replicated strategy; nodes that do
not depend on any graph input are constants, computed replicated on every rank.
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.placement_types import Placement, Replicate, Shard

from vescale._torch_compat import (
    DTensorSpec,
    MaskPartial,
    OpSpec,
    OpStrategy,
    TensorMeta,
    TupleStrategy,
    pytree,
)
from vescale.dtensor.op_args import bind
from vescale.dtensor.ops import _registry as registry
from vescale.plan.cost import CommStep

__all__ = ["NodeStrategies", "Value", "propagate", "tensor_meta"]

Placements = tuple[Placement, ...]
Value = tuple[torch.fx.Node, int | None]  # a node's output, or item k of its tuple output


@dataclass
class NodeStrategies:
    """The strategies of one node: per strategy the output placements (one tuple per output,
    ``None`` for non-tensor outputs) and the placements each tensor input must have."""

    node: torch.fx.Node
    inputs: list[Value]
    outputs: list[tuple[Placements | None, ...]]
    input_placements: list[tuple[Placements, ...]]
    source: str  # "registry", "replicated fallback: <why>", "plan", "constant", "free", "input"
    candidates: dict[int, list[Placements]] = field(default_factory=dict)
    internal: list[tuple[Any, ...]] = field(default_factory=list)  # CommSteps inside the op

    def out_candidates(self, k: int | None) -> list[Placements]:
        """Distinct placements of output ``k`` over the strategies, in strategy order."""
        key = -1 if k is None else k
        if key not in self.candidates:
            seen: dict[Placements, None] = {}
            for out in self.outputs:
                p = out[0 if k is None else k]
                if p is not None:
                    seen.setdefault(p, None)
            self.candidates[key] = list(seen)
        return self.candidates[key]


def tensor_meta(val: Any) -> TensorMeta | None:
    if isinstance(val, torch.Tensor):
        return TensorMeta(val.shape, val.stride(), val.dtype)
    return None


def value_of(arg: torch.fx.Node) -> Value:
    if arg.op == "call_function" and arg.target is operator.getitem:
        return (arg.args[0], arg.args[1])  # type: ignore[return-value]
    return (arg, None)


def _nonempty(placements: Placements, shape: torch.Size, mesh: DeviceMesh) -> bool:
    """No shard is empty (each sharded tensor dim has at least one row per rank)."""
    split = [1] * len(shape)
    for p, n in zip(placements, mesh.shape):
        if isinstance(p, Shard):
            split[p.dim] *= n
    return all(s >= k for s, k in zip(shape, split))


def free_candidates(shape: torch.Size, mesh: DeviceMesh) -> list[Placements]:
    """Every placement of a parameter the plan leaves open: Replicate or Shard per mesh dim,
    no empty shards."""
    per_dim = [Replicate(), *(Shard(d) for d in range(len(shape)))]
    combos = itertools.product(per_dim, repeat=mesh.ndim)
    return [c for c in combos if _nonempty(c, shape, mesh)]


def _replicated(
    node: torch.fx.Node, inputs: list[Value], mesh: DeviceMesh, why: str
) -> NodeStrategies:
    rep: Placements = (Replicate(),) * mesh.ndim
    vals = node.meta.get("val")
    outs = tuple(
        rep if isinstance(v, torch.Tensor) else None
        for v in (vals if isinstance(vals, tuple | list) else (vals,))
    )
    return NodeStrategies(node, inputs, [outs], [tuple(rep for _ in inputs)], why)


def _schema_args(
    node: torch.fx.Node,
    table: dict[torch.fx.Node, NodeStrategies],
    mesh: DeviceMesh,
    only: Placements | None = None,
) -> tuple[tuple[Any, ...], dict[str, Any], list[Value]]:
    """``node``'s args with each tensor input an ``OpStrategy`` over its producer's placements
    (``only``: that one placement, for a node with one tensor input)."""
    inputs: list[Value] = []

    def strategy(arg: Any) -> Any:
        if isinstance(arg, list | tuple) and arg and all(isinstance(a, torch.fx.Node) for a in arg):
            return TupleStrategy(tuple(strategy(a) for a in arg))
        if not isinstance(arg, torch.fx.Node):
            return arg
        value = value_of(arg)
        meta = tensor_meta(arg.meta.get("val"))
        if meta is None:
            return arg.meta.get("val")
        inputs.append(value)
        cands = table[value[0]].out_candidates(value[1]) if only is None else [only]
        return OpStrategy([OpSpec(DTensorSpec(mesh, p, meta)) for p in cands])

    args = tuple(strategy(a) for a in node.args)
    kwargs = {k: strategy(v) for k, v in node.kwargs.items()}
    return args, kwargs, inputs


def _specs(spec: Any) -> tuple[Placements | None, ...]:
    specs = spec if isinstance(spec, tuple | list) else (spec,)
    return tuple(tuple(s.placements) if isinstance(s, DTensorSpec) else None for s in specs)


def _registry_strategies(
    node: torch.fx.Node,
    table: dict[torch.fx.Node, NodeStrategies],
    mesh: DeviceMesh,
    only: Placements | None = None,
) -> NodeStrategies | None:
    args, kwargs, inputs = _schema_args(node, table, mesh, only)
    val = node.meta.get("val")
    out_meta: Any = (
        tuple(tensor_meta(v) for v in val) if isinstance(val, tuple | list) else tensor_meta(val)
    )
    found = registry.strategies(node.target, args, kwargs, mesh, out_meta)  # type: ignore[arg-type]
    if not isinstance(found, OpStrategy):
        return None
    outs, ins = [], []
    out_vals = val if isinstance(val, tuple | list) else (val,)
    for s in found.strategies:
        out = _specs(s.output_specs)
        in_specs = s.input_specs if s.input_specs is not None else [s.output_spec] * len(inputs)
        inp = tuple(tuple(spec.placements) for spec in in_specs)
        if len(inp) != len(inputs) or any(isinstance(p, MaskPartial) for ps in inp for p in ps):
            # upstream's vocab-parallel embedding masks its indices in their redistribution to
            # _MaskPartial; vescale's embedding handler, which runs instead, takes none such
            continue
        shapes_ok = all(
            p is None or not isinstance(v, torch.Tensor) or _nonempty(p, v.shape, mesh)
            for p, v in zip(out, out_vals)
        )
        metas: list[Any] = [table[v[0]].node.meta["val"] for v in inputs]
        sizes = [m[v[1]] if v[1] is not None else m for m, v in zip(metas, inputs)]
        if shapes_ok and all(_nonempty(p, t.shape, mesh) for p, t in zip(inp, sizes)):
            outs.append(out)
            ins.append(inp)
    if not outs:
        return None
    return NodeStrategies(node, inputs, outs, ins, "registry")


def _depends_on_inputs(node: torch.fx.Node, table: dict[torch.fx.Node, NodeStrategies]) -> bool:
    return any(table[value_of(a)[0]].source != "constant" for a in node.all_input_nodes)


def propagate(
    gm: torch.fx.GraphModule,
    mesh: DeviceMesh,
    fixed: dict[str, Placements | list[Placements]],
) -> dict[torch.fx.Node, NodeStrategies]:
    """Strategies of every node of ``gm`` (placeholders: ``fixed[name]``, a list of them for
    an input whose placements the solver chooses (:class:`vescale.plan.Batch`), or, when
    absent, every placement of :func:`free_candidates`). Getitem nodes are not listed: consumers
    read ``(tuple node, index)`` directly. Ops a vescale handler runs get the strategies it
    declares (:func:`_handler_strategies`). A node whose :func:`_signature` an earlier one
    has (a repeated layer's twin) takes that node's strategies without asking the registry."""
    table: dict[torch.fx.Node, NodeStrategies] = {}
    seen: dict[Any, NodeStrategies] = {}  # by _signature
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            val = node.meta.get("val")
            given = fixed.get(node.name)
            if isinstance(given, list):
                table[node] = NodeStrategies(
                    node, [], [(p,) for p in given], [()] * len(given), "input"
                )
            elif given is not None:
                table[node] = NodeStrategies(node, [], [(given,)], [()], "plan")
            else:
                table[node] = NodeStrategies(
                    node,
                    [],
                    [(c,) for c in free_candidates(val.shape, mesh)],
                    [() for _ in free_candidates(val.shape, mesh)],
                    "free",
                )
        elif node.op == "call_function" and node.target is operator.getitem:
            continue
        elif node.op == "call_function":
            if not _depends_on_inputs(node, table):
                table[node] = _replicated(node, [], mesh, "constant")
                continue
            key = _signature(node, table)
            known = seen.get(key) if key is not None else None
            if known is not None:  # a repeated layer's twin: its strategies, this node's inputs
                _, _, inputs = _schema_args(node, table, mesh)
                table[node] = dataclasses.replace(known, node=node, inputs=inputs, candidates={})
                continue
            table[node] = _node_strategies(node, table, mesh)
            if key is not None:
                seen[key] = table[node]
    return table


def _node_strategies(
    node: torch.fx.Node, table: dict[torch.fx.Node, NodeStrategies], mesh: DeviceMesh
) -> NodeStrategies:
    """The strategies of a ``call_function`` node from the registry (the replicated fallback
    where it has none or its rule fails), a handler's declared ones included."""
    try:
        found = _registry_strategies(node, table, mesh)
        why = "no strategy in the registry"
    except Exception as err:  # a rule that cannot handle these arguments
        found, why = (
            _each_candidate(node, table, mesh),
            f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}",
        )
    if found is None:
        _, _, inputs = _schema_args(node, table, mesh)
        found = _replicated(node, inputs, mesh, f"replicated fallback: {why}")
    return _handler_strategies(found, mesh, table)


def _each_candidate(
    node: torch.fx.Node, table: dict[torch.fx.Node, NodeStrategies], mesh: DeviceMesh
) -> NodeStrategies | None:
    """For a node with one tensor input whose rule raised for some of its candidates (a view
    a shard layout cannot take): the strategies of every candidate the rule accepts, asked
    one candidate at a time (``None``: it accepts none, or the node has more inputs)."""
    tensors = flat_inputs(node)
    if len({value_of(a) for a in tensors}) != 1:
        return None
    value = value_of(tensors[0])
    outputs, input_placements, inputs = [], [], []
    for candidate in table[value[0]].out_candidates(value[1]):
        try:
            found = _registry_strategies(node, table, mesh, only=candidate)
        except Exception:  # this candidate: the rule's failure
            continue
        if found is not None:
            outputs += found.outputs
            input_placements += found.input_placements
            inputs = found.inputs
    if not outputs:
        return None
    return NodeStrategies(node, inputs, outputs, input_placements, "registry")


def _signature(node: torch.fx.Node, table: dict[torch.fx.Node, NodeStrategies]) -> Any:
    """All ``node``'s strategies depend on: its op, its output metadata, its other arguments
    and, per tensor argument, its candidate placements, metadata and which earlier argument
    it repeats. Nodes of repeated layers share it; ``None`` when an argument is unhashable."""
    values: list[Value] = []

    def sig(a: Any) -> Any:
        if isinstance(a, list | tuple):
            return (type(a).__name__, *(sig(x) for x in a))
        if not isinstance(a, torch.fx.Node):
            return a
        val = a.meta.get("val")
        meta = tensor_meta(val)
        if meta is None:
            return ("value", val)
        value = value_of(a)
        first = values.index(value) if value in values else len(values)
        values.append(value)
        return ("tensor", first, meta, tuple(table[value[0]].out_candidates(value[1])))

    val = node.meta.get("val")
    out = tuple(map(tensor_meta, val)) if isinstance(val, tuple | list) else tensor_meta(val)
    key = (node.target, sig(node.args), sig(tuple(sorted(node.kwargs.items()))), out)
    try:
        hash(key)
    except TypeError:
        return None
    return key


def flat_inputs(node: torch.fx.Node) -> list[torch.fx.Node]:
    """``node``'s tensor argument nodes in the order strategies list their input specs."""
    leaves = pytree.tree_leaves((node.args, node.kwargs))
    return [
        a
        for a in leaves
        if isinstance(a, torch.fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)
    ]


# ---- ops a vescale handler runs (strategies declared beside the handler) -----------------


def _handler_strategies(
    ns: NodeStrategies, mesh: DeviceMesh, table: dict[torch.fx.Node, NodeStrategies]
) -> NodeStrategies:
    """For an op a vescale handler runs instead of dispatch (``declare_handler_strategies``):
    ``ns`` without the layouts of the handler's ``layout_arg`` it takes over, plus the
    strategies it declares for each candidate of that argument (each alternative; inputs it
    takes as they come: one per candidate), its collectives priced inside the op. Other ops:
    ``ns``."""
    op: Any = ns.node.target
    handled = registry.handled_op(op)
    if handled is None:
        return ns
    bound = bind(op, ns.node.args, ns.node.kwargs)
    names = [
        n
        for n, a in bound.items()
        if isinstance(a, torch.fx.Node) and tensor_meta(a.meta.get("val")) is not None
    ]
    if [value_of(bound[n]) for n in names] != ns.inputs or handled.layout_arg not in names:
        return ns
    cands = {n: table[v[0]].out_candidates(v[1]) for n, v in zip(names, ns.inputs)}
    meta = {n: tensor_meta(bound[n].meta["val"]) for n in names}
    declared: dict[Placements, tuple[registry.HandlerStrategy, ...]] = {}

    def strategies(layout: Placements) -> tuple[registry.HandlerStrategy, ...]:
        if layout not in declared:
            args = dict(bound)
            for n in names:  # the others' placements do not decide (HandledOp)
                p = layout if n == handled.layout_arg else cands[n][0]
                args[n] = DTensorSpec(mesh, p, meta[n])
            declared[layout] = registry.declared_strategies(handled, op, args)
        return declared[layout]

    at = names.index(handled.layout_arg)
    kept = [(o, i) for o, i in zip(ns.outputs, ns.input_placements) if not strategies(i[at])]
    outputs = [o for o, _ in kept]
    inputs = [i for _, i in kept]
    internal: list[tuple[Any, ...]] = [()] * len(kept)
    for layout in cands[handled.layout_arg]:
        for s in strategies(layout):
            steps = tuple(
                CommStep(c.kind, c.mesh_dim, mesh.size(c.mesh_dim), c.bytes) for c in s.collectives
            )
            laid = [[p] if (p := s.inputs[n]) is not None else cands[n] for n in names]
            for combo in itertools.product(*laid):
                outputs.append(tuple(s.outputs))
                inputs.append(tuple(combo))
                internal.append(steps)
    source = ns.source if kept else "handler"
    return NodeStrategies(ns.node, ns.inputs, outputs, inputs, source, internal=internal)
