"""Ops on ``RaggedShard`` DTensors (issue 29 item 2): element-wise ops, the optimizers'
foreach ops, reductions, ``clip_grad_norm_`` and gradients through them.

Every result equals the same op on the one-device float64 tensor; layouts have uneven units
and ranks holding nothing. Element-wise ops keep the input's placements and communicate
nothing; a reduction over every dim communicates nothing until its value is read, then one
all-reduce; ``clip_grad_norm_`` over several parameters all-reduces once. SGD, Adam and
AdamW (foreach on and off) on RaggedShard parameters equal torch's one-device optimizer.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

import vescale
from tests.harness.collectives import count_collectives
from vescale import Partial, RaggedShard, Replicate, Shard

INF = math.inf

# world size -> [(global shape, RaggedShard dims, local_units)]
LAYOUTS = {
    2: [
        ((8, 6), (0,), (3, 1)),
        ((4, 6), (0, 1), (0, 24)),
        ((6, 2, 3), (0,), (1, 2)),
    ],
    4: [
        ((8, 6), (0,), (1, 0, 3, 4)),
        ((4, 6), (0, 1), (5, 0, 7, 12)),
        ((6, 2, 3), (0,), (0, 0, 6, 0)),
        ((12,), (0,), (1, 2, 0, 3)),
    ],
}


def _mesh() -> vescale.DeviceMesh:
    return vescale.init_device_mesh("cpu", (dist.get_world_size(),))


def _layouts() -> list[tuple[tuple[int, ...], RaggedShard]]:
    return [
        (shape, RaggedShard(dims, units)) for shape, dims, units in LAYOUTS[dist.get_world_size()]
    ]


def _expected_local(full: torch.Tensor, p: RaggedShard) -> torch.Tensor:
    """This rank's slice of the flattened storage, from the units (independent of vescale)."""
    units, rank = p.local_units, dist.get_rank()
    rows = math.prod(full.shape[: len(p.dims)])
    per_unit = rows // sum(units) * (full.numel() // rows)
    start = sum(units[:rank]) * per_unit
    return full.reshape(-1)[start : start + units[rank] * per_unit]


def _check(out: torch.Tensor, expected: torch.Tensor, placements: tuple, what: str) -> None:
    assert type(out) is vescale.DTensor and out.placements == placements, (what, out.placements)
    assert out.shape == expected.shape and out.dtype == expected.dtype, (what, out.shape)
    ragged = [p for p in placements if isinstance(p, RaggedShard)]
    if ragged:
        assert torch.equal(out.to_local(), _expected_local(expected, ragged[0])), what
    assert torch.equal(out.full_tensor(), expected), what


# ---- element-wise ------------------------------------------------------------------------

UNARY = {
    "neg": torch.neg,
    "exp": torch.exp,
    "sqrt_abs": lambda x: x.abs().sqrt(),
    "gt": lambda x: x > 0,
    "to_float32": lambda x: x.to(torch.float32),
    "zeros_like": torch.zeros_like,
}
BINARY = {
    "add": lambda x, y: x + y,
    "mul": torch.mul,
    "div": torch.div,
    "sub_alpha": lambda x, y: torch.sub(x, y, alpha=0.5),
    "maximum": torch.maximum,
    "where": lambda x, y: torch.where(x > y, x, y),
    "lerp": lambda x, y: torch.lerp(x, y, 0.3),
    "addcdiv": lambda x, y: torch.addcdiv(x, y, y.abs() + 1, value=-0.5),
}
IN_PLACE = {
    "add_": lambda x, y: x.add_(y, alpha=2.0),
    "mul_": lambda x, y: x.mul_(y),
    "copy_": lambda x, y: x.copy_(y),
    "lerp_": lambda x, y: x.lerp_(y, 0.25),
    "addcmul_": lambda x, y: x.addcmul_(y, y, value=0.5),
    "clamp_": lambda x, y: x.clamp_(min=-0.5, max=0.5),
    "zero_": lambda x, y: x.zero_(),
}


