"""The planner's strategy for the ops vescale's eager layer runs with its own handlers
(vocabulary-parallel ``_log_softmax`` / ``nll_loss`` and their backwards) is what eager
dispatch does, on a 2x2 mesh: for inputs laid out as the handler takes them, exactly one
strategy, with eager's output placements and the collectives eager issues inside the op
(kind and mesh dim, in order; bytes of the rank holding the most). Weighted and
``reduction="none"`` losses included. Eager's results equal one device's (float64)."""

from __future__ import annotations

import contextlib
import itertools
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed._functional_collectives as funcol
from torch.fx.experimental.proxy_tensor import make_fx

import vescale
from tests.harness.collectives import count_collectives
from vescale import Partial, Replicate, Shard

aten = torch.ops.aten
N, C, IGNORE = 5, 7, -100  # uneven shards on both dims
NONE, MEAN, SUM = 0, 1, 2
R, S0, S1, P = Replicate(), Shard(0), Shard(1), Partial()

# (input rank, x placements): batch and class sharded, class only, batch only, ...
SAMPLE_LAYOUTS = [(2, (S0, S1)), (2, (S1, R)), (1, (S0, R))]
FULL_LAYOUTS = [
    *SAMPLE_LAYOUTS,
    (2, (S0, R)),
    (2, (R, S1)),
    (2, (S1, S1)),
    (2, (S0, S0)),
    (2, (P, S1)),
    (1, (S0, S0)),
]


def _cases(layouts: list[tuple[int, tuple[Any, ...]]]) -> list[tuple[Any, ...]]:
    out: list[tuple[Any, ...]] = []
    for ndim, x in layouts:
        if P not in x and any(p.is_shard(ndim - 1) for p in x):  # log_softmax over the classes
            out += [("log_softmax", ndim, x), ("log_softmax_backward", ndim, x)]
        for op, weighted, reduction in itertools.product(
            ("nll", "nll_backward"), (False, True), (NONE, MEAN, SUM)
        ):
            out.append((op, ndim, x, weighted, reduction))
    return out


def _batch(ndim: int, x: tuple[Any, ...]) -> tuple[Any, ...]:
    """The target's placements: the input's batch sharding, replicated elsewhere."""
    return tuple(p if ndim == 2 and p.is_shard(0) else R for p in x)


