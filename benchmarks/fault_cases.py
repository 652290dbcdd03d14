"""Fault and misuse cases (issue 40), each a tiny program under ``torchrun`` (gloo, CPU),
classified by what happened on every rank.

    nice -n 10 python benchmarks/fault_cases.py [-k SUBSTRING] [--out FILE] [--timeout S]

Each case's body runs on every rank after a prelude (gloo group, ``import vescale``); it ends
with ``check(got, want)`` against a single-process reference computed inside the case. Each
rank prints one line: ``RESULT ok``, ``RESULT wrong`` or ``ERROR <type>: <message>``. The case's
outcome:

* ``correct``: every rank ``ok``;
* ``clear error everywhere``: every rank raised the same text, and the case is a misuse;
* ``valid program failed``: the same, but the program is valid;
* ``silent wrong result``: some rank ``wrong``, none raised;
* ``hang``: the time limit passed, or a rank waited out the gloo group's timeout;
* ``error on one rank only``: ranks raised different texts, or some raised and others not;
* ``gloo abort``: a rank died of a signal.

Cases run one at a time (``-j 1``); the table (case, class, outcome, seconds) and a summary
count go to stdout and ``--out`` (rewritten after each case). The gloo group's timeout
(``--pg-timeout``, 90 s) must exceed the ranks' compile-time skew on a loaded machine, or a
slow compile reads as a hang.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GRACE_S = 15  # a raising rank waits this long before exiting

PRELUDE = """
import datetime, os, sys, time, traceback
import torch, torch.distributed as dist
from torch import nn
import torch.nn.functional as F
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds={pg_timeout}))
RANK, WORLD = dist.get_rank(), dist.get_world_size()
import vescale
from vescale import DTensor, Partial, Replicate, Shard

def mesh(*shape):
    return vescale.init_device_mesh("cpu", shape or (WORLD,))

def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t

def check(got, want, atol=1e-6):
    got = [full(g) for g in (got if isinstance(got, (list, tuple)) else [got])]
    want = want if isinstance(want, (list, tuple)) else [want]
    same = len(got) == len(want) and all(
        g.shape == w.shape and torch.allclose(g.double(), w.double(), atol=atol, equal_nan=True)
        for g, w in zip(got, want)
    )
    # every rank must also agree with every other (a replica that drifted is wrong)
    flat = torch.cat([g.detach().double().reshape(-1) for g in got]) if got else torch.zeros(1)
    mine = torch.nan_to_num(flat, nan=1e300)
    peers = [torch.zeros_like(mine) for _ in range(WORLD)]
    dist.all_gather(peers, mine)
    same = same and all(torch.equal(p, mine) for p in peers)
    print(f"\\nR{{RANK}} RESULT {{'ok' if same else 'wrong'}}", flush=True)

try:
{body}
except BaseException as e:
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    print(f"\\nR{{RANK}} ERROR {{type(e).__name__}}: {{msg[:300]}}", flush=True)
    time.sleep({grace})  # let the other ranks print theirs before torchrun stops them
    os._exit(1)
dist.destroy_process_group()
"""


@dataclass(frozen=True)
class Case:
    name: str
    cls: str  # the class
    valid: bool  # a valid program (an error is a failure), or a misuse (an error is right)
    body: str
    nproc: int = 2
    env: tuple[tuple[int | None, str, str], ...] = ()  # (rank or None: all, name, value)


UNEVEN, BRANCH, SILENT, ONE_RANK, VALID, FAULT, UNCLEAR = (
    "last uneven batch",
    "rank-dependent branch",
    "silent wrong setup",
    "one rank raising",
    "valid program",
    "fault",
    "unclear error",
)

_MLP = """
class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 3), nn.Linear(4, 3)
    def forward(self, x, branch=0):
        h = torch.tanh(self.a(x))
        return (self.b(h) if branch == 0 else self.c(h)).pow(2).mean()
"""

CASES = [
    # ---- last uneven batch -------------------------------------------------------------------
    Case(
        "compiled_uneven_last_batch",
        UNEVEN,
        True,
        """
