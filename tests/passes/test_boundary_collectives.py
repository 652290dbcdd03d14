"""Compiled regions whose collectives cross the graph boundary.

A region may receive the result of a collective issued before it (an ``AsyncCollectiveTensor``
input: the graph waits on a graph input) or return a collective's result unwaited (a later
region waits). Every pass accepts both: hand-built FX graphs check each pass's contract, real
gloo runs check per-block compiled sequence-parallel blocks and two chained regions against
one device, with no fallback to eager.
"""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.fx.experimental.proxy_tensor import make_fx

import vescale
from tests.dtensor.reference import mesh_of, partial_source
from tests.harness import fake_world
from vescale import Partial, Replicate, Shard
from vescale.backend import PIPELINE, vescale_backend
from vescale.fx.collectives import COLLECTIVE_KINDS, WAIT_TENSOR, inflight_inputs
from vescale.fx.dump import graph_text
from vescale.fx.timeline import LANES, timeline
from vescale.passes import BackendOptions, PassContext, annotate, bucket, eliminate, schedule
from vescale.passes.annotate import verify_waits

c10d = torch.ops._c10d_functional
aten = torch.ops.aten


# --- hand-built graphs (fake process group: structure only) -------------------------------


def _traced(fn, *shapes):
    """``fn`` traced to an aten graph with functional collectives (fake tensors, ``val`` meta)."""
    return make_fx(fn, tracing_mode="fake")(*(torch.randn(*s) for s in shapes))


def _ctx(**options) -> PassContext:
    return PassContext("g", options=BackendOptions(**{"eliminate": False, **options}))


def _order(gm) -> list[str]:
    return [n.name for n in gm.graph.nodes]


def _group() -> str:
    """A new group of both ranks, which no mesh owns: collectives on it are labelled "group"."""
    return dist.new_group([0, 1]).group_name  # type: ignore[union-attr]


def test_meshes_of_an_earlier_world_label_nothing():
    """A mesh kept alive past ``destroy_process_group`` names groups whose names the next
    world reuses; it must not label that world's collectives (the fingerprint below read
    "over mesh dim 0" after other tests in the same process)."""
    from vescale.dtensor.device_mesh import known_meshes

    with fake_world(2):
        old = vescale.init_device_mesh("cpu", (2,))
        assert any(m is old for m in known_meshes())
    with fake_world(2):
        assert not any(m is old for m in known_meshes())
    test_passes_keep_unwaited_output_and_inflight_input()  # with ``old`` still alive


def _reads_inflight_directly(group):
    """The AOTAutograd shape of an in-flight input: an unused wait on it, then direct reads;
    an all-reduce of another input and two matmuls that do not need it."""

    def fn(x, w, y):
        c10d.wait_tensor(y)
        h = torch.mm(torch.mm(x, w), w)
        z = y + h
        r = c10d.wait_tensor(c10d.all_reduce(x, "sum", group))
        return r + z

    return fn


def test_schedule_waits_inflight_input_where_first_read():
    with fake_world(2):
        gm = _traced(_reads_inflight_directly(_group()), (4, 4), (4, 4), (4, 4))
        assert [n.name for n in inflight_inputs(gm)] == ["y_1"]
        ctx = _ctx()
        gm = schedule(annotate(gm, ctx), ctx)
    order = _order(gm)
    # the all-reduce is issued first (its input is ready), the matmuls overlap it and the
    # in-flight input, whose wait comes right before its first (direct) read
    assert order == [
        *("x_1", "w_1", "y_1", "all_reduce", "mm", "mm_1"),
        *("wait_tensor", "add", "wait_tensor_1", "add_1", "output"),
    ]
    assert ctx.reports["overlap_inputs"] == {"y_1": 3}  # all_reduce, mm, mm_1
    assert ctx.reports["boundary"] == {"inflight_inputs": ["y_1"], "unwaited_outputs": []}


def test_schedule_cap_waits_inflight_input_as_early_as_inputs_allow():
    with fake_world(2):
        gm = _traced(_reads_inflight_directly(_group()), (4, 4), (4, 4), (4, 4))
        ctx = _ctx(overlap_cap_mb=1e-6)  # below one 64 B tensor: one result in flight at most
        gm = schedule(gm, ctx)
    order = _order(gm)
    # the input counts as in flight from the start: it is waited before the all-reduce
    assert order.index("wait_tensor") < order.index("all_reduce")
    assert ctx.reports["overlap_inputs"] == {"y_1": 0}


