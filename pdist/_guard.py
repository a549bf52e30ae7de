"""Deadlines enforced by a watchdog: the start-up of ``distributed()`` and ``world_comm_guard``.

A rank stuck while a communicator comes up sits inside a C call that no signal
or exception reaches, so the watchdog ends the process itself (exit code 93),
after logging the stage and the ranks that never checked in to the store.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist

from . import _compat, _env
from ._compat import Store
from ._departures import StoreGoneError, bounded
from ._errors import PdistError
from ._group import DistContext

__all__ = [
    "WORLD_COMM_TIMEOUT_EXIT_CODE",
    "Deadline",
    "end_process",
    "grace",
    "probe_world",
    "world_comm_guard",
    "world_comm_timeout",
]

logger = logging.getLogger("pdist")

WORLD_COMM_TIMEOUT_EXIT_CODE = 93
"""Exit code of a process whose start-up (or guarded block) missed its deadline."""

_PREFIX = "pdist/checkin"
_STORE_READ_SECONDS = 3.0
_CHECK_CHUNK = 512
_MISSING_SHOWN = 16


def world_comm_timeout() -> float | None:
    """The start-up deadline from ``PDIST_WORLD_COMM_TIMEOUT_SEC``: seconds, or None (forever).

    Unset gives 600 s, ``0`` waits forever; a bad value warns and gives the default.
    """
    return _env.world_comm_timeout()


def grace(seconds: float) -> float:
    """How long past the deadline the watchdog still waits: a build right at it is not killed."""
    return min(10.0, max(1.0, 0.05 * seconds))


def _missing(store: Store, keys: list[str]) -> list[int] | None:
    """The indices of ``keys`` absent from ``store``, read with a bounded wait (None: no answer).

    Reads through a clone of ``store``, whose connection the stuck main thread may hold,
    in a thread that the watchdog never waits on (a dead store can hang it).
    """

    def read() -> list[int]:
        bound = timedelta(seconds=_STORE_READ_SECONDS)
        reader = _compat.store_connection(store, bound) or store  # a file store reads as is
        found: list[int] = []
        for start in range(0, len(keys), _CHECK_CHUNK):
            chunk = keys[start : start + _CHECK_CHUNK]
            if not reader.check(chunk):
                found.extend(start + i for i, key in enumerate(chunk) if not reader.check([key]))
        return found

    try:
        return bounded(read, _STORE_READ_SECONDS, "pdist-checkin-read")
    except StoreGoneError:
        return None


class Deadline:
    """A watchdog that ends the process with exit code 93 unless disarmed in time.

    ``stage`` names what the rank is doing; check-ins name the ranks that never arrived.
    """

    def __init__(
        self,
        seconds: float | None,
        *,
        rank: int,
        world_size: int,
        what: str,
        hint: str,
        rendezvous: str | None = None,
    ) -> None:
        self.seconds, self.rank, self.world_size = seconds, rank, world_size
        self.what, self.hint, self.rendezvous, self.stage = what, hint, rendezvous, "starting"
        self._store: Store | None = None
        self._keys: list[str] = []
        self._done, self._aborting = threading.Event(), threading.Lock()
        self._thread: threading.Thread | None = None
        self._start, self._linger = time.monotonic(), 0.0

    def hosts_store(self) -> None:
        """This rank hosts the store: on expiry it exits after the others read the check-ins."""
        if self.seconds is not None:
            self._linger = grace(self.seconds) + _STORE_READ_SECONDS

    def arm(self) -> None:
        """Start the watchdog (none without a deadline)."""
        self._start = time.monotonic()
        if self.seconds is None:
            return
        limit = self.seconds + grace(self.seconds)
        self._thread = threading.Thread(
            target=self._watch, args=(limit,), name="pdist-deadline", daemon=True
        )
        self._thread.start()

    def check_in(self, store: Store, kind: str) -> int:
        """Record this rank (and its host) in ``store``; returns this call's generation.

        Every rank's k-th call of ``kind`` shares generation k, so two blocks' keys never mix.
        """
        generation = int(store.add(f"{_PREFIX}/{kind}/calls/{self.rank}", 1))
        self._keys = [f"{_PREFIX}/{kind}/{generation}/{r}" for r in range(self.world_size)]
        store.set(self._keys[self.rank], socket.gethostname())
        self._store = store
        return generation

    def disarm(self) -> float:
        """Stop the watchdog; returns the seconds since ``arm`` (warns if past the deadline)."""
        self._done.set()
        if self._thread is not None:
            self._thread.join()
        took = time.monotonic() - self._start
        if self.seconds is not None and took > self.seconds:
            msg = (
                "pdist: rank %d: %s took %.1fs, past its %gs deadline (saved by the grace "
                "period); raise the deadline before it ends a run: %s"
            )
            logger.warning(msg, self.rank, self.what, took, self.seconds, self.hint)
        return took

    def abort_if_expired(self, error: BaseException) -> None:
        """End the process as on expiry when ``error`` came after the deadline passed.

        A peer that gave up at its deadline makes this rank fail just before its own
        watchdog fires; it must still end with exit code 93, not a traceback.
        """
        if self.seconds is None or self._done.is_set():
            return
        if time.monotonic() - self._start > self.seconds:
            self._abort(f" ({type(error).__name__}: {str(error)[:200]})")

    def _watch(self, limit: float) -> None:
        if not self._done.wait(limit):
            self._abort()

    def _describe_missing(self) -> str:
        store = self._store
        if store is None:
            where = f" at {self.rendezvous}" if self.rendezvous else ""
            return (
                f"unknown: the rendezvous store{where} never answered (is the rank-0 host up "
                "and the address and port reachable from this host?)"
            )
        missing = _missing(store, self._keys)
        if missing is None:
            return "unknown (the rendezvous store did not answer)"
        if not missing:
            return "none (all checked in)"
        shown = ", ".join(str(r) for r in missing[:_MISSING_SHOWN])
        more = len(missing) - _MISSING_SHOWN
        return shown + (f" and {more} more ({len(missing)} in all)" if more > 0 else "")

    def _abort(self, failure: str = "") -> None:
        if not self._aborting.acquire(blocking=False):
            while True:  # the other thread is ending the process
                time.sleep(60)
        host = socket.gethostname()
        message = (
            f"pdist: rank {self.rank} on {host}: {self.what} did not finish within the "
            f"{self.seconds:g}s deadline while {self.stage}{failure}; ranks that never checked in: "
            f"{self._describe_missing()}. {self.hint}, or find out why those ranks are late. "
            f"Exiting with code {WORLD_COMM_TIMEOUT_EXIT_CODE}."
        )
        if logger.hasHandlers():
            logger.error(message)
        else:  # logging is not configured: still say why the process ends, once
            sys.stderr.write(message + "\n")
        # The others' watchdogs fire about now too (within their start-up skew).
        end_process(WORLD_COMM_TIMEOUT_EXIT_CODE, self._linger)


def end_process(code: int, linger: float = 0.0) -> NoReturn:
    """Flush the logs, serve ``linger`` seconds more, then ``os._exit(code)``.

    No cleanup that could wait on a peer (a collective, a group's destructor) runs;
    ``linger`` lets the others still read a store this process hosts.
    """
    for handler in logging.getLogger().handlers + logger.handlers:
        handler.flush()
    sys.stderr.flush()
    time.sleep(linger)
    os._exit(code)


def probe_world(ctx: DistContext) -> None:
    """All-reduce ``rank + 1`` (int64) over the world device group; PdistError if the sum is off."""
    if ctx.world_size == 1:
        return
    probe = torch.tensor([ctx.rank + 1], dtype=torch.int64, device=ctx.device)
    dist.all_reduce(probe, group=ctx.world.device_group)
    expected = ctx.world_size * (ctx.world_size + 1) // 2
    got = int(probe.item())
    if got != expected:
        msg = (
            f"world communicator probe on rank {ctx.rank}: all-reduce gave {got}, "
            f"expected {expected}; the communicator is broken"
        )
        raise PdistError(msg)


@contextlib.contextmanager
def world_comm_guard(ctx: DistContext, timeout: float | timedelta | None = None) -> Iterator[None]:
    """Bound a chosen block, and a probe of the world communicator, by a deadline.

    Past the deadline (plus a short grace) a watchdog logs which ranks never
    checked in and ends the process with ``WORLD_COMM_TIMEOUT_EXIT_CODE``: a
    stall inside a C call cannot be interrupted. Never guard a whole training
    job: it ends any late block.

    Note:
        Every rank of the world must enter it.

    Args:
        ctx: The context.
        timeout: Seconds or ``timedelta``; ``0`` waits forever; None reads
            [`world_comm_timeout`][pdist.world_comm_timeout] (``PDIST_WORLD_COMM_TIMEOUT_SEC``,
            default 600).

    Raises:
        PdistError: The probe's sum is wrong (a broken communicator).
    """
    deadline = Deadline(
        _env.deadline_seconds(timeout, "timeout"),
        rank=ctx.rank,
        world_size=ctx.world_size,
        what="the world_comm_guard block",
        hint="Raise the deadline with world_comm_guard(ctx, timeout=...) or "
        "PDIST_WORLD_COMM_TIMEOUT_SEC (0 waits forever)",
    )
    deadline.arm()  # before the check-in: a store that never answers is a stall too
    try:
        store = _compat.default_store()
        if store is not None:
            deadline.stage = "checking in with the rendezvous store"
            deadline.check_in(store, "guard")
        deadline.stage = "probing the world communicator"
        start = time.monotonic()
        try:
            probe_world(ctx)
        except Exception as exc:  # a peer that gave up at its deadline closed the connection
            deadline.abort_if_expired(exc)
            raise
        took = time.monotonic() - start
        logger.info("pdist: world communicator of %d ranks answered in %.2fs", ctx.world_size, took)
        deadline.stage = "running the guarded block"
        yield
    finally:
        deadline.disarm()