m = mesh()
f = torch.compile(lambda x: (x * 2).sum(0), backend="vescale")
outs, refs = [], []
for n in (8, 7):
    x = torch.arange(n * 3.0).reshape(n, 3)
    outs.append(f(vescale.distribute_tensor(x, m, [Shard(0)])))
    refs.append((x * 2).sum(0))
check(outs, refs)
""",
    ),
    Case(
        "compiled_uneven_last_batch_4",
        UNEVEN,
        True,
        """
m = mesh()
f = torch.compile(lambda x: torch.relu(x).mean(), backend="vescale")
outs, refs = [], []
for n in (8, 5):
    x = torch.linspace(-1, 1, n * 2).reshape(n, 2)
    outs.append(f(vescale.distribute_tensor(x, m, [Shard(0)])))
    refs.append(torch.relu(x).mean())
check(outs, refs)
""",
        nproc=4,
    ),
    Case(
        "eager_uneven_from_local",
        UNEVEN,
        True,
        """
m = mesh()
x = torch.arange(10.0).reshape(5, 2)
local = x[:3] if RANK == 0 else x[3:]
check(vescale.DTensor.from_local(local, m, [Shard(0)]), x)
""",
    ),
    Case(
        "compiled_from_local_uneven_inside",
        UNEVEN,
        False,
        """
m = mesh()
f = torch.compile(lambda t: vescale.DTensor.from_local(t, m, [Shard(0)]).sum(), backend="vescale")
x = torch.arange(10.0).reshape(5, 2)
check(f(x[:3] if RANK == 0 else x[3:]), x.sum())
""",
    ),
    Case(
        "compiled_uneven_ddp_last_batch",
        UNEVEN,
        True,
        _MLP
        + """
from vescale.ddp import DistributedDataParallel as DDP
m = mesh()
ddp = DDP(Mlp(), dp_mesh=m)
f = torch.compile(ddp, backend="vescale")
x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
mine = x[:3] if RANK == 0 else x[3:]
f(mine).backward()
ref = Mlp()
(ref(x[:3]) / 2).backward(); (ref(x[3:]) / 2).backward()
check([p.grad for p in ddp.module.parameters() if p.grad is not None],
      [p.grad for p in ref.parameters() if p.grad is not None])
""",
    ),
    # ---- rank-dependent branches -----------------------------------------------------------
    Case(
        "ddp_eager_branch_same_shape",
        BRANCH,
        False,
        _MLP
        + """
from vescale.ddp import DistributedDataParallel as DDP
ddp = DDP(Mlp(), dp_mesh=mesh())
for _ in range(2):
    ddp(torch.randn(2, 4), RANK).backward()
check(torch.zeros(1), torch.zeros(1))
""",
    ),
    Case(
        "ddp_eager_branch_find_unused",
        BRANCH,
        True,
        _MLP
        + """
from vescale.ddp import DistributedDataParallel as DDP
ddp = DDP(Mlp(), dp_mesh=mesh(), find_unused_parameters=True)
xs = torch.randn(2, 2, 4, generator=torch.Generator().manual_seed(2))
ddp(xs[RANK], RANK).backward()
ref = Mlp()
for r in range(2):
    (ref(xs[r], r) / 2).backward()
check([p.grad for p in ddp.module.parameters()], [p.grad for p in ref.parameters()])
""",
    ),
    Case(
        "ddp_compiled_branch_find_unused",
        BRANCH,
        True,
        _MLP
        + """
from vescale.ddp import DistributedDataParallel as DDP
ddp = DDP(Mlp(), dp_mesh=mesh(), find_unused_parameters=True)
f = torch.compile(ddp, backend="vescale")
xs = torch.randn(2, 2, 4, generator=torch.Generator().manual_seed(2))
f(xs[RANK], RANK).backward()
ref = Mlp()
for r in range(2):
    (ref(xs[r], r) / 2).backward()
check([p.grad for p in ddp.module.parameters()], [p.grad for p in ref.parameters()])
""",
    ),
    Case(
        "compiled_rank_branch_collective",
        BRANCH,
        False,
        """
m = mesh()
def f(x, r):
    return x.redistribute(placements=[Replicate()]).sum() if r == 0 else x.sum()
g = torch.compile(f, backend="vescale")
x = vescale.distribute_tensor(torch.arange(8.0), m, [Shard(0)])
check(g(x, RANK), torch.arange(8.0).sum())
""",
    ),
    Case(
        "eager_rank_branch_full_tensor",
        BRANCH,
        False,
        """