def test_verify_rejects_reading_inflight_input_before_its_wait():
    def fn(y):
        z = y * 2  # reads a buffer the collective is still writing
        return c10d.wait_tensor(y) + z

    with fake_world(2):
        gm = _traced(fn, (4,))
        with pytest.raises(RuntimeError, match=r"%mul reads %y_1, whose collective was issued"):
            verify_waits(gm, "g")


def _returns_unwaited(group):
    """An in-flight input waited and used; two all-reduces of one group and dtype: one waited
    in the graph, one returned unwaited (a later region waits for it)."""

    def fn(x, y):
        a = c10d.wait_tensor(c10d.all_reduce(x * 2, "sum", group))
        b = c10d.all_reduce(x + 1, "sum", group)
        return a + c10d.wait_tensor(y), b

    return fn


def test_passes_keep_unwaited_output_and_inflight_input():
    with fake_world(2):
        gm = _traced(_returns_unwaited(_group()), (4,), (4,))
        ctx = _ctx()
        gm = PIPELINE.run(gm, ctx)
        text = graph_text(gm, "g")
    colls = [n for n in gm.graph.nodes if n.target in COLLECTIVE_KINDS]
    # not merged across the boundary (the two would bucket otherwise), nothing eliminated
    assert len(colls) == 2 and ctx.reports["buckets"] == [] and ctx.reports["eliminated"] == 0
    out = next(iter(reversed(gm.graph.nodes)))
    unwaited = [c for c in colls if not any(u.target is WAIT_TENSOR for u in c.users)]
    assert len(unwaited) == 1 and unwaited[0] in out.all_input_nodes
    assert [r["waited"] for r in ctx.reports["collectives"]] == ["in graph", "after graph"]
    # both collectives issued first, the input waited where the sum needs it
    assert ctx.reports["fingerprint"] == [
        "all_reduce float32[4] over group of 2 @ ?",
        "all_reduce float32[4] over group of 2, waited after this graph @ ?",
        "wait on input float32[4]: collective issued before this graph",
    ]
    assert "wait on input %y_1: collective issued before this graph" in text
    assert "<< all_reduce, waited after this graph" in text


def test_eliminate_keeps_unused_wait_on_inflight_input():
    def fn(x, y):
        c10d.wait_tensor(y)  # completes the collective; nothing reads the result
        return x * 2

    with fake_world(2):
        gm = _traced(fn, (4,), (4,))
        gm = eliminate(gm, _ctx(eliminate=True))
        gm = bucket(gm, _ctx())
    assert sum(n.target is WAIT_TENSOR for n in gm.graph.nodes) == 1


def test_timeline_stalls_on_inflight_input():
    def fn(y):
        return c10d.wait_tensor(y) * 2

    with fake_world(2):
        gm = _traced(fn, (1024,))
    events = {e["name"].split(" %")[0]: e for e in timeline(gm, "g")}
    before = events["issued before this graph"]
    assert before["tid"] == LANES["communication"] and before["ts"] == 0
    assert events["wait"]["dur"] == before["dur"] > 0  # compute waits for all of it


# --- real runs (gloo, 2 ranks): per-block compiled sequence-parallel blocks ----------------

DIM, SEQ, BATCH = 8, 4, 2


class Block(nn.Module):
    """Pre-norm MLP block: ``x + proj(gelu(fc(ln(x))))``."""

    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(DIM)
        self.fc = nn.Linear(DIM, 4 * DIM)
        self.proj = nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(F.gelu(self.fc(self.ln(x))))


def _blocks() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Block(), Block()).double()


def _sequence_parallel(blocks: nn.Sequential, mesh) -> nn.Sequential:
    """Megatron sequence parallelism over ``mesh`` (tp): the residual stream is sharded over
    the sequence (``Shard(1)``), layer norm runs on the shard, an all-gather feeds the
    column-parallel ``fc``, the row-parallel ``proj``'s Partial output is reduce-scattered
    back to sequence shards."""
    vescale.materialize_module(
        blocks,
        {
            "*.fc.*": (mesh, [Shard(0)]),
            "*.proj.weight": (mesh, [Shard(1)]),
            "*": (mesh, [Replicate()]),
        },
    )
    for block in blocks:
        block.fc.register_forward_pre_hook(
            lambda _m, args: (args[0].redistribute(placements=[Replicate()]),)
        )
        block.proj.register_forward_hook(lambda _m, _a, y: y.redistribute(placements=[Shard(1)]))
    return blocks


