"""Plain data from peers: JSON, parsed with a bounded depth (a leaf).

Python's JSON parser refuses deep nesting only past the interpreter's
recursion limit, which other libraries raise (torch.compile does); so the
depth a peer may nest is pdist's own bound, checked on what was parsed.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["MAX_DEPTH", "TooDeepError", "deeper_than", "loads"]

MAX_DEPTH = 64  # how deeply a peer's JSON may nest (pdist's own records nest a few levels)


class TooDeepError(ValueError):
    """A peer's JSON nests deeper than allowed."""


def deeper_than(value: Any, depth: int) -> bool:
    """Whether parsed JSON ``value`` nests lists and dicts more than ``depth`` levels."""
    stack = [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, (list, dict)):
            if level > depth:
                return True
            stack += [(v, level + 1) for v in (item.values() if isinstance(item, dict) else item)]
    return False


def loads(data: bytes | str) -> Any:
    """``json.loads(data)``, raising ``TooDeepError`` past ``MAX_DEPTH`` levels."""
    try:
        value = json.loads(data)
    except RecursionError:
        raise TooDeepError("JSON nested past the interpreter's recursion limit") from None
    if deeper_than(value, MAX_DEPTH):
        msg = f"JSON nested deeper than {MAX_DEPTH} levels"
        raise TooDeepError(msg)
    return value
