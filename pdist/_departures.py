"""Exit records: a rank that leaves its block through an exception says so in the store.

When one rank raises inside ``distributed()`` (or calls ``sys.exit``), the others
sit in a collective that then fails with the backend's "Connection closed by peer",
which names no rank. Before its communicators go, the leaving rank writes one line
to the block's rendezvous store: its rank, the exception's type and message, and
the user's frame (``train.py:57 in load_batch``). A survivor whose pdist collective
fails reads those lines and raises a [`PdistError`][pdist.PdistError] naming the rank
that left, chained to torch's error; for collectives pdist does not run (DDP's
buckets, a raw ``dist.all_reduce``) the same line is printed when the survivor's
exception leaves its block. Every store access runs in a daemon thread with a
bounded wait (principle 15), on a connection the block opened before anything failed:
a store that is gone too (its host was the rank that left) makes the survivor say so
instead of waiting.

A rank that left no line (killed, out of memory, ``os._exit``) is found by a roll call.
From its first pdist collective of a block on (``distributed()``'s start-up agreement, or
a link's first call), every rank answers roll calls from a daemon thread of its own
(``pdist-roll-call``, blocked in a store wait), so a rank that is alive but blocked in a
collective answers too; a survivor of a small group wakes the others' threads and, for a
couple of seconds, looks for their answers. A member whose thread was answering and does
not answer is gone; one that started no thread (its store gave it no connection of its
own) is "not known", never guessed. A survivor names the root
cause first: the ranks gone without a record, and the ranks whose own error made them
leave; then the ranks that left because of those (their records say whom they followed).
A link (``pdist.link``) keeps its records in its own store, so the members of two jobs
name each other too.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from datetime import timedelta
from typing import Any, NamedTuple, TypeVar

from . import _compat
from ._compat import PrefixStore, Store, TCPStore
from ._errors import PdistError, PeerLeftError
from ._group import Group, Lifetime, RollCall

__all__ = [
    "HINT",
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
# How long a rank's roll-call thread waits for a roll call (bounded, principle 15; a store
# wait that times out makes torch log, so it is long). It ends with the store, or on a call.
_LISTEN = timedelta(hours=1)
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
        return _compat.tcp_client(store.host, store.port, timedelta(seconds=_STORE_TIMEOUT))
    return _compat.store_connection(store) or store


def _refuses(store: Store) -> bool:
    """Whether ``store``'s TCP host refuses a connection: its process is gone, at once.

    torch's client retries a refused connect until its timeout, so two looks at a store
    whose host exited would take seconds each; a bare connect says so in a millisecond.
    """
    while isinstance(store, PrefixStore):
        store = store.underlying_store
    if not isinstance(store, TCPStore):
        return False
    try:
        socket.create_connection((store.host, store.port), timeout=_STORE_TIMEOUT).close()
    except ConnectionRefusedError:
        return True
    except OSError:  # unreachable, or slow: the looks below decide
        return False
    return False


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


class _Left(NamedTuple):
    """A member's exit record: its own failure, or the echo of ``after`` (whom it followed)."""

    rank: int
    primary: bool
    after: tuple[int, ...]
    line: str


def _ranks(ranks: Iterable[int], word: str = "rank") -> str:
    listed = sorted(ranks)
    return ", ".join(f"{word} {r}" for r in listed) if listed else "a peer"


def _followed(exc: BaseException) -> tuple[bool, tuple[int, ...]]:
    """Whether ``exc`` (or what it was raised from, or while handling) is a peer's departure.

    Also the ranks that departure named: a script that prints a PeerLeftError and calls
    ``sys.exit`` in its ``except`` clause followed them, it did not fail on its own.
    """
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        if isinstance(e, PeerLeftError):
            return True, e.ranks
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False, ()


