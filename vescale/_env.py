"""Environment variables, parsed strictly: the one place vescale reads a boolean from one.

``env_flag(name, default)``: unset -> ``default``; ``1/true/yes/on`` -> True and
``0/false/no/off`` -> False (case-insensitive, surrounding blanks ignored); anything else,
the empty string included, raises ``ValueError`` naming the variable, its value and what is
accepted. Never "any other value means on".
"""

from __future__ import annotations

import os

__all__ = ["FALSE_WORDS", "TRUE_WORDS", "env_flag", "parse_flag"]

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