def elementwise() -> None:
    mesh = _mesh()
    torch.manual_seed(0)
    for shape, p in _layouts():
        a, b = torch.randn(shape, dtype=torch.float64), torch.randn(shape, dtype=torch.float64)
        x, y = (vescale.distribute_tensor(t, mesh, [p]) for t in (a, b))
        with count_collectives() as counts:
            outs = {k: f(x) for k, f in UNARY.items()}
            outs |= {k: f(x, y) for k, f in BINARY.items()}
            scalar = vescale.distribute_tensor(
                torch.tensor(2.5, dtype=torch.float64), mesh, [Replicate()]
            )
            outs["dtensor_scalar"] = x * scalar
            outs["python_scalar"] = 3.0 - x
        assert sum(counts.values()) == 0, (shape, p, dict(counts))
        for k, f in UNARY.items():
            _check(outs[k], f(a), (p,), f"{k} {shape} {p}")
        for k, f in BINARY.items():
            _check(outs[k], f(a, b), (p,), f"{k} {shape} {p}")
        _check(outs["dtensor_scalar"], a * 2.5, (p,), "dtensor_scalar")
        _check(outs["python_scalar"], 3.0 - a, (p,), "python_scalar")
        for k, f in IN_PLACE.items():
            xc, ac = x.clone(), a.clone()
            local = xc.to_local()
            out = f(xc, y)
            assert out is xc and xc.to_local().data_ptr() == local.data_ptr(), k
            _check(xc, f(ac, b), (p,), f"{k} {shape} {p}")


def replicated_operand() -> None:
    """A Replicate tensor of the same shape joins a RaggedShard one by slicing (no collective)."""
    mesh = _mesh()
    torch.manual_seed(1)
    for shape, p in _layouts():
        a, b = torch.randn(shape, dtype=torch.float64), torch.randn(shape, dtype=torch.float64)
        x = vescale.distribute_tensor(a, mesh, [p])
        r = vescale.distribute_tensor(b, mesh, [Replicate()])
        with count_collectives() as counts:
            out = x * r
            x.add_(r)
        assert sum(counts.values()) == 0, dict(counts)
        _check(out, a * b, (p,), "mul replicated")
        _check(x, a + b, (p,), "add_ replicated")


def foreach_ops() -> None:
    mesh = _mesh()
    torch.manual_seed(2)
    layouts = _layouts()
    a = [torch.randn(shape, dtype=torch.float64) for shape, _ in layouts]
    b = [torch.randn(shape, dtype=torch.float64) for shape, _ in layouts]
    x = [vescale.distribute_tensor(t, mesh, [p]) for t, (_, p) in zip(a, layouts)]
    y = [vescale.distribute_tensor(t, mesh, [p]) for t, (_, p) in zip(b, layouts)]
    with count_collectives() as counts:
        added = torch._foreach_add(x, y, alpha=0.5)
        roots = torch._foreach_sqrt(torch._foreach_abs(x))
        torch._foreach_addcdiv_(x, y, roots, [0.1 * i for i in range(len(x))])
        torch._foreach_lerp_(y, x, 0.2)
    assert sum(counts.values()) == 0, dict(counts)
    ref_added = torch._foreach_add(a, b, alpha=0.5)
    ref_roots = torch._foreach_sqrt(torch._foreach_abs(a))
    torch._foreach_addcdiv_(a, b, ref_roots, [0.1 * i for i in range(len(a))])
    torch._foreach_lerp_(b, a, 0.2)
    for i, (_, p) in enumerate(layouts):
        _check(added[i], ref_added[i], (p,), "foreach_add")
        _check(roots[i], ref_roots[i], (p,), "foreach_sqrt")
        _check(x[i], a[i], (p,), "foreach_addcdiv_")
        _check(y[i], b[i], (p,), "foreach_lerp_")


# ---- optimizers --------------------------------------------------------------------------

