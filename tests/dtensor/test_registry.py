"""The op registry (vescale/dtensor/ops/_registry.py) is what both eager dispatch and the
planner read: for every op with a vescale rule, on a 2x2 mesh and a sample of input
layouts, the planner's strategy equals what eager dispatch does (output placements, and the
collectives it issues, counted with the profiler); the planner's ``clone`` of a ``Partial``
input communicates nothing; the public hook names declare through the registry."""

from __future__ import annotations

import operator
from collections import Counter
from typing import Any

import pytest
import torch

from tests.dtensor.reference import mesh_of
from tests.harness.collectives import count_collectives
from vescale import DTensor, Partial, Replicate, Shard
from vescale.dtensor import dispatch, explicit_redistribute, hooks
from vescale.dtensor.ops import _registry
from vescale.plan.cost import flattened_steps, redistribution_steps
from vescale.plan.program import flattens
from vescale.plan.propagate import propagate

aten = torch.ops.aten
R, P, S0, S1, S2 = Replicate(), Partial(), Shard(0), Shard(1), Shard(2)
MESH = (2, 2)
SHAPE = (4, 6, 8)  # batch, sequence, normalized


def _f64(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float64)


def _norm_backward_inputs() -> dict[str, torch.Tensor]:
    x, w, b = _f64(*SHAPE), _f64(8), _f64(8)
    _, mean, rstd = aten.native_layer_norm.default(x, [8], w, b, 1e-5)
    return {"grad": _f64(*SHAPE), "x": x, "mean": mean, "rstd": rstd, "w": w, "b": b}


Case = tuple[Any, Any, list[dict[str, tuple[Any, ...]]]]
# op -> (named inputs, the op's arguments from them, sample layouts {input: placements})
RULE_CASES: dict[Any, Case] = {
    aten.clone.default: (
        lambda: {"x": _f64(4, 8)},
        lambda t: [t["x"]],
        [{"x": p} for p in [(P, P), (P, S0), (S1, P), (P, R), (R, R), (S0, S1)]],
    ),
    aten.native_layer_norm_backward.default: (
        _norm_backward_inputs,
        lambda t: [t["grad"], t["x"], [8], t["mean"], t["rstd"], t["w"], t["b"], [True] * 3],
        [
            # a Partial gradient, replicated input: all-reduced once (not reduce-scattered)
            {"grad": (P, P), "x": (R, R), "mean": (R, R), "rstd": (R, R)},
            # batch-dim shards: the gradient reduce-scattered to the input's layout
            {"grad": (P, R), "x": (S0, R), "mean": (S0, R), "rstd": (S0, R)},
            {"grad": (S0, S1), "x": (S0, S1), "mean": (S0, S1), "rstd": (S0, S1)},
            # the gradient laid out otherwise than the input
            {"grad": (S1, R), "x": (R, S0), "mean": (R, R), "rstd": (R, S0)},
            # input sharded over the normalized dim: upstream's choice
            {"grad": (R, R), "x": (R, S2), "mean": (R, R), "rstd": (R, R)},
        ],
    ),
}
# ops whose strategy vescale registers or wraps (a sample): eager selects one of the strategies
STRATEGY_CASES: dict[Any, Case] = {
    aten.sum.dim_IntList: (
        lambda: {"x": _f64(4, 8)},
        lambda t: [t["x"], [-1]],
        [{"x": (S0, S1)}, {"x": (S1, R)}],
    ),
    aten.linalg_vector_norm.default: (
        lambda: {"x": _f64(4, 8)},
        lambda t: [t["x"], 2, [0, 1]],
        [{"x": (S0, S1)}, {"x": (S1, S0)}],
    ),
    aten.view.default: (
        lambda: {"x": _f64(4, 8)},
        lambda t: [t["x"], [2, 2, 8]],
        [{"x": (S0, R)}, {"x": (S1, S0)}],
    ),
    aten.index_add.default: (
        lambda: {"x": _f64(4, 8), "idx": torch.tensor([0, 2, 0]), "src": _f64(3, 8)},
        lambda t: [t["x"], 0, t["idx"], t["src"]],
        [{"x": (S1, R), "src": (S1, R)}, {"x": (R, S0), "src": (R, R)}],
    ),
    aten.gather.default: (
        lambda: {"x": _f64(4, 8), "idx": torch.randint(0, 8, (4, 3))},
        lambda t: [t["x"], 1, t["idx"]],
        [{"x": (S0, R), "idx": (S0, R)}, {"x": (R, S1), "idx": (R, R)}],
    ),
}
CASES = {**RULE_CASES, **STRATEGY_CASES}


def test_every_rule_has_a_case() -> None:
    assert set(RULE_CASES) == set(_registry.rule_ops()), (
        "every op with a vescale rule needs a planner-vs-eager case here"
    )


def _layout(layout: dict[str, tuple[Any, ...]], name: str, t: torch.Tensor) -> tuple[Any, ...]:
    return layout.get(name, (R,) * len(MESH)) if t.ndim else (R,) * len(MESH)


def _distribute(t: torch.Tensor, placements: tuple[Any, ...]) -> DTensor:
    """``t`` as a DTensor in ``placements`` (a Partial: Replicate redistributed, locally)."""
    mesh = mesh_of(MESH)
    start = tuple(R if p.is_partial() else p for p in placements)
    return (
        DTensor.from_local(t, mesh, (R,) * len(MESH))
        .redistribute(mesh, start)
        .redistribute(mesh, placements)
    )


