"""A ``dump_dir`` that is a file is an error naming it, never a silent eager fallback."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import vescale  # noqa: F401  (registers the backend)


def test_dump_dir_that_is_a_file_raises(tmp_path: Path) -> None:
    target = tmp_path / "dumps"
    target.write_text("not a folder")
    torch._dynamo.reset()
    f = torch.compile(
        lambda x: torch.sin(x) + 1, backend="vescale", options={"dump_dir": str(target)}
    )
    with pytest.raises(Exception, match=r"dump_dir .*dumps.* is not a directory"):
        f(torch.ones(3))
    assert target.read_text() == "not a folder"