OPTIMIZERS = {
    "sgd": lambda ps, fe: torch.optim.SGD(
        ps, lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=True, foreach=fe
    ),
    "adam": lambda ps, fe: torch.optim.Adam(ps, lr=0.05, weight_decay=0.1, foreach=fe),
    "adamw": lambda ps, fe: torch.optim.AdamW(ps, lr=0.05, weight_decay=0.1, foreach=fe),
    "adam-fused": lambda ps, fe: torch.optim.Adam(ps, lr=0.05, weight_decay=0.1, fused=True),
    "adamw-fused": lambda ps, fe: torch.optim.AdamW(ps, lr=0.05, weight_decay=0.1, fused=True),
}
STEPS = 3


def optimizer_steps(name: str, foreach: bool) -> None:
    mesh = _mesh()
    torch.manual_seed(3)
    layouts = _layouts()
    values = [torch.randn(shape, dtype=torch.float64) for shape, _ in layouts]
    grads = [[torch.randn_like(v) for v in values] for _ in range(STEPS)]
    ref = [torch.nn.Parameter(v.clone()) for v in values]
    params = [
        torch.nn.Parameter(vescale.distribute_tensor(v, mesh, [p]))
        for v, (_, p) in zip(values, layouts)
    ]
    ref_opt, opt = OPTIMIZERS[name](ref, foreach), OPTIMIZERS[name](params, foreach)
    for step in range(STEPS):
        for r, q, g in zip(ref, params, grads[step]):
            r.grad = g
            q.grad = vescale.distribute_tensor(g, mesh, q.placements)
        ref_opt.step()
        with count_collectives() as counts:
            opt.step()
        assert sum(counts.values()) == 0, (name, dict(counts))
    for r, q, (_, p) in zip(ref, params, layouts):
        _check(q.data, r.detach(), (p,), f"{name} foreach={foreach}")
        for key, state in opt.state[q].items():
            if key != "step":
                assert type(state) is vescale.DTensor and state.placements == (p,), key


RUNS = [(n, fe) for n in OPTIMIZERS for fe in ([False] if "fused" in n else [False, True])]


@pytest.mark.parametrize(("name", "foreach"), RUNS, ids=[f"{n}-foreach={fe}" for n, fe in RUNS])
def test_optimizer_equals_one_device(pool4, name, foreach):
    pool4.run(optimizer_steps, name, foreach)


def test_adamw_pool2(pool2):
    pool2.run(optimizer_steps, "adamw", True)


# ---- reductions --------------------------------------------------------------------------

# name -> (op on a DTensor or tensor, pending placement)
FULL_REDUCTIONS = {
    "sum": (torch.sum, Partial("sum")),
    "sum_dims_keepdim": (lambda x: x.sum(dim=list(range(x.ndim)), keepdim=True), Partial("sum")),
    "mean": (torch.mean, Partial("sum")),
    "norm2": (lambda x: torch.linalg.vector_norm(x), None),
    "norm1": (lambda x: torch.linalg.vector_norm(x, 1), None),
    "norm3": (lambda x: x.norm(3), None),
    "norm_inf": (lambda x: torch.linalg.vector_norm(x, INF), None),
    "norm_neg_inf": (lambda x: torch.linalg.vector_norm(x, -INF), None),
}


def full_reductions() -> None:
    mesh = _mesh()
    torch.manual_seed(4)
    for shape, p in _layouts():
        a = torch.randn(shape, dtype=torch.float64)
        x = vescale.distribute_tensor(a, mesh, [p])
        for name, (f, pending) in FULL_REDUCTIONS.items():
            with count_collectives() as counts:
                out = f(x)
            assert sum(counts.values()) == 0, (name, dict(counts))
            assert out.placements[0].is_partial(), (name, out.placements)
            if pending is not None:
                assert out.placements == (pending,), (name, out.placements)
            with count_collectives() as counts:
                value = out.full_tensor()
            assert dict(counts) == {"all_reduce": 1}, (name, dict(counts))
            expected = f(a)
            assert value.shape == expected.shape, (name, value.shape)
            torch.testing.assert_close(value, expected, rtol=1e-12, atol=1e-12, msg=name)


TRAILING = {
    "sum_dim_last": lambda x: x.sum(dim=-1),
    "mean_dim_last_keepdim": lambda x: x.mean(dim=-1, keepdim=True),
    "norm_dim_last": lambda x: torch.linalg.vector_norm(x, 2, dim=-1),
    "norm_inf_dim_last": lambda x: torch.linalg.vector_norm(x, INF, dim=-1),
}