def record(
    lifetime: Lifetime,
    rank: int,
    exc: BaseException,
    *,
    echo: bool = False,
    after: tuple[int, ...] = (),
) -> None:
    """Record that ``rank`` leaves its block through ``exc`` (best effort, bounded).

    ``echo``: the failure followed a peer's departure, ``after`` names those peers (a
    reader names them first); a PeerLeftError in ``exc``'s chain makes it one too.
    """
    if lifetime.exit_records is None or lifetime.store_gone:
        return
    store, prefix = lifetime.exit_records
    followed, named = _followed(exc)
    word = _rank_word(lifetime)
    if followed or echo:
        after = named or after
        why = f"{type(exc).__name__}{_user_frame(exc)}"
        why = why if isinstance(exc, PeerLeftError) else summary(exc)
        value = f"{_ECHO}{','.join(map(str, after))}|{word} {rank} left the job because of "
        value += f"{_ranks(after, word)}: {why}" if after else f"a peer that went away: {why}"
    else:
        value = f"{_PRIMARY}|{word} {rank} left the job: {summary(exc)}"

    def write() -> None:
        conn = _calls(lifetime, store)
        conn.set(f"{prefix}/left/{rank}", value)
        conn.add(f"{prefix}/left/count", 1)
        conn.set(f"{prefix}/roll/{rank}", "exit")  # this rank's roll-call thread ends

    with contextlib.suppress(StoreGoneError):  # nobody can read it either
        bounded(write)


def _parse_record(rank: int, raw: str) -> _Left:
    """A peer's record (plain text, never code): ``P|line`` or ``E<ranks>|line``."""
    head, _, line = raw.partition("|")
    after = tuple(int(x) for x in head[1:].split(",") if x.isdigit())
    return _Left(rank, head[:1] != _ECHO, after, line)


def _exit_records_of(conn: Store, prefix: str, ranks: Iterable[int]) -> list[_Left]:
    """The exit records of ``ranks`` that left one, in rank order (unbounded: bound it)."""
    wanted = sorted(set(ranks))
    if not wanted or conn.add(f"{prefix}/left/count", 0) == 0:
        return []
    keys = {r: f"{prefix}/left/{r}" for r in wanted}
    got = [(r, k) for r, k in keys.items() if conn.check([k])]
    return [_parse_record(r, conn.get(k).decode(errors="replace")) for r, k in got]


def _read_records(lifetime: Lifetime, ranks: Iterable[int]) -> list[_Left]:
    """The exit records of ``ranks`` that left one, in rank order (bounded)."""
    if lifetime.exit_records is None:
        return []
    store, prefix = lifetime.exit_records
    return bounded(lambda: _exit_records_of(_calls(lifetime, store), prefix, ranks))


def _listen(group: Group) -> None:
    """Start this rank's roll-call thread for ``group``'s block, once; it answers for the rank.

    The thread opens two connections of its own: one it waits on, and one the block's
    short calls share (records, reads, roll calls), so that a failure opens none. A new
    connection to a store can take seconds (torch's client looks up the peer's name), so
    the caller waits for them within ``_WAIT`` only: a rank that says in the store that it
    answers before its collective is known to be gone if it dies just after, and one whose
    connection is late is "not known" until it is made. The thread holds connections only,
    not the store (a link's member 0 must be able to free its port).
    """
    lifetime = group.lifetime
    if lifetime.exit_records is None or group.world_size == 1 or lifetime.roll_call is not None:
        return
    store, prefix = lifetime.exit_records
    call, here = f"{prefix}/roll/{group.rank}", f"{prefix}/here/{group.rank}"
    listener = RollCall(call=call)
    if not lifetime.claim_roll_call(listener):
        return  # another thread of this rank started it
    ready = listener.ready

    def run() -> None:
        try:
            if isinstance(store, TCPStore):
                conn: Store | None = _connection(store)
            else:  # a connection of its own, or none: a wait on a shared one blocks the rank
                conn = _compat.store_connection(store, timedelta(seconds=_STORE_TIMEOUT))
            if conn is None:
                return
            conn.set(f"{prefix}/listening/{group.rank}", "1")
            listener.connection = _connection(store)
        except Exception:  # no store to answer through: this rank is "not known"
            return
        finally:
            ready.set()
        _answer(conn, call, here)

    thread = threading.Thread(target=run, name="pdist-roll-call", daemon=True)
    thread.start()
    listener.thread = thread  # closing the block ends the thread
    ready.wait(_WAIT)


def _calls(lifetime: Lifetime, store: Store) -> Store:
    """The block's connection for short calls, or a new one if it has none (yet)."""
    conn = lifetime.roll_call.connection if lifetime.roll_call is not None else None
    return conn if conn is not None else _connection(store)


