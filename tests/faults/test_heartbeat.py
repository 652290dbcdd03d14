"""The heartbeat thread's own report: while this rank waits in one collective longer than
``VESCALE_TIMEOUT_S`` and a peer's heartbeat is stale, one line on stderr names the peer
(a group whose timeout is longer than vescale's, or NCCL's watchdog ending the process)."""

from __future__ import annotations

import threading
import time
from unittest import mock

import torch.distributed as dist

from vescale import _watchdog


def test_a_long_wait_with_a_silent_peer_is_reported_once(monkeypatch, capsys):
    store = dist.HashStore()
    now = time.time()
    store.set("vescale/heartbeat/rank1", f"{now - 30:.3f} vescale.ddp all-reduce of bucket 3")
    store.set("vescale/heartbeat/rank2", f"{now + 60:.3f} fresh")  # beats on: not named
    monkeypatch.setenv("VESCALE_TIMEOUT_S", "1")
    world = object()
    with (
        mock.patch.object(_watchdog, "_store", lambda: store),
        mock.patch.object(dist, "get_rank", lambda: 0),
        mock.patch.multiple(
            _watchdog, _world=world, _depth=1, _entered=time.monotonic() - 5, _seen=None
        ),
        mock.patch.object(_watchdog, "_activity", "vescale.fsdp all-gather of block 0"),
    ):
        beat = threading.Thread(target=_watchdog._run, args=(world, 0, 3), daemon=True)
        beat.start()
        time.sleep(3.5 * _watchdog.BEAT_S)  # three beats: one report
        _watchdog._world = None  # the thread stops at its next beat
        beat.join(timeout=5)
    assert not beat.is_alive()
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    head, _, tail = lines[0].partition(
        " s in vescale.fsdp all-gather of block 0, which it misses: "
    )
    assert head.startswith("vescale: rank 0 waited ") and float(head.split()[-1]) > 1
    age, _, rest = tail.removeprefix("rank 1 silent for ").partition(" s ")
    assert 30 <= float(age) < 40
    assert (
        rest
        == "(stopped, hung or gone), at its last heartbeat in: vescale.ddp all-reduce of bucket 3"
    )
    assert (
        store.get("vescale/heartbeat/rank0")
        .decode()
        .endswith(" vescale.fsdp all-gather of block 0")
    )