m = mesh()
x = vescale.distribute_tensor(torch.arange(8.0), m, [Shard(0)])
y = x.full_tensor() if RANK == 0 else x.to_local()
check(torch.zeros(1), torch.zeros(1))
""",
    ),
    Case(
        "ddp_no_sync_on_one_rank",
        BRANCH,
        False,
        _MLP
        + """
from vescale.ddp import DistributedDataParallel as DDP
import contextlib
ddp = DDP(Mlp(), dp_mesh=mesh())
x = torch.randn(2, 4)
with ddp.no_sync() if RANK == 0 else contextlib.nullcontext():
    ddp(x).backward()
ddp(x).backward()
check(torch.zeros(1), torch.zeros(1))
""",
    ),
    # ---- silent wrong setups ---------------------------------------------------------------
    Case(
        "distribute_tensor_unsynced_values",
        SILENT,
        False,
        """
m = mesh()
torch.manual_seed(RANK)  # each rank a different tensor
x = torch.randn(4, 4)
obj = [x]; dist.broadcast_object_list(obj, src=0)
check(vescale.distribute_tensor(x, m, [Replicate()]), obj[0])
""",
    ),
    Case(
        "from_local_replicate_unsynced",
        SILENT,
        False,
        """
m = mesh()
x = torch.full((3,), float(RANK))
check(vescale.DTensor.from_local(x, m, [Replicate()]), torch.zeros(3))
""",
    ),
    Case(
        "from_local_replicate_unsynced_no_check",
        SILENT,
        False,
        """
m = mesh()
x = torch.full((3,), float(RANK))
check(vescale.DTensor.from_local(x, m, [Replicate()], run_check=False), torch.zeros(3))
""",
    ),
    Case(
        "ddp_unsynced_init_broadcast",
        SILENT,
        False,
        """
from vescale.ddp import DistributedDataParallel as DDP
torch.manual_seed(RANK)
net = nn.Linear(3, 2)
obj = [net.weight.detach().clone()]; dist.broadcast_object_list(obj, src=0)
ddp = DDP(net, dp_mesh=mesh())
check(net.weight, obj[0])
""",
    ),
    Case(
        "ddp_unsynced_init_sync_off",
        SILENT,
        False,
        """
from vescale.ddp import DistributedDataParallel as DDP
torch.manual_seed(RANK)
net = nn.Linear(3, 2)
obj = [net.weight.detach().clone()]; dist.broadcast_object_list(obj, src=0)
ddp = DDP(net, dp_mesh=mesh(), init_sync=False)
check(net.weight, obj[0])
""",
    ),
    Case(
        "deferred_init_cast_before_materialize",
        SILENT,
        True,
        """
m = mesh()
torch.manual_seed(0)
d = vescale.deferred_init(nn.Linear, 4, 6).double()
vescale.materialize_module(d, {"*": (m, [Shard(0)])})
torch.manual_seed(0)
ref = nn.Linear(4, 6).double()
check([d.weight, d.bias], [ref.weight, ref.bias])
""",
    ),
    Case(
        "deferred_init_seed_per_rank",
        SILENT,
        False,
        """
m = mesh()
torch.manual_seed(RANK)  # a different seed on each rank
d = vescale.deferred_init(nn.Linear, 4, 6)
vescale.materialize_module(d, {"*": (m, [Replicate()])})
torch.manual_seed(0)
ref = nn.Linear(4, 6)
check([d.weight], [ref.weight])
""",
    ),
    Case(
        "plan_optimizer_before_parallelize",
        SILENT,
        False,
        """
m = vescale.init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",))
torch.manual_seed(0)
net = nn.Linear(4, 4)
opt = torch.optim.SGD(net.parameters(), lr=0.1)
model = vescale.parallelize(net, m, {"weight": {"tp": Shard(0)}}, inputs=[{"tp": Replicate()}],
                            example_inputs=[torch.randn(2, 4)], compile=False)