def _placements(out: Any) -> tuple[Any, ...]:
    outs = out if isinstance(out, tuple | list) else (out,)
    return tuple(tuple(o.placements) if isinstance(o, DTensor) else None for o in outs)


def _eager(op: Any, layout: dict[str, tuple[Any, ...]]) -> tuple[Any, Counter[str]]:
    """Output placements and collectives of eager dispatch (values checked: one device)."""
    inputs, args, _ = CASES[op]
    torch.manual_seed(0)
    t = inputs()
    d = {k: _distribute(v, _layout(layout, k, v)) for k, v in t.items()}
    with explicit_redistribute(False), count_collectives() as counts:
        out = op(*args(d))
    ref = op(*args(t))
    for o, r in zip(
        out if isinstance(out, tuple) else (out,), ref if isinstance(ref, tuple) else (ref,)
    ):
        torch.testing.assert_close(o.full_tensor(), r, rtol=1e-10, atol=1e-10)
    return _placements(out), Counter({k: v for k, v in counts.items() if v})


def _graph(op: Any) -> tuple[torch.fx.GraphModule, torch.fx.Node, dict[str, torch.Tensor]]:
    """``op`` on placeholders, with the meta values the planner reads."""
    inputs, args, _ = CASES[op]
    torch.manual_seed(0)
    t = inputs()
    graph = torch.fx.Graph()
    nodes = {}
    for name, v in t.items():
        nodes[id(v)] = graph.placeholder(name)
        nodes[id(v)].meta["val"] = v
    node = graph.call_function(op, tuple(nodes.get(id(a), a) for a in args(t)))
    node.meta["val"] = val = op(*args(t))
    outs = []
    if isinstance(val, tuple):
        for i, v in enumerate(val):
            item = graph.call_function(operator.getitem, (node, i))
            item.meta["val"] = v
            outs.append(item)
    graph.output(tuple(outs) if outs else node)
    return torch.fx.GraphModule(torch.nn.Module(), graph), node, t


def _planned(op: Any, layout: dict[str, tuple[Any, ...]]) -> list[tuple[Any, Counter[str]]]:
    """The planner's strategies for ``op`` with its inputs fixed in ``layout``: each one's
    output placements and the collectives of moving each input to the layout it wants."""
    gm, node, t = _graph(op)
    fixed = {k: _layout(layout, k, v) for k, v in t.items()}
    mesh = mesh_of(MESH)
    ns = propagate(gm, mesh, fixed)[node]
    assert ns.source == "registry", ns.source
    priced = flattened_steps if flattens(mesh) else redistribution_steps  # as program.py
    found = []
    for out, wants in zip(ns.outputs, ns.input_placements):
        kinds: Counter[str] = Counter()
        for (producer, _), want in zip(ns.inputs, wants):
            v = t[producer.name]
            steps = priced(fixed[producer.name], want, tuple(v.shape), v.element_size(), MESH)
            assert steps is not None
            kinds.update(s.kind for s in steps)
        found.append((out, kinds))
    return found


def _compare(op_names: list[str]) -> list[str]:
    wrong = []
    for name in op_names:
        op = next(o for o in CASES if str(o) == name)
        for layout in CASES[op][2]:
            eager, planned = _eager(op, layout), _planned(op, layout)
            # a rule's one answer is eager's; a strategy list holds eager's selection
            if (planned != [eager]) if op in RULE_CASES else (eager not in planned):
                wrong.append(f"{op} {layout}: eager {eager}, planner {planned}")
    return wrong


def test_planner_strategies_equal_eager_dispatch(pool4) -> None:  # type: ignore[no-untyped-def]
    """With its inputs fixed, an op with a rule has one strategy in the plan: eager's; an op
    with a registered or wrapped strategy has eager's among its strategies."""
    wrong = pool4.run(_compare, [str(op) for op in CASES])[0]
    assert not wrong, "\n".join(wrong)


def _clone_partial() -> list[Any]:
    gm, node, _ = _graph(aten.clone.default)
    candidates = [(P, P), (P, S0), (R, R), (S0, S1)]
    ns = propagate(gm, mesh_of(MESH), {"x": candidates})[node]
    return sorted(zip(ns.input_placements, ns.outputs), key=str)


def test_planner_clone_of_partial_communicates_nothing(pool4) -> None:  # type: ignore[no-untyped-def]
    """Every candidate, Partial ones included, is cloned as it is: no strategy asks for a
    reduction (the planner used upstream's pointwise rule: Partial all-reduced first)."""
    strategies = pool4.run(_clone_partial)[0]
    candidates = [(P, P), (P, S0), (R, R), (S0, S1)]
    assert strategies == sorted((((c,), (c,)) for c in candidates), key=str)


def _identity(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return args[0]


@pytest.mark.parametrize(
    "declare",
    [hooks.bypass_dispatch, dispatch.bypass_dispatch, dispatch._bypass_for_dispatch],
)
def test_public_hook_names_declare_in_the_registry(declare: Any) -> None:
    op = aten.neg.default
    before = _registry.hooks_of(op)
    assert before is None or before.bypass is None
    declare(op)(_identity)
    try:
        found = _registry.hooks_of(op)
        assert found is not None and found.bypass is not None and found.bypass.fn is _identity
    finally:
        dispatch.unregister_bypass_dispatch(op)
    after = _registry.hooks_of(op)
    assert after is None or after.bypass is None
