"""Backend options and boolean env vars are checked strictly (issue 27 items 3-4).

Options: a value not of its field's type is a ``ValueError`` naming the option, the value and
what is accepted, raised when Dynamo calls the backend (the first call; Dynamo reports it as
``BackendCompilerFailed``), never a fallback to eager; ``vescale.parallelize`` raises it on
every rank before tracing. Env vars: ``1/true/yes/on`` and ``0/false/no/off`` in any case take
effect; any other value is a ``ValueError`` naming the variable, on every rank.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch._dynamo.exc import BackendCompilerFailed

import vescale
from tests.dtensor.reference import mesh_of
from tests.harness.misuse import error_everywhere
from vescale import Replicate, Shard
from vescale.backend import BackendOptions, capture_graphs

pytestmark = pytest.mark.filterwarnings(
    "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"
)

ON_WORDS = ["true", "ON", "yes", "1"]
OFF_WORDS = ["false", "OFF", "no", "0"]
BAD_WORDS = ["", "2", "maybe"]

BAD_OPTIONS = [
    ("strict", "false", "True or False"),
    ("explicit", "off", "True, False or None"),
    ("overlap", "no", "True or False"),
    ("rank_check", "no", "True or False"),
    ("eager", "1", "True or False"),
    ("eliminate", 1, "True or False"),
    ("dump_dir", 5, "a str, an os.PathLike or None"),
    ("bucket_cap_mb", None, "a number >= 0 (int or float)"),
    ("bucket_cap_mb", True, "a number >= 0 (int or float)"),
    ("overlap_cap_mb", -1.0, "a number >= 0 (int or float)"),
    ("codegen", "triton", "'inductor' or 'fx'"),
]


def _compile_error(options: dict[str, Any]) -> ValueError:
    """The ``ValueError`` the first call of a vescale-compiled function raises, through
    Dynamo's ``BackendCompilerFailed``; no vescale fallback warning on the way."""
    torch._dynamo.reset()
    f = torch.compile(lambda t: torch.sin(t) * 2, backend="vescale", options=options)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(BackendCompilerFailed) as err:
            f(torch.randn(4))
    torch._dynamo.reset()
    fallbacks = [str(w.message) for w in caught if "vescale backend" in str(w.message)]
    assert not fallbacks, fallbacks
    inner = err.value.inner_exception
    assert isinstance(inner, ValueError), repr(inner)
    assert str(inner) in str(err.value)  # the user sees its text
    return inner


@pytest.mark.parametrize(("name", "value", "accepted"), BAD_OPTIONS)
def test_bad_option_raises_at_the_first_call(name, value, accepted):
    err = _compile_error({"codegen": "fx", name: value})
    assert str(err).startswith(
        f"vescale backend: option {name} must be {accepted}, got {value!r}"
    ), str(err)


def test_a_string_for_a_bool_option_says_which_bool_was_meant():
    err = _compile_error({"codegen": "fx", "strict": "false"})
    assert str(err).endswith("; pass the bool False, not a string"), str(err)


def test_every_field_is_type_checked_and_accepted_values_pass(tmp_path):
    for f in dataclasses.fields(BackendOptions):
        with pytest.raises(ValueError, match=rf"^vescale backend: option {f.name} must be "):
            BackendOptions.resolve({f.name: object()})
    opts = BackendOptions.resolve({"bucket_cap_mb": 0, "explicit": None, "dump_dir": tmp_path})
    assert opts.bucket_cap_mb == 0.0 and type(opts.bucket_cap_mb) is float
    # a PathLike dump_dir really dumps there
    torch._dynamo.reset()
    given = {"codegen": "fx", "strict": True, "dump_dir": tmp_path}
    x = torch.randn(4, dtype=torch.float64)
    out = torch.compile(lambda t: torch.sin(t) * 2, backend="vescale", options=given)(x)
    torch._dynamo.reset()
    assert torch.equal(out, torch.sin(x) * 2)
    assert list((tmp_path / "rank0").glob("graph*/graph.annotate.txt"))


def test_bad_redistribute_env_raises_at_the_first_compiled_call(monkeypatch):
    monkeypatch.setenv("VESCALE_DISABLE_REDISTRIBUTE", "maybe")
    err = _compile_error({"codegen": "fx"})
    assert str(err).startswith("VESCALE_DISABLE_REDISTRIBUTE='maybe' is not a boolean"), str(err)