model(torch.ones(2, 4)).sum().backward()
opt.step()
torch.manual_seed(0)
ref = nn.Linear(4, 4)
ref(torch.ones(2, 4)).sum().backward()
torch.optim.SGD(ref.parameters(), lr=0.1).step()
check([model.weight], [ref.weight])
""",
    ),
    Case(
        "plan_seed_mismatch",
        SILENT,
        False,
        """
m = vescale.init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",))
torch.manual_seed(RANK)
net = nn.Linear(4, 4)
model = vescale.parallelize(net, m, {"weight": {"tp": Shard(0)}}, inputs=[{"tp": Replicate()}],
                            example_inputs=[torch.randn(2, 4)], compile=False)
model(torch.ones(2, 4))
check(torch.zeros(1), torch.zeros(1))
""",
    ),
    Case(
        "plan_batch_mismatch",
        SILENT,
        False,
        """
m = vescale.init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",))
torch.manual_seed(0)
net = nn.Linear(4, 4)
model = vescale.parallelize(net, m, {"weight": {"tp": Shard(0)}}, inputs=[{"tp": Shard(0)}],
                            example_inputs=[torch.randn(2, 4)], compile=False)
model(torch.full((2, 4), float(RANK)))
check(torch.zeros(1), torch.zeros(1))
""",
    ),
    Case(
        "manual_seed_differs_dropout_replicate",
        SILENT,
        False,
        """
m = mesh()
torch.manual_seed(RANK)
x = vescale.distribute_tensor(torch.ones(64), m, [Replicate()])
y = F.dropout(x, 0.5, training=True)
check(y.to_local(), torch.ones(64))
""",
    ),
    # ---- one rank raising while the others wait ---------------------------------------------
    Case(
        "bad_env_value_one_rank",
        ONE_RANK,
        False,
        """
m = mesh()
x = vescale.distribute_tensor(torch.arange(4.0), m, [Shard(0)])
check((x + 1), torch.arange(4.0) + 1)
""",
        env=((1, "VESCALE_DISABLE_REDISTRIBUTE", "maybe"),),
    ),
    Case(
        "explicit_mode_off_one_rank",
        ONE_RANK,
        False,
        """
m = mesh()
x = vescale.distribute_tensor(torch.arange(4.0), m, [Shard(0)])
y = vescale.distribute_tensor(torch.arange(4.0), m, [Replicate()])
check(x + y, torch.arange(4.0) * 2)
""",
        env=((0, "VESCALE_DISABLE_REDISTRIBUTE", "1"),),
    ),
    Case(
        "bad_cache_dir_one_rank",
        ONE_RANK,
        False,
        """
m = mesh()
f = torch.compile(lambda x: (x * 3).sum(), backend="vescale")
check(f(vescale.distribute_tensor(torch.arange(4.0), m, [Shard(0)])), torch.arange(4.0).sum() * 3)
""",
        env=((1, "VESCALE_CACHE_DIR", "/proc/vescale_nope"),),
    ),
    Case(
        "bad_env_value_all_ranks",
        ONE_RANK,
        False,
        """
m = mesh()
x = vescale.distribute_tensor(torch.arange(4.0), m, [Shard(0)])
check(x * 2, torch.arange(4.0) * 2)
""",
        env=((None, "VESCALE_DISABLE_RUN_CHECK", "maybe"),),
    ),
    Case(
        "bad_backend_option",
        ONE_RANK,
        False,
        """
f = torch.compile(lambda x: x * 2, backend="vescale", options={"no_such_option": 1})
check(f(torch.ones(2)), torch.ones(2) * 2)
""",
    ),
    Case(
        "from_local_placements_differ",
        ONE_RANK,
        False,
        """
m = mesh()
check(vescale.DTensor.from_local(torch.ones(2, 2), m, [Shard(RANK)]), torch.ones(4, 2))
""",
    ),
    Case(
        "distribute_tensor_shape_differs",
        ONE_RANK,
        False,
        """
m = mesh()
x = torch.ones(4 + 2 * RANK, 2)
check(vescale.distribute_tensor(x, m, [Shard(0)]), torch.ones(4, 2))
""",
    ),
    Case(
        "redistribute_bad_dim",
        ONE_RANK,
        False,
        """
m = mesh()
x = vescale.distribute_tensor(torch.ones(4, 2), m, [Shard(0)])
check(x.redistribute(placements=[Shard(5)]), torch.ones(4, 2))
""",
    ),
    Case(
        "ddp_bad_dtype_one_rank",
        ONE_RANK,
        False,
        """