def _inputs(case: tuple[Any, ...]) -> tuple[Any, list[torch.Tensor], list[tuple[Any, ...]]]:
    """(the op on global tensors, its tensor arguments, the placements the handler takes
    them in: stated here independently of the handlers)."""
    name, ndim, x_p = case[:3]
    g = torch.Generator().manual_seed(0)
    shape = (N, C) if ndim == 2 else (C,)
    x = torch.randn(*shape, generator=g, dtype=torch.float64)
    if name.startswith("log_softmax"):
        dim = ndim - 1
        if name == "log_softmax":
            return (lambda a: aten._log_softmax(a, dim, False)), [x], [x_p]
        out = torch.log_softmax(x, dim)
        grad = torch.randn(*shape, generator=g, dtype=torch.float64)

        def backward(gr: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
            return aten._log_softmax_backward_data(gr, o, dim, torch.float64)

        return backward, [grad, out], [x_p, x_p]
    weighted, reduction = case[3:]
    x = torch.log_softmax(x, -1)
    t = torch.randint(0, C, shape[:-1], generator=g)
    if ndim == 2:
        t[1] = IGNORE
    w = torch.rand(C, generator=g, dtype=torch.float64) + 0.5
    rep = (R, R)
    t_p = _batch(ndim, x_p)
    tensors, placements = [x, t], [x_p, t_p]
    if weighted:
        tensors.append(w)
        placements.append(rep)
    if name == "nll":

        def forward(a: torch.Tensor, b: torch.Tensor, *rest: torch.Tensor) -> Any:
            w_arg = rest[0] if weighted else None
            return aten.nll_loss_forward(a, b, w_arg, reduction, IGNORE)

        return forward, tensors, placements
    total = aten.nll_loss_forward(x, t, w if weighted else None, reduction, IGNORE)[1]
    loss_shape = t.shape if reduction == NONE else ()
    grad = torch.randn(loss_shape, generator=g, dtype=torch.float64)
    batch_partial = tuple(P if p.is_shard(0) and ndim == 2 else R for p in x_p)
    # total weight: replicated for mean (the global weight), else as the forward makes it
    total_p = rep if reduction == MEAN else batch_partial

    def backward(gr: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *rest: torch.Tensor) -> Any:
        w_arg = rest[0] if weighted else None
        return aten.nll_loss_backward(gr, a, b, w_arg, reduction, IGNORE, rest[-1])

    return (
        backward,
        [grad, *tensors, total],
        [t_p if reduction == NONE else rep, *placements, total_p],
    )


_GROUP_ARG = {"all_reduce": 2, "all_gather_tensor": 2, "reduce_scatter_tensor": 3}
_KIND = {"all_reduce": "all_reduce", "all_gather_tensor": "all_gather"}
_KIND["reduce_scatter_tensor"] = "reduce_scatter"


@contextlib.contextmanager
def _mesh_dims(mesh: Any) -> Iterator[list[tuple[str, int | None]]]:
    """``(kind, mesh dim)`` of each functional collective issued in the block."""
    seen: list[tuple[str, int | None]] = []
    by_group = {mesh.get_group(d).group_name: d for d in range(mesh.ndim)}
    saved = {name: getattr(funcol, name) for name in _GROUP_ARG}

    def recorder(name: str, fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            at = _GROUP_ARG[name]
            group = kwargs["group"] if "group" in kwargs else args[at]
            dim = group[1] if isinstance(group, tuple) else by_group.get(group.group_name)
            seen.append((_KIND[name], dim))
            return fn(*args, **kwargs)

        return call

    for name, fn in saved.items():
        setattr(funcol, name, recorder(name, fn))
    try:
        yield seen
    finally:
        for name, fn in saved.items():
            setattr(funcol, name, fn)


def _placed(t: torch.Tensor, mesh: Any, placements: tuple[Any, ...]) -> Any:
    dt = vescale.distribute_tensor(t, mesh, [R] * mesh.ndim)
    return dt.redistribute(mesh, list(placements))


def _planned(fn: Any, tensors: list[torch.Tensor], placements: list[Any], mesh: Any) -> Any:
    """The planner's strategies of the op's node with its inputs fixed in ``placements``:
    those taking the inputs as they are (output placements, collectives inside)."""
    from vescale.plan.propagate import propagate

    gm = make_fx(fn, tracing_mode="fake")(*tensors)
    holders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    table = propagate(gm, mesh, {h.name: tuple(p) for h, p in zip(holders, placements)})
    (node,) = [n for n in gm.graph.nodes if n.op == "call_function" and n in table]
    ns = table[node]
    return [
        (out, [(s.kind, s.mesh_dim, s.bytes) for s in (ns.internal[k] if ns.internal else ())])
        for k, (out, ins) in enumerate(zip(ns.outputs, ns.input_placements))
        if ins == tuple(tuple(p) for p in placements)
    ]


def _check(cases: list[tuple[Any, ...]]) -> list[dict[str, Any]]:
    mesh = vescale.init_device_mesh("cpu", (2, 2))
    results = []
    for case in cases:
        fn, tensors, placements = _inputs(case)
        dts = [_placed(t, mesh, p) for t, p in zip(tensors, placements)]
        with count_collectives() as counts, _mesh_dims(mesh) as dims:
            out = fn(*dts)
        outs = all_outs = out if isinstance(out, tuple) else (out,)
        ref = fn(*tensors)
        refs = ref if isinstance(ref, tuple) else (ref,)
        if case[0] == "nll" and case[4] == NONE:  # total_weight: unused, torch leaves it 0
            outs, refs = outs[:1], refs[:1]
        err = max(float((o.full_tensor() - r).abs().max()) for o, r in zip(outs, refs))
        results.append(
            {
                "out": tuple(tuple(o._spec.placements) for o in all_outs),
                "dims": dims,
                "counts": dict(counts),
                "bytes": dict(counts.bytes),
                "err": err,
                "plan": _planned(fn, tensors, placements, mesh) if mesh.get_rank() == 0 else None,
            }
        )
    return results


def _assert_same(cases: list[tuple[Any, ...]], per_rank: list[list[dict[str, Any]]]) -> None:
    for i, case in enumerate(cases):
        ranks = [r[i] for r in per_rank]
        plan = ranks[0]["plan"]
        assert len(plan) == 1, (case, plan)  # one strategy takes the inputs as they are
        outputs, steps = plan[0]
        for r in ranks:
            assert r["err"] < 1e-12, (case, r["err"])
            assert tuple(outputs) == r["out"], (case, outputs, r["out"])
            # the recorder saw every collective the profiler counted
            assert Counter(k for k, _ in r["dims"]) == Counter(r["counts"]), (case, r)
            assert [(k, d) for k, d, _ in steps] == r["dims"], (case, steps, r["dims"])
        for kind in {k for k, _, _ in steps}:
            most = max(r["bytes"].get(kind, 0) for r in ranks)
            assert sum(b for k, _, b in steps if k == kind) == most, (case, steps, most)


def test_planner_prices_what_the_loss_handlers_do(pool4):
    cases = _cases(SAMPLE_LAYOUTS)
    _assert_same(cases, pool4.run(_check, cases, timeout_s=600))


@pytest.mark.full
def test_planner_prices_what_the_loss_handlers_do_every_layout(pool4):
    cases = _cases(FULL_LAYOUTS)
    _assert_same(cases, pool4.run(_check, cases, timeout_s=900))
