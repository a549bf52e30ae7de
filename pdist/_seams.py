"""The few places where a test may inject a fault, kept on purpose (a leaf).

Fail-together code is only as good as its tests of one rank failing half-way,
so pdist keeps three seams, and only three, where such a failure can be put
in from outside (through :func:`pdist.testing.inject`, documented in the
testing guide): every staging or receive buffer is allocated through one
function, every bucket is packed through one function, and every framed
message leaves a rank through one function. Inside ``inject`` those call the
test's hooks; outside it they cost one context-variable read.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable

import attrs

__all__ = ["Faults", "active", "allocating", "outgoing", "packing"]


@attrs.frozen(kw_only=True)
class Faults:
    """The hooks of one :func:`pdist.testing.inject` block (each optional).

    Attributes:
        allocate: Called with the size in bytes before each buffer is allocated;
            what it raises is the allocation's failure.
        pack: Called with the bucket's index before each bucket is packed.
        outgoing: Returns the bytes to send in place of each framed message.
    """

    allocate: Callable[[int], object] | None = None
    pack: Callable[[int], object] | None = None
    outgoing: Callable[[bytes], bytes] | None = None


active: contextvars.ContextVar[Faults | None] = contextvars.ContextVar("pdist_faults", default=None)
"""The faults of the innermost :func:`pdist.testing.inject` block of this thread, if any."""


def allocating(nbytes: int) -> None:
    """The allocation seam: a buffer of ``nbytes`` is about to be allocated."""
    faults = active.get()
    if faults is not None and faults.allocate is not None:
        faults.allocate(nbytes)


def packing(index: int) -> None:
    """The packing seam: bucket ``index`` is about to be packed."""
    faults = active.get()
    if faults is not None and faults.pack is not None:
        faults.pack(index)


def outgoing(message: bytes) -> bytes:
    """The wire seam: ``message`` (a framed message) is about to leave this rank."""
    faults = active.get()
    if faults is None or faults.outgoing is None:
        return message
    return faults.outgoing(message)
