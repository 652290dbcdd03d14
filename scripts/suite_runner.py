"""Shared runner of the peer suites (``peer_upstream.py``, ``legacy_suite.py``).

One pytest target at a time under ``nice`` and a wall-clock ``timeout``, junit XML per run,
verdicts read back from the XML, and the telling error line of a failure.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

STATUSES = ("passed", "failed", "error", "skipped")


def run_pytest(
    cwd: Path, args: list[str], xml: Path, log: Path, timeout: int, pythonpath: list[str]
) -> int:
    """``pytest -q ARGS`` in ``cwd`` under nice + timeout; junit XML to ``xml``, output
    appended to ``log``; returns the exit code (124: the timeout killed it)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(pythonpath))
    cmd = ["nice", "-n", "19", "timeout", str(timeout), sys.executable, "-m", "pytest", "-q"]
    cmd += ["-p", "no:cacheprovider", "-rfEs", f"--junitxml={xml}", *args]
    with log.open("a") as out:
        out.write(f"\n$ pytest {' '.join(args)}\n")
        out.flush()
        return subprocess.run(
            cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT
        ).returncode


def collect(cwd: Path, target: str, pythonpath: list[str], args: list[str]) -> list[str]:
    """Node ids (``file::Class::test``) that pytest collects from ``target``."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(pythonpath))
    cmd = [sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider"]
    out = subprocess.run(
        [*cmd, *args, target], cwd=cwd, env=env, capture_output=True, text=True
    ).stdout
    return [line.strip() for line in out.splitlines() if "::" in line and " " not in line.strip()]


def verdicts(xml: Path) -> dict[str, tuple[str, str]]:
    """test id (``Class::test``) -> (one of ``STATUSES``, message) from a junit XML file."""
    out: dict[str, tuple[str, str]] = {}
    for tc in ET.parse(xml).getroot().iter("testcase"):
        status, msg = "passed", ""
        for child in tc:
            if child.tag in ("failure", "error"):
                status = "failed" if child.tag == "failure" else "error"
                msg = (child.get("message") or "") + "\n" + (child.text or "")
            elif child.tag == "skipped":
                status, msg = "skipped", child.get("message") or ""
        out[f"{tc.get('classname', '').split('.')[-1]}::{tc.get('name')}"] = (status, msg)
    return out


def counts(v: dict[str, tuple[str, str]] | None) -> str:
    """``passed/failed/error/skipped`` of a verdict table, or why there is none."""
    if v is None:
        return "no result"
    return "/".join(str(sum(s == k for s, _ in v.values())) for k in STATUSES)


def first_error(msg: str) -> str:
    """The most telling line of a failure: the last exception line (a rank's, if any)."""
    pat = re.compile(r"^([\w.]*(Error|Exception)|AssertionError)\b")
    best = ""
    for line in msg.splitlines():
        line = re.sub(r"^(E\s+|\[rank\d+\]:\S* .*?\] ?)", "", line.strip())
        if pat.match(line) and "exited with error code" not in line:
            best = line
    return (best or msg.strip().split("\n")[0])[:240]
