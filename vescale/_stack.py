"""The user's line in a stack trace: shared by the eager layer (explicit-mode errors) and the
capture layer (collective records), so neither imports the other for it."""

from __future__ import annotations

import os
import re

import torch

__all__ = ["user_line_of_stack"]

_FRAME = re.compile(r'File "([^"]+)", line (\d+)')
_INTERNAL = (
    os.path.dirname(torch.__file__) + os.sep,
    os.path.dirname(os.path.abspath(__file__)) + os.sep,  # the vescale package
)


def user_line_of_stack(stack_trace: str) -> str:
    """``file.py:line`` of the innermost frame outside torch and vescale, else (a vescale
    module such as the DDP wrapper at the top of the traced region) outside torch; "" if none."""
    frames = _FRAME.findall(stack_trace)
    user = [f for f in frames if not f[0].startswith(_INTERNAL)]
    user = user or [f for f in frames if not f[0].startswith(_INTERNAL[0])]
    if not user:
        return ""
    path, line = user[-1]
    return f"{path.rsplit('/', 1)[-1]}:{line}"