def stop_listening(lifetime: Lifetime) -> None:
    """End this rank's roll-call thread, if it started, as its block closes (bounded).

    Its wait would otherwise hold a store connection for up to ``_LISTEN`` after the block
    (the launcher's store outlives it); a rank that left through an error ended it already.
    """
    listener = lifetime.roll_call
    records = lifetime.exit_records
    if records is None or lifetime.store_gone or listener is None or listener.thread is None:
        return  # no thread started (yet)
    store, call, thread, ready = records[0], listener.call, listener.thread, listener.ready
    # A thread still connecting would be inside torch's client as the process exits (an
    # abort): a late connection is waited for, within two store waits.
    ready.wait(2 * _WAIT)
    with contextlib.suppress(StoreGoneError):
        bounded(lambda: _calls(lifetime, store).set(call, "exit"))
        thread.join(_STORE_TIMEOUT)  # no pdist thread outlives a clean block
    listener.connection = None  # its connection closes with the block


def _answer(conn: Store, call: str, here: str) -> None:
    """The roll-call thread: wait for a call (bounded), answer it once, end."""
    try:
        conn.wait([call], _LISTEN)
        if conn.get(call) != b"exit":
            conn.set(here, "1")
    except Exception:  # a store gone, or no call within the bound: nothing to answer
        return


def _roll_call(conn: Store, group: Group, prefix: str) -> tuple[list[int], set[int]]:
    """The other members that neither answer a roll call nor record an exit (unbounded).

    Also those of them whose roll-call thread had been answering (the others started none:
    whether they are gone is not known).
    """
    others = [r for r in group.ranks if r != group.rank]
    if len(others) >= _ROLL_CALL_MAX:
        return [], set()  # no roll call: each survivor would read every member's key
    conn.set(f"{prefix}/here/{group.rank}", "1")
    for r in others:
        conn.set(f"{prefix}/roll/{r}", "1")  # wakes r's thread
    missing = others
    deadline = time.monotonic() + _ROLL_CALL_SECONDS
    while missing and time.monotonic() < deadline:
        time.sleep(0.05)
        missing = [
            r
            for r in missing
            if not conn.check([f"{prefix}/here/{r}"]) and not conn.check([f"{prefix}/left/{r}"])
        ]
    return missing, {r for r in missing if conn.check([f"{prefix}/listening/{r}"])}


def _gone_line(rank: int, echo: _Left | None, word: str) -> str:
    if echo is not None:
        why = f"{word} {echo.rank} left the job because of it, and it left no exit record"
    else:
        why = (
            f"it did not answer a roll call through the store within {_ROLL_CALL_SECONDS:g} s: "
            "killed, out of memory, or os._exit"
        )
    return f"{word} {rank} went away without a word ({why})"


def _verdict(
    group: Group, left: list[_Left], missing: list[int], listening: set[int], called: bool
) -> tuple[list[str], tuple[int, ...]]:
    """The lines that name who left, root cause first, and the root-cause ranks."""
    recorded = {x.rank for x in left}
    answered = {r for r in group.ranks if called and r not in missing}
    echoes = [x for x in left if not x.primary]
    cited = {r: x for x in echoes for r in x.after if r not in recorded | answered}
    silent = sorted({r for r in missing if r in listening} | set(cited) - {group.rank})
    primary = [x for x in left if x.primary]
    word = _rank_word(group.lifetime)
    lines = [
        _gone_line(r, None if r in missing and r in listening else cited[r], word) for r in silent
    ]
    lines += [x.line for x in primary]
    causes = (*silent, *(x.rank for x in primary))
    if not causes:  # nothing known to be gone on its own: say what is not known
        lines += [
            f"{word} {r} did not answer a roll call within {_ROLL_CALL_SECONDS:g} s and left no "
            "exit record; not known whether it went away (it started no roll-call thread, "
            "so its silence proves nothing)"
            for r in missing
            if r not in listening
        ]
    return [*lines, *(x.line for x in echoes)], causes


