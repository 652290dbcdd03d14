"""The Trace Event Format's rules for the traces vescale writes (``schedule.json``)."""

from __future__ import annotations

from typing import Any


def check_chrome_trace(trace: dict[str, Any]) -> None:
    """Complete (``X``) events with integer pid/tid, numeric ts/dur >= 0 and an args object;
    every (pid, tid) used is named by ``process_name``/``thread_name`` metadata (``M``)."""
    assert set(trace) >= {"traceEvents", "displayTimeUnit"}
    named_pids, named_tids = set(), set()
    for e in trace["traceEvents"]:
        assert isinstance(e["name"], str) and isinstance(e["pid"], int)
        assert isinstance(e["tid"], int) and isinstance(e["args"], dict)
        if e["ph"] == "M":
            assert e["name"] in ("process_name", "thread_name")
            assert isinstance(e["args"]["name"], str)
            (named_pids if e["name"] == "process_name" else named_tids).add((e["pid"], e["tid"]))
        else:
            assert e["ph"] == "X"
            assert isinstance(e["ts"], int | float) and isinstance(e["dur"], int | float)
            assert e["ts"] >= 0 and e["dur"] >= 0
            assert (e["pid"], 0) in named_pids and (e["pid"], e["tid"]) in named_tids
