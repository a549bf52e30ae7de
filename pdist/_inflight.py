"""pdist's own record of the collectives a block is in, where torch's flight recorder is blind.

torch's flight recorder records every collective, but not gloo's on torch 2.6
and never gloo's point-to-point ones; the stall watch (``_stall``) then reads
this record instead. It sits below the transports, which ``recorded``
decorates, and knows groups only by their attributes (``name``, ``ranks``,
``lifetime``), so that it imports nothing of pdist's but ``_compat``.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch

from ._compat import recorder_sees_gloo

__all__ = ["InFlight", "recorded"]

F = TypeVar("F", bound=Callable[..., Any])


class InFlight:
    """The calls of one block, kept by ``recorded`` while ``active`` (the watch is on).

    ``current`` is the innermost call in flight, ``(group key, op, seq, sizes,
    dtype, start ns)``; ``entered`` counts the calls per group key (pdist's own
    sequence numbers), ``finished`` keeps each group's last finished call. One
    thread (the one running the block) writes; the watch only reads.
    """

    __slots__ = ("active", "current", "entered", "finished")

    def __init__(self) -> None:
        self.active = False
        self.current: tuple[Any, ...] | None = None
        self.entered: dict[str, int] = {}
        self.finished: dict[str, tuple[Any, ...]] = {}

    @staticmethod
    def key(group: Any) -> str:
        """The group's key in the record: its name, first rank and size (equal on its members)."""
        return f"{group.name}@{group.ranks[0]}+{group.world_size}"

    def track(self, groups: list[Any]) -> None:
        """Start counting ``groups`` at zero, so that a rank that never called on one shows."""
        for group in groups:
            self.entered.setdefault(self.key(group), 0)

    def enter(self, group: Any, op: str, first: object) -> tuple[Any, ...] | None:
        """Record that ``op`` started on ``group``; returns what ``leave`` restores."""
        key = self.key(group)
        seq = self.entered.get(key, 0) + 1
        self.entered[key] = seq
        if isinstance(first, torch.Tensor):
            sizes, dtype = [list(first.shape)], str(first.dtype).replace("torch.", "")
        elif isinstance(first, (bytes, bytearray, memoryview)):
            sizes, dtype = [[len(first)]], "bytes"
        else:
            sizes, dtype = [], ""
        outer, self.current = self.current, (key, op, seq, sizes, dtype, time.time_ns())
        return outer

    def leave(self, outer: tuple[Any, ...] | None) -> None:
        """Record that the innermost call ended; ``outer`` is what ``enter`` returned."""
        if self.current is not None:
            self.finished[self.current[0]] = self.current
        self.current = outer


def recorded(op: str, *, p2p: bool = False) -> Callable[[F], F]:
    """Record a pdist function's calls (``op``, or the call's ``what=``) where torch cannot.

    ``p2p`` marks a point-to-point call (never in gloo's recorder).
    """

    def decorate(fn: F) -> F:
        if recorder_sees_gloo() and not p2p:
            return fn

        @functools.wraps(fn)
        def recorded_call(group: Any, *args: Any, **kwargs: Any) -> Any:
            g = getattr(group, "world", group)  # a context's world, or the group itself
            # A bad group is the function's own error to raise; a traced call has no time.
            lifetime = getattr(g, "lifetime", None)
            if lifetime is None or torch.compiler.is_compiling() or not lifetime.in_flight.active:
                return fn(group, *args, **kwargs)
            record = lifetime.in_flight
            outer = record.enter(g, kwargs.get("what", op), args[0] if args else None)
            try:
                return fn(group, *args, **kwargs)
            finally:
                record.leave(outer)

        return cast("F", recorded_call)

    return decorate
