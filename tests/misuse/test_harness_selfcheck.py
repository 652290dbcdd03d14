"""error_everywhere itself: it passes on one error everywhere and fails on any other outcome."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from tests.harness.misuse import error_everywhere, without_rank


def _same() -> None:
    raise ValueError("bad option 'x'")


def _rank_text() -> None:
    raise ValueError(f"rank {dist.get_rank()} says no")


def _only_rank0() -> None:
    if dist.get_rank() == 0:
        raise ValueError("only here")


def test_error_everywhere_accepts_one_error_and_rejects_the_rest(pool2):
    err = error_everywhere(pool2, _same)
    assert (err.kind, err.message) == ("ValueError", "bad option 'x'")
    assert error_everywhere(pool2, _rank_text, normalize=without_rank).kind == "ValueError"
    with pytest.raises(AssertionError, match="ranks disagree"):
        error_everywhere(pool2, _rank_text)
    with pytest.raises(AssertionError, match=r"ranks \[1\] raised nothing"):
        error_everywhere(pool2, _only_rank0)
