"""The three places where a test may inject a fault (a leaf), through ``pdist.testing.inject``.

Fail-together code is only as good as its tests of one rank failing half-way:
every buffer is allocated, every bucket packed and every framed message sent
through one function here, which costs one context-variable read outside ``inject``.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable

import attrs

__all__ = ["Faults", "active", "allocating", "outgoing", "packing"]


@attrs.frozen(kw_only=True)
class Faults:
    """The hooks of one ``pdist.testing.inject`` block (each optional; see its docs)."""

    allocate: Callable[[int], object] | None = None
    pack: Callable[[int], object] | None = None
    outgoing: Callable[[bytes], bytes] | None = None


_NONE = Faults()  # frozen, so one instance serves every thread
active: contextvars.ContextVar[Faults] = contextvars.ContextVar("pdist_faults", default=_NONE)
"""The faults of the innermost ``pdist.testing.inject`` block of this thread (none outside)."""


def allocating(nbytes: int) -> None:
    """The allocation seam: a buffer of ``nbytes`` is about to be allocated."""
    if (hook := active.get().allocate) is not None:
        hook(nbytes)


def packing(index: int) -> None:
    """The packing seam: bucket ``index`` is about to be packed."""
    if (hook := active.get().pack) is not None:
        hook(index)


def outgoing(message: bytes) -> bytes:
    """The wire seam: ``message`` (a framed message) is about to leave this rank."""
    hook = active.get().outgoing
    return message if hook is None else hook(message)
