"""The compiled step of :func:`vescale.parallelize` cached on disk: a later run of the same
placed program on this machine loads Inductor's code for it instead of tracing the program
(twice, through AOTAutograd), running the passes and hashing the result for Inductor's own
cache, which is most of a warm start's first step.

An entry names the forward graph in Inductor's FX graph cache (its key), the rank check's
collective sequence and the step's output layouts. Its key hashes everything the compiled
local program depends on: the joint graph's code, each node's chosen strategy, the demands
and the placements they require, the flattening choice; the mesh (shape, ranks, names) and
this rank's groups (name and ranks: the graph calls collectives by group name), the rank;
the inputs' local shapes, strides, dtypes and layouts; the backend options, the
``VESCALE_*`` environment, autocast and determinism settings, Inductor's and AOTAutograd's
configs; torch's version and the source of every vescale module. Only a step AOTAutograd
wraps in nothing but a call is stored (:class:`vescale.backend.InductorForward`), and
nothing is stored or read while dumps are written (they come from the passes). Files:
``$VESCALE_CACHE_DIR/steps/<key>.json``, next to the plans; ``VESCALE_PLAN_CACHE=0`` turns
this cache off with the plan cache.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from vescale.backend import InductorForward
from vescale.cost.calibration import cache_root, write_atomic
from vescale.dtensor.flat_groups import flattened_meshes
from vescale.dtensor.placement_types import make_spec
from vescale.passes import BackendOptions
from vescale.plan.cache import PACKAGE, enabled, source_digest
from vescale.plan.program import PlacedProgram
from vescale.plan.propagate import Placements

__all__ = ["Entry", "output_specs", "outputs_of", "read", "step_key", "write"]

_FORMAT = 1  # of the files; a change invalidates every file


Outputs = list[tuple[list[int], list[int], str]]  # each output's (shape, stride, dtype name)
_DTYPES = {str(d): d for d in vars(torch).values() if isinstance(d, torch.dtype)}


class Entry(NamedTuple):
    """A cached step: Inductor's forward and each output's (shape, stride, dtype name)."""

    forward: InductorForward
    outputs: Outputs


@functools.cache
def _package_digest() -> str:
    return source_digest(sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")))


def _groups(program: PlacedProgram) -> list[Any]:
    """(mesh dims, group name, ranks) of every group the step's collectives may name: the
    mesh dims' and the flattened meshes' made so far."""
    mesh = program.mesh
    meshes: list[tuple[tuple[int, ...], Any, int]] = [((d,), mesh, d) for d in range(mesh.ndim)]
    meshes += [(dims, m, 0) for dims, m in sorted(flattened_meshes(mesh).items()) if m is not None]
    out = []
    for dims, m, d in meshes:
        group = m.get_group(d)
        out.append((dims, group.group_name, dist.get_process_group_ranks(group)))
    return out


def step_key(
    program: PlacedProgram,
    specs: Sequence[Any],
    flat: Sequence[torch.Tensor],
    options: dict[str, Any] | None,
) -> str | None:
    """The hex key of ``program``'s compiled step on ``flat`` (this rank's inputs laid out as
    ``specs``) with backend ``options``; ``None`` when the cache is off, the codegen is not
    Inductor, or dumps are written."""
    if not enabled():
        return None
    opts = BackendOptions.resolve(options)
    if opts.codegen != "inductor" or opts.dump_dir is not None or opts.eager:
        return None
    from torch._functorch import config as aot_config
    from torch._inductor import config as inductor_config

    mesh = program.mesh
    h = hashlib.sha256(
        repr(
            (
                _FORMAT,
                _package_digest(),
                torch.__version__,
                torch.version.git_version,
                repr(opts),
                sorted((k, v) for k, v in os.environ.items() if k.startswith("VESCALE_")),
                [
                    (d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d))
                    for d in ("cpu", "cuda")
                ],
                torch.are_deterministic_algorithms_enabled(),
                sorted(inductor_config.save_config_portable().items()),
                sorted(aot_config.save_config_portable().items()),
                dist.get_rank() if dist.is_initialized() else 0,
                dist.get_world_size() if dist.is_initialized() else 1,
                mesh.device_type,
                mesh.mesh.tolist(),
                mesh.mesh_dim_names,
                _groups(program),
                program.flat,
            )
        ).encode()
    )
    h.update(program.joint.gm.code.encode())
    for node, ns in program.table.items():
        i = program.chosen[node]
        internal = ns.internal[i] if ns.internal else ()
        h.update(
            repr((node.name, ns.source, ns.outputs[i], ns.input_placements[i], internal)).encode()
        )
    for d in program.demands:
        node, k = d.value
        h.update(repr((node.name, k, program.required(d), d.bucket)).encode())
    for t, s in zip(flat, specs):
        h.update(
            repr((tuple(t.shape), t.stride(), t.dtype, s.placements, s.shape, s.stride)).encode()
        )
    return h.hexdigest()


def _path(key: str) -> Path:
    return cache_root() / "steps" / f"{key}.json"


def read(key: str, inputs: int) -> Entry | None:
    """The entry of ``key`` for a step of ``inputs`` inputs; ``None``: absent, unreadable,
    or not such a step."""
    try:
        data = json.loads(_path(key).read_text())
        forward = InductorForward(
            str(data["key"]),
            [str(line) for line in data["debug_lines"]],
            [str(s) for s in data["sequence"]],
            int(data["inputs"]),
            True,
        )
        outputs = [
            ([int(n) for n in shape], [int(n) for n in stride], str(dtype))
            for shape, stride, dtype in data["outputs"]
        ]
        if forward.inputs != inputs or not outputs or any(d not in _DTYPES for *_, d in outputs):
            return None
        return Entry(forward, outputs)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write(key: str, entry: Entry) -> None:
    """Store ``entry`` under ``key`` (atomically); a cache that cannot be written is skipped."""
    f = entry.forward
    data = {
        "key": f.key,
        "debug_lines": f.debug_lines,
        "sequence": f.sequence,
        "inputs": f.inputs,
        "outputs": entry.outputs,
    }
    with contextlib.suppress(OSError):
        write_atomic(_path(key), json.dumps(data) + "\n")


def _demanded(program: PlacedProgram, n: int) -> list[Placements]:
    """The placements the step's ``n`` outputs are returned in (the last ``n`` demands)."""
    return [program.required(d) for d in program.demands[-n:]]


def outputs_of(program: PlacedProgram, specs: Sequence[Any]) -> Outputs | None:
    """Each traced output spec's (shape, stride, dtype) when every output is a DTensor in its
    demanded placements (so :func:`output_specs` rebuilds ``specs``); else ``None``."""
    if not specs or any(s is None for s in specs):
        return None
    if [tuple(s.placements) for s in specs] != _demanded(program, len(specs)):
        return None
    return [(list(s.shape), list(s.stride), str(s.tensor_meta.dtype)) for s in specs]


def output_specs(program: PlacedProgram, entry: Entry) -> list[Any]:
    """The step's output specs as the traced step set them."""
    return [
        make_spec(program.mesh, p, shape, stride, _DTYPES[dtype])
        for p, (shape, stride, dtype) in zip(_demanded(program, len(entry.outputs)), entry.outputs)
    ]
