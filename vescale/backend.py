"""The ``vescale`` torch.compile backend.

Pipeline per captured program: Dynamo graph -> AOTAutograd (forward and backward graphs of
local aten ops and functional collectives, placements decided by the same eager strategies;
with Inductor codegen inside Inductor's ``compile_fx``, its pre-grad and joint-graph passes
included) -> vescale passes (``annotate``/verify, ``eliminate``, ``bucket``, ``schedule``,
``fingerprint``) -> codegen (Inductor's ``compile_fx_inner`` with ``compile_fx``'s
arguments, or the FX graphs as they are).

Options (``torch.compile(..., options={...})``) are the fields of
:class:`vescale.passes.options.BackendOptions`, each documented in its ``metadata["doc"]``;
the passes read the same object (``PassContext.options``); ``inductor`` holds Inductor's
own config options. Fallbacks without ``strict``: a
capture failure (e.g. an op with no sharding strategy for its placements) runs that graph
eagerly and a graph Inductor cannot compile runs as captured (FX), each with one warning
naming the graph and the error (op, placements and mesh for a missing strategy).
:func:`capture_graphs` hands out every graph compiled within it, after the passes.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import warnings
from collections.abc import Iterator, Sequence
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from vescale import _progress, finite
from vescale._agree import active
from vescale._torch_compat import (
    DYNAMO_COMPILER_FNS,
    aot_autograd,
    inductor_cache_key,
    inductor_compile_fx,
    inductor_config_patches,
    inductor_inner,
    inductor_mode_options,
    load_inductor_graph,
    make_boxed_func,
    plain_aot_forward,
    register_backend,
)
from vescale.dtensor._recording import recording
from vescale.dtensor.dispatch import ImplicitRedistributionError
from vescale.dtensor.explicit import explicit_scope, explicit_state
from vescale.fx.aliased_outputs import route_input_views
from vescale.fx.collectives import user_source
from vescale.fx.timeline import write_schedule_json
from vescale.passes import (
    PASSES_OFF,
    BackendOptions,
    PassContext,
    PassManager,
    RankDivergenceError,
    annotate,
    bucket,
    eliminate,
    fingerprint,
    schedule,
)
from vescale.passes.fingerprint import FromLocal, RankCheck, from_local_calls, size_args

__all__ = [
    "PASSES_OFF",
    "BackendOptions",
    "CompiledGraph",
    "InductorForward",
    "capture_graphs",
    "compile_or_load",
    "record_inductor_forwards",
    "register",
    "vescale_backend",
]

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


def _rank_dir(dump_dir: str | os.PathLike[str] | None) -> Path | None:
    if dump_dir is None:
        return None
    rank = dist.get_rank() if dist.is_initialized() else 0
    path = Path(dump_dir) / f"rank{rank}"
    for p in (Path(dump_dir), path):
        if p.exists() and not p.is_dir():
            raise ValueError(f"vescale backend: dump_dir {str(dump_dir)!r}: {p} is not a directory")
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


class CompiledGraph(NamedTuple):
    """One forward or backward graph the backend compiled: its name (``graph<i>.forward`` or
    ``graph<i>.backward``), the graph after every pass, and the pass context (options,
    reports, per-pass timings)."""

    name: str
    gm: torch.fx.GraphModule
    ctx: PassContext


_T = TypeVar("_T")
_captures: list[list[CompiledGraph]] = []


@contextlib.contextmanager
def _listening(listeners: list[list[_T]]) -> Iterator[list[_T]]:
    """A list registered in ``listeners`` for the block (the compiler appends to each)."""
    items: list[_T] = []
    listeners.append(items)
    try:
        yield items
    finally:
        listeners.remove(items)


def capture_graphs() -> contextlib.AbstractContextManager[list[CompiledGraph]]:
    """Within the block, every graph this backend compiles is appended, after its passes and
    before codegen, to the yielded list (nested blocks each see every graph)."""
    return _listening(_captures)


class InductorForward(NamedTuple):
    """A forward graph Inductor compiled into its FX graph cache, as :func:`compile_or_load`
    loads it again: the cache ``key`` and ``debug_lines``, the rank check's ``sequence``, the
    number of ``inputs`` it takes, and ``plain``: AOTAutograd wraps it in nothing but a call
    (so loading the graph alone gives the same step)."""

    key: str
    debug_lines: list[str]
    sequence: list[str]
    inputs: int
    plain: bool


_forwards: list[list[InductorForward]] = []


def record_inductor_forwards() -> contextlib.AbstractContextManager[list[InductorForward]]:
    """Within the block, every forward graph compiled by Inductor into its cache is appended
    to the yielded list."""
    return _listening(_forwards)


def _graph_compiler(
    opts: BackendOptions, name: str, graph: _DynamoGraph, calls: Sequence[FromLocal] = ()
) -> Any:
    """The compiler of graph ``name`` of the Dynamo ``graph`` (AOTAutograd's, or Inductor's
    inner compiler taking ``compile_fx_inner``'s keywords); ``calls``: that graph's
    ``from_local`` calls, compared across ranks (with the collectives) by the rank check."""

    def compile_graph(gm: torch.fx.GraphModule, example_inputs: list[Any], **inner: Any) -> Any:
        if name.endswith(".backward"):  # compiled at the first backward: a stage of its own
            with _progress.stage(f"compile {name}"):
                return compile_forward_or_backward(gm, example_inputs, inner)
        return compile_forward_or_backward(gm, example_inputs, inner)

    def compile_forward_or_backward(
        gm: torch.fx.GraphModule, example_inputs: list[Any], inner: dict[str, Any]
    ) -> Any:
        folder = _rank_dir(opts.dump_dir)
        ctx = PassContext(name, folder, options=opts)
        gm = PIPELINE.run(gm, ctx)
        if folder is not None:
            write_schedule_json(folder / name / "schedule.json", gm, name)
        _append_collectives(folder, ctx.reports.get("collectives", []))
        for graphs in _captures:
            graphs.append(CompiledGraph(name, gm, ctx))
        compiled = _codegen(gm, example_inputs, opts, name, inner)
        check = graph.check(name, list(calls), ctx.reports["fingerprint"], example_inputs)
        listened = _forwards and name.endswith(".forward")  # nobody asks: nothing to record
        cached = inductor_cache_key(compiled) if listened else None
        compiled = _ranged(compiled, name)
        if cached is not None:
            inputs, plain = len(example_inputs), plain_aot_forward()
            forward = InductorForward(*cached, check.sequence(), inputs, plain)
            for forwards in _forwards:
                forwards.append(forward)
        return _rank_checked(compiled, check) if opts.rank_check else compiled

    return compile_graph


def _codegen(
    gm: torch.fx.GraphModule,
    example_inputs: list[Any],
    opts: BackendOptions,
    name: str,
    inner: dict[str, Any],
) -> Any:
    """``compile_fx_inner`` with the keywords ``compile_fx`` gave (``inner``), falling back to
    the captured FX graph if it fails, or FX, boxed; node by node while the non-finite check
    is on."""
    if finite.enabled():
        return finite.interpreted(gm, name)
    if opts.codegen == "inductor":
        try:
            return inductor_inner()(gm, example_inputs, **inner)
        except Exception as err:
            if opts.strict:
                raise
            _warn(f"{name} runs as captured (FX), Inductor failed", err)
    return make_boxed_func(gm.forward)


def _ranged(compiled: Any, name: str) -> Any:
    """``compiled`` (boxed) run inside the profiler range ``vescale::<name>``."""
    label = f"vescale::{name}"

    def run(args: list[Any]) -> Any:
        with torch.profiler.record_function(label):
            return compiled(args)

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


class _DynamoGraph(NamedTuple):
    """What the rank check knows of a Dynamo graph: its frame and compile (Dynamo's compile id
    ``frame/compile``; ``?`` where Dynamo gave none) and the explicit mode it compiles under."""

    frame: str
    compile_id: str
    explicit: tuple[bool, str]

    @classmethod
    def of(cls, gm: torch.fx.GraphModule, explicit: tuple[bool, str]) -> _DynamoGraph:
        compile_id = str(gm.meta.get("dynamo_compile_id") or "?")
        return cls(compile_id.partition("/")[0], compile_id, explicit)

    def check(
        self,
        name: str,
        calls: list[FromLocal],
        collectives: list[str],
        example_inputs: Sequence[Any] = (),
        failure: str | None = None,
    ) -> RankCheck:
        """The rank check of ``name``, one of this Dynamo graph's forward or backward graphs."""
        identity = f"Dynamo frame {self.frame} {name.rpartition('.')[2]}"
        sizes = size_args(calls, example_inputs)
        return RankCheck(
            name, identity, self.compile_id, self.explicit, calls, collectives, sizes, failure
        )


def _rank_checked(compiled: Any, check: RankCheck) -> Any:
    """``compiled`` run after ``check`` (:meth:`RankCheck.before_run`: at every call for a
    graph with even-shard ``from_local`` calls, else at its first run)."""

    def run(args: list[Any]) -> Any:
        check.before_run(args)
        return compiled(args)

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


def vescale_backend(
    gm: torch.fx.GraphModule,
    example_inputs: list[Any],
    options: dict[str, Any] | None = None,
    mode: str | None = None,
) -> Any:
    """``torch.compile(model, backend="vescale", options={...}, mode=...)``.

    ``mode`` ("default", "reduce-overhead", "max-autotune", ...) and the ``inductor`` option
    patch Inductor's config as ``backend="inductor"``'s mode and options do; they need
    ``codegen="inductor"``. Bad options, a bad mode and a bad ``VESCALE_DISABLE_REDISTRIBUTE``
    raise ``ValueError`` here, before anything can fall back (Dynamo reports it as
    ``BackendCompilerFailed`` at the first call)."""
    opts = BackendOptions.resolve(options)
    patches = _inductor_patches(mode, opts)
    explicit = _explicit(opts)
    if opts.eager:
        return gm.forward
    return _compile(gm, example_inputs, opts, next(_graph_ids), explicit, patches)


def _inductor_patches(mode: str | None, opts: BackendOptions) -> dict[str, Any]:
    """Inductor's config patches of ``torch.compile``'s ``mode`` and the ``inductor`` option,
    merged as ``backend="inductor"`` merges its mode and options (the options win)."""
    moded = mode is not None and mode != "default"
    if moded and mode not in (modes := inductor_mode_options()):
        raise ValueError(f"vescale backend: unknown mode {mode!r}; known: {sorted(modes)}")
    if not moded and not opts.inductor:
        return {}
    if opts.codegen != "inductor":
        what = f"mode={mode!r}" if moded else f"option inductor={opts.inductor!r}"
        raise ValueError(
            f"vescale backend: {what} configures Inductor; it needs codegen='inductor', "
            f"got codegen={opts.codegen!r}"
        )
    return inductor_config_patches(mode, opts.inductor)


def compile_or_load(
    gm: torch.fx.GraphModule,
    example_inputs: list[Any],
    options: dict[str, Any] | None,
    forward: InductorForward,
) -> Any:
    """:func:`vescale_backend` of ``gm``, whose forward Inductor compiled before as
    ``forward`` (a plain one, on inputs like these): that graph loaded from Inductor's cache,
    rank-checked as compiling it would be, called with the inputs unboxed; compiled as usual
    when the cache no longer holds it (a stage line saying so, then the compile's)."""
    opts = BackendOptions.resolve(options)
    explicit = _explicit(opts)
    gid = next(_graph_ids)
    name = f"graph{gid}.forward"
    with _progress.stage(f"compile {name}") as stage:
        loaded = load_inductor_graph(forward.key, forward.debug_lines, example_inputs)
        stage.detail = "not in Inductor's cache" if loaded is None else "Inductor's cached code"
    if loaded is None:
        return _compile(gm, example_inputs, opts, gid, explicit, _inductor_patches(None, opts))
    loaded = _ranged(loaded, name)
    calls = from_local_calls(gm)
    collectives = forward.sequence[len(calls) :]
    check = _DynamoGraph.of(gm, explicit).check(name, calls, collectives, example_inputs)
    boxed = _rank_checked(loaded, check) if opts.rank_check else loaded

    def step(*args: Any) -> Any:
        with torch.no_grad():  # as AOTAutograd runs an inference graph
            return boxed(list(args))

    return step


def _explicit(opts: BackendOptions) -> tuple[bool, str]:
    if opts.explicit is None:
        return explicit_state()
    return opts.explicit, f"the vescale backend option explicit={opts.explicit}"


def _compile(
    gm: torch.fx.GraphModule,
    example_inputs: list[Any],
    opts: BackendOptions,
    gid: int,
    explicit: tuple[bool, str],
    patches: dict[str, Any],
) -> Any:
    """``gm`` traced by AOTAutograd (the vescale passes on each graph, then codegen) or, with
    ``codegen="inductor"``, by Inductor's ``compile_fx`` under ``patches``: its pre-grad,
    joint-graph and post-grad passes and every ``compile_fx_inner`` keyword, as
    ``backend="inductor"``, with the vescale passes between partition and codegen."""
    graph = _DynamoGraph.of(gm, explicit)
    calls = from_local_calls(gm)
    forward = _graph_compiler(opts, f"graph{gid}.forward", graph, calls)
    backward = _graph_compiler(opts, f"graph{gid}.backward", graph)

    def inner_compile(g: torch.fx.GraphModule, inputs: list[Any], **inner: Any) -> Any:
        return (backward if inner.get("is_backward") else forward)(g, inputs, **inner)

    def aot(g: torch.fx.GraphModule, inputs: list[Any]) -> Any:
        if opts.codegen == "inductor":
            return inductor_compile_fx(g, inputs, inner_compile, patches)
        return aot_autograd(fw_compiler=forward, bw_compiler=backward)(g, inputs)

    _rank_dir(opts.dump_dir)  # a dump_dir that is a file: an error here, not a fallback
    route_input_views(gm)  # outputs that view inputs keep a DTensor backward
    shown = _progress.enabled()  # a bad VESCALE_PROGRESS raises here, not as a fallback
    try:
        with (
            recording(),
            explicit_scope(*explicit),
            _progress.stage(f"compile graph{gid}.forward", shown),
        ):
            return aot(gm, example_inputs)
    except ImplicitRedistributionError as err:
        if not (opts.rank_check and active()):
            raise
        failure = str(err).splitlines()[0]  # Dynamo appends the graph node and traceback
        return _failed_after_check(graph.check(f"graph{gid}.forward", calls, [], (), failure), err)
    except RankDivergenceError:
        raise
    except Exception as err:
        if opts.strict:
            raise
        _warn(f"graph{gid} runs eagerly, its capture failed{_failure_site(err)}", err)
        return gm.forward


def _failed_after_check(check: RankCheck, err: Exception) -> Any:
    """A graph whose capture raised ``err`` on this rank: its first call runs ``check`` (so
    ranks that captured it differently, e.g. under another explicit mode, all raise the
    rank check's error rather than wait for this rank), then raises ``err``."""

    def step(*args: Any) -> Any:
        check.before_run(args)
        raise err

    return step


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
