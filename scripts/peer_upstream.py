"""Run PyTorch's own DTensor tests twice: plain, and with ``import vescale`` first.

usage: python scripts/peer_upstream.py SRC [FILE ...] [--work DIR] [--timeout S] [--report-only]

SRC holds PyTorch's test sources: a folder with ``test/distributed/tensor/...`` (or that
``tensor`` folder itself). FILE is relative to ``test/distributed/tensor/`` (default ``FILES``).
The files are copied into ``--work`` (never into this repository) as two trees: ``plain/`` and
``vescale/``, whose ``conftest.py`` imports vescale and puts a ``sitecustomize.py`` on
``PYTHONPATH`` that imports vescale in spawned rank processes. Name drift between the stored
test versions and torch 2.13 is fixed by the same edit in both trees (``DRIFT``). Rank processes
start by fork (this file is also the pytest plugin that does it). Each file runs alone under
``nice`` and a timeout, plain then with vescale; tests that a persistent-process class skipped
only because an earlier test failed are rerun one by one, so each test gets its own verdict.

Prints the per-file table (passed/failed/skipped plain and with vescale) and the difference:
every test that passes plain and fails (or is missing) with vescale, with its first error line.
``--report-only`` prints the tables from an earlier run's logs.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

FILES = [
    "test_api.py",
    "test_dtensor.py",
    "test_redistribute.py",
    "test_init.py",
    "test_math_ops.py",
    "test_view_ops.py",
    "test_tensor_ops.py",
    "test_pointwise_ops.py",
    "test_embedding_ops.py",
    "test_optimizers.py",
    "parallel/test_tp_style.py",
    "parallel/test_parallelize_api.py",
    "test_dtensor_compile.py",
]

# file -> [(line regex, replacement)]: names the stored test versions import that torch 2.13
# spells differently or lacks; applied identically in both modes.
DRIFT: dict[str, list[tuple[str, str]]] = {
    "test_redistribute.py": [
        (r"import _StridedShard, MaskPartial$", "import _StridedShard, _MaskPartial as MaskPartial")
    ],
    "parallel/test_tp_style.py": [
        (
            r"^from torch.testing._internal.common_utils import HardwareClassification, run_tests$",
            "from torch.testing._internal.common_utils import run_tests",
        ),
        (r"^    hw_classification = HardwareClassification.ACCELERATOR$", "    pass"),
    ],
}

MODES = ("plain", "vescale")
REPO = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent

VESCALE_CONFTEST = '''"""peer_upstream: import vescale here and, through sitecustomize, in every rank process."""
import os
import sys

_site = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_vescale_site")
os.environ["PYTHONPATH"] = _site + os.pathsep + os.environ.get("PYTHONPATH", "")
sys.path.insert(0, _site)

import vescale  # noqa: E402,F401
'''


# Spawned rank processes (argv ends with --multiprocessing-fork) import vescale; other
# subprocesses a test starts stay clean (test_dtensor_save_load_import checks that a bare
# interpreter cannot load a DTensor without importing torch.distributed.tensor).
VESCALE_SITE = """import sys

if "--multiprocessing-fork" in sys.argv:
    import vescale  # noqa: F401
"""


def pytest_configure(config: object) -> None:
    """pytest plugin hook (``-p peer_upstream``): rank processes start by fork, not spawn.

    A spawned rank re-imports torch (and vescale) for seconds of CPU; test bodies are unchanged.
    """
    import torch.multiprocessing as mp
    from torch.testing._internal.common_distributed import MultiProcessTestCase

    def fork_processes(self: MultiProcessTestCase) -> None:
        self._start_processes(mp.get_context("fork").Process)

    MultiProcessTestCase._spawn_processes = fork_processes  # type: ignore[method-assign]


def prepare(src: Path, work: Path, files: list[str]) -> None:
    """Copy ``files`` from ``src`` into ``work/plain`` and ``work/vescale`` with ``DRIFT`` applied."""
    for f in files:
        text = (src / f).read_text()
        for pattern, repl in DRIFT.get(f, []):
            text = re.sub(pattern, repl, text, flags=re.M)
        for mode in MODES:
            dst = work / mode / f
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_text(text)
    site = work / "vescale" / "_vescale_site"
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(VESCALE_SITE)
    (work / "vescale" / "conftest.py").write_text(VESCALE_CONFTEST)


def run_pytest(tree: Path, target: str, xml: Path, log: Path, timeout: int) -> int:
    """One pytest run under nice + timeout, junit XML to ``xml``, output appended to ``log``."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(REPO), str(HERE)]))
    cmd = ["nice", "-n", "19", "timeout", str(timeout), sys.executable, "-m", "pytest", "-q"]
    cmd += ["-p", "no:cacheprovider", "-p", "peer_upstream", "-rfEs", "--timeout=600"]
    cmd += [f"--junitxml={xml}", target]
    with log.open("a") as out:
        return subprocess.run(
            cmd, cwd=tree, env=env, stdout=out, stderr=subprocess.STDOUT
        ).returncode


