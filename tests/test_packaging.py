"""Installation and packaging: ``scripts/install.sh``'s choice of pip command (without network,
by ``--dry-run``), the extras of ``pyproject.toml`` against what is installed, the Dockerfile
installing through ``install.sh``, and the suite's conftest under plain pytest."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
INSTALL = ROOT / "scripts" / "install.sh"


def _dry_run(*args: str, torch_version: str | None = "real", index: str | None = None) -> str:
    """The pip command ``install.sh args --dry-run`` prints. ``torch_version``: ``"real"`` asks
    this interpreter; otherwise a ``python`` on PATH reports that torch version (``None``: no
    torch installed)."""
    env = {k: v for k, v in os.environ.items() if k != "VESCALE_TORCH_INDEX"}
    if index is not None:
        env["VESCALE_TORCH_INDEX"] = index
    with tempfile.TemporaryDirectory() as shim_dir:
        if torch_version == "real":
            env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
        else:
            shim = Path(shim_dir) / "python"
            answer = "exit 1" if torch_version is None else f"echo {torch_version}"
            shim.write_text(f"#!/bin/sh\n{answer}\n")
            shim.chmod(0o755)
            env["PATH"] = f"{shim_dir}{os.pathsep}{env['PATH']}"
        out = subprocess.run(
            ["bash", str(INSTALL), *args, "--dry-run"], env=env, capture_output=True, text=True
        )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_install_keeps_an_installed_torch_2_13():
    assert importlib.metadata.version("torch").startswith("2.13.")
    assert _dry_run() == "python -m pip install -q -e ."
    assert _dry_run(torch_version="2.13.0+cu128") == "python -m pip install -q -e ."
    assert _dry_run(torch_version="2.13.1") == "python -m pip install -q -e ."


@pytest.mark.parametrize("version", [None, "2.12.1+cu126", "2.14.0", "2.1.3"])
def test_install_installs_torch_2_13_from_the_default_index(version):
    """No torch, or another version: ``torch==2.13.0`` (no local label such as ``+cpu``, which
    plain PyPI has no wheel for), from pip's configured index."""
    assert _dry_run(torch_version=version) == "python -m pip install -q torch==2.13.0 -e ."


def test_install_extras_and_torch_index():
    assert _dry_run("test") == "python -m pip install -q -e .[test]"
    assert _dry_run("test", "dev") == "python -m pip install -q -e .[test,dev]"
    cmd = _dry_run("dev", torch_version=None, index="https://download.pytorch.org/whl/cpu")
    assert cmd == (
        "python -m pip install -q --extra-index-url https://download.pytorch.org/whl/cpu "
        "torch==2.13.0 -e .[dev]"
    )


def test_install_rejects_an_unknown_argument():
    out = subprocess.run(["bash", str(INSTALL), "tests"], capture_output=True, text=True)
    assert out.returncode == 2
    assert "unknown argument 'tests'" in out.stderr


def test_dockerfile_installs_through_install_sh():
    lines = [ln for ln in (ROOT / "Dockerfile").read_text().splitlines() if ln.startswith("RUN")]
    assert not [ln for ln in lines if "pip" in ln.replace("PIP_NO_CACHE_DIR", "")], lines
    assert any(ln.endswith("bash scripts/install.sh test") for ln in lines), lines


def _extras() -> dict[str, list[Requirement]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    return {name: [Requirement(r) for r in reqs] for name, reqs in extras.items()}


def test_every_extra_installs_something_and_lint_tools_are_dev_only():
    extras = _extras()
    assert all(extras.values()), {k: v for k, v in extras.items() if not v}
    names = {name: {r.name for r in reqs} for name, reqs in extras.items()}
    assert {"ruff", "mypy"} <= names["dev"]
    assert not {"ruff", "mypy"} & names["test"]


def test_installed_transformers_and_lint_tools_satisfy_their_ranges():
    extras = _extras()
    pinned = {r.name: r for r in extras["test"] + extras["dev"]}
    for name in ("transformers", "ruff", "mypy"):
        req = pinned[name]
        assert str(req.specifier), f"{name} has no tested range"
        installed = importlib.metadata.version(name)
        assert req.specifier.contains(installed), (name, installed, str(req.specifier))


def test_conftest_works_without_pytest_xdist():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "pytest", "-p", "no:xdist", "-p", "no:cacheprovider"]
    cmd += ["tests/test_docs.py", "-q"]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert " passed" in out.stdout