from vescale.ddp import DistributedDataParallel as DDP
torch.manual_seed(0)
net = nn.Linear(3, 2).to(torch.float64 if RANK == 1 else torch.float32)
ddp = DDP(net, dp_mesh=mesh())
ddp(torch.ones(2, 3, dtype=net.weight.dtype)).sum().backward()
check(torch.zeros(1), torch.zeros(1))
""",
    ),
    # ---- valid programs that fail -----------------------------------------------------------
    Case(
        "compiled_dropout_replicate",
        VALID,
        True,
        """
m = mesh()
f = torch.compile(lambda x: F.dropout(x, 0.5, training=True) * 2, backend="vescale")
y = f(vescale.distribute_tensor(torch.ones(64), m, [Replicate()]))
check(y.to_local() != 0, y.full_tensor() != 0)  # every rank the same mask
""",
    ),
    Case(
        "deepcopy_dtensor",
        VALID,
        True,
        """
import copy
m = mesh()
x = vescale.distribute_tensor(torch.arange(6.0).reshape(3, 2), m, [Shard(0)])
check(copy.deepcopy(x), torch.arange(6.0).reshape(3, 2))
""",
    ),
    Case(
        "torch_save_load_weights_only",
        VALID,
        True,
        """
import io
m = mesh()
x = vescale.distribute_tensor(torch.arange(6.0).reshape(3, 2), m, [Shard(0)])
buf = io.BytesIO(); torch.save(x, buf); buf.seek(0)
check(torch.load(buf, weights_only=True), torch.arange(6.0).reshape(3, 2))
""",
        nproc=2,
    ),
    Case(
        "dcp_2x2_to_4x1",
        VALID,
        True,
        """
import tempfile
import torch.distributed.checkpoint as dcp
path = [tempfile.mkdtemp() if RANK == 0 else None]; dist.broadcast_object_list(path, src=0)
v = torch.arange(35.0).reshape(7, 5)
a = vescale.distribute_tensor(v, mesh(2, 2), [Shard(0), Shard(1)])
dcp.save({"v": a}, checkpoint_id=path[0])
b = {"v": vescale.distribute_tensor(torch.zeros(7, 5), mesh(4, 1), [Shard(0), Replicate()])}
dcp.load(b, checkpoint_id=path[0])
check(b["v"], v)
""",
        nproc=4,
    ),
    Case(
        "size_one_mesh_dim_softmax",
        VALID,
        True,
        """
m = mesh(WORLD, 1)
x = torch.randn(4, 6, generator=torch.Generator().manual_seed(0))
y = torch.log_softmax(vescale.distribute_tensor(x, m, [Shard(0), Shard(1)]), dim=1)
check(y, torch.log_softmax(x, dim=1))
""",
    ),
    Case(
        "pickle_dtensor",
        VALID,
        True,
        """
import pickle
m = mesh()
x = vescale.distribute_tensor(torch.arange(4.0), m, [Shard(0)])
check(pickle.loads(pickle.dumps(x)), torch.arange(4.0))
""",
    ),
    Case(
        "ddp_state_dict_round_trip",
        VALID,
        True,
        """
from vescale.ddp import DistributedDataParallel as DDP
torch.manual_seed(0)
ddp = DDP(nn.Linear(3, 2), dp_mesh=mesh())
sd = ddp.state_dict()
fresh = DDP(nn.Linear(3, 2), dp_mesh=mesh())
fresh.load_state_dict(sd)
torch.manual_seed(0)
check([fresh.module.weight], [nn.Linear(3, 2).weight])
""",
    ),
    Case(
        "fsdp_full_state_dict",
        VALID,
        True,
        """
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from vescale.fsdp import fully_shard
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 3))
torch.manual_seed(0)
ref = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 3))
fully_shard(net, mesh=mesh())
sd = get_model_state_dict(net, options=StateDictOptions(full_state_dict=True))
check([sd[k] for k in sorted(sd)], [ref.state_dict()[k] for k in sorted(sd)])
""",
    ),
    Case(
        "compiled_ddp_no_sync",
        VALID,
        True,
        _MLP
        + """
