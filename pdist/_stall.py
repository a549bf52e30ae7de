"""The stall watch: a collective waiting past ``stall_timeout`` produces one report of who is where.

A thread per rank (``pdist-stall``) polls this process's own view: torch's
flight recorder (each group's last enqueued and completed sequence numbers),
and where the recorder is blind (gloo on torch 2.6, gloo's point-to-point
calls) pdist's own record (``InFlight``); no collective,
no store traffic while healthy. A group whose completed number has not moved
for ``stall_timeout`` while a collective is enqueued is a stall.

A round, in store keys under ``<prefix>/stall/``: a second thread per rank
(``pdist-stall-answer``, on a store connection of its own) waits on
``wake/<rank>/<round>``; the first rank to see a stall takes ``claim/<round>``
and sets every ``wake`` key; each rank writes its record (JSON, never pickle) to
``answer/<round>/<rank>`` and counts itself in ``count/<round>``; the requester
reads those in by the answer wait, writes ``report/<round>`` and each answering
rank's verdict ``told/<rank>/<round>`` (its own last); the lowest answering rank
logs the report. With ``on_stall="exit"`` the told ranks count themselves in
``exiting/<round>`` and exit together (or after the answer wait), so that no exit
breaks a collective of a rank that does not yet know.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import socket
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any

import torch

from . import _compat, _plain
from ._compat import PrefixStore, Store
from ._departures import StoreGoneError, bounded
from ._env import Settings
from ._group import Group, Lifetime
from ._guard import end_process
from ._inflight import InFlight
from ._stall_report import format_report, frame_text, picture, stalled

__all__ = ["STALL_EXIT_CODE", "Watch", "arm_flight_recorder", "local_record"]

logger = logging.getLogger("pdist")

STALL_EXIT_CODE = 94
"""Exit code of a rank ended by ``distributed(on_stall="exit")`` after a stall report."""

_RECORDER_ENTRIES = 2000  # torch's own default where it records by default (2.13)
_MAX_FRAMES, _MAX_STACK_BYTES = 24, 3072
_MAX_GROUPS, _MAX_SIZES = 16, 4
_CHUNK = 512  # store keys per round trip
_GRACE = 10.0  # seconds a rank waits for the verdict past the answer wait
_LINGER = 2.0  # seconds a store-hosting rank serves before an exit
# The answering thread's wait for a wake-up between stalls. Bounded (principle 15), but long:
# torch logs two warning lines on every store wait that times out, so a short bound would
# write them into every rank's log every few seconds of a healthy job. The thread is a
# daemon and leaving the block never waits on it for more than _STOP_SECONDS.
_LISTEN = timedelta(hours=1)
_STOP_SECONDS = 5.0  # how long leaving the block waits for the store (a live one: milliseconds)
_LIBRARY = ("torch/", "pdist/")
_ROOTS = sorted(
    {os.path.dirname(os.path.dirname(os.path.abspath(m.__file__ or ""))) for m in (torch, _compat)},
    key=len,
    reverse=True,
)


def _short(path: str) -> str:
    for root in _ROOTS:
        if path.startswith(root + os.sep):
            return path[len(root) + 1 :]
    return path


def main_stack(thread_id: int) -> list[list[Any]]:
    """``[file, line, function]`` of the thread's frames, innermost first, a few KiB at most."""
    frame = sys._current_frames().get(thread_id)
    out: list[list[Any]] = []
    size = 0
    while frame is not None and len(out) < _MAX_FRAMES:
        code = frame.f_code
        path = _short(code.co_filename)
        size += len(path) + len(code.co_name) + 8
        if size > _MAX_STACK_BYTES:
            break
        out.append([path, frame.f_lineno, code.co_name])
        frame = frame.f_back
    return out


def _site(stack: list[list[Any]]) -> str:
    """The innermost frame outside torch and pdist: where the program called into them."""
    for frame in stack:
        if not str(frame[0]).startswith(_LIBRARY):
            return frame_text(frame)
    return frame_text(stack[0]) if stack else "?"


def _entry_op(entry: dict[str, Any] | None, now_ns: int) -> dict[str, Any] | None:
    if entry is None:
        return None
    return {
        "seq": entry.get("collective_seq_id"),
        "op": str(entry.get("profiling_name", "?")),
        "sizes": [list(s)[:8] for s in entry.get("input_sizes", [])][:_MAX_SIZES],
        "dtypes": [str(d) for d in entry.get("input_dtypes", [])][:_MAX_SIZES],
        "age": max(0.0, (now_ns - int(entry.get("time_created_ns") or now_ns)) / 1e9),
    }


