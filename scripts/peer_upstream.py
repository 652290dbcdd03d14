"""Run PyTorch's own DTensor tests twice: plain, and with ``import vescale`` first.

usage: python scripts/peer_upstream.py SRC [FILE ...] [--work DIR] [--timeout S]
       [--modes plain vescale] [--resume] [--report-only]

SRC holds PyTorch's test sources: a folder with ``test/distributed/tensor/...`` (or that
``tensor`` folder itself). FILE is relative to ``test/distributed/tensor/`` (default ``FILES``).
The files are copied into ``--work`` (never into this repository) as two trees: ``plain/`` and
``vescale/``, whose ``conftest.py`` imports vescale and puts a ``sitecustomize.py`` on
``PYTHONPATH`` that imports vescale in spawned rank processes. Name drift between the stored
test versions and torch 2.13 is fixed by the same edit in both trees (``DRIFT``). Rank processes
start by fork (this file is also the pytest plugin that does it). Each test class runs in its
own pytest process under ``nice`` and ``--timeout`` seconds, plain then with vescale, one at a
time; a class that times out is rerun test by test, and tests a persistent-process class skipped
only because an earlier test failed are rerun one by one, so each test gets its own verdict.
``--resume`` keeps every class that already has a result (a run can be stopped and restarted).

Prints the per-file table (passed/failed/error/skipped plain and with vescale) and the
difference: every test that passes plain and does not pass (or is missing) with vescale, with
its first error line. ``--report-only`` prints the tables from an earlier run's logs.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from suite_runner import STATUSES, collect, counts, first_error, run_pytest, verdicts

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

from vescale import _patches  # noqa: E402

assert _patches.installed(), "peer_upstream: importing vescale did not install its seam"
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


def _logs(work: Path, mode: str) -> Path:
    logs = work / "logs" / mode
    logs.mkdir(parents=True, exist_ok=True)
    return logs


def _name(f: str) -> str:
    return f.replace("/", "__")[:-3]


def classes(work: Path, f: str) -> dict[str, list[str]]:
    """Test class -> its tests in ``f``, as pytest collects them (cached in ``work/logs``)."""
    cache = _logs(work, "ids") / f"{_name(f)}.ids"
    if not cache.exists():
        cache.write_text("\n".join(collect(work / "plain", f, [str(HERE)], [])))
    out: dict[str, list[str]] = {}
    for node in cache.read_text().split():
        _, cls, test = node.split("::", 2)
        out.setdefault(cls, []).append(test)
    return out


def _pytest(work: Path, mode: str, target: str, xml: Path, timeout: int) -> int:
    log = _logs(work, mode) / f"{_name(target.split('::')[0])}.log"
    args = ["-p", "peer_upstream", "--timeout=600", target]
    return run_pytest(work / mode, args, xml, log, timeout, [str(REPO), str(HERE)])


def run_file(work: Path, mode: str, f: str, timeout: int, resume: bool) -> None:
    """Run ``f`` in one mode, one test class per pytest process.

    A class that leaves no junit XML (timeout, crash) is rerun test by test; a test that still
    leaves none is recorded as a timeout. Tests a persistent-process class skipped only because
    an earlier test failed are rerun one by one. ``resume`` keeps the results already there.
    """
    logs, name = _logs(work, mode), _name(f)
    if not resume:
        for old in logs.glob(f"{name}.*"):
            old.unlink()
    for cls, tests in classes(work, f).items():
        xml = logs / f"{name}.{cls}.0.xml"
        if resume and (xml.exists() or list(logs.glob(f"{name}.{cls}.t*"))):
            continue
        _pytest(work, mode, f"{f}::{cls}", xml, timeout)
        if not xml.exists():
            for i, test in enumerate(tests):
                one = logs / f"{name}.{cls}.t{i}.xml"
                _pytest(work, mode, f"{f}::{cls}::{test}", one, timeout)
                if not one.exists():
                    one.with_suffix(".timeout").write_text(f"{cls}::{test}")
            continue
        skipped = [
            t
            for t, (s, m) in verdicts(xml).items()
            if s == "skipped" and "Previous test failed" in m
        ]
        for i, tid in enumerate(skipped):
            _pytest(work, mode, f"{f}::{tid}", logs / f"{name}.{cls}.r{i}.xml", timeout)


def file_verdicts(work: Path, mode: str, f: str) -> dict[str, tuple[str, str]] | None:
    """Verdicts of ``f`` in ``mode`` (reruns override first runs); None: no result."""
    logs, name = work / "logs" / mode, _name(f)
    out: dict[str, tuple[str, str]] = {}
    for xml in sorted(logs.glob(f"{name}.*.xml")):  # NAME.CLASS.0.xml before its reruns
        out.update(verdicts(xml))
    for marker in logs.glob(f"{name}.*.timeout"):
        out[marker.read_text()] = ("error", "timeout/crash: no junit XML")
    return out or None


def report(work: Path, files: list[str]) -> None:
    """Print the per-file table of both modes, then every test passing plain only."""
    print("| file | plain p/f/e/s | with vescale p/f/e/s | regressions |")
    print("|---|---|---|---|")
    totals = {m: dict.fromkeys(STATUSES, 0) for m in MODES}
    regressions: list[str] = []
    for f in files:
        plain, ves = (file_verdicts(work, m, f) for m in MODES)
        for m, v in zip(MODES, (plain, ves)):
            for s, _ in (v or {}).values():
                totals[m][s] += 1
        lost = [
            (t, (ves or {}).get(t, ("missing", "no verdict with vescale"))[1])
            for t, (s, _) in (plain or {}).items()
            if s == "passed" and (ves or {}).get(t, ("missing", ""))[0] != "passed"
        ]
        regressions += [f"{f}::{t} :: {first_error(m)}" for t, m in lost]
        print(f"| {f} | {counts(plain)} | {counts(ves)} | {len(lost)} |")
    tot = ["/".join(str(totals[m][s]) for s in STATUSES) for m in MODES]
    print(f"| **total** | {tot[0]} | {tot[1]} | {len(regressions)} |\n")
    print(f"Passing plain, not passing with vescale imported: {len(regressions)}")
    for r in regressions:
        print("REGRESSION " + r)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("src", type=Path)
    ap.add_argument("files", nargs="*", default=FILES)
    ap.add_argument("--work", type=Path, default=Path("/tmp/peer_upstream"))
    ap.add_argument("--timeout", type=int, default=1200, help="seconds per pytest process")
    ap.add_argument("--report-only", action="store_true")
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    ap.add_argument("--resume", action="store_true", help="keep the classes that have a result")
    args = ap.parse_intermixed_args()
    src = args.src / "test" / "distributed" / "tensor" if (args.src / "test").is_dir() else args.src
    if not args.report_only:
        prepare(src, args.work, args.files)
        for f in args.files:
            for mode in args.modes:
                run_file(args.work, mode, f, args.timeout, args.resume)
                print(f"{mode}: {f} {counts(file_verdicts(args.work, mode, f))}", file=sys.stderr)
    report(args.work, args.files)


if __name__ == "__main__":
    main()
