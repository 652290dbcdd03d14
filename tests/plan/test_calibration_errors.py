"""A calibration cache folder that cannot hold files is the same error on every rank within
seconds, before anything is measured (was: a FileExistsError on rank 0 after measuring while
rank 1 waited for the next collective)."""

from __future__ import annotations

from pathlib import Path

from tests.harness.misuse import error_everywhere


def _calibrate() -> None:
    from tests.dtensor.reference import mesh_of
    from vescale.cost import calibration

    calibration._cache.clear()
    calibration.calibrate(mesh_of((2,)))


def test_a_cache_dir_that_is_a_file_fails_on_every_rank(pool2, tmp_path: Path) -> None:
    for target in (tmp_path / "a-file", tmp_path / "a-file" / "below"):
        (tmp_path / "a-file").write_text("not a folder")
        err = error_everywhere(pool2, _calibrate, env={"VESCALE_CACHE_DIR": str(target)})
        assert err.kind == "RuntimeError", err
        assert str(target) in err.message and "VESCALE_CACHE_DIR" in err.message, err.message
        assert "not a writable folder" in err.message, err.message