def _names(lifetime: Lifetime) -> dict[str, str]:
    """This block's torch group names and what pdist calls them (``world``, ``tp``, ...)."""
    names = {}
    for pg in lifetime.process_groups():
        desc = str(getattr(pg, "group_desc", "") or "")
        names[str(pg.group_name)] = "world" if desc in ("", "default_pg") else desc
    return names


def recorder_groups(
    dump: dict[str, Any], names: dict[str, str], now_ns: int
) -> list[dict[str, Any]]:
    """Per group of ``names``: sequence numbers and oldest unfinished collective, from the recorder.

    A group name comes back in every block while its ``pg_id`` grows: the highest is this block's.
    On gloo an entry's ``state`` stays ``scheduled``; ``retired`` says it finished.
    """
    entries = [e for e in dump.get("entries", []) if not e.get("is_p2p")]
    newest: dict[str, int] = {}
    mine: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for e in entries:
        name = str(e.get("process_group", ("",))[0])
        if name in names:
            newest[name] = max(newest.get(name, -1), int(e["pg_id"]))
        mine[int(e["pg_id"])].append(e)
    groups = []
    for name, pg_id in newest.items():
        status = dump.get("pg_status", {}).get(str(pg_id), {})
        completed = status.get("last_completed_collective")
        waiting = [e for e in mine[pg_id] if not e.get("retired")]
        last = [e for e in mine[pg_id] if e.get("collective_seq_id") == completed]
        oldest = min(waiting, key=lambda e: int(e["collective_seq_id"]), default=None)
        groups.append(
            {
                "key": name,
                "label": names[name],
                "source": "flight recorder",
                "enqueued": status.get("last_enqueued_collective"),
                "completed": completed,
                "inflight": _entry_op(oldest, now_ns),
                "last": _entry_op(last[-1] if last else None, now_ns),
            }
        )
    return groups


def record_groups(record: InFlight, now_ns: int) -> list[dict[str, Any]]:
    """Per group pdist's record saw: its call count, the call in flight and the last finished."""

    def op(call: tuple[Any, ...] | None) -> dict[str, Any] | None:
        if call is None:
            return None
        _, name, seq, sizes, dtype, start = call
        age = max(0.0, (now_ns - start) / 1e9)
        return {"seq": seq, "op": name, "sizes": sizes, "dtypes": [dtype], "age": age}

    current, entered, finished = record.current, dict(record.entered), dict(record.finished)
    return [
        {
            "key": key,
            "label": key.split("@")[0],
            "source": "pdist record",
            "enqueued": count,
            "completed": finished[key][2] if key in finished else 0,
            "inflight": op(current) if current is not None and current[0] == key else None,
            "last": op(finished.get(key)),
        }
        for key, count in entered.items()
    ]


def local_record(
    *, rank: int, thread_id: int, lifetime: Lifetime, use_recorder: bool
) -> dict[str, Any]:
    """This rank's answer: its main-thread stack and, per group, what it waits in (plain data)."""
    now = time.time_ns()
    groups: list[dict[str, Any]] = []
    if use_recorder:
        dump = _compat.dump_flight_recorder(collectives=True, stacks=False)
        groups += recorder_groups(dump or {}, _names(lifetime), now)
    groups += record_groups(lifetime.in_flight, now)
    groups.sort(key=lambda g: g["inflight"] is None)
    stack = main_stack(thread_id)
    return {
        "rank": rank,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "stack": stack,
        "site": _site(stack),
        "groups": groups[:_MAX_GROUPS],
    }


class _Detector:
    """How long this rank's oldest collective has waited, from cheap reads of its own state."""

    def __init__(self, record: InFlight, use_recorder: bool) -> None:
        self.record = record
        self.use_recorder = use_recorder
        self._pending: dict[str, tuple[Any, float]] = {}  # pg_id -> (completed, first seen)
        self._ignored: dict[str, Any] = {}  # pg_id -> the completed number it was ignored at

    def age(self) -> float:
        """Seconds since the oldest pending collective was first seen (0: none pending)."""
        now = time.monotonic()
        oldest = now
        if self.use_recorder:
            dump = _compat.dump_flight_recorder(collectives=False, stacks=False) or {}
            status: dict[str, dict[str, Any]] = dump.get("pg_status", {})
            for pg_id, s in status.items():
                done = s.get("last_completed_collective")
                if s.get("last_enqueued_collective", -1) <= (done if done is not None else -1):
                    self._pending.pop(pg_id, None)
                elif self._ignored.get(pg_id, object()) != done:
                    self._ignored.pop(pg_id, None)
                    seen = self._pending.get(pg_id)
                    if seen is None or seen[0] != done:
                        self._pending[pg_id] = seen = (done, now)
                    oldest = min(oldest, seen[1])
        current = self.record.current
        if current is not None:
            oldest = min(oldest, now - (time.time_ns() - current[5]) / 1e9)
        return now - oldest

    def ignore_pending(self, stall_timeout: float) -> None:
        """Stop counting the groups pending that long: none of them is this block's."""
        now = time.monotonic()
        for pg_id, (done, since) in list(self._pending.items()):
            if now - since >= stall_timeout:
                self._ignored[pg_id] = done
                del self._pending[pg_id]