def verdicts(xml: Path) -> dict[str, tuple[str, str]]:
    """test id (``Class::test``) -> (passed | failed | skipped, message) from a junit XML file."""
    out: dict[str, tuple[str, str]] = {}
    for tc in ET.parse(xml).getroot().iter("testcase"):
        status, msg = "passed", ""
        for child in tc:
            if child.tag in ("failure", "error"):
                status, msg = "failed", (child.get("message") or "") + "\n" + (child.text or "")
            elif child.tag == "skipped":
                status, msg = "skipped", child.get("message") or ""
        out[f"{tc.get('classname', '').split('.')[-1]}::{tc.get('name')}"] = (status, msg)
    return out


def run_file(work: Path, mode: str, f: str, timeout: int) -> None:
    """Run ``f`` in one mode; rerun alone each test skipped for "Previous test failed"."""
    logs = work / "logs" / mode
    logs.mkdir(parents=True, exist_ok=True)
    name = f.replace("/", "__")[:-3]
    for old in logs.glob(f"{name}.*"):
        old.unlink()
    log = logs / f"{name}.log"
    xml = logs / f"{name}.xml"
    rc = run_pytest(work / mode, f, xml, log, timeout)
    if not xml.exists():
        log.open("a").write(f"\npeer_upstream: no junit XML (rc={rc})\n")
        return
    skipped = [
        t for t, (s, m) in verdicts(xml).items() if s == "skipped" and "Previous test failed" in m
    ]
    for n, tid in enumerate(skipped, 1):
        run_pytest(work / mode, f"{f}::{tid}", logs / f"{name}.rerun{n}.xml", log, timeout)


def file_verdicts(work: Path, mode: str, f: str) -> dict[str, tuple[str, str]] | None:
    """Verdicts of ``f`` in ``mode``, reruns overriding the first run; None: no result."""
    logs = work / "logs" / mode
    name = f.replace("/", "__")[:-3]
    xml = logs / f"{name}.xml"
    if not xml.exists():
        return None
    out = verdicts(xml)
    for rerun in sorted(logs.glob(f"{name}.rerun*.xml")):
        out.update(verdicts(rerun))
    return out


def first_error(msg: str) -> str:
    """The most telling line of a failure: the last exception line (a rank's, if any)."""
    pat = re.compile(r"^([\w.]*(Error|Exception)|AssertionError)\b")
    best = ""
    for line in msg.splitlines():
        line = re.sub(r"^(E\s+|\[rank\d+\]:\S* .*?\] ?)", "", line.strip())
        if pat.match(line) and "exited with error code" not in line:
            best = line
    return (best or msg.strip().split("\n")[0])[:240]


def counts(v: dict[str, tuple[str, str]] | None) -> str:
    """``passed/failed/skipped`` of one file, or why there is none."""
    if v is None:
        return "no result (timeout/crash)"
    return "/".join(
        str(sum(s == k for s, _ in v.values())) for k in ("passed", "failed", "skipped")
    )


def report(work: Path, files: list[str]) -> None:
    """Print the per-file table of both modes, then every test passing plain only."""
    print(
        "| file | plain passed/failed/skipped | with vescale passed/failed/skipped | regressions |"
    )
    print("|---|---|---|---|")
    totals = {m: [0, 0, 0] for m in MODES}
    regressions: list[str] = []
    for f in files:
        plain, ves = (file_verdicts(work, m, f) for m in MODES)
        for m, v in zip(MODES, (plain, ves)):
            for i, k in enumerate(("passed", "failed", "skipped")):
                totals[m][i] += sum(s == k for s, _ in (v or {}).values())
        lost = [
            (t, (ves or {}).get(t, ("missing", "no verdict with vescale"))[1])
            for t, (s, _) in (plain or {}).items()
            if s == "passed" and (ves or {}).get(t, ("missing", ""))[0] != "passed"
        ]
        regressions += [f"{f}::{t} :: {first_error(m)}" for t, m in lost]
        print(f"| {f} | {counts(plain)} | {counts(ves)} | {len(lost)} |")
    tot = ["/".join(map(str, totals[m])) for m in MODES]
    print(f"| **total** | {tot[0]} | {tot[1]} | {len(regressions)} |\n")
    print(f"Passing plain, not passing with vescale imported: {len(regressions)}")
    for r in regressions:
        print("REGRESSION " + r)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("src", type=Path)
    ap.add_argument("files", nargs="*", default=FILES)
    ap.add_argument("--work", type=Path, default=Path("/tmp/peer_upstream"))
    ap.add_argument("--timeout", type=int, default=900)
    ap.add_argument("--report-only", action="store_true")
    args = ap.parse_intermixed_args()
    src = args.src / "test" / "distributed" / "tensor" if (args.src / "test").is_dir() else args.src
    if not args.report_only:
        prepare(src, args.work, args.files)
        for f in args.files:
            for mode in MODES:
                run_file(args.work, mode, f, args.timeout)
                print(f"{mode}: {f} {counts(file_verdicts(args.work, mode, f))}", file=sys.stderr)
    report(args.work, args.files)


if __name__ == "__main__":
    main()
