"""The compiled-step cache (vescale/plan/step_cache.py) on 2 gloo ranks: a second
``parallelize`` of the same model loads the first one's Inductor code instead of compiling
(no trace), and trains exactly as the compiled one did and as one device does; an entry is
not written while dumps are, nor read with the cache off; a damaged entry (bad JSON, an
unknown dtype) compiles again; an entry whose code Inductor's cache no longer holds compiles
again."""

from __future__ import annotations

import ast
import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

import vescale
import vescale.backend as backend
from tests.harness.pool import scoped_environ
from tests.plan.gpt_cases import ALPHA_BETA, train
from tests.plan.test_plan_cache import last_lines_of_two_runs
from vescale.plan import Batch


class _Regression(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((self.net(x) - y) ** 2).mean()


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 8, generator=g), torch.randn(8, 2, generator=g)) for _ in range(3)]


def _placed(**kwargs: Any) -> Any:
    """The regression placed on a 2-rank dp mesh, its batch free over dp."""
    mesh = vescale.init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    return vescale.parallelize(
        _Regression(),
        mesh,
        {},
        inputs=[Batch("dp")] * 2,
        example_inputs=_batches()[0],
        alpha_beta=ALPHA_BETA,
        progress=False,
        **kwargs,
    )


def _place_and_train(options: dict[str, Any] | None = None) -> tuple[int, list[float], dict]:
    """(graphs traced and compiled, losses, final parameters) of the placed model."""
    traced = [0]
    compile_ = backend._compile

    def counted(*args: Any) -> Any:
        traced[0] += 1
        return compile_(*args)

    backend._compile = counted  # type: ignore[assignment]
    try:
        losses, params = train(_placed(options=options), _batches())
    finally:
        backend._compile = compile_  # type: ignore[assignment]
    return traced[0], losses, params


def _steps(root: str) -> list[Path]:
    return sorted((Path(root) / "steps").glob("*.json"))


def _cache_cases(folder: str) -> dict[str, Any]:
    import torch.distributed as dist

    root = os.path.join(folder, f"rank{dist.get_rank()}")  # one entry per rank, its own
    out: dict[str, Any] = {}
    cache_on = {"VESCALE_CACHE_DIR": root, "VESCALE_PLAN_CACHE": "1", "VESCALE_DUMP_DIR": None}
    with scoped_environ(cache_on):
        out["cold"] = _place_and_train()
        out["files after cold"] = len(_steps(root))
        out["warm"] = _place_and_train()
        (entry,) = _steps(root)
        data = json.loads(entry.read_text())
        entry.write_text("{not json")
        out["damaged"] = _place_and_train()
        out["rewritten"] = json.loads(entry.read_text()) == data
        entry.write_text(json.dumps({**data, "key": "f" * 52}))  # Inductor holds no such code
        out["gone"] = _place_and_train()
        bad = [[shape, stride, "torch.float99"] for shape, stride, _ in data["outputs"]]
        entry.write_text(json.dumps({**data, "outputs": bad}))  # no such dtype: not an entry
        out["bad dtype"] = _place_and_train()
        entry.write_text(json.dumps(data))
        out["dumps"] = _place_and_train({"dump_dir": os.path.join(root, "dumps")})
    with scoped_environ({"VESCALE_CACHE_DIR": root, "VESCALE_PLAN_CACHE": "0"}):
        out["off"] = _place_and_train()
    out["files at the end"] = len(_steps(root))
    return out


def test_a_second_placement_loads_the_compiled_step(pool2, tmp_path):
    ref_losses, ref_params = train(_Regression(), _batches())
    out, other = pool2.run(_cache_cases, str(tmp_path), timeout_s=600)
    for case, value in out.items():  # both ranks: the same traces, losses, full parameters
        if isinstance(value, tuple):
            assert value[:2] == other[case][:2], case
            assert all(torch.equal(v, other[case][2][k]) for k, v in value[2].items()), case
        else:
            assert value == other[case], case
    assert out["files after cold"] == 1
    assert out["files at the end"] == 1  # neither dumps nor the off switch wrote another
    assert out["rewritten"]  # the damaged entry was compiled again and stored again
    cases = ("cold", "warm", "damaged", "gone", "bad dtype", "dumps", "off")
    traced = {case: out[case][0] for case in cases}
    assert traced == {
        "cold": 1,
        "warm": 0,
        "damaged": 1,
        "gone": 1,
        "bad dtype": 1,
        "dumps": 1,
        "off": 1,
    }
    cold_losses, cold_params = out["cold"][1:]
    assert all(abs(a - b) < 1e-5 for a, b in zip(cold_losses, ref_losses)), (
        cold_losses,
        ref_losses,
    )
    for k, v in cold_params.items():
        torch.testing.assert_close(v, ref_params[k.removeprefix("module.")], atol=1e-5, rtol=0)
    for case in cases[1:]:
        losses, params = out[case][1:]
        assert losses == cold_losses, case  # the same code: the same numbers, bit for bit
        for k, v in params.items():
            assert torch.equal(v, cold_params[k]), (case, k)


_KEY = """
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
from tests.plan.test_step_cache import _keys_of_a_placed_step
print(_keys_of_a_placed_step())
"""


def _keys_of_a_placed_step() -> list[str | None]:
    """The step's keys with the default options, without the rank check, with FX codegen."""
    from vescale.plan import step_cache

    model = _placed(compile=False)
    model(*_batches()[0])  # the first call fixes the inputs' layouts
    specs, flat = model._step_inputs(_batches()[0])
    return [
        step_cache.step_key(model.program, specs, flat, options)
        for options in (None, {"rank_check": False}, {"codegen": "fx"})
    ]


def test_the_key_is_the_same_in_another_process(tmp_path):
    """No address, set order or process-local state in the key: two processes placing the
    same model get the same keys, so the second run of a training script loads the first's;
    an option changes it."""
    first, second = last_lines_of_two_runs(_KEY, tmp_path)
    assert first == second, (first, second)
    default, unchecked, fx = ast.literal_eval(first)
    assert len(default) == 64 and unchecked != default  # an option is part of the key
    assert fx is None  # nothing to load: FX codegen is not cached
