"""Every ``python`` code block of the README and the docs folder runs as shown (the doc is the
source).

A block that starts with ``# torchrun ... --nproc-per-node N sample.py`` (optionally preceded by
``PYTHONPATH=examples``) runs under ``torch.distributed.run`` with N CPU ranks; any other block
runs in one interpreter. Each runs from a fresh directory, with this checkout importable, and
must exit 0 without a warning on stderr. Signatures and other fragments use ``text`` fences.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_BLOCK = re.compile(r"^```python\n(.*?)^```$", re.S | re.M)
_TORCHRUN = re.compile(
    r"^# (PYTHONPATH=examples )?torchrun --standalone --nproc-per-node (\d+) sample\.py\n"
)


def _samples() -> list[tuple[str, str]]:
    out = []
    for page in PAGES:
        for i, m in enumerate(_BLOCK.finditer(page.read_text()), 1):
            out.append((f"{page.relative_to(ROOT)}#{i}", m.group(1)))
    return out


SAMPLES = _samples()


def test_the_docs_have_samples():
    assert len(SAMPLES) >= 5, [name for name, _ in SAMPLES]


def _param(name: str, code: str) -> Any:
    """A sample as a test case; the plan path's (4 ranks solving and compiling, the costliest)
    run in the worker that owns the pools (tests/conftest.py), to balance the two workers."""
    group = [pytest.mark.xdist_group("pools")] if "vescale.parallelize(" in code else []
    return pytest.param(code, id=name, marks=group)


@pytest.mark.parametrize("code", [_param(n, c) for n, c in SAMPLES])
def test_sample_runs_as_shown(code: str, tmp_path: Path) -> None:
    (tmp_path / "sample.py").write_text(code)
    header = _TORCHRUN.match(code)
    paths = [str(ROOT)]
    if header and header.group(1):
        paths.append(str(ROOT / "examples"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(paths)}
    cmd = [sys.executable]
    if header:
        cmd += ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", header[2]]
    out = subprocess.run(
        [*cmd, "sample.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert "Warning" not in out.stderr, out.stderr[-4000:]
