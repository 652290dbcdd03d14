"""Environment variables, parsed strictly: the one place vescale reads a boolean or a number
of seconds from one.

``env_flag(name, default)``: unset -> ``default``; ``1/true/yes/on`` -> True and
``0/false/no/off`` -> False (case-insensitive, surrounding blanks ignored); anything else,
the empty string included, raises ``ValueError`` naming the variable, its value and what is
accepted. Never "any other value means on". ``env_seconds(name, default)``: a positive,
finite number of seconds, else a ``ValueError`` naming the variable.
"""

from __future__ import annotations

import os

__all__ = ["FALSE_WORDS", "TRUE_WORDS", "env_flag", "env_seconds", "parse_flag"]

TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


def parse_flag(name: str, value: str) -> bool:
    """``value`` of the variable (or option) ``name`` as a boolean; ``ValueError`` if neither."""
    word = value.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise ValueError(
        f"{name}={value!r} is not a boolean: use one of {', '.join(TRUE_WORDS)} (on) or "
        f"{', '.join(FALSE_WORDS)} (off), case-insensitive"
    )


def env_flag(name: str, default: bool) -> bool:
    """The boolean environment variable ``name``; ``default`` when it is unset."""
    value = os.environ.get(name)
    return default if value is None else parse_flag(name, value)


def env_seconds(name: str, default: float) -> float:
    """The positive number of seconds in the environment variable ``name``; ``default`` when
    unset; anything else (``0``, negative, not a number) raises ``ValueError`` naming it."""
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0 or seconds == float("inf"):
        raise ValueError(f"{name}={value!r} is not a positive number of seconds")
    return seconds
