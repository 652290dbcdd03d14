"""Planning cost at scale: ``vescale.parallelize`` of Llama-3-8B / 70B-shaped models on meta
meshes (no process group, no memory), CPU seconds per stage and peak RSS.

    python benchmarks/plan_scale.py            # 8B on (8, 8), (16, 8); 70B on (32, 8), (128, 8)
    python benchmarks/plan_scale.py --quick    # 8B, 1 and 2 layers on (8, 8)
    python benchmarks/plan_scale.py --model 8b --mesh 8x8 --layers 1 2 4

Each row runs in a fresh interpreter (its own peak RSS, nothing cached from an earlier row):
the plan is empty, both inputs a ``Batch("dp", "tp")`` of one sequence of 8192 tokens per
rank, ``memory_budget=80e9``, AdamW, ``cost="h100"``, not compiled. Columns: capture,
propagate and solve in CPU seconds of this process, its peak RSS, the solver's status, the
estimated step (what :func:`vescale.plan.explain` reports) and the recipe the choice amounts to.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
MODELS = ("8b", "70b")
DEFAULT_ROWS = [
    ("8b", mesh, layers) for mesh in ("8x8", "16x8") for layers in (1, 2, 4, 8, 16, 32)
] + [("70b", mesh, layers) for mesh in ("32x8", "128x8") for layers in (1, 2, 4, 8, 16, 32, 80)]
QUICK_ROWS = [("8b", "8x8", 1), ("8b", "8x8", 2)]


def _cpu_timed(fn: Callable[..., Any], into: dict[str, float], key: str) -> Callable[..., Any]:
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.process_time()
        try:
            return fn(*args, **kwargs)
        finally:
            into[key] = into.get(key, 0.0) + time.process_time() - start

    return timed


def _propagated(model: Any, mesh: Any, ids: Any, cpu: dict[str, float]) -> None:
    """Capture and propagate only (no solve): what ``parallelize`` does before solving."""
    from vescale.plan import Batch
    from vescale.plan.batch import batch_choices
    from vescale.plan.capture import capture_joint
    from vescale.plan.propagate import propagate

    joint = _cpu_timed(capture_joint, cpu, "capture")(model, [ids, ids])
    batch = batch_choices("inputs[0]", Batch("dp", "tp"), ids, mesh)
    held = len(joint.param_names) + len(joint.buffer_names)
    fixed: dict[str, Any] = {ph: batch for ph in joint.placeholder_names[held:]}
    _cpu_timed(propagate, cpu, "propagate")(joint.gm, mesh, fixed)


def _planned(model: Any, mesh: Any, ids: Any) -> tuple[str, str, str, str]:
    """``vescale.parallelize`` as the issue runs it: (status, estimated step, recipe, error)."""
    import vescale
    from vescale.plan import Batch, explain

    try:
        planned = vescale.parallelize(
            model,
            mesh,
            {},
            inputs=[Batch("dp", "tp")] * 2,
            example_inputs=[ids, ids],
            memory_budget=int(80e9),
            optimizer="adamw",
            cost="h100",
            compile=False,
            progress=False,
        )
    except Exception as err:  # a row that fails is reported, the table goes on
        return "error", "-", "", f"{type(err).__name__}: {(str(err).splitlines() or [''])[0]}"
    report = explain(planned.program)
    status = report.solution.status if report.solution is not None else "-"
    step = f"{report.step_us / 1e3:.1f} ms" if report.step_us is not None else "-"
    return status, step, report.recipe, ""


def row(
    model_name: str, mesh_text: str, layers: int, seq: int, solve: bool = True
) -> dict[str, Any]:
    """Plan one model on one mesh in this process (``solve=False``: capture and propagate
    only); the row's columns."""
    import torch

    sys.path.insert(0, str(HERE))
    from llama_meta import LLAMA3_8B, LLAMA3_70B, build

    import vescale
    from vescale.plan import api, program

    cpu: dict[str, float] = {}
    api.capture_joint = _cpu_timed(api.capture_joint, cpu, "capture")  # type: ignore[attr-defined]
    api.place = _cpu_timed(api.place, cpu, "place")  # type: ignore[attr-defined]
    program.propagate = _cpu_timed(program.propagate, cpu, "propagate")  # type: ignore[attr-defined]
    dp, tp = (int(n) for n in mesh_text.split("x"))
    cfg = LLAMA3_8B if model_name == "8b" else LLAMA3_70B
    model = build(cfg, layers)
    mesh = vescale.DeviceMesh(
        "meta", torch.arange(dp * tp).view(dp, tp), mesh_dim_names=("dp", "tp")
    )
    ids = torch.empty(dp * tp, seq, dtype=torch.long, device="meta")  # one sequence per GPU
    if solve:
        status, step, recipe, error = _planned(model, mesh, ids)
    else:
        _propagated(model, mesh, ids, cpu)
        status, step, recipe, error = "not solved", "-", "", ""
    return {
        "model": model_name,
        "mesh": mesh_text,
        "layers": layers,
        "capture_s": cpu.get("capture", 0.0),
        "propagate_s": cpu.get("propagate", 0.0),
        "solve_s": cpu.get("place", 0.0) - cpu.get("propagate", 0.0) if solve else 0.0,
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "status": status,
        "step": step,
        "recipe": recipe,
        "error": error,
    }


def _line(r: dict[str, Any]) -> str:
    return (
        f"| {r['model']} | {r['mesh']} | {r['layers']} | {r['capture_s']:.1f} | "
        f"{r['propagate_s']:.1f} | {r['solve_s']:.1f} | {r['peak_rss_gib']:.2f} | "
        f"{r['status']} | {r['step']} | {r['recipe'] or r['error']} |"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8B, 1 and 2 layers on (8, 8)")
    parser.add_argument("--model", choices=MODELS)
    parser.add_argument("--mesh", help="dp x tp, e.g. 8x8")
    parser.add_argument("--layers", type=int, nargs="+")
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--no-solve", action="store_true", help="capture and propagate only")
    parser.add_argument("--row", action="store_true", help=argparse.SUPPRESS)  # one, as JSON
    args = parser.parse_args(argv)
    if args.row:
        print(json.dumps(row(args.model, args.mesh, args.layers[0], args.seq, not args.no_solve)))
        return
    rows = QUICK_ROWS if args.quick else DEFAULT_ROWS
    if args.model or args.mesh or args.layers:
        rows = [
            r
            for r in DEFAULT_ROWS
            if r[0] == (args.model or r[0])
            and r[1] == (args.mesh or r[1])
            and r[2] in (args.layers or [r[2]])
        ]
    print(
        "| model | mesh | layers | capture s | propagate s | solve s | peak RSS GiB | status "
        "| est. step | recipe |\n|---|---|---|---|---|---|---|---|---|---|",
        flush=True,
    )
    for model_name, mesh_text, layers in rows:
        out = subprocess.run(
            [
                sys.executable,
                __file__,
                "--row",
                "--model",
                model_name,
                "--mesh",
                mesh_text,
                "--layers",
                str(layers),
                "--seq",
                str(args.seq),
                *(["--no-solve"] if args.no_solve else []),
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        if out.returncode != 0:
            tail = (out.stderr.strip().splitlines() or ["?"])[-1]
            print(f"| {model_name} | {mesh_text} | {layers} | failed: {tail} |", flush=True)
            continue
        print(_line(json.loads(out.stdout.strip().splitlines()[-1])), flush=True)


if __name__ == "__main__":
    main()
