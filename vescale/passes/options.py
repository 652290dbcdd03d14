"""``BackendOptions``: every option of the ``vescale`` backend, its default and its meaning.

The one home of the defaults: the backend resolves ``torch.compile(..., options={...})`` into
this object and every pass reads it from ``PassContext.options``. Each field's
``metadata["doc"]`` says what it does and ``metadata["env"]`` names the environment variable
read when the option is not given (``None``: none), so a docs table can be generated from or
checked against ``dataclasses.fields(BackendOptions)``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Any

from vescale.ddp.reducer import DEFAULT_BUCKET_CAP_MB

__all__ = ["PASSES_OFF", "BackendOptions"]

# Backend options turning the communication passes off: the captured program as eager runs it.
PASSES_OFF: dict[str, Any] = {"eliminate": False, "bucket_cap_mb": 0, "overlap": False}


def _opt(default: Any, doc: str, env: str | None = None) -> Any:
    return field(default=default, metadata={"doc": doc, "env": env})


@dataclass(frozen=True)
class BackendOptions:
    """Options of the ``vescale`` backend; ``fields(BackendOptions)[i].metadata`` documents each."""

    codegen: str = _opt(
        "inductor",
        '"inductor" (Inductor\'s decompositions and partitioner) or "fx" (run the graphs as '
        "they are)",
    )
    eager: bool = _opt(
        False,
        "run the Dynamo graph through eager DTensor (debugging)",
        "VESCALE_COMPILE_EAGER",
    )
    dump_dir: str | None = _opt(
        None,
        "write dumps (graph.<pass>.txt, schedule.json, collectives.json), one folder per rank",
        "VESCALE_DUMP_DIR",
    )
    explicit: bool | None = _opt(
        None,
        "True/False: forbid/allow implicit redistribution while this backend traces; None: "
        "the env var, or the enclosing explicit_redistribute scope",
        "VESCALE_DISABLE_REDISTRIBUTE",
    )
    strict: bool = _opt(False, "raise instead of falling back when capture or Inductor fails")
    eliminate: bool = _opt(
        True, "drop collectives whose results are unused or sliced back to the local shard"
    )
    bucket_cap_mb: float = _opt(
        DEFAULT_BUCKET_CAP_MB,
        "merge collectives of one kind, group, reduce op and dtype up to this size in MiB "
        "(0 = off); the same default as DistributedDataParallel's eager buckets",
    )
    overlap: bool = _opt(
        True,
        "schedule: issue collectives as soon as their inputs exist, wait just before first use",
    )
    overlap_cap_mb: float = _opt(
        256.0, "most MiB of issued-but-unwaited collective results the schedule may keep alive"
    )
    rank_check: bool = _opt(
        True, "compare each graph's collective sequence across ranks at its first run"
    )

    @classmethod
    def resolve(cls, options: dict[str, Any] | None) -> BackendOptions:
        """``options`` checked (unknown names and bad values raise ``ValueError``), with the
        env vars of ``eager`` and ``dump_dir`` where not given."""
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
