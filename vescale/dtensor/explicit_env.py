"""``VESCALE_DISABLE_REDISTRIBUTE``, explicit mode's environment variable, read strictly and
agreed across ranks.

:func:`env_state` reads it (unset: on; ``1/true/yes/on`` on, ``0/false/no/off`` off,
case-insensitive; anything else a ``ValueError`` naming it). :func:`agree_env_state` runs at
the first vescale ``DeviceMesh`` made over process groups (``init_device_mesh``, or
``DeviceMesh(...)`` creating its groups, both collective over the world): one
:func:`vescale._agree.all_equal`, once per default group; where the ranks' settings differ,
every rank raises the same ``ValueError`` naming each rank's value (an explicit-mode error on
some ranks while others communicate would hang them). A value that is not a boolean on every
rank raises where explicit mode is read, as without a mesh.
"""

from __future__ import annotations

import os

import torch.distributed as dist

from vescale import _agree
from vescale._env import parse_flag

__all__ = ["ENV", "agree_env_state", "env_state"]

ENV = "VESCALE_DISABLE_REDISTRIBUTE"
_agreed: set[int] = set()  # default groups (by id) whose ranks agreed


def env_state() -> tuple[bool, str]:
    """Explicit mode as ``VESCALE_DISABLE_REDISTRIBUTE`` sets it, and what says so (for
    messages); ``ValueError`` if it is not a boolean."""
    value = os.environ.get(ENV)
    if value is None:
        return True, f"the default: {ENV} is unset"
    return parse_flag(ENV, value), f"{ENV}={value!r}"


def _code() -> int:
    """0 off, 1 on, 2 not a boolean."""
    try:
        return int(env_state()[0])
    except ValueError:
        return 2


def _shown(value: str | None) -> str:
    if value is None:
        return "unset (on)"
    try:
        return f"{value!r} ({'on' if parse_flag(ENV, value) else 'off'})"
    except ValueError:
        return f"{value!r} (not a boolean)"


def agree_env_state() -> None:
    """Check, once per default group, that ``VESCALE_DISABLE_REDISTRIBUTE`` gives every rank
    the same explicit mode (see the module doc); nothing without a real multi-rank group."""
    if not _agree.active() or id(dist.group.WORLD) in _agreed:
        return
    what = f"{ENV} agreement at the first DeviceMesh"
    if not _agree.all_equal(what, _code()):
        values = _agree.gather(f"{what} (each rank's value)", os.environ.get(ENV))
        ranks = ", ".join(f"rank {r}: {_shown(v)}" for r, v in enumerate(values))
        raise ValueError(
            f"vescale: {ENV} differs across ranks ({ranks}); explicit mode must be the same on "
            f"every rank (else an op raises on some ranks while the others wait for its "
            f"collective): set it the same on every rank, e.g. in the launcher's environment"
        )
    _agreed.add(id(dist.group.WORLD))  # a bad value, the same everywhere, raises where read