def trailing_reductions() -> None:
    """Reducing dims after the flattened ones keeps the RaggedShard: no communication."""
    mesh = _mesh()
    torch.manual_seed(5)
    for shape, p in _layouts():
        if len(shape) == len(p.dims):
            continue
        a = torch.randn(shape, dtype=torch.float64)
        x = vescale.distribute_tensor(a, mesh, [p])
        for name, f in TRAILING.items():
            with count_collectives() as counts:
                out = f(x)
            assert sum(counts.values()) == 0, (name, dict(counts))
            expected = f(a)
            assert out.placements == (p,) and out.shape == expected.shape, (name, out.placements)
            torch.testing.assert_close(
                out.to_local(), _expected_local(expected, p), rtol=1e-12, atol=0
            )
            torch.testing.assert_close(out.full_tensor(), expected, rtol=1e-12, atol=0)


def clip_grad_norm(norm_type: float, foreach: bool | None) -> None:
    """RaggedShard gradients beside an uneven ``Shard(0)`` one (a foreach list mixing both):
    one all-reduce in all, the norm and the clipped gradients equal to one device."""
    mesh = _mesh()
    torch.manual_seed(6)
    layouts = [(shape, (p,)) for shape, p in _layouts()] + [((7, 3), (Shard(0),))]
    values = [torch.randn(shape, dtype=torch.float64) for shape, _ in layouts]
    grads = [torch.randn_like(v) * (i + 1) for i, v in enumerate(values)]
    ref = [torch.nn.Parameter(v.clone()) for v in values]
    params = [
        torch.nn.Parameter(vescale.distribute_tensor(v, mesh, placements))
        for v, (_, placements) in zip(values, layouts)
    ]
    for r, q, g in zip(ref, params, grads):
        r.grad = g.clone()
        q.grad = vescale.distribute_tensor(g, mesh, q.placements)
    expected = torch.nn.utils.clip_grad_norm_(ref, 0.5, norm_type=norm_type)
    with count_collectives() as counts:
        total = torch.nn.utils.clip_grad_norm_(params, 0.5, norm_type=norm_type, foreach=foreach)
    assert dict(counts) == {"all_reduce": 1}, dict(counts)
    torch.testing.assert_close(total.full_tensor(), expected, rtol=1e-12, atol=0)
    for r, q, (_, placements) in zip(ref, params, layouts):
        assert q.grad.placements == placements
        torch.testing.assert_close(q.grad.full_tensor(), r.grad, rtol=1e-12, atol=0)


LOSSES = {
    "sum": lambda x, y: (x * y - x.exp()).sum(),
    "mean": lambda x, y: (x * x).mean(),
    "norm": lambda x, y: torch.linalg.vector_norm(x.exp() - y),
    "masked": lambda x, y: torch.where(x > 0, x, y * 2.0).sum(),
}


def gradients() -> None:
    """Backward through element-wise ops and reductions: RaggedShard gradients equal to one
    device (a norm's backward reduces the norm first)."""
    mesh = _mesh()
    torch.manual_seed(8)
    for shape, p in _layouts():
        a, b = torch.randn(shape, dtype=torch.float64), torch.randn(shape, dtype=torch.float64)
        y = vescale.distribute_tensor(b, mesh, [p])
        for name, f in LOSSES.items():
            x = torch.nn.Parameter(vescale.distribute_tensor(a, mesh, [p]))
            ref = a.clone().requires_grad_()
            f(x, y).backward()
            f(ref, b).backward()
            assert x.grad.placements == (p,), (name, x.grad.placements)
            torch.testing.assert_close(
                x.grad.to_local(), _expected_local(ref.grad, p), rtol=1e-12, atol=1e-12
            )


SAMPLES = [
    elementwise,
    replicated_operand,
    foreach_ops,
    full_reductions,
    trailing_reductions,
    gradients,
]


