"""Strategy validation: every op vescale hooks, and every upstream op whose strategies produce
private placements (``_MaskPartial``, ``_NormPartial``, ``_StridedShard``), run through
``vescale.DTensor`` on enumerated input placements of small random inputs and compared with
the same computation on one device (float64, 1e-10; gradients too).

Upstream's ``torch/distributed/tensor/_ops/strategy_validation.py`` checks each strategy's
claims in isolation (placements simulated on LocalTensors); here the whole path runs, as users
meet it: vescale's handlers and wrapped strategies, the dispatcher's redistributions and
vescale's planner, on gloo ranks. The op cases reuse the fuzz's (``op_cases.py``) and add the
ones below; :func:`reached_ops` records which aten ops a case dispatches (forward and
backward), so a test can demand that every hook is exercised by some case.

An answer is one of: right; *refused* (an exception naming the op: a layout vescale declines
with a clear error); wrong (a wrong value, or any other exception).
"""

from __future__ import annotations

import itertools
import random
import warnings
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import vescale
from tests.dtensor.op_cases import CASES, EVEN, EXTRA_CASES, UNEVEN, OpCase, seeded
from tests.dtensor.test_op_fuzz import MeshKey, check_layout, layouts, make_inputs, mesh_ndim

aten = torch.ops.aten


