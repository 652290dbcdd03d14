"""The ``vescale`` torch.compile backend.

Pipeline per captured program: Dynamo graph -> AOTAutograd (forward and backward graphs of
local aten ops and functional collectives, placements decided by the same eager strategies)
-> vescale passes (``annotate``/verify, ``eliminate``, ``bucket``, ``schedule``,
``fingerprint``) -> codegen (Inductor, or the FX graphs as they are). Options (``torch.compile(..., options={...})`` or env vars):

* ``codegen``: ``"inductor"`` (default) or ``"fx"``.
* ``eager`` / ``VESCALE_COMPILE_EAGER=1``: run the captured program through eager DTensor.
* ``dump_dir`` / ``VESCALE_DUMP_DIR``: per rank, ``graph.<pass>.txt`` for every graph and
  pass, ``schedule.json`` per graph, and ``collectives.json``.
* ``explicit``: forbid (``True``) or allow (``False``) implicit redistribution while this
  backend traces, overriding ``VESCALE_DISABLE_REDISTRIBUTE`` (default: the env var / scope).
* ``eliminate`` (default on), ``bucket_cap_mb`` (default 25; 0 turns bucketing off),
  ``overlap`` (default on) and ``overlap_cap_mb`` (default 256): the communication passes.
* ``rank_check`` (default on): compare each graph's collective sequence across ranks at its
  first run and raise instead of hanging when they differ.
* ``strict``: raise instead of falling back on an unsupported construct. Without it, a
  capture failure (e.g. an op with no sharding strategy for its placements) runs that graph
  eagerly and a graph Inductor cannot compile runs as captured (FX), each with one warning
  naming the graph and the error (op, placements and mesh for a missing strategy).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import warnings
from dataclasses import asdict, dataclass, fields
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from vescale._torch_compat import (
    DYNAMO_COMPILER_FNS,
    aot_autograd,
    inductor_pieces,
    make_boxed_func,
    register_backend,
)
from vescale.dtensor._recording import recording
from vescale.dtensor.dispatch import ImplicitRedistributionError, explicit_redistribute
from vescale.fx.aliased_outputs import route_input_views
from vescale.fx.collectives import user_source
from vescale.fx.timeline import write_schedule_json
from vescale.passes import (
    PassContext,
    PassManager,
    RankDivergenceError,
    annotate,
    bucket,
    check_rank_consistency,
    eliminate,
    fingerprint,
    schedule,
)

__all__ = ["PASSES_OFF", "BackendOptions", "register", "vescale_backend"]

BACKEND_NAME = "vescale"
PIPELINE = PassManager(
    [
        ("annotate", annotate),
        ("eliminate", eliminate),
        ("bucket", bucket),
        ("schedule", schedule),
        ("fingerprint", fingerprint),
    ]
)
_graph_ids = itertools.count()
DEFAULT_BUCKET_CAP_MB = 25.0
# Backend options turning the communication passes off: the captured program as eager runs it.
PASSES_OFF: dict[str, Any] = {"eliminate": False, "bucket_cap_mb": 0, "overlap": False}


@dataclass(frozen=True)
class BackendOptions:
    """Options of the ``vescale`` backend (see module docstring)."""

    codegen: str = "inductor"
    eager: bool = False
    dump_dir: str | None = None
    explicit: bool | None = None
    strict: bool = False
    eliminate: bool = True
    bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB
    overlap: bool = True
    overlap_cap_mb: float = 256.0
    rank_check: bool = True

    @classmethod
    def resolve(cls, options: dict[str, Any] | None) -> BackendOptions:
        options = dict(options or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"vescale backend: unknown options {unknown}; known: {sorted(known)}")
        options.setdefault("eager", os.environ.get("VESCALE_COMPILE_EAGER", "0") == "1")
        options.setdefault("dump_dir", os.environ.get("VESCALE_DUMP_DIR") or None)
        out = cls(**options)
        if out.codegen not in ("inductor", "fx"):
            raise ValueError(
                f"vescale backend: codegen must be 'inductor' or 'fx', got {out.codegen!r}"
            )
        return out


def _rank_dir(dump_dir: str | None) -> Path | None:
    if dump_dir is None:
        return None
    rank = dist.get_rank() if dist.is_initialized() else 0
    path = Path(dump_dir) / f"rank{rank}"
    path.mkdir(parents=True, exist_ok=True)
    return path


_written: set[Path] = set()  # collectives.json files this process started (older runs are replaced)


def _append_collectives(folder: Path | None, records: list[Any]) -> None:
    if folder is None:
        return
    path = folder / "collectives.json"
    existing = json.loads(path.read_text()) if path in _written and path.exists() else []
    _written.add(path)
    path.write_text(json.dumps(existing + records, indent=1) + "\n")


_sinks: list[list[tuple[str, torch.fx.GraphModule, PassContext]]] = []  # vescale.fx.trace


def _graph_compiler(opts: BackendOptions, name: str) -> Any:
    def compile_graph(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        folder = _rank_dir(opts.dump_dir)
        ctx = PassContext(name, folder, options=asdict(opts))
        gm = PIPELINE.run(gm, ctx)
        if folder is not None:
            write_schedule_json(folder / name / "schedule.json", gm, name)
        _append_collectives(folder, ctx.reports.get("collectives", []))
        for sink in _sinks:
            sink.append((name, gm, ctx))
        compiled = _codegen(gm, example_inputs, opts, name)
        if not opts.rank_check:
            return compiled
        return _rank_checked(compiled, name, ctx.reports["fingerprint"])

    return compile_graph


def _codegen(
    gm: torch.fx.GraphModule, example_inputs: list[Any], opts: BackendOptions, name: str
) -> Any:
    """Inductor (falling back to the captured FX graph if it fails) or FX, boxed."""
    if opts.codegen == "inductor":
        compile_fx_inner, _, _ = inductor_pieces()
        try:
            return compile_fx_inner(gm, example_inputs)
        except Exception as err:
            if opts.strict:
                raise
            _warn(f"{name} runs as captured (FX), Inductor failed", err)
    return make_boxed_func(gm.forward)


def _rank_checked(compiled: Any, name: str, sequence: list[str]) -> Any:
    """``compiled`` that compares its collective sequence across ranks at its first run."""
    checked = [False]

    def run(args: list[Any]) -> Any:
        if not checked[0]:
            check_rank_consistency(name, sequence)
            checked[0] = True
        return compiled(args)

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


def vescale_backend(
    gm: torch.fx.GraphModule, example_inputs: list[Any], options: dict[str, Any] | None = None
) -> Any:
    """``torch.compile(model, backend="vescale", options={...})``."""
    opts = BackendOptions.resolve(options)
    if opts.eager:
        return gm.forward
    gid = next(_graph_ids)
    extra: dict[str, Any] = {}
    if opts.codegen == "inductor":  # Inductor lowers only its own decomposed op set
        _, select_decomp_table, min_cut_rematerialization_partition = inductor_pieces()
        extra = {
            "decompositions": select_decomp_table(),
            "partition_fn": min_cut_rematerialization_partition,
        }
    aot = aot_autograd(
        fw_compiler=_graph_compiler(opts, f"graph{gid}.forward"),
        bw_compiler=_graph_compiler(opts, f"graph{gid}.backward"),
        **extra,
    )
    explicit = (
        contextlib.nullcontext() if opts.explicit is None else explicit_redistribute(opts.explicit)
    )
    route_input_views(gm)  # outputs that view inputs keep a DTensor backward
    try:
        with recording(), explicit:
            return aot(gm, example_inputs)
    except (ImplicitRedistributionError, RankDivergenceError):
        raise
    except Exception as err:
        if opts.strict:
            raise
        _warn(f"graph{gid} runs eagerly, its capture failed{_failure_site(err)}", err)
        return gm.forward


def _failure_site(err: BaseException) -> str:
    """`` at <op> on <input placements and shapes> (file.py:line)`` from ``err``'s traceback:
    the innermost DTensor op being dispatched (a frame with an ``op``/``op_call`` OpOverload
    and DTensor ``args``), else the Dynamo graph node AOTAutograd was interpreting (its
    ``run_node`` frame), which also gives the user line."""
    op, inputs, node = None, [], None
    tb = err.__traceback__
    while tb is not None:
        local = tb.tb_frame.f_locals
        candidate = local.get("op_call", local.get("op"))
        args = local.get("args")
        if isinstance(candidate, torch._ops.OpOverload) and isinstance(args, tuple | list):
            tensors = [a for a in args if isinstance(a, DTensor)]
            if tensors:
                op, inputs = candidate, tensors
        if tb.tb_frame.f_code.co_name == "run_node" and isinstance(local.get("n"), torch.fx.Node):
            node = local["n"]
        tb = tb.tb_next
    if op is None and node is not None:
        op = getattr(node.target, "__name__", node.target)
        vals = [a.meta.get("example_value") for a in node.all_input_nodes]
        inputs = [v for v in vals if isinstance(v, DTensor)]
    if op is None:
        return ""
    on = ", ".join(f"{tuple(t.placements)} {list(t.shape)}" for t in inputs)
    src = user_source(node) if node is not None else ""
    return f" at {op}{f' on {on}' if on else ''}{f' ({src})' if src else ''}"


def _warn(what: str, err: Exception) -> None:
    first = str(err).splitlines()[0] if str(err) else ""
    warnings.warn(f"vescale backend: {what}: {type(err).__name__}: {first}", stacklevel=3)


def register() -> None:
    """Register ``vescale`` with Dynamo unless the installed entry point will do it lazily.

    Dynamo loads the ``torch_dynamo_backends`` entry point and then registers it itself;
    registering here as well would make that lookup fail with "duplicate name".
    """
    if any(ep.name == BACKEND_NAME for ep in entry_points(group="torch_dynamo_backends")):
        return
    if BACKEND_NAME not in DYNAMO_COMPILER_FNS:
        register_backend(vescale_backend, name=BACKEND_NAME)