def arm_flight_recorder() -> Callable[[], object] | None:
    """Size torch's flight recorder before any group exists: the undo, or None if the user did."""
    name = _compat.FEATURES.flight_recorder_env
    if name in os.environ:
        return None
    os.environ[name] = str(_RECORDER_ENTRIES)
    return functools.partial(os.environ.pop, name, None)


class Watch:
    """The stall watch of one block on one rank: ``start`` once its groups exist."""

    def __init__(
        self, settings: Settings, lifetime: Lifetime, store: Store, prefix: str, hosts_store: bool
    ) -> None:
        """``settings.stall_timeout`` is set; ``store`` holds the block's keys under ``prefix``."""
        self.rank, self.world_size = settings.launch.rank, settings.launch.world_size
        self.stall_timeout = settings.stall_timeout or math.inf  # None: no Watch is made
        self.on_stall, self.answer = settings.on_stall, settings.stall_answer
        self._exit_code = STALL_EXIT_CODE if self.on_stall == "exit" else None  # in the report
        self._lifetime, self._hosts_store, self._prefix = lifetime, hosts_store, f"{prefix}/stall"
        self._base = store
        self._control: Store | None = None  # stop's connection to the store
        # Bounds every store call of the watch (principle 15): a store whose host is gone
        # without closing the connection answers nothing, and nothing may wait on it.
        self._bound = timedelta(seconds=self.answer + _GRACE)
        self._lock, self._stopping = threading.Lock(), threading.Event()
        self._phase: tuple[str, int] = ("wake", 1)  # the key the answering thread waits on
        self._last_end: float | None = None
        self._last_digest, self._tried = "", 0
        self._mine: set[str] = set()
        self._threads: list[threading.Thread] = []
        self._use_recorder = bool(
            (_compat.dump_flight_recorder(collectives=False, stacks=False) or {}).get("pg_status")
        )
        self._detector = _Detector(lifetime.in_flight, self._use_recorder)
        main, recorder = threading.get_ident(), self._use_recorder  # main: the block's thread
        self._record = functools.partial(
            local_record, rank=self.rank, thread_id=main, lifetime=lifetime, use_recorder=recorder
        )

    def _connection(self) -> Store | None:
        try:
            conn = _compat.store_connection(self._base, self._bound)
        except Exception:  # the store refuses a second client: this rank reports alone
            logger.debug("pdist: rank %d: no second store connection", self.rank, exc_info=True)
            return None
        return None if conn is None else PrefixStore(self._prefix, conn)

    def start(self, groups: Sequence[Group] = ()) -> None:
        """Start the polling thread, and the answering one where the store allows."""
        if not _compat.recorder_sees_gloo():
            self._lifetime.in_flight.track(list(groups))
        self._lifetime.in_flight.active = True
        if not self._use_recorder and _compat.recorder_sees_gloo():
            msg = "pdist: rank %d: torch's flight recorder records nothing (%s=0?), so the stall "
            msg += "watch sees only pdist's point-to-point calls"
            logger.warning(msg, self.rank, _compat.FEATURES.flight_recorder_env)
        conn = self._connection()
        if conn is not None:
            self._control = self._connection()
            self._spawn("pdist-stall-answer", self._listen, conn)
        self._spawn("pdist-stall", self._watch)

    def _spawn(self, name: str, target: Callable[..., None], *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def stop(self) -> None:
        """Wake both threads, join them and delete this rank's keys; no collective.

        Bounded (principle 15): torch's store client can wait forever on a store whose host
        is gone without closing the connection, so every store call here runs in a daemon
        thread waited on for a few seconds at most; the watch's own threads are daemons
        too, and a store that does not answer leaves them behind rather than the process.
        """
        self._lifetime.in_flight.active = False
        with self._lock:
            self._stopping.set()
            phase, k = self._phase
        key = f"{phase}/{self.rank}/{k}"  # the key the answering thread waits on
        control, bound = self._control, min(self._bound.total_seconds(), _STOP_SECONDS)

        def wake() -> None:
            assert control is not None
            control.set(key, "exit")
            control.check([key])  # a round trip: the store answers

        answers = False
        with contextlib.suppress(StoreGoneError):  # a store gone with its host
            if control is not None and not self._lifetime.store_gone:
                bounded(wake, bound, "pdist-stall-store")
                answers = True
        self._mine.add(key)
        for thread in self._threads:
            thread.join(timeout=bound if answers else 0.5)
            if thread.is_alive() and answers:
                logger.warning("pdist: rank %d: the %s thread did not end", self.rank, thread.name)
        if answers and control is not None:
            keys = sorted(self._mine)
            with contextlib.suppress(StoreGoneError):
                bounded(lambda: list(map(control.delete_key, keys)), bound, "pdist-stall-store")

    # ------------------------------------------------------------------ polling side

    def _watch(self) -> None:
        interval = min(1.0, max(0.05, self.stall_timeout / 10))
        try:
            while not self._stopping.wait(interval):
                if self._detector.age() >= self.stall_timeout:
                    self._suspect()
        except Exception:  # the watch must never take the job down
            logger.warning("pdist: rank %d: the stall watch failed", self.rank, exc_info=True)

    def _suspect(self) -> None:
        with self._lock:
            k, last = self._phase[1], self._last_end
        if self._tried >= k or (last is not None and time.monotonic() - last < self.stall_timeout):
            return
        record = self._record()
        if not stalled([record], self.stall_timeout):
            self._detector.ignore_pending(self.stall_timeout)  # an older block's group
            return
        self._tried = k
        if len(self._threads) > 1 and self._threads[0].is_alive():
            try:
                self._request(k)
                return
            except Exception:  # a store that fails mid-round: still say what this rank sees
                logger.warning("pdist: rank %d: stall round %d failed", self.rank, k, exc_info=True)
        # No answering thread (no second store connection, or the store left): this rank's view.
        with self._lock:
            self._phase = ("wake", k + 1)
        text = format_report(
            [record], stall_timeout=self.stall_timeout, round_no=k, exit_code=self._exit_code
        )
        self._act(self._verdict([record], k), k, text)

    def _verdict(self, records: list[dict[str, Any]], k: int) -> dict[str, Any]:
        digest = picture(records, self.world_size)
        is_stalled = stalled(records, self.stall_timeout)
        return {
            "round": k,
            "holder": min((r["rank"] for r in records), default=self.rank),
            "stalled": is_stalled,
            "report": is_stalled and digest != self._last_digest,
            "digest": digest,
        }

    def _request(self, k: int) -> None:
        """Wake every rank for round ``k``, gather their answers, publish the verdict."""
        conn: Any = self._connection()  # torch's stubs lack multi_set
        if conn is None or conn.add(f"claim/{k}", 1) != 1:
            return  # another rank asks this round
        self._mine.update({f"claim/{k}", f"count/{k}", f"report/{k}"})
        for part in _parts([f"wake/{r}/{k}" for r in range(self.world_size)]):
            conn.multi_set(part, [str(k)] * len(part))
        deadline = time.monotonic() + self.answer
        while time.monotonic() < deadline and conn.add(f"count/{k}", 0) < self.world_size:
            if self._stopping.wait(0.1):
                return
        records = _read_answers(conn, k, self.world_size)
        verdict = self._verdict(records, k)
        if verdict["report"]:
            text = format_report(
                records,
                world_size=self.world_size,
                stall_timeout=self.stall_timeout,
                round_no=k,
                exit_code=self._exit_code,
            )
            conn.set(f"report/{k}", text)
        told = json.dumps({**verdict, "told": len(records)})
        # This rank's own verdict last: it may exit on it.
        answered = sorted((r["rank"] for r in records), key=lambda r: (r == self.rank, r))
        for part in _parts([f"told/{r}/{k}" for r in answered]):
            conn.multi_set(part, [told] * len(part))

    # ------------------------------------------------------------------ answering side

    def _wait(self, conn: Store, phase: str, k: int, timeout: timedelta) -> bytes | None:
        """This rank's ``phase`` key of round ``k`` once set; None: stop; OSError: no answer."""
        key = f"{phase}/{self.rank}/{k}"
        with self._lock:
            if self._stopping.is_set():
                return None
            self._phase = (phase, k)
        try:
            conn.wait([key], timeout)
            value = conn.get(key)
        except Exception as exc:  # torch raises its DistStoreError or a RuntimeError
            raise OSError(f"the store did not answer: {exc}") from exc
        self._mine.add(key)
        return None if value == b"exit" or self._stopping.is_set() else value

    def _listen(self, conn: Store) -> None:
        k = 1
        while not self._stopping.is_set():
            try:
                woken = self._wait(conn, "wake", k, _LISTEN)
            except OSError:
                if not self._stopping.is_set() and _answers(conn):
                    continue  # no stall within the bound: wait again
                # The store is gone: the polling thread reports alone from now on.
                logger.debug(
                    "pdist: rank %d: the stall watch lost its store", self.rank, exc_info=True
                )
                return
            if woken is not None:
                try:
                    self._answer(conn, k)
                except Exception:  # a round that failed (its requester left) ends only itself
                    logger.warning("pdist: rank %d: a stall round failed", self.rank, exc_info=True)
            k += 1
            with self._lock:
                self._phase = ("wake", k)

    def _answer(self, conn: Store, k: int) -> None:
        key = f"answer/{k}/{self.rank}"
        conn.set(key, json.dumps(self._record(), separators=(",", ":")))
        self._mine.add(key)
        conn.add(f"count/{k}", 1)
        try:
            told = self._wait(conn, "told", k, timedelta(seconds=self.answer + _GRACE))
        except OSError:  # no verdict: the requester left, or this rank answered too late
            logger.info("pdist: rank %d: no verdict came for stall round %d", self.rank, k)
            return
        if told is None:
            return
        verdict = _plain.loads(told)
        holds = verdict["report"] and verdict["holder"] == self.rank
        self._act(verdict, k, conn.get(f"report/{k}").decode() if holds else "", conn)

    def _act(self, verdict: dict[str, Any], k: int, text: str, conn: Store | None = None) -> None:
        with self._lock:
            self._last_end, self._last_digest = time.monotonic(), verdict["digest"]
        if verdict["report"] and verdict["holder"] == self.rank:
            logger.error(text)
        elif verdict["report"]:
            msg = "pdist: rank %d: a collective stalled; rank %d logged the stall report (round %d)"
            logger.warning(msg, self.rank, verdict["holder"], k)
        if verdict["stalled"] and self.on_stall == "exit":
            if conn is not None:
                self._told_ranks_hold_verdicts(conn, k, verdict["told"])
            # A store-hosting rank serves on: the others still read their verdicts from it.
            end_process(STALL_EXIT_CODE, _LINGER if self._hosts_store else 0.0)

    def _told_ranks_hold_verdicts(self, conn: Store, k: int, told: int) -> None:
        """Wait (at most the answer wait) until every rank told in round ``k`` has its verdict.

        An earlier exit would break the collective of a rank yet to read its verdict.
        """
        deadline = time.monotonic() + self.answer
        with contextlib.suppress(Exception):  # a store gone with its host: exit now
            conn.add(f"exiting/{k}", 1)
            while conn.add(f"exiting/{k}", 0) < told and time.monotonic() < deadline:
                time.sleep(0.05)


def _answers(conn: Store) -> bool:
    try:
        conn.check(["alive"])
    except Exception:  # torch raises its DistStoreError or a RuntimeError
        return False
    return True


def _parts(keys: list[str]) -> Iterator[list[str]]:
    """``keys`` in slices of ``_CHUNK``, one store round trip each."""
    return (keys[i : i + _CHUNK] for i in range(0, len(keys), _CHUNK))


def _well_formed(rec: dict[str, Any]) -> bool:
    """Whether a peer's record has the shape the report reads (a bad one counts as no answer)."""
    for group in rec["groups"]:
        op = group["inflight"]
        op_ok = op is None or (isinstance(op["age"], (int, float)) and isinstance(op["seq"], int))
        if not (isinstance(group["key"], str) and op_ok):
            return False
    return all(isinstance(f, list) and len(f) == 3 for f in rec["stack"])


def _read_answers(conn: Store, k: int, world_size: int) -> list[dict[str, Any]]:
    """The answers of round ``k`` that arrived, as checked plain data (JSON, never pickle)."""
    records = []
    for part in _parts([f"answer/{k}/{r}" for r in range(world_size)]):
        keys = part if conn.check(part) else [key for key in part if conn.check([key])]
        for key, raw in zip(keys, conn.multi_get(keys) if keys else [], strict=True):
            with contextlib.suppress(ValueError, TypeError, KeyError, AttributeError):
                rec = _plain.loads(raw)
                if rec["rank"] == int(key.rsplit("/", 1)[1]) and _well_formed(rec):
                    records.append(rec)
    return records
