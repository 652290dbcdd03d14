"""Graph node facts have one definition (``vescale/_node_meta.py``), and the pass manager
recomputes collective records only after a pass that changed the graph."""

from __future__ import annotations

import ast
import copy
from pathlib import Path

import pytest
import torch

import vescale
import vescale.fx.collectives as collectives
from tests.harness import fake_world
from vescale import Replicate, Shard
from vescale._node_meta import KEYS, get_collective, set_bucket
from vescale.backend import PASSES_OFF
from vescale.passes import PassContext, PassManager

PACKAGE = Path(vescale.__file__).parent


def test_node_fact_keys_are_spelled_only_in_node_meta():
    """Every writer and reader goes through the accessors: no other module of the package
    holds a ``vescale_*`` node-fact key as a string."""
    spelled = sorted(
        f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.value}"
        for path in PACKAGE.rglob("*.py")
        if path.name != "_node_meta.py"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and node.value in KEYS
    )
    assert spelled == []


def _gather_twice(x):
    return x.redistribute(placements=[Replicate()]) * 2


@pytest.fixture
def counted(monkeypatch):
    """The number of ``collective_table`` computations so far (a one-item list)."""
    calls = [0]
    table = collectives.collective_table

    def counting(gm, graph):
        calls[0] += 1
        return table(gm, graph)

    monkeypatch.setattr(collectives, "collective_table", counting)
    return calls


@pytest.fixture(scope="module")
def mesh():
    """One fake world for the module: a second fake world in one process fails to compile a
    backward that the first compiled (AOTAutograd's partitioner, before any vescale pass)."""
    with fake_world(2):
        yield vescale.init_device_mesh("cpu", (2,))


def _trace(mesh, options):
    x = vescale.distribute_tensor(torch.randn(4, 3), mesh, [Shard(0)]).requires_grad_(True)
    return vescale.fx.trace(_gather_twice, x, options=options)


def test_one_compile_computes_records_once_per_graph_when_no_pass_changes_it(mesh, counted):
    """With the communication passes off no pass changes either graph: one computation per
    graph (the capture's), not one after each of the five passes; the records are those of the
    final graphs, recomputed here from scratch."""
    result = _trace(mesh, PASSES_OFF)
    graphs = [g for g in (result.forward, result.backward) if g is not None]
    assert counted[0] == len(graphs) == 2
    fresh = collectives.collective_table(result.forward, "")
    forward = [r for r in result.collectives if r["graph"].endswith(".forward")]
    assert [r["kind"] for r in forward] == ["all_gather"]
    assert [{**r, "graph": ""} for r in forward] == [{**r, "graph": ""} for r in fresh]


def _unchanged(gm, ctx):
    return gm


def _new_node(gm, ctx):
    """Doubles the collective's input: the graph's structure and the collective's bytes change."""
    coll = next(n for n in gm.graph.nodes if n.target in collectives.COLLECTIVE_KINDS)
    inp = coll.args[0]
    with gm.graph.inserting_before(coll):
        doubled = gm.graph.call_function(torch.ops.aten.cat.default, ([inp, inp],))
    doubled.meta["val"] = torch.cat([inp.meta["val"]] * 2)
    coll.replace_input_with(inp, doubled)
    return gm


def _bucket_fact(gm, ctx):
    """Only a node fact changes: the collective is tagged as bucket 7."""
    set_bucket(next(n for n in gm.graph.nodes if n.target in collectives.COLLECTIVE_KINDS), 7)
    return gm


def _copied(gm, ctx):
    """A new GraphModule, node facts copied: nothing the records read changed."""
    return copy.deepcopy(gm)


def _facts_dropped(gm, ctx):
    for n in gm.graph.nodes:
        n.meta.pop("custom", None)
    return gm


def test_records_recomputed_exactly_after_each_pass_that_changed_the_graph(mesh, counted):
    gm = _trace(mesh, PASSES_OFF).forward
    steps = [
        ("unchanged", _unchanged, 0),
        ("new_node", _new_node, 1),
        ("unchanged_again", _unchanged, 0),
        ("bucket_fact", _bucket_fact, 1),
        ("copied", _copied, 0),
        ("facts_dropped", _facts_dropped, 1),
    ]
    ctx = PassContext("g")
    counted[0] = 0
    gm = PassManager([(name, fn) for name, fn, _ in steps]).run(gm, ctx)
    assert counted[0] == 1 + sum(n for _, _, n in steps)  # 1: the capture's
    expected = collectives.collective_table(gm, "g")
    (record,) = ctx.reports["collectives"]
    assert record == expected[0]
    assert record["bucket"] is None  # the dropped facts: no bucket any more
    assert record["bytes"] == 2 * 2 * 3 * 4  # the doubled (4, 3) float32 shard
    coll = next(n for n in gm.graph.nodes if n.target in collectives.COLLECTIVE_KINDS)
    assert get_collective(coll) == record