@pytest.mark.parametrize("fn", SAMPLES, ids=lambda f: f.__name__)
def test_ops_pool2(pool2, fn):
    pool2.run(fn)


@pytest.mark.parametrize("fn", SAMPLES, ids=lambda f: f.__name__)
def test_ops_pool4(pool4, fn):
    pool4.run(fn)


@pytest.mark.parametrize("foreach", [None, True], ids=["default", "foreach"])
@pytest.mark.parametrize("norm_type", [2.0, INF], ids=["2", "inf"])
def test_clip_grad_norm_pool4(pool4, norm_type, foreach):
    pool4.run(clip_grad_norm, norm_type, foreach)


def test_clip_grad_norm_pool2(pool2):
    pool2.run(clip_grad_norm, 2.0, None)


# ---- beside other placements on a 2x2 mesh -----------------------------------------------

LAYOUTS_2D = [
    ((8, 6), [Shard(1), RaggedShard((0,), (1, 3))]),
    ((4, 6), [RaggedShard((0, 1), (5, 7)), Replicate()]),
    ((6, 4), [Shard(0), RaggedShard((0,), (0, 1))]),
]


def mesh_2d() -> None:
    """Element-wise ops, AdamW, full reductions and clip_grad_norm_ with the RaggedShard
    beside Shard or Replicate: equal to one device (locals as distribute_tensor lays out); a
    reduction's value read with one all-reduce per sharded mesh dim (as for Shard)."""
    mesh = vescale.init_device_mesh("cpu", (2, 2))
    torch.manual_seed(7)
    values = [torch.randn(shape, dtype=torch.float64) for shape, _ in LAYOUTS_2D]
    grads = [torch.randn_like(v) for v in values]
    for v, (_, placements) in zip(values, LAYOUTS_2D):
        x = vescale.distribute_tensor(v, mesh, placements)
        with count_collectives() as counts:
            y = (x * 2.0 + x.exp()).mul_(x)
            total, norm, top = (
                x.sum(),
                torch.linalg.vector_norm(x),
                torch.linalg.vector_norm(x, INF),
            )
        assert sum(counts.values()) == 0, dict(counts)
        expected = (v * 2.0 + v.exp()).mul_(v)
        assert y.placements == tuple(placements)
        assert torch.equal(
            y.to_local(), vescale.distribute_tensor(expected, mesh, placements).to_local()
        )
        assert torch.equal(y.full_tensor(), expected)
        for out, ref in [
            (total, v.sum()),
            (norm, torch.linalg.vector_norm(v)),
            (top, v.abs().max()),
        ]:
            with count_collectives() as counts:
                value = out.full_tensor()
            sharded = sum(not p.is_replicate() for p in placements)  # one per mesh dim, as Shard
            assert dict(counts) == {"all_reduce": sharded}, (placements, dict(counts))
            torch.testing.assert_close(value, ref, rtol=1e-12, atol=1e-12)

    ref = [torch.nn.Parameter(v.clone()) for v in values]
    params = [
        torch.nn.Parameter(vescale.distribute_tensor(v, mesh, placements))
        for v, (_, placements) in zip(values, LAYOUTS_2D)
    ]
    for r, q, g in zip(ref, params, grads):
        r.grad = g.clone()
        q.grad = vescale.distribute_tensor(g, mesh, q.placements)
    expected_norm = torch.nn.utils.clip_grad_norm_(ref, 0.5)
    torch.testing.assert_close(
        torch.nn.utils.clip_grad_norm_(params, 0.5).full_tensor(), expected_norm, rtol=1e-12, atol=0
    )
    ref_opt = torch.optim.AdamW(ref, lr=0.05, weight_decay=0.1, foreach=True)
    opt = torch.optim.AdamW(params, lr=0.05, weight_decay=0.1, foreach=True)
    ref_opt.step()
    opt.step()
    for r, q, (_, placements) in zip(ref, params, LAYOUTS_2D):
        assert q.placements == tuple(placements)
        torch.testing.assert_close(q.full_tensor(), r.detach(), rtol=1e-12, atol=0)


def test_mesh_2d(pool4):
    pool4.run(mesh_2d)