def _f(g: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def _p(g: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.rand(*shape, generator=g, dtype=torch.float64)


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(5)


def _random_inplace(p: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return (
        p.clone().cauchy_(),
        p.clone().log_normal_(),
        p.clone().geometric_(0.3),
        p.clone().random_(),
        p.clone().random_(7),
        p.clone().random_(2, 9),
        p.clone().bernoulli_(p),
        torch.randint_like(p, 2, 9),
        torch.bernoulli(p, 0.4),
        torch.nn.init.normal_(p.clone(), 0.5, 2.0),
        torch.nn.init.uniform_(p.clone(), -1.0, 3.0),
    )


def _random_generators(p: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return (
        torch.rand_like(p, generator=_gen()),
        torch.randn_like(p, generator=_gen()),
        torch.randint_like(p, 5, generator=_gen()),
        torch.randint_like(p, 2, 5, generator=_gen()),
    )


def _scatter_reduce_arg(x: torch.Tensor, i: torch.Tensor, s: torch.Tensor) -> tuple:
    with warnings.catch_warnings():  # torch deprecates reduce= with a tensor src; still an op
        warnings.simplefilter("ignore", UserWarning)
        return x.clone().scatter_(0, i, s, reduce="add"), x.clone().scatter_(
            0, i, 2.0, reduce="multiply"
        )


def _flatten_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x.reshape(-1, x.shape[-1]) @ w).view(x.shape[0], x.shape[1], -1)


def _split_cat(x: torch.Tensor) -> torch.Tensor:
    parts = x.split(3, dim=1)
    rows = x.split([2, x.shape[0] - 2], dim=0)
    return torch.cat([*parts[::-1], *x.chunk(2, dim=1)], dim=1) + torch.cat(rows[::-1]).sum()


VALIDATION_CASES: Sequence[OpCase] = (
    OpCase(
        "gather_index_size1",  # upstream: input Shard(dim) + index _MaskPartial
        lambda x, i: torch.gather(x, 1, i),
        lambda r, c, g: (_f(g, r, c), torch.randint(0, c, (r, 1), generator=g)),
        grad=(0,),
        partial=(0,),
    ),
    OpCase(
        "gather_dim0",
        lambda x, i: torch.gather(x, 0, i),
        lambda r, c, g: (_f(g, r, c), torch.randint(0, r, (3, c), generator=g)),
        grad=(0,),
        partial=(0,),
    ),
    OpCase(
        "vector_norm",  # upstream: _NormPartial
        lambda x: (
            torch.linalg.vector_norm(x),
            torch.linalg.vector_norm(x, 1, dim=1),
            torch.linalg.vector_norm(x, float("inf"), dim=0),
            torch.linalg.vector_norm(x, float("-inf")),
            x.norm(3),
        ),
        lambda r, c, g: (_f(g, r, c),),
        grad=(0,),
        partial=(0,),
    ),
    OpCase(
        "empty_dim_list",  # [] reduces every dim (upstream's strategies read it as none)
        lambda x: (
            torch.sum(x, [], keepdim=True),
            torch.mean(x, []),
            x.mean(),  # aten.mean.default (hooked for RaggedShard inputs)
            torch.nansum(x, []),
            torch.amax(x, []),
            torch.amin(x, [], keepdim=True),
            # no gradient: one device's var backward over [] divides by 1 - 1 (inf)
            torch.var(x.detach(), []),
            torch.std(x.detach(), [], keepdim=True),
            torch.var_mean(x, [])[1],
            torch.linalg.vector_norm(x, 3, dim=[]),
            torch.ops.aten.linalg__powsum(x.detach(), 2.0, []),  # no derivative
        ),
        lambda r, c, g: (_f(g, r, c),),
        grad=(0,),
        partial=(0,),
    ),
    OpCase(
        "foreach_norm",  # clip_grad_norm_'s reduction: _NormPartial per tensor
        lambda x, y: (*torch._foreach_norm([x, y]), *torch._foreach_norm([x, y], float("inf"))),
        lambda r, c, g: (_f(g, r, c), _f(g, c, r)),
        grad=(0, 1),
        partial=(0, 1),
    ),
    OpCase(
        "flatten_sharded_then_mm",  # _StridedShard through a view, mm and a view back
        _flatten_mm,
        lambda r, c, g: (_f(g, 2, r, c), _f(g, c, 3)),
        grad=(0, 1),
        partial=(1,),
    ),
    OpCase(
        "split_chunk_cat",
        _split_cat,
        lambda r, c, g: (_f(g, r, c),),
        grad=(0,),
        partial=(0,),
    ),
    OpCase(
        "slice_step",
        lambda x: x[1:4, ::2] * 2,
        lambda r, c, g: (_f(g, r, c),),
        grad=(0,),
        partial=(0,),
    ),
    OpCase(
        "log_softmax",
        lambda x: (F.log_softmax(x, dim=1), F.log_softmax(x, dim=0)),
        lambda r, c, g: (_f(g, r, c),),
        grad=(0,),
        partial=(0,),
    ),
    OpCase(
        "layer_norm",  # vescale's layout rule for native_layer_norm_backward
        lambda x, w: F.layer_norm(x, x.shape[-1:], w) * 1.5,
        lambda r, c, g: (_f(g, r, c), _f(g, c)),
        grad=(0, 1),
        partial=(0,),
    ),
    OpCase(
        "elementwise_losses",
        lambda x, y, p: (
            F.mse_loss(x, y),
            F.smooth_l1_loss(x, y, reduction="sum"),
            F.huber_loss(x, y, delta=0.5),
            F.soft_margin_loss(x, y.sign()),
            F.binary_cross_entropy(p, (y > 0).double()),
        ),
        lambda r, c, g: (_f(g, r, c), _f(g, r, c), _p(g, r, c) * 0.9 + 0.05),
        grad=(0, 2),
        partial=(0,),
    ),
    OpCase("clone", lambda x: x.clone(), lambda r, c, g: (_f(g, r, c),), grad=(0,), partial=(0,)),
    OpCase(
        "as_strided_identity",
        lambda x: x.as_strided(x.shape, x.stride()),
        lambda r, c, g: (_f(g, r, c),),
    ),
    OpCase(
        "index_add",
        lambda x, i, s: torch.index_add(x, 0, i, s, alpha=-1.5),
        lambda r, c, g: (_f(g, r, c), torch.randint(0, r, (6,), generator=g), _f(g, 6, c)),
        grad=(0, 2),
        partial=(0, 2),
    ),
    OpCase(
        "scatter_add_inplace",
        lambda x, i, s: x.clone().scatter_add_(0, i, s),
        lambda r, c, g: (_f(g, r, c), torch.randint(0, r, (3, c), generator=g), _f(g, 3, c)),
        partial=(0, 2),
    ),
    OpCase(
        "scatter_reduce_arg",  # upstream registers no strategy: refused on every layout
        _scatter_reduce_arg,
        lambda r, c, g: (_f(g, r, c), torch.randint(0, r, (3, c), generator=g), _f(g, 3, c)),
        partial=(0, 2),
    ),
    OpCase("nonzero", lambda x: torch.nonzero(x > 0), lambda r, c, g: (_f(g, r, c),)),
    OpCase(
        "equal",
        lambda a, b, c: (torch.equal(a, b), torch.equal(a, c)),
        lambda r, cols, g: (lambda x: (x, x.clone(), x + (x > 1.5)))(_f(g, r, cols)),
    ),
    OpCase("random_inplace", seeded(_random_inplace), lambda r, c, g: (_p(g, r, c),)),
    OpCase("random_generators", _random_generators, lambda r, c, g: (_p(g, r, c),)),
)

ALL_CASES: Sequence[OpCase] = (*CASES, *EXTRA_CASES, *VALIDATION_CASES)
CASE_BY_NAME = {c.name: c for c in ALL_CASES}

PRIVATE_PLACEMENT_OPS = (
    aten.gather.default,  # _MaskPartial index
    aten.embedding.default,  # _MaskPartial index (row-wise tables)
    aten.linalg_vector_norm.default,  # _NormPartial
    aten._foreach_norm.Scalar,  # _NormPartial
    aten.view.default,  # _StridedShard
    aten.mm.default,  # _StridedShard operands
)
"""Upstream ops whose strategies produce private placements, validated with vescale's."""

KNOWN_WRONG: dict[str, str] = {}
"""Cases whose wrong answers the validation found and are not fixed yet, with the layout."""

UNREACHED: dict[str, str] = {
    "aten.randint_like.Tensor": "needs a tensor `high`; torch.randint_like's Python binding "
    "takes ints only, so no program reaches it",
    "aten.randint_like.Tensor_generator": "as aten.randint_like.Tensor",
    "aten._scaled_dot_product_flash_attention.default": "a CUDA kernel (no CPU one); its "
    "handler runs upstream's sharding and only moves the Philox offset per shard "
    "(tests/dtensor/test_random_philox.py checks it on meta tensors)",
    "aten._scaled_dot_product_efficient_attention.default": "as the flash attention kernel",
    "aten.reshape.default": "CompositeImplicit: decomposed into view/_unsafe_view before "
    "DTensor dispatch (validated through those)",
}
"""Hooked ops no case reaches, and why (the coverage test keeps this list honest)."""


def hooked_ops() -> set[str]:
    """Every op vescale hooks: handlers, strategies it registers or wraps, vescale rules."""
    from vescale import _patches
    from vescale.dtensor.ops import _registry

    tables = {"OpDispatcher._custom_op_handlers", "ShardingPropagator.op_strategy_funcs"}
    ops = {str(e.key) for e in _patches._entries.values() if e.table_name in tables}
    return ops | {str(op) for op in _registry.rule_ops()}


class _Record(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops.add(str(func))
        return func(*args, **(kwargs or {}))


def reached_ops(case: OpCase) -> set[str]:
    """The aten ops ``case`` dispatches on one device, forward and backward."""
    inputs = [
        x.clone().requires_grad_(i in case.grad) for i, x in enumerate(make_inputs(case, EVEN))
    ]
    with _Record() as rec:
        out = case.fn(*inputs)
        outs = [
            o for o in (out if isinstance(out, tuple) else (out,)) if isinstance(o, torch.Tensor)
        ]
        loss = sum((o.sum() for o in outs if o.requires_grad), torch.zeros((), dtype=torch.float64))
        if loss.requires_grad:
            loss.backward()
    return rec.ops


@dataclass
class Tally:
    """Layouts checked, refused with a clear error, and wrong (with what went wrong)."""

    checked: int = 0
    refused: int = 0
    wrong: list[str] = field(default_factory=list)

    def add(self, other: Tally) -> None:
        self.checked += other.checked
        self.refused += other.refused
        self.wrong += other.wrong


def _refusal(err: Exception) -> bool:
    """A clear error: not an assertion (a wrong value) and names the op or a placement."""
    msg = str(err)
    return not isinstance(err, AssertionError) and ("aten." in msg or "Shard(" in msg)


def sweep(
    names: Sequence[str],
    mesh_keys: Sequence[MeshKey],
    sample: int | None = None,
    sizes: Sequence[tuple[int, int]] = (EVEN, UNEVEN),
) -> tuple[int, int, list[str]]:
    """Run every case on every mesh and size: all layouts, or ``sample`` of them per mesh and
    size (chosen by a seed from the case name). Returns (checked, refused, wrong)."""
    tally = Tally()
    with vescale.dtensor.explicit_redistribute(False):
        for name, key, size in itertools.product(names, mesh_keys, sizes):
            case = CASE_BY_NAME[name]
            if mesh_ndim(key) == 2 and not case.mesh_2d:
                continue
            every = layouts(case, make_inputs(case, size), mesh_ndim(key))
            if sample is not None:
                rng = random.Random(zlib.crc32(f"{name}{key}{size}".encode()))
                every = rng.sample(every, min(sample, len(every)))
            for layout in every:
                tally.checked += 1
                try:
                    check_layout(case, size, key, layout)
                except Exception as e:
                    if _refusal(e):
                        tally.refused += 1
                    else:
                        line = str(e).strip().splitlines()[:2]
                        tally.wrong.append(
                            f"{name} {key} {size} {layout}: {type(e).__name__}: {line}"
                        )
    return tally.checked, tally.refused, tally.wrong


def uncovered(
    cases: Sequence[OpCase] = ALL_CASES, reach: Callable[[OpCase], set[str]] = reached_ops
) -> set[str]:
    """Hooked and private-placement ops that no case reaches and :data:`UNREACHED` does not explain."""
    reached: set[str] = set()
    for case in cases:
        reached |= reach(case)
    wanted = hooked_ops() | {str(op) for op in PRIVATE_PLACEMENT_OPS}
    return wanted - reached - set(UNREACHED)
