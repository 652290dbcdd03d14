"""Importing vescale changes nothing for upstream DTensor code (issue 13).

Upstream programs on gloo ranks compute what they compute without vescale, in upstream's
classes, with upstream's implicit redistribution; vescale DTensors keep vescale's semantics;
every change to a torch object is an entry of ``vescale._patches`` that ``uninstall()``
restores, and no other module assigns to a torch object.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor as UpstreamDTensor
from torch.distributed.tensor import Partial as UpstreamPartial
from torch.distributed.tensor import Replicate as UpstreamReplicate
from torch.distributed.tensor import Shard as UpstreamShard
from torch.distributed.tensor import distribute_tensor as upstream_distribute

import vescale
from tests.dtensor.reference import mesh_of
from vescale import Replicate, Shard
from vescale.dtensor.dispatch import ImplicitRedistributionError, explicit_redistribute

ROOT = Path(__file__).resolve().parents[1]


def _check_upstream_program() -> None:
    mesh = mesh_of((2,))
    torch.manual_seed(0)
    a, b, w = (
        torch.randn(6, 4, dtype=torch.float64),
        torch.randn(4, 5, dtype=torch.float64),
        torch.randn(4, 4),
    )
    da = upstream_distribute(a, mesh, [UpstreamShard(0)])
    db = upstream_distribute(b, mesh, [UpstreamShard(1)])
    # explicit mode is on by default for vescale DTensors; upstream's implicit redistribution here
    with explicit_redistribute(True):
        out = da @ db
    assert type(out) is UpstreamDTensor and type(out._spec) is type(da._spec)
    assert torch.allclose(out.full_tensor(), a @ b, atol=1e-12)
    # nn.Parameter needs detach() to keep the class (FSDP2 and TP styles build these)
    p = torch.nn.Parameter(upstream_distribute(w, mesh, [UpstreamShard(0)]))
    assert type(p.detach()) is UpstreamDTensor
    loss = (p * 2).sum()
    assert type(loss) is UpstreamDTensor
    loss.backward()
    assert type(p.grad) is UpstreamDTensor and torch.equal(
        p.grad.full_tensor(), torch.full((4, 4), 2.0)
    )
    # upstream's Partial divides the value (vescale keeps it on coordinate 0)
    part = upstream_distribute(torch.ones(4), mesh, [UpstreamPartial()])
    assert torch.equal(part.to_local(), torch.full((4,), 0.5))
    # clone keeps upstream's rule on a Partial (reduces it); vescale keeps Partial
    assert part.clone().placements == (UpstreamReplicate(),)
    vpart = vescale.distribute_tensor(torch.ones(4), mesh, [vescale.Partial()])
    assert vpart.clone().placements == (vescale.Partial(),)


def test_upstream_program_unchanged(pool2):
    pool2.run(_check_upstream_program)


def _check_vescale_semantics() -> None:
    mesh = mesh_of((2,))
    a, b = torch.randn(6, 4, dtype=torch.float64), torch.randn(4, 5, dtype=torch.float64)
    va = vescale.distribute_tensor(a, mesh, [Shard(0)])
    vb = vescale.distribute_tensor(b, mesh, [Shard(1)])
    with pytest.raises(ImplicitRedistributionError, match=r"aten\.mm.*Shard\(dim=1\)"):
        va @ vb
    with explicit_redistribute(False):
        out = va @ vb
    assert type(out) is vescale.DTensor
    assert torch.allclose(out.full_tensor(), a @ b, atol=1e-12)
    # an op with one vescale and one upstream input gives a vescale DTensor
    mixed = va + upstream_distribute(a, mesh, [UpstreamShard(0)])
    assert type(mixed) is vescale.DTensor and torch.allclose(mixed.full_tensor(), 2 * a)
    rep = vescale.distribute_tensor(a, mesh, [Replicate()])
    assert type(rep.detach()) is vescale.DTensor
    p = torch.nn.Parameter(rep)
    assert type(p.detach()) is vescale.DTensor


def test_vescale_semantics_kept(pool2):
    pool2.run(_check_vescale_semantics)


_SNAPSHOT = r"""
import torch
from torch.distributed.tensor import DTensor
import torch.distributed.tensor._dispatch as d
from torch.distributed.tensor._utils import ExplicitRedistributionContext as E
from torch.distributed.device_mesh import _mesh_resources as M
prop = DTensor._op_dispatcher.sharding_propagator
def snap():
    return {
        "wrap": vars(d.OpDispatcher)["wrap"],
        "observe": vars(E)["observe_redistribution"],
        "redistribute": d.redistribute_local_tensor,
        "devices": vars(M).get("num_devices_per_host"),
        "prop": vars(prop).get("propagate_op_sharding"),
        "prop_nc": vars(prop).get("propagate_op_sharding_non_cached"),
        "handlers": dict(DTensor._op_dispatcher._custom_op_handlers),
        "strategies": dict(prop.op_strategy_funcs),
        "single_dim": dict(prop.op_single_dim_strategy_funcs),
        "schema_info": dict(prop.op_to_schema_info),
        "adjusters": dict(prop.op_to_scalar_shape_adjuster),
    }
