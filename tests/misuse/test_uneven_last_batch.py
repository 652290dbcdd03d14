"""Compiled training with an uneven last batch (issue 40.1): local batches (4, 4), (4, 4), then
(4, 3) on 2 ranks. Dynamo guards on the local size, so only rank 1 recompiles.

A graph whose ``from_local`` assumes even shards is rank-checked at every call: rank 0's
cached graph and rank 1's new one meet in that check and every rank raises the same
``RankDivergenceError`` naming both graphs (before: a hang until the process-group timeout,
or with ``rank_check=False`` a graph with the old global shape). A graph without
``from_local`` (plain DDP) whose recompile has the same collectives trains on as one device
would (before: rank 1's rank check waited in the training group). The rank check
communicates one side-group all-reduce per checked call when the ranks agree.
"""

from __future__ import annotations

import re
from collections import Counter
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn

import vescale
from tests.ddp.mlp import Mlp
from tests.dtensor.reference import mesh_of
from tests.harness.collectives import count_collectives
from tests.harness.fresh import run_fresh
from tests.harness.misuse import error_everywhere
from vescale import Partial, Replicate, Shard, _agree
from vescale.ddp import DistributedDataParallel

BATCHES = [(4, 4), (4, 4), (4, 3)]  # local rows of each step on ranks 0 and 1
# a check that waits for a rank fails well before the pool's timeout, yet after a recompile
# under load (rank 0 waits in its check while rank 1 compiles)
SHORT = {"VESCALE_TIMEOUT_S": "60"}
WITHIN_S = 60


def _blank_graph_ids(text: str) -> str:
    return re.sub(r"graph\d+", "graph_", text)


def _one_error(pool, fn, *args):  # type: ignore[no-untyped-def]
    """The one error ``fn(*args)`` raises on every rank, graph numbers blanked (they count
    per process), within :data:`WITHIN_S` under the short agreement timeout."""
    return error_everywhere(
        pool, fn, *args, env=SHORT, within_s=WITHIN_S, timeout_s=120, normalize=_blank_graph_ids
    )