def _check_sequence_parallel_blocks(compiled: bool, dump_dir: str, codegen: str = "fx") -> None:
    torch._dynamo.reset()
    mesh = mesh_of((2,))
    full, piece = partial_source([Partial()], (2,), (BATCH, SEQ, DIM))
    target = torch.randn(BATCH, SEQ, DIM, dtype=torch.float64)

    ref = _blocks()
    ref_in = full.clone().requires_grad_()
    (ref(ref_in) * target).sum().backward()

    blocks = _sequence_parallel(_blocks(), mesh)
    piece.requires_grad_()
    # the previous stage's Partial output, reduce-scattered to sequence shards and not waited
    x = vescale.from_local(piece, mesh, [Partial()]).redistribute(placements=[Shard(1)])
    assert isinstance(x._local_tensor, AsyncCollectiveTensor)
    opts = {"codegen": codegen, "dump_dir": dump_dir}
    run = [torch.compile(b, backend="vescale", fullgraph=True, options=opts) for b in blocks]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y = x
        for block in run if compiled else blocks:
            y = block(y)
        (y.full_tensor() * target).sum().backward()
    fallbacks = [str(w.message) for w in caught if "vescale backend" in str(w.message)]
    assert not fallbacks, fallbacks

    torch.testing.assert_close(y.full_tensor(), ref(full), rtol=0, atol=1e-12)
    torch.testing.assert_close(piece.grad, ref_in.grad, rtol=0, atol=1e-12)
    for (name, p), (_, p_ref) in zip(blocks.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), p_ref.grad, rtol=0, atol=1e-12, msg=name)
    if compiled:  # the first block's graph waits on its in-flight input, and says so
        folder = Path(dump_dir) / f"rank{dist.get_rank()}"
        captured = sorted(folder.glob("graph*.forward/graph.schedule.txt"))
        assert len(captured) == 2, captured
        assert "collective issued before this graph" in captured[0].read_text()
        assert "collective issued before this graph" not in captured[1].read_text()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_sequence_parallel_blocks_with_inflight_input(pool2, compiled):
    with tempfile.TemporaryDirectory() as d:
        pool2.run(_check_sequence_parallel_blocks, compiled, d)


def _check_unwaited_output_feeds_next_region() -> None:
    """Region one returns a reduce-scatter unwaited; the next compiled region waits for it."""
    torch._dynamo.reset()
    group = _group()
    rank = dist.get_rank()
    xs = [torch.randn(4, 3, generator=torch.Generator().manual_seed(r)) for r in range(2)]

    def region_one(x):
        return (c10d.reduce_scatter_tensor(x * 2, "sum", 2, group),)  # as Dynamo graphs return

    first = make_fx(region_one, tracing_mode="fake")(xs[rank])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled_one = vescale_backend(first, [xs[rank]], {"codegen": "fx"})
        (inflight,) = compiled_one(xs[rank])
        # how eager functional collectives hand out an in-flight result
        y = AsyncCollectiveTensor(inflight)
        second = torch.compile(
            lambda t: t * 3 + 1, backend="vescale", fullgraph=True, options={"codegen": "fx"}
        )
        out = second(y)
    fallbacks = [str(w.message) for w in caught if "vescale backend" in str(w.message)]
    assert not fallbacks, fallbacks
    expected = (sum(2 * x for x in xs).chunk(2)[rank]) * 3 + 1
    torch.testing.assert_close(out, expected)


def test_unwaited_output_feeds_next_region(pool2):
    pool2.run(_check_unwaited_output_feeds_next_region)


def test_schedule_orders_a_result_waited_twice():
    """A collective's result waited again (``wait_tensor(wait_tensor(all_reduce))``, as code
    that waits an already-waited tensor traces): both waits go where the result is first
    needed, in graph order (the second wait counted as a node to schedule before, the
    scheduler left 1620 nodes of a compiled step unordered)."""

    def fn(x, w):
        r = c10d.wait_tensor(c10d.wait_tensor(c10d.all_reduce(x, "sum", group)))
        return torch.mm(w, w) + r

    with fake_world(2):
        group = _group()
        gm = _traced(fn, (4, 4), (4, 4))
        ctx = _ctx()
        gm = schedule(gm, ctx)
    order = _order(gm)
    assert order == [
        "x_1",
        "w_1",
        "all_reduce",
        "mm",
        "wait_tensor",
        "wait_tensor_1",
        "add",
        "output",
    ]