@pytest.mark.parametrize("word", ["true", "ON", "no", "0"])
def test_compile_eager_env_words(monkeypatch, word):
    """``VESCALE_COMPILE_EAGER`` on: the backend hands the Dynamo graph back, no AOT graphs."""
    monkeypatch.setenv("VESCALE_COMPILE_EAGER", word)
    torch._dynamo.reset()
    x = torch.randn(4, dtype=torch.float64)
    with capture_graphs() as graphs:
        f = torch.compile(lambda t: torch.sin(t) * 2, backend="vescale", options={"codegen": "fx"})
        assert torch.equal(f(x), torch.sin(x) * 2)
    torch._dynamo.reset()
    assert (graphs == []) == (word in ON_WORDS), [g.name for g in graphs]


@pytest.mark.parametrize("word", BAD_WORDS)
def test_compile_eager_env_bad_words(monkeypatch, word):
    monkeypatch.setenv("VESCALE_COMPILE_EAGER", word)
    err = _compile_error({"codegen": "fx"})
    assert str(err).startswith(f"VESCALE_COMPILE_EAGER={word!r} is not a boolean"), str(err)


def _implicit_matmul(compiled: bool) -> None:
    """``a @ b`` of two row-sharded operands (needs an all-gather) equals one device's."""
    torch.manual_seed(0)
    fa, fb = torch.randn(8, 8, dtype=torch.float64), torch.randn(8, 8, dtype=torch.float64)
    mesh = mesh_of((2,))
    a = vescale.distribute_tensor(fa, mesh, [Shard(0)])
    b = vescale.distribute_tensor(fb, mesh, [Shard(0)])

    def f(a, b):
        return a @ b

    if compiled:
        torch._dynamo.reset()
        f = torch.compile(f, backend="vescale", options={"codegen": "fx", "strict": True})
    out = f(a, b).full_tensor()
    torch._dynamo.reset()
    assert torch.allclose(out, fa @ fb, atol=1e-12)


@pytest.mark.parametrize("word", OFF_WORDS)
def test_redistribute_env_off_words_allow_implicit_redistribution(pool2, word):
    pool2.run(_implicit_matmul, False, env={"VESCALE_DISABLE_REDISTRIBUTE": word})


def test_redistribute_env_off_word_allows_it_compiled(pool2):
    pool2.run(_implicit_matmul, True, env={"VESCALE_DISABLE_REDISTRIBUTE": "false"})


@pytest.mark.parametrize("word", ON_WORDS)
def test_redistribute_env_on_words_forbid_it_and_the_error_quotes_the_value(pool2, word):
    err = error_everywhere(
        pool2, _implicit_matmul, False, env={"VESCALE_DISABLE_REDISTRIBUTE": word}
    )
    assert err.kind == "ImplicitRedistributionError", err
    assert f"explicit mode is on (VESCALE_DISABLE_REDISTRIBUTE={word!r})" in err.message, err


@pytest.mark.parametrize("word", BAD_WORDS)
def test_redistribute_env_bad_words_raise_on_every_rank(pool2, word):
    err = error_everywhere(
        pool2, _implicit_matmul, False, env={"VESCALE_DISABLE_REDISTRIBUTE": word}
    )
    assert err.kind == "ValueError", err
    assert err.message.startswith(f"VESCALE_DISABLE_REDISTRIBUTE={word!r} is not a boolean"), err


def _replicated_from_local() -> float:
    """This rank's value after ``from_local(Replicate)`` of the rank number: 0 (rank 0's)
    everywhere when the run check syncs it, else the rank's own."""
    mine = torch.full((3,), float(dist.get_rank()))
    return vescale.from_local(mine, mesh_of((2,)), [Replicate()]).to_local()[0].item()


@pytest.mark.parametrize("word", ["true", "ON", "no", "0"])
def test_run_check_env_words(pool2, word):
    values = pool2.run(_replicated_from_local, env={"VESCALE_DISABLE_RUN_CHECK": word})
    assert values == ([0.0, 1.0] if word in ON_WORDS else [0.0, 0.0]), values


def test_run_check_env_bad_word_raises_on_every_rank(pool2):
    err = error_everywhere(pool2, _replicated_from_local, env={"VESCALE_DISABLE_RUN_CHECK": "2"})
    assert err.kind == "ValueError", err
    assert err.message.startswith("VESCALE_DISABLE_RUN_CHECK='2' is not a boolean"), err


class _Chain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("W", torch.randn(4, 4))

    def forward(self) -> torch.Tensor:
        return (self.W @ self.W).sum()


def _parallelize_with(options: dict[str, Any]) -> None:
    mesh = mesh_of((2,))
    plan = {"W": (Shard(0),)}
    vescale.parallelize(_Chain(), mesh, plan, inputs=[], example_inputs=[], options=options)


def test_parallelize_checks_options_on_every_rank(pool2):
    err = error_everywhere(pool2, _parallelize_with, {"overlap": "no"})
    assert err.kind == "ValueError", err
    assert err.message.startswith(
        "vescale backend: option overlap must be True or False, got 'no' (str)"
    ), err