def _batch(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank-local rows of step ``step`` (rank r's rows depend on r: a real data split)."""
    g = torch.Generator().manual_seed(10 * step + dist.get_rank())
    return torch.randn(rows, 4, generator=g), torch.randn(rows, 3, generator=g)


def _plain_from_local_graph(dynamic: bool) -> None:
    mesh = mesh_of((2,))

    def f(t):
        x = vescale.from_local(t, mesh, [Shard(0)])  # even shards assumed: global = 2 x local
        return x.redistribute(placements=[Replicate()]).to_local().sum(0)

    torch._dynamo.reset()
    step = torch.compile(f, backend="vescale", options={"codegen": "fx"})
    for rows in BATCHES:
        t = torch.ones(rows[dist.get_rank()], 6)
        if dynamic:  # one graph for every size on every rank: no recompile at all
            torch._dynamo.mark_dynamic(t, 0)
        step(t)


def _assert_names_both_graphs(text: str, local: str, recompiled: bool = True) -> None:
    """Each rank's graph (rank 1's a recompile) and its from_local call's local shape."""
    site = r" as \(Shard\(dim=0\),\) @ test_uneven_last_batch\.py:\d+"
    second = 1 if recompiled else 0
    assert re.search(rf"rank 0: graph_\.forward \(compile \d+/0\), .*\[4, {local}\]{site}", text)
    assert re.search(
        rf"rank 1: graph_\.forward \(compile \d+/{second}\), .*\[3, {local}\]{site}", text
    )
    assert ("a rank recompiled alone" in text) == recompiled, text
    assert "DataLoader(drop_last=True)" in text and "pad it" in text, text


@pytest.mark.parametrize("dynamic", [False, True])
def test_uneven_last_batch_of_a_from_local_graph_is_one_error_everywhere(pool2, dynamic):
    """Static: rank 1 recompiles alone. Dynamic: one graph on both ranks, whose local sizes
    at this call differ (the per-call digest holds them)."""
    err = _one_error(pool2, _plain_from_local_graph, dynamic)
    assert err.kind == "RankDivergenceError", err
    _assert_names_both_graphs(_blank_graph_ids(err.message), "6", recompiled=not dynamic)


def _compiled_ddp_from_local() -> None:
    mesh = mesh_of((2,))
    net = Mlp()
    for name, p in list(net.named_parameters()):
        owner, _, leaf = name.rpartition(".")
        dt = vescale.distribute_tensor(p.detach(), mesh, [Replicate()])
        net.get_submodule(owner).register_parameter(leaf, nn.Parameter(dt))
    ddp = DistributedDataParallel(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)

    def loss_of(x, t):
        return ddp(vescale.from_local(x, mesh, [Shard(0)]), vescale.from_local(t, mesh, [Shard(0)]))

    torch._dynamo.reset()
    compiled = torch.compile(loss_of, backend="vescale", options={"codegen": "fx"})
    for i, rows in enumerate(BATCHES):
        compiled(*_batch(i, rows[dist.get_rank()])).backward()
        opt.step()
        opt.zero_grad()


def test_compiled_ddp_uneven_last_batch_is_one_error_everywhere(pool2):
    err = _one_error(pool2, _compiled_ddp_from_local)
    assert err.kind == "RankDivergenceError", err
    _assert_names_both_graphs(_blank_graph_ids(err.message), "4")


def _plain_ddp_steps(compiled: bool) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Plain-parameter DDP over the uneven batches: the weights after them, and one device's
    reference (each step's loss the mean of the ranks' mean losses: DDP averages the
    gradients)."""
    mesh = mesh_of((2,))
    ddp = DistributedDataParallel(Mlp(), dp_mesh=mesh)
    model = torch.compile(ddp, backend="vescale", options={"codegen": "fx"}) if compiled else ddp
    ref = Mlp()
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ddp.module, ref)]
    torch._dynamo.reset()
    for i, rows in enumerate(BATCHES):
        model(*_batch(i, rows[dist.get_rank()])).backward()
        per_rank = []
        for r in range(2):
            g = torch.Generator().manual_seed(10 * i + r)
            x, t = torch.randn(rows[r], 4, generator=g), torch.randn(rows[r], 3, generator=g)
            per_rank.append(ref(x, t))
        (sum(per_rank) / 2).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
    weights = {n: p.detach().clone() for n, p in ddp.module.named_parameters()}
    return weights, dict(ref.named_parameters())


def test_compiled_plain_ddp_uneven_last_batch_trains_like_one_device(pool2):
    """Rank 1 recompiles alone into the same collectives: no check waits for rank 0."""
    for got, want in pool2.run(_plain_ddp_steps, True, env=SHORT):
        for name in want:
            torch.testing.assert_close(got[name], want[name].detach(), msg=name)


def _side_group_calls(from_local: bool) -> tuple[Counter[str], dict[str, int]]:
    """Three calls of a compiled graph: the calls of all_reduce (in the rank check's side
    group or not) and all_gather_object, and the training collectives of the last call."""
    mesh = mesh_of((2,))
    side = _agree.side_group()
    if from_local:

        def f(t):
            return vescale.from_local(t, mesh, [Shard(0)]).redistribute(placements=[Replicate()])

        arg = torch.ones(4, 6)
    else:

        def f(x):
            return x.redistribute(placements=[Replicate()])

        arg = vescale.distribute_tensor(torch.ones(8, 6), mesh, [Shard(0)])
    torch._dynamo.reset()
    step = torch.compile(f, backend="vescale", options={"codegen": "fx"})
    counts: Counter[str] = Counter()
    real_all_reduce, real_gather = dist.all_reduce, dist.all_gather_object

    def all_reduce(*args, **kwargs):
        counts["side all_reduce" if kwargs.get("group") is side else "all_reduce"] += 1
        return real_all_reduce(*args, **kwargs)

    def all_gather_object(*args, **kwargs):
        counts["all_gather_object"] += 1
        return real_gather(*args, **kwargs)

    with (
        mock.patch.object(dist, "all_reduce", all_reduce),
        mock.patch.object(dist, "all_gather_object", all_gather_object),
    ):
        for _ in range(2):
            step(arg)
        with count_collectives() as training:
            step(arg)
    return counts, dict(training)


def test_agreeing_ranks_communicate_one_digest_per_checked_call(pool2):
    # from_local (even shards): checked at each of the 3 calls; else at the first only
    for from_local, checks in ((True, 3), (False, 1)):
        for counts, training in pool2.run(_side_group_calls, from_local):
            assert counts == Counter({"side all_reduce": checks}), (from_local, counts)
            assert training == {"all_gather": 1}, training  # the graph's own, nothing more


def _recompiled_alone_into_other_collectives() -> None:
    """``shape=`` given (no even-shard assumption: checked at the first run only), but the
    all-reduce's shape is the local batch's: rank 1's recompile issues another collective."""
    mesh = vescale.init_device_mesh("cpu", (2,))

    def f(t):
        x = vescale.from_local(t, mesh, [Partial()], shape=t.shape, stride=t.stride())
        return x.redistribute(placements=[Replicate()]).to_local()

    step = torch.compile(f, backend="vescale", options={"codegen": "fx"})
    for rows in BATCHES:
        step(torch.ones(rows[dist.get_rank()], 6))


def test_a_rank_that_recompiled_alone_does_not_wait_forever():
    """What the first-run check cannot make an error everywhere (docs/compiler.md#rank-check):
    rank 1 waits in its check, then raises naming rank 0's last check (fresh ranks: rank 0 is
    left in a collective)."""
    outcomes = run_fresh(
        2, _recompiled_alone_into_other_collectives, env={"VESCALE_TIMEOUT_S": "5"}
    )
    kind, text, seconds = outcomes[1]
    assert kind == "err", outcomes
    assert re.fullmatch(
        r"AgreementError: vescale: rank check of graph\d+\.forward: not every rank reached this "
        r"check within 5 s \(VESCALE_TIMEOUT_S\): rank 0: last at rank check of graph\d+\.forward",
        text,
    ), text
    assert seconds < 30, outcomes
