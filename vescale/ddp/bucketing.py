"""The one bucket policy of eager DDP (:mod:`vescale.ddp.reducer`) and the compiled ``bucket``
pass (:mod:`vescale.passes.bucket`): the default cap and the sizing rule.

Collectives that may share a bucket are taken in order (gradients as they become ready;
graph order when compiled). A collective joins the open bucket while the bucket's bytes (this
rank's buffer: the larger of a collective's input and output) stay within the cap; otherwise
the open bucket is closed (issued) and a new one starts with it. A collective larger than the
cap gets a bucket of its own; a cap of 0 puts every collective in its own bucket.

Under ``torch.compile``, ``DistributedDataParallel`` tags the gradient reductions it traces
with its ``bucket_cap_mb`` (:func:`vescale._node_meta.set_bucket_cap_mb`); the pass buckets tagged
collectives with that cap, the others with the backend's ``bucket_cap_mb`` option.
"""

from __future__ import annotations

__all__ = ["DEFAULT_BUCKET_CAP_MB", "cap_bytes", "joins"]

# torch DDP's bucket size; also the default of the compiled ``bucket`` pass (BackendOptions).
DEFAULT_BUCKET_CAP_MB = 25.0


def cap_bytes(cap_mb: float) -> int:
    """``cap_mb`` MiB in bytes; ``ValueError`` for a negative or non-finite cap."""
    cap = float(cap_mb)
    if not 0 <= cap < float("inf"):
        raise ValueError(f"bucket_cap_mb must be a finite number >= 0 (MiB), got {cap_mb!r}")
    return int(cap * 2**20)


def joins(held: int, size: int, cap: int) -> bool:
    """Whether a collective of ``size`` bytes joins an open bucket holding ``held`` bytes
    (``held`` 0: the bucket is empty and takes it) under a cap of ``cap`` bytes."""
    return held == 0 or held + size <= cap
