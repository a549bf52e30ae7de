"""Exit records: a rank that leaves its block through an exception says so in the store.

When one rank raises inside ``distributed()`` (or calls ``sys.exit``), the others
sit in a collective that then fails with the backend's "Connection closed by peer",
which names no rank. Before its communicators go, the leaving rank writes one line
to the block's rendezvous store: its rank, the exception's type and message, and
the user's frame (``train.py:57 in load_batch``). A survivor whose pdist collective
fails reads those lines and raises a [`PdistError`][pdist.PdistError] naming the rank
that left, chained to torch's error; for collectives pdist does not run (DDP's
buckets, a raw ``dist.all_reduce``) the same line is printed when the survivor's
exception leaves its block. Every store access runs on its own connection in a
daemon thread with a bounded wait (principle 15): a store that is gone too (its
host was the rank that left) makes the survivor say so instead of waiting.

A rank that left no line (killed, out of memory, ``os._exit``) is found by a roll call:
the survivors of a small group each set a key of their own and, for a couple of
seconds, look for the others'; the members that never answer are named as most likely
gone. A link (``pdist.link``) keeps its records in its own store, so the members of two
jobs name each other too.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from datetime import timedelta
from typing import Any, TypeVar

from . import _compat
from ._compat import Store, TCPStore
from ._errors import PdistError, PeerLeftError
from ._group import Group, Lifetime

__all__ = [
    "LINK_PREFIX",
    "PeerLeftError",
    "StoreGoneError",
    "bounded",
    "explained",
    "left_block",
    "naming",
    "record",
    "wait_all",
]

T = TypeVar("T")

_WAIT = 3.0  # seconds any store access may take before the store counts as gone
_STORE_TIMEOUT = 1.0  # seconds a connection to it tries (a live store answers in ms)
# A roll call: how long survivors look for each other, and the largest group that holds one
# (every survivor reads every member's key: a failure must not load the store with W^2 reads).
_ROLL_CALL_SECONDS = 2.0
_ROLL_CALL_MAX = 64
LINK_PREFIX = "pdist/link/"  # where pdist.link keeps its store's keys (its exit records too)
_PRIMARY, _ECHO = "P", "E"  # a rank's own failure / the echo of a peer's departure
_PACKAGES = tuple(
    os.path.dirname(m.__file__ or "") + os.sep
    for m in (sys.modules["torch"], sys.modules[__name__.rsplit(".", 1)[0]])
)


class StoreGoneError(Exception):
    """The store did not answer within the wait."""


def bounded(fn: Callable[[], T], seconds: float = _WAIT, name: str = "pdist-exit-records") -> T:
    """``fn()`` on a daemon thread, waited on for ``seconds`` at most (else StoreGoneError).

    torch's store client can wait without end on a store whose host is gone without closing
    the connection: such a call is left behind in its daemon thread, never the caller.
    """
    box: list[T] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            box.append(fn())
        except BaseException as exc:  # reported to the caller below
            errors.append(exc)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join(seconds)
    if box:
        return box[0]
    raise StoreGoneError from (errors[0] if errors else None)


def _connection(store: Store) -> Store:
    """A connection of its own, whose connect and reads give up within ``_STORE_TIMEOUT``."""
    if isinstance(store, TCPStore):  # a client that does not retry a gone server for 30 min
        timeout = timedelta(seconds=_STORE_TIMEOUT)
        return TCPStore(
            store.host, store.port, is_master=False, wait_for_workers=False, timeout=timeout
        )
    return _compat.store_connection(store) or store


def _user_frame(exc: BaseException) -> str:
    """``file.py:57 in fn``: the innermost frame of the traceback outside torch and pdist."""
    frames = traceback.extract_tb(exc.__traceback__)
    mine = [f for f in frames if not f.filename.startswith(_PACKAGES)] or frames
    if not mine:
        return ""
    f = mine[-1]
    return f" ({os.path.basename(f.filename)}:{f.lineno} in {f.name})"


def summary(exc: BaseException) -> str:
    """``RuntimeError: boom (train.py:57 in load_batch)``: one line."""
    text = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
    if isinstance(exc, SystemExit):
        text = f"exited through sys.exit({exc.code!r})"
    return f"{type(exc).__name__}: {text}{_user_frame(exc)}"


def _rank_word(lifetime: Lifetime) -> str:
    """``link rank`` on a link (whose records sit under ``LINK_PREFIX``), else ``rank``.

    A link's ranks are not its jobs' ranks: a reader in the trainer job would take a
    link's "rank 0" for the trainer's.
    """
    records = lifetime.exit_records
    return "link rank" if records is not None and records[1].startswith(LINK_PREFIX) else "rank"


def record(lifetime: Lifetime, rank: int, exc: BaseException, *, echo: bool = False) -> None:
    """Record that ``rank`` leaves its block through ``exc`` (best effort, bounded).

    ``echo``: the failure followed a peer's departure (a reader names the peer first).
    """
    if lifetime.exit_records is None:
        return
    store, prefix = lifetime.exit_records
    kind = _ECHO if echo or isinstance(exc, PeerLeftError) else _PRIMARY
    line = f"{kind}{_rank_word(lifetime)} {rank} left the job: {summary(exc)}"

    def write() -> None:
        conn = _connection(store)
        conn.set(f"{prefix}/left/{rank}", line)
        conn.add(f"{prefix}/left/count", 1)

    with contextlib.suppress(StoreGoneError):  # nobody can read it either
        bounded(write)


def _read(lifetime: Lifetime, ranks: tuple[int, ...]) -> list[str]:
    """The departure lines of ``ranks``, the primary ones (or, lacking those, the echoes)."""
    if lifetime.exit_records is None:
        return []
    store, prefix = lifetime.exit_records

    def read() -> list[str]:
        conn = _connection(store)
        if conn.add(f"{prefix}/left/count", 0) == 0:
            return []
        keys = [f"{prefix}/left/{r}" for r in ranks]
        return [conn.get(k).decode(errors="replace") for k in keys if conn.check([k])]

    lines = bounded(read)
    primary = [line[1:] for line in lines if line.startswith(_PRIMARY)]
    return primary or [line[1:] for line in lines]


def explained(group: Group, what: str, error: BaseException) -> BaseException | None:
    """The error to raise instead of ``error`` (a failed collective ``what``), or None.

    Names the ranks of ``group`` that left their blocks, or says the store is gone too.
    """
    if isinstance(error, PdistError) or not isinstance(error, RuntimeError):
        return None
    others = tuple(r for r in group.ranks if r != group.rank)
    where = f"this rank was in {what} on group {group.name!r}"
    try:
        lines = _read(group.lifetime, others)
    except StoreGoneError:
        word = _rank_word(group.lifetime)
        host = "link rank 0" if word == "link rank" else "rank 0, or the launcher's agent"
        msg = (
            f"{what} on group {group.name!r} failed, and the rendezvous store does not answer "
            f"either, so pdist cannot tell which {word} left: the store's host ({host}) has "
            "most likely exited; look at its output first"
        )
        return PeerLeftError(msg, store_gone=True)
    records = group.lifetime.exit_records
    if not lines and records is not None and len(group.ranks) <= _ROLL_CALL_MAX:
        try:
            missing = _roll_call(group, *records)
        except StoreGoneError:
            missing = []
        word = _rank_word(group.lifetime)
        lines = [
            f"{word} {r} went away without a word (it did not answer a roll call through the "
            f"store within {_ROLL_CALL_SECONDS:g} s: killed, out of memory, or os._exit)"
            for r in missing
        ]
    if not lines:
        return None
    return PeerLeftError("; ".join([*lines, where]))


@contextlib.contextmanager
def naming(group: Group, what: str) -> Iterator[None]:
    """Collectives of ``what`` whose failure raises as ``explained``'s error, if any.

    Wrap only communicator calls: a local ``RuntimeError`` would start a roll call, and
    its peers, still in the collective, would not answer it.
    """
    try:
        yield
    except RuntimeError as exc:
        better = explained(group, what, exc)
        if better is None:
            raise
        raise better from exc


def wait_all(group: Group, works: Iterable[Any], what: str) -> None:
    """Wait for ``works`` (the transfers of ``what``); a failure names who left, if known."""
    with naming(group, what):
        for work in works:
            work.wait()


def _roll_call(group: Group, store: Store, prefix: str) -> list[int]:
    """The members of ``group`` that never answer a roll call through the store (bounded)."""
    key = f"{prefix}/here/{group.name}/{{}}"

    def call() -> list[int]:
        conn = _connection(store)
        conn.set(key.format(group.rank), "1")
        missing = [r for r in group.ranks if r != group.rank]
        deadline = time.monotonic() + _ROLL_CALL_SECONDS
        while missing and time.monotonic() < deadline:
            missing = [r for r in missing if not conn.check([key.format(r)])]
            if missing:
                time.sleep(0.05)
        return missing

    return bounded(call, _ROLL_CALL_SECONDS + _WAIT)


def left_block(lifetime: Lifetime, rank: int, world_size: int, exc: BaseException) -> None:
    """At the block's exit through ``exc``: print which peers left before, and record it."""
    if lifetime.exit_records is None or world_size == 1:
        return
    if isinstance(exc, PeerLeftError) and exc.store_gone:
        return  # nowhere to record it
    lines: list[str] = []
    gone = False
    if isinstance(exc, RuntimeError) and not isinstance(exc, PeerLeftError):
        # Perhaps a collective pdist does not run (DDP, a raw dist.all_reduce) failed.
        try:
            lines = _read(lifetime, tuple(r for r in range(world_size) if r != rank))
        except StoreGoneError:
            gone = True
            lines = ["the rendezvous store does not answer: its host (rank 0) most likely exited"]
        if lines:
            own = f"this rank's {type(exc).__name__} followed"
            print(f"pdist (rank {rank}): " + "; ".join([*lines, own]), file=sys.stderr, flush=True)
    if not gone:
        record(lifetime, rank, exc, echo=bool(lines))