from vescale.ddp import DistributedDataParallel as DDP
ddp = DDP(Mlp(), dp_mesh=mesh())
f = torch.compile(ddp, backend="vescale")
xs = torch.randn(2, 4, 4, generator=torch.Generator().manual_seed(3))
with ddp.no_sync():
    f(xs[RANK][:2]).backward()
f(xs[RANK][2:]).backward()
ref = Mlp()
for r in range(2):
    (ref(xs[r][:2]) / 2).backward(); (ref(xs[r][2:]) / 2).backward()
check([p.grad for p in ddp.module.parameters() if p.grad is not None],
      [p.grad for p in ref.parameters() if p.grad is not None])
""",
    ),
    # ---- faults ------------------------------------------------------------------------------
    Case(
        "stuck_rank_eager_collective",
        FAULT,
        False,
        """
m = mesh()
x = vescale.distribute_tensor(torch.arange(4.0), m, [Shard(0)])
if RANK == 1:
    time.sleep(3600)
check(x.full_tensor(), torch.arange(4.0))
""",
    ),
    Case(
        "rank_exits_before_collective",
        FAULT,
        False,
        """
m = mesh()
x = vescale.distribute_tensor(torch.arange(4.0), m, [Shard(0)])
if RANK == 1:
    os._exit(0)
check(x.full_tensor(), torch.arange(4.0))
""",
    ),
    Case(
        "rank_raises_before_collective",
        FAULT,
        False,
        """
m = mesh()
x = vescale.distribute_tensor(torch.arange(4.0), m, [Shard(0)])
if RANK == 1:
    raise ValueError("a user error on rank 1")
check(x.full_tensor(), torch.arange(4.0))
""",
    ),
    Case(
        "nan_input_one_rank_ddp",
        FAULT,
        True,
        """
from vescale.ddp import DistributedDataParallel as DDP
torch.manual_seed(0)
net = nn.Linear(3, 1)
ddp = DDP(net, dp_mesh=mesh())
x = torch.ones(2, 3); x[0, 0] = float("nan") if RANK == 1 else 1.0
ddp(x).sum().backward()
check(torch.isnan(net.weight.grad).any().reshape(1).float(), torch.ones(1))
""",
    ),
    Case(
        "inf_in_sharded_param_sum",
        FAULT,
        True,
        """
m = mesh()
v = torch.arange(4.0); v[3] = float("inf")
check(vescale.distribute_tensor(v, m, [Shard(0)]).sum(), v.sum())
""",
    ),
    Case(
        "stuck_rank_compiled",
        FAULT,
        False,
        """
m = mesh()
f = torch.compile(lambda x: x.redistribute(placements=[Replicate()]) * 2, backend="vescale")
x = vescale.distribute_tensor(torch.arange(4.0), m, [Shard(0)])
if RANK == 1:
    time.sleep(3600)
check(f(x), torch.arange(4.0) * 2)
""",
    ),
    # ---- unclear errors ---------------------------------------------------------------------
    Case(
        "op_across_two_meshes",
        UNCLEAR,
        False,
        """
a = vescale.distribute_tensor(torch.ones(4), mesh(), [Shard(0)])
m2 = vescale.init_device_mesh("cpu", (WORLD,), mesh_dim_names=("other",))
b = vescale.distribute_tensor(torch.ones(4), m2, [Shard(0)])
check(a + b, torch.ones(4) * 2)
""",
    ),
    Case(
        "matmul_shape_mismatch",
        UNCLEAR,
        False,
        """
m = mesh()
a = vescale.distribute_tensor(torch.ones(4, 3), m, [Shard(0)])
b = vescale.distribute_tensor(torch.ones(4, 3), m, [Replicate()])
check(a @ b, torch.ones(4, 4))
""",
    ),
    Case(
        "mesh_larger_than_world",
        UNCLEAR,
        False,
        """
check(vescale.distribute_tensor(torch.ones(4), mesh(WORLD + 1), [Shard(0)]), torch.ones(4))
""",
    ),
    Case(
        "ddp_plain_params_without_mesh_mixed",
        UNCLEAR,
        False,
        """
