"""docs/concepts.md "Ops on every placement" as test cases: inputs, the op, which inputs take gradients.

Shared by the op x placement fuzz test and the communication tests. Every case builds its
global inputs from a seed and a size pair (``rows``, ``cols``): (8, 12) shards evenly on 2
and 4 ranks, (5, 7) does not (4 ranks hold 2, 2, 1 and 0 rows).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

aten = torch.ops.aten

EVEN = (8, 12)
UNEVEN = (5, 7)


@dataclass(frozen=True)
class OpCase:
    """``fn(*inputs)`` with ``make(rows, cols, gen)`` building the global inputs.

    ``grad``: inputs that require grad (float). ``partial``: inputs that may be Partial.
    ``shared``: all inputs take the same placements (attention's q, k, v).
    ``mesh_2d``: also fuzzed on the 2x2 mesh (the math attention's decomposition is not: its
    first call per layout spends seconds in upstream's graph-based redistribution planner).
    """

    name: str
    fn: Callable[..., Any]
    make: Callable[[int, int, torch.Generator], tuple[torch.Tensor, ...]]
    grad: tuple[int, ...] = ()
    partial: tuple[int, ...] = ()
    shared: bool = False
    mesh_2d: bool = True


def _f(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=torch.float64)


def _distinct(gen: torch.Generator, n: int, k: int, high: int, along: int) -> torch.Tensor:
    """A long index of ``n`` lines of ``k`` distinct values in ``[0, high)``; lines run along
    dim ``along`` (0: shape (k, n), 1: shape (n, k))."""
    idx = torch.stack([torch.randperm(high, generator=gen)[:k] for _ in range(n)])
    return idx if along == 1 else idx.t().contiguous()


def _in_place(method: str) -> Callable[..., torch.Tensor]:
    def run(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        y = x.clone()
        getattr(y, method)(*args, **kwargs)
        return y

    return run


def _scatter_src(dim: int, in_place: bool) -> Callable[..., torch.Tensor]:
    if in_place:
        return lambda x, i, s: _in_place("scatter_")(x, dim, i, s)
    return lambda x, i, s: torch.scatter(x, dim, i, s)


def _scatter_value(dim: int, in_place: bool) -> Callable[..., torch.Tensor]:
    if in_place:
        return lambda x, i: _in_place("scatter_")(x, dim, i, 2.5)
    return lambda x, i: torch.scatter(x, dim, i, 2.5)


def _scatter_inputs(dim: int, with_src: bool) -> Callable[..., tuple[torch.Tensor, ...]]:
    def make(r: int, c: int, g: torch.Generator) -> tuple[torch.Tensor, ...]:
        k = 3
        idx = _distinct(g, r, k, c, 1) if dim == 1 else _distinct(g, c, k, r, 0)
        x = _f(g, r, c)
        return (x, idx, _f(g, *idx.shape)) if with_src else (x, idx)

    return make


def _rows(g: torch.Generator, r: int, m: int) -> torch.Tensor:
    return torch.randint(0, r, (m,), generator=g)


def _unique(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return torch.unique(x, sorted=True, return_inverse=True, return_counts=True)  # type: ignore[no-any-return]


def _sdpa_inputs(r: int, c: int, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    b, h, length, e = (2, 4, 6, 3) if r % 2 == 0 else (3, 5, 7, 3)
    return tuple(_f(g, b, h, length, e) for _ in range(3))


def _sdpa_mask_inputs(boolean: bool) -> Callable[..., tuple[torch.Tensor, ...]]:
    """q, k, v and a per-head (b, h, length, length) mask, bool (the diagonal kept, so no row
    is fully masked) or float."""

    def make(r: int, c: int, g: torch.Generator) -> tuple[torch.Tensor, ...]:
        q, k, v = _sdpa_inputs(r, c, g)
        b, h, length, _ = q.shape
        if not boolean:
            return q, k, v, _f(g, b, h, length, length)
        keep = torch.rand(b, h, length, length, generator=g) > 0.4
        return q, k, v, keep | torch.eye(length, dtype=torch.bool)

    return make


def _math_sdpa(**kwargs: Any) -> Callable[..., torch.Tensor]:
    """``F.scaled_dot_product_attention(q, k, v[, attn_mask], **kwargs)`` on the math path."""

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *mask: torch.Tensor) -> Any:
        with sdpa_kernel(SDPBackend.MATH):
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask[0] if mask else None, **kwargs
            )

    return run


def _targets(g: torch.Generator, r: int, c: int, ignore: bool) -> torch.Tensor:
    t = torch.randint(0, c, (r,), generator=g)
    if ignore:
        t[1] = -100
    return t


CASES: Sequence[OpCase] = (
    OpCase("argmax", lambda x: x.argmax(1), lambda r, c, g: (_f(g, r, c),), partial=(0,)),
    OpCase("argmin", lambda x: x.argmin(0), lambda r, c, g: (_f(g, r, c),), partial=(0,)),
    OpCase(
        "topk_dim0",
        lambda x: torch.topk(x, 2, dim=0),
        lambda r, c, g: (_f(g, r, c),),
        grad=(0,),
        partial=(0,),
    ),
    OpCase(
        "topk_dim1_smallest",
        lambda x: torch.topk(x, 3, dim=1, largest=False),
        lambda r, c, g: (_f(g, r, c),),
        grad=(0,),
        partial=(0,),
    ),
    OpCase("unique", _unique, lambda r, c, g: (torch.randint(0, 6, (r, c), generator=g),)),
    OpCase(
        "scatter_src_dim1",
        _scatter_src(1, False),
        _scatter_inputs(1, True),
        grad=(0, 2),
        partial=(0, 2),
    ),
    OpCase(
        "scatter__src_dim0",
        _scatter_src(0, True),
        _scatter_inputs(0, True),
        grad=(0, 2),
        partial=(0, 2),
    ),
    OpCase(
        "scatter_value_dim0",
        _scatter_value(0, False),
        _scatter_inputs(0, False),
        grad=(0,),
        partial=(0,),
    ),
    OpCase(
        "scatter__value_dim1",
        _scatter_value(1, True),
        _scatter_inputs(1, False),
        grad=(0,),
        partial=(0,),
    ),
    OpCase(
        "select_dim0",
        lambda x: x.select(0, x.shape[0] - 2),
        lambda r, c, g: (_f(g, r, c),),
        grad=(0,),
        partial=(0,),
    ),
    OpCase(
        "select_dim1",
        lambda x: x.select(1, 1),
        lambda r, c, g: (_f(g, r, c),),
        grad=(0,),
        partial=(0,),
    ),
    OpCase(
        "select_negative_dim",
        lambda x: x.select(-1, 1),
        lambda r, c, g: (_f(g, r, c),),
        grad=(0,),
        partial=(0,),
    ),
    OpCase(
        "narrow_negative_dim",
        lambda x: x.narrow(-1, 1, 3),
        lambda r, c, g: (_f(g, r, c),),
        grad=(0,),
        partial=(0,),
    ),
    OpCase("alias", aten.alias.default, lambda r, c, g: (_f(g, r, c),), grad=(0,), partial=(0,)),
    OpCase(
        "index_put",
        lambda x, i, v: torch.index_put(x, (i,), v),
        lambda r, c, g: (_f(g, r, c), torch.randperm(r, generator=g)[:3], _f(g, 3, c)),
        grad=(0, 2),
        partial=(0, 2),
    ),
    OpCase(
        "index_put__accumulate",
        lambda x, i, v: _in_place("index_put_")(x, (i,), v, accumulate=True),
        lambda r, c, g: (_f(g, r, c), _rows(g, r, 6), _f(g, 6, c)),
        grad=(0, 2),
        partial=(0, 2),
    ),
    OpCase(
        "index_put_2d",
        lambda x, i, j, v: torch.index_put(x, (i, j), v, accumulate=True),
        lambda r, c, g: (_f(g, r, c), _rows(g, r, 6), _rows(g, c, 6), _f(g, 6)),
        grad=(0, 3),
        partial=(0, 3),
    ),
    OpCase(
        "index_add__dim0",
        lambda x, i, s: _in_place("index_add_")(x, 0, i, s, alpha=2.0),
        lambda r, c, g: (_f(g, r, c), _rows(g, r, 6), _f(g, 6, c)),
        grad=(0, 2),
        partial=(0, 2),
    ),
    OpCase(
        "index_add__dim1",
        lambda x, i, s: _in_place("index_add_")(x, 1, i, s),
        lambda r, c, g: (_f(g, r, c), _rows(g, c, 4), _f(g, r, 4)),
        grad=(0, 2),
        partial=(0, 2),
    ),
    OpCase(
        "expand_as",
        lambda a, b: a.expand_as(b),
        lambda r, c, g: (_f(g, r, 1), _f(g, r, c)),
        grad=(0,),
        partial=(0, 1),
    ),
    OpCase(
        "one_hot",
        lambda i: F.one_hot(i, 9),
        lambda r, c, g: (torch.randint(0, 9, (r, 3), generator=g),),
    ),
    OpCase(
        "where",
        torch.where,
        lambda r, c, g: (_f(g, r, c) > 0, _f(g, r, c), _f(g, r, c)),
        grad=(1, 2),
        partial=(1, 2),
    ),
    OpCase(
        "where_scalar",
        lambda m, x: torch.where(m, x, 0.5),
        lambda r, c, g: (_f(g, r, c) > 0, _f(g, r, c)),
        grad=(1,),
        partial=(1,),
    ),
    OpCase(
        "embedding",
        F.embedding,
        lambda r, c, g: (torch.randint(0, c, (r, 3), generator=g), _f(g, c, r)),
        grad=(1,),
        partial=(1,),
    ),
    OpCase(
        "cross_entropy",
        F.cross_entropy,
        lambda r, c, g: (_f(g, r, c), _targets(g, r, c, False)),
        grad=(0,),
        partial=(0,),
    ),
    OpCase(
        "cross_entropy_sum_ignore",
        lambda x, t: F.cross_entropy(x, t, reduction="sum"),
        lambda r, c, g: (_f(g, r, c), _targets(g, r, c, True)),
        grad=(0,),
        partial=(0,),
    ),
    OpCase(
        "cross_entropy_none",
        lambda x, t: F.cross_entropy(x, t, reduction="none"),
        lambda r, c, g: (_f(g, r, c), _targets(g, r, c, True)),
        grad=(0,),
        partial=(0,),
    ),
    OpCase(
        "nll_loss",
        F.nll_loss,
        lambda r, c, g: (_f(g, r, c), _targets(g, r, c, True)),
        grad=(0,),
        partial=(0,),
    ),
    OpCase(
        "sdpa_cpu_flash_causal",
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        _sdpa_inputs,
        grad=(0, 1, 2),
        partial=(0, 1, 2),
        shared=True,
    ),
    OpCase(
        "sdpa_math",
        lambda q, k, v: aten._scaled_dot_product_attention_math(q, k, v)[0],
        _sdpa_inputs,
        grad=(0, 1, 2),
        partial=(0, 1, 2),
        shared=True,
        mesh_2d=False,
    ),
    OpCase(
        "sdpa_math_causal",
        _math_sdpa(is_causal=True),
        _sdpa_inputs,
        grad=(0, 1, 2),
        partial=(0, 1, 2),
        shared=True,
        mesh_2d=False,
    ),
    OpCase(
        "sdpa_math_float_mask",
        _math_sdpa(),
        _sdpa_mask_inputs(False),
        grad=(0, 1, 2),
        partial=(0, 1, 2, 3),
        shared=True,
        mesh_2d=False,
    ),
    OpCase(
        "sdpa_math_bool_mask",
        _math_sdpa(),
        _sdpa_mask_inputs(True),
        grad=(0, 1, 2),
        shared=True,
        mesh_2d=False,
    ),
)


def seeded(fn: Callable[..., Any], seed: int = 1234) -> Callable[..., Any]:
    """``fn`` run from a fixed generator state, so a random op's single-device reference and
    its DTensor run draw the same numbers."""

    def run(*args: Any) -> Any:
        torch.manual_seed(seed)
        return fn(*args)

    return run


def _random_like(p: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return (
        torch.rand_like(p),
        torch.randn_like(p),
        torch.randint_like(p, 5),
        torch.bernoulli(p),
        p.clone().exponential_(),
        p.clone().bernoulli_(0.3),
    )


def _chained_view(x: torch.Tensor) -> torch.Tensor:
    r, c = x.shape
    return x.reshape(-1).view(c, r).t().reshape(r, c).unsqueeze(0).flatten(0, 1)


EXTRA_CASES: Sequence[OpCase] = (
    OpCase("chained_views", _chained_view, lambda r, c, g: (_f(g, r, c),), grad=(0,), partial=(0,)),
    OpCase(
        "random_like",
        seeded(_random_like),
        lambda r, c, g: (torch.rand(r, c, generator=g, dtype=torch.float64),),
        partial=(0,),
    ),
    OpCase(
        "dropout",
        seeded(lambda x: (F.dropout(x, 0.4), *aten.native_dropout(x, 0.3, True))),
        lambda r, c, g: (_f(g, r, c),),
        grad=(0,),
        partial=(0,),
    ),
    OpCase(
        "sdpa_math_causal_dropout",
        seeded(_math_sdpa(is_causal=True, dropout_p=0.3)),
        _sdpa_inputs,
        grad=(0, 1, 2),
        partial=(0, 1, 2),
        shared=True,
        mesh_2d=False,
    ),
)
"""Chained views (flattening sharded dims: interleaved layouts), every random op of
``vescale.dtensor.random`` and math-path attention's dropout (seeded), fuzzed like ``CASES``."""

BY_NAME = {case.name: case for case in (*CASES, *EXTRA_CASES)}