def explained(group: Group, what: str, error: BaseException) -> BaseException | None:
    """The error to raise instead of ``error`` (a failed collective ``what``), or None.

    Names the members of ``group`` that left, the root cause first (module docstring),
    and only those known to be gone; or says the store is gone too.
    """
    records = group.lifetime.exit_records
    if isinstance(error, PdistError) or not isinstance(error, RuntimeError) or records is None:
        return None
    others = [r for r in group.ranks if r != group.rank]
    where = f"this rank was in {what} on group {group.name!r}"
    store, prefix = records

    def look() -> tuple[list[int], set[int], list[_Left]]:
        conn = _calls(group.lifetime, store)  # made before the failure (a new one can be slow)
        missing, listening = _roll_call(conn, group, prefix)
        left = _exit_records_of(conn, prefix, others)
        cited = {r for x in left if not x.primary for r in x.after} - {*others, group.rank}
        return missing, listening, left + _exit_records_of(conn, prefix, cited)  # not members

    # A store that takes seconds to answer under load is not gone: a wide bound, and a
    # second look within it after a look that failed (a refused connect fails both at once;
    # a frozen host, which accepts and never answers, takes the bound once, not twice).
    deadline = time.monotonic() + _ROLL_CALL_SECONDS + 2 * _WAIT
    try:
        try:
            if _refuses(store):
                raise StoreGoneError
            missing, listening, left = bounded(look, deadline - time.monotonic())
        except StoreGoneError:
            if _refuses(store) or deadline - time.monotonic() < _STORE_TIMEOUT:
                raise
            missing, listening, left = bounded(look, deadline - time.monotonic())
    except StoreGoneError:
        group.lifetime.store_gone = True
        word = _rank_word(group.lifetime)
        host = "link rank 0" if word == "link rank" else "rank 0, or the launcher's agent"
        msg = (
            f"{what} on group {group.name!r} failed, and the rendezvous store does not answer "
            f"either, so pdist cannot tell which {word} left: the store's host ({host}) has "
            "most likely exited; look at its output first"
        )
        return PeerLeftError(msg, store_gone=True)
    lines, causes = _verdict(group, left, missing, listening, len(group.ranks) <= _ROLL_CALL_MAX)
    if not lines:
        return None
    return PeerLeftError("; ".join([*lines, where]), ranks=causes)


_MISMATCH = ("mismatch", "does not match", "doesn't match")  # the backends' words

HINT = (
    "turn on check mode (pdist.distributed(check=True) or PDIST_CHECK=1) and every rank "
    "raises a RankMismatchError naming each rank's shapes and dtypes"
)


@contextlib.contextmanager
def naming(group: Group, what: str, *, counted: bool = False) -> Iterator[None]:
    """The one wrapper that turns a backend's failure of ``what`` into one naming its cause.

    A peer that left its block is named (``explained``); else a size mismatch the backend
    reports (rather than aborting the process, as gloo mostly does) gets check mode's
    hint. ``counted``: a collective of its own, numbered per group name (``all_reduce
    #6``), so that a survivor's message says which call of the job it was in. Wrap only
    communicator calls: a local ``RuntimeError`` would start a roll call, and its peers,
    still in the collective, would not answer it. The first one of a block starts this
    rank's roll-call thread (``_listen``).
    """
    if counted:
        calls = group.lifetime.calls
        calls[group.name] = number = calls.get(group.name, 0) + 1
        what = f"{what} #{number}"
    _listen(group)
    try:
        yield
    except RuntimeError as exc:
        better = explained(group, what, exc)
        if better is not None:
            raise better from exc
        text = str(exc).strip()
        if isinstance(exc, PdistError) or not any(m in text.lower() for m in _MISMATCH):
            raise
        msg = (
            f"{what} on group {group.name!r} (rank {group.rank}): the ranks' tensors "
            f"do not match ({text.splitlines()[0]}); {HINT}"
        )
        raise PdistError(msg) from exc


def wait_all(group: Group, works: Iterable[Any], what: str) -> None:
    """Wait for ``works`` (the transfers of ``what``); a failure names who left, if known."""
    with naming(group, what):
        for work in works:
            work.wait()


def left_block(lifetime: Lifetime, rank: int, world_size: int, exc: BaseException) -> None:
    """At the block's exit through ``exc``: print which peers left before, and record it."""
    if lifetime.exit_records is None or world_size == 1:
        return
    if isinstance(exc, PeerLeftError) and exc.store_gone:
        return  # nowhere to record it
    left: list[_Left] = []
    lines: list[str] = []
    if isinstance(exc, RuntimeError) and not isinstance(exc, PeerLeftError):
        # Perhaps a collective pdist does not run (DDP, a raw dist.all_reduce) failed.
        try:
            left = _read_records(lifetime, (r for r in range(world_size) if r != rank))
        except StoreGoneError:
            lines = ["the rendezvous store does not answer: its host (rank 0) most likely exited"]
        else:
            lines = [x.line for x in sorted(left, key=lambda x: not x.primary)]
        if lines:
            own = f"this rank's {type(exc).__name__} followed"
            print(f"pdist (rank {rank}): " + "; ".join([*lines, own]), file=sys.stderr, flush=True)
        if not left and lines:
            return  # the store is gone: nowhere to record it
    after = [x.rank for x in left if x.primary] or [r for x in left for r in x.after]
    record(lifetime, rank, exc, echo=bool(left), after=tuple(dict.fromkeys(after)))