from vescale.ddp import DistributedDataParallel as DDP
net = nn.Linear(3, 2)
net.weight = nn.Parameter(vescale.distribute_tensor(net.weight.detach(), mesh(), [Replicate()]))
DDP(net)
check(torch.zeros(1), torch.zeros(1))
""",
    ),
]


# a rank's line; two ranks writing at once can put two on one line
_LINE = re.compile(r"R(\d+) (RESULT (?:ok|wrong)|ERROR .*?)(?=R\d+ (?:RESULT|ERROR)|$)", re.M)


def _classify(case: Case, rc: int, out: str, timed_out: bool) -> str:
    lines = dict(_LINE.findall(out))
    per_rank = [lines.get(str(r)) for r in range(case.nproc)]
    if timed_out:
        return "hang"
    # a rank killed by a signal of its own (torchrun stops the others with SIGTERM, -15)
    if any(int(n) != 15 for n in re.findall(r"exitcode\s*:\s*-(\d+)", out)):
        return "gloo abort"
    errors = [x for x in per_rank if x and x.startswith("ERROR")]
    if any(re.search(r"Timed out waiting \d+ms", x) for x in errors):
        return "hang"  # a rank waited out the gloo group's timeout
    if errors:
        if len(errors) == case.nproc and len(set(errors)) == 1:
            return "valid program failed" if case.valid else "clear error everywhere"
        return "error on one rank only"
    if all(x == "RESULT ok" for x in per_rank):
        return "correct"
    if any(x == "RESULT wrong" for x in per_rank):
        return "silent wrong result"
    return "error on one rank only" if rc else "silent wrong result"


def _run(case: Case, limit_s: float, pg_timeout_s: float) -> tuple[str, float, str]:
    body = textwrap.indent(textwrap.dedent(case.body).strip("\n"), "    ")
    code = PRELUDE.format(body=body, pg_timeout=pg_timeout_s, grace=GRACE_S)
    per_rank_env = [(r, k, v) for r, k, v in case.env if r is not None]
    if per_rank_env:  # set by rank at the top of the program, before anything reads it
        sets = "".join(
            f"if os.environ['RANK'] == '{r}': os.environ[{k!r}] = {v!r}\n"
            for r, k, v in per_rank_env
        )
        code = "import os\n" + sets + code
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_COMPILE_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.update({k: v for r, k, v in case.env if r is None})
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "case.py"
        script.write_text(code)
        cmd = [
            "timeout", "-k", "5", str(limit_s),
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(case.nproc), str(script),
        ]  # fmt: skip
        start = time.monotonic()
        p = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True)
        took = time.monotonic() - start
    out = p.stdout + p.stderr
    timed_out = p.returncode in (124, 137)
    return _classify(case, p.returncode, out, timed_out), took, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-k", default="", help="run the cases whose name contains one of these (a,b)")
    ap.add_argument("--out", type=Path, default=None, help="also write the table here")
    ap.add_argument("--timeout", type=float, default=150.0, help="seconds per case")
    ap.add_argument("--pg-timeout", type=float, default=90.0, help="the gloo group's timeout")
    ap.add_argument("-v", action="store_true", help="print each case's output tail")
    args = ap.parse_args()
    rows: list[str] = []
    counts: collections.Counter[str] = collections.Counter()
    for case in CASES:
        if not any(k in case.name for k in args.k.split(",")):
            continue
        outcome, took, out = _run(case, args.timeout, args.pg_timeout)
        counts[outcome] += 1
        rows.append(f"| {case.name} | {case.cls} | {outcome} | {took:.0f} |")
        print(rows[-1], flush=True)
        if args.v:  # each rank's line, or the first traceback
            lines = [f"R{r} {x}" for r, x in _LINE.findall(out)]
            tb = out[out.find("Traceback") :][:1200] if not lines else ""
            print(textwrap.indent("\n".join(lines) + tb, "    "), flush=True)
        if args.out:  # after each case: a partial run keeps what it measured
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(_table(rows, counts))
    print(_table(rows, counts))


def _table(rows: list[str], counts: collections.Counter[str]) -> str:
    table = ["| case | class | outcome | s |", "|---|---|---|---|", *rows, ""]
    table += [f"**{n}** {k}  " for k, n in counts.most_common()]
    return "\n".join(table) + "\n"


if __name__ == "__main__":
    main()