before = snap()
import vescale
from vescale import _patches
after = snap()
changed = sorted(k for k in before if before[k] != after[k])
_patches.install()  # idempotent
assert snap() == after
_patches.uninstall()
restored = snap()
def vescale_made(v):
    return "vescale" in (getattr(v, "__module__", None) or getattr(type(v), "__module__", ""))
def same(b, r):
    if isinstance(b, dict):  # importing vescale may import upstream modules that register more
        return all(r.get(k) is v for k, v in b.items()) and not any(
            vescale_made(v) for k, v in r.items() if k not in b
        )
    return b is r
bad = sorted(k for k in before if not same(before[k], restored[k]))
assert not bad, f"not restored: {bad}"
_patches.install()
assert snap() == after, "re-install differs"
rows = _patches.describe()
print(changed, len(rows))
"""


def test_uninstall_restores_every_entry():
    out = subprocess.run(
        [sys.executable, "-c", _SNAPSHOT], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr[-3000:]
    changed, n = out.stdout.strip().rsplit(" ", 1)
    # every kind of entry is exercised, so the test cannot pass by changing nothing
    for key in (
        "wrap",
        "observe",
        "redistribute",
        "devices",
        "prop",
        "handlers",
        "strategies",
        "adjusters",
    ):
        assert key in changed, (key, changed)
    assert int(n) >= 20


def _torch_names(tree: ast.Module) -> set[str]:
    """Module-level names bound to torch objects: imported from torch (or vescale's private
    import module), or derived from one (``PROPAGATOR = DTensor._op_dispatcher...``)."""
    names = {"torch"}
    for node in tree.body:
        if (
            isinstance(node, ast.ImportFrom)
            and node.module
            and (node.module.startswith("torch") or node.module.endswith("_torch_compat"))
        ):
            names.update(a.asname or a.name for a in node.names)
        elif isinstance(node, ast.Assign):
            root = node.value
            while isinstance(root, ast.Attribute | ast.Subscript | ast.Call):
                root = root.func if isinstance(root, ast.Call) else root.value
            if isinstance(root, ast.Name) and root.id in names:
                names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def _root(node: ast.expr) -> str | None:
    while isinstance(node, ast.Attribute | ast.Subscript):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


_MUTATORS = {"pop", "update", "setdefault", "clear", "__setitem__", "__delitem__"}


def test_upstream_loss_parallel_leaves_vescale_handlers():
    """Upstream's ``loss_parallel()`` pops the handlers it installed on exit; vescale's
    handlers for the same ops (class-sharded nll_loss) are there again afterwards."""
    from torch.distributed.tensor.parallel import loss_parallel

    table = UpstreamDTensor._op_dispatcher._custom_op_handlers
    nll = torch.ops.aten.nll_loss_forward.default
    before = dict(table)
    assert before[nll].__module__.startswith("vescale")
    with loss_parallel():
        assert table[nll].__module__.startswith("torch")
    assert table == before


def test_only_the_seam_changes_torch_objects():
    offenders = []
    for path in sorted((ROOT / "vescale").rglob("*.py")):
        if path.name == "_patches.py":
            continue
        tree = ast.parse(path.read_text())
        torch_names = _torch_names(tree)
        for node in ast.walk(tree):
            targets: list[ast.expr] = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, ast.AugAssign | ast.AnnAssign):
                targets = [node.target]
            elif isinstance(node, ast.Delete):
                targets = node.targets
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                if node.func.attr in _MUTATORS and isinstance(node.func.value, ast.Attribute):
                    targets = [node.func.value]
                elif node.func.attr == "setattr":
                    targets = [node.func]
            for t in targets:
                if isinstance(t, ast.Attribute | ast.Subscript) and _root(t) in torch_names:
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, f"assignments to torch objects outside vescale/_patches.py: {offenders}"


def test_docs_list_every_attribute():
    from vescale import _patches

    doc = (ROOT / "docs" / "torch-changes.md").read_text()
    attributes = [r for r in _patches.describe() if "." not in r[1] and not r[1].startswith("aten")]
    assert len(attributes) >= 6
    missing = [f"{owner}.{name}" for owner, name, _ in attributes if f"`{name}`" not in doc]
    assert not missing, f"docs/torch-changes.md does not list {missing}"
