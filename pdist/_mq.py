"""Same-host fast path: a shared-memory ring buffer for object broadcasts from a group's first rank.

Inference engines broadcast a small object to every worker on every step, where
a socket collective's latency dominates: here it goes through ``/dev/shm``.

Ring layout, every part on its own 64-byte line: a header (magic, readers,
chunk_bytes, chunks), one ``u64`` per reader (the last message it consumed),
then ``chunks`` slots of ``[u64 seq][u64 length][u64 kind]`` and data. Message
``s`` waits for every reader to consume ``s - chunks``; a message larger than a
slot goes over the CPU group, announced in the ring.

Memory ordering. The writer stores a slot's data, length and kind, then
publishes its sequence number with a *release* store; a reader loads it with
*acquire*, copies the data out, then publishes its progress with a release
store, which the writer loads with acquire before it reuses the slot. Python
has no fences. x86-64 needs none: TSO keeps a store in order with older stores
and a load with older loads, a word of a ``memoryview`` of format ``Q`` is one
aligned 8-byte ``memcpy`` (one ``mov``), and each access is a separate C call
the compiler cannot move; so there the words are plain memory, at a hundredth
of a ctypes call's cost. Other CPUs call libatomic's ``__atomic_store_8`` /
``__atomic_load_8`` (through ctypes) with ``__ATOMIC_RELEASE`` /
``__ATOMIC_ACQUIRE`` (on aarch64, ``stlr`` and ``ldar``). Without libatomic
such a CPU refuses to start the queue, naming the package to install.

Set-up fails together: arguments and pids are exchanged first, and the segment
has a name only between two status rounds. A failure of the queue itself (a
timeout, a dead peer, a corrupt slot) poisons it.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import logging
import mmap
import os
import platform
import re
import select
import signal
import stat
import struct
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any, NamedTuple

import attrs

from . import _agree, _wire
from ._buffers import ALIGN, aligned
from ._env import env_seconds, to_seconds
from ._errors import PdistError, RankMismatchError, RemoteError
from ._group import DistContext, Group, as_group
from ._topology import host_blocks, shm_dir

__all__ = ["IDLE_TIMEOUT_ENV", "message_queue"]

logger = logging.getLogger("pdist")

IDLE_TIMEOUT_ENV = "PDIST_MQ_IDLE_TIMEOUT_SEC"
"""How long a reader waits for the next message (unset or ``0``: forever)."""

_HEADER = struct.Struct("<8sQQQ")  # magic, readers, chunk_bytes, chunks
_LEFT = _HEADER.size // 8  # the header line's next word: 1 + the group index of a rank that left
_DEAD = _LEFT + 1  # and the next: 1 + the group index of a rank whose process a rank saw exit
_MAGIC = b"pdistmq1"
_SLOT_WORDS = struct.Struct("<QQ")  # length, kind (after the sequence number)
_INLINE, _OVERFLOW = 1, 2
_SEGMENT_PREFIX = "pdist-mq-"
_SEGMENT_NAME = re.compile(r"pdist-mq-[0-9a-f]{32}")
_SPIN_SECONDS, _YIELD_SECONDS, _MAX_SLEEP = 20e-6, 2e-3, 1e-3
_PEER_CHECK_SECONDS, _LOG_SECONDS = 0.5, 60.0
_WHAT = "message_queue"
_ACQUIRE, _RELEASE = 2, 3  # C11 memory orders, as GCC's __atomic builtins number them
_STRONGLY_ORDERED = frozenset({"x86_64", "amd64", "i386", "i686"})


class _Words(NamedTuple):
    """Acquire loads and release stores of a mapping's aligned 8-byte words, by word index."""

    name: str
    load: Callable[[int], int]
    store: Callable[[int, int], None]
    release: Callable[[], object]  # drops the export of the mapping, before it closes


_Atomics = Callable[[Any], _Words]  # a writable buffer -> its words
_Test = Callable[[], bool]
_Text = Callable[[], str]


def _plain_words(buffer: Any) -> _Words:
    """Plain aligned 8-byte loads and stores (release/acquire on x86-64 only): one C call each."""
    view = memoryview(buffer).cast("Q")
    return _Words("plain (x86 TSO)", view.__getitem__, view.__setitem__, view.release)


def _libatomic_words(lib: ctypes.CDLL, buffer: Any) -> _Words:
    """Words through ``__atomic_load_8(p, ACQUIRE)`` and ``__atomic_store_8(p, v, RELEASE)``."""
    load, store = lib.__atomic_load_8, lib.__atomic_store_8
    load.argtypes, load.restype = [ctypes.c_void_p, ctypes.c_int], ctypes.c_uint64
    store.argtypes, store.restype = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int], None
    exports = [(ctypes.c_char * len(buffer)).from_buffer(buffer)]  # for raw addresses
    base = ctypes.addressof(exports[0])
    return _Words(
        "libatomic",
        lambda i: int(load(base + 8 * i, _ACQUIRE)),
        lambda i, value: store(base + 8 * i, value, _RELEASE),
        exports.clear,
    )


def _open_libatomic() -> ctypes.CDLL | None:
    for known in ("libatomic.so.1", "libatomic.so", ""):
        name = known or ctypes.util.find_library("atomic")  # slow (runs ldconfig): last
        # PyDLL keeps the GIL over these few instructions, which a spinning reader polls.
        with contextlib.suppress(OSError):
            return ctypes.PyDLL(name) if name else None
    return None


def _choose_atomics(machine: str, lib: Callable[[], ctypes.CDLL | None]) -> _Atomics:
    """Plain words on x86 (TSO); libatomic elsewhere (``lib`` opens it); else refuse."""
    if machine.lower() in _STRONGLY_ORDERED:
        return _plain_words
    found = lib()
    if found is not None:
        return functools.partial(_libatomic_words, found)
    msg = (
        f"message_queue needs libatomic on {machine} (a weakly ordered CPU) to publish ring "
        "slots in order; install it (Debian/Ubuntu: apt install libatomic1; RHEL/Fedora: "
        "dnf install libatomic) or use the group without message_queue"
    )
    raise PdistError(msg)


_atomics = functools.cache(lambda: _choose_atomics(platform.machine(), _open_libatomic))


class _Watch:
    """A peer whose exit is noticed: by pidfd (immune to pid reuse) where there is one."""

    def __init__(self, rank: int, pid: int) -> None:
        self.rank, self.pid, self.fd, self._poll = rank, pid, None, select.poll()
        with contextlib.suppress(AttributeError, OSError):
            self.fd = os.pidfd_open(pid)
            self._poll.register(self.fd, select.POLLIN)

    def exited(self) -> bool:
        if self.fd is not None:
            return bool(self._poll.poll(0))
        try:
            with contextlib.suppress(PermissionError):  # alive, another user's
                os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        return False


class _MessageQueue:
    """One rank's ``HeaderTransport``: the writer (group index 0) or a reader."""

    def __init__(self, group: Group, region: Any, atomics: _Atomics, idle: float | None, pids: Any):
        self._g, self._region, self._idle = group, region, idle
        peers = group.ranks[1:] if group.is_first_rank else group.ranks[:1]
        self._watches = [] if pids is None else [_Watch(r, pids[r]) for r in peers]
        self._reader = None if group.is_first_rank else group.rank_in_group - 1
        self._words = atomics(region)
        self._chunk_bytes, self._chunks = (int(n) for n in _HEADER.unpack_from(region)[2:])
        self._progress = [ALIGN // 8 * (1 + r) for r in range(group.world_size - 1)]
        self._slot0, self._stride = ALIGN * group.world_size, ALIGN + aligned(self._chunk_bytes)
        self._timeout = group.timeout.total_seconds()
        self._seq = 0  # the last message written or consumed (the first is 1)
        self._failure: str | None = None
        self._closed = self._released = False
        # Serializes broadcasts and close: no thread reads an unmapped ring or interleaves messages.
        self._lock = threading.Lock()

    def broadcast_bytes(
        self,
        group: Group,
        payload: bytes | None,
        src: int,
        *,
        error: BaseException | None = None,
        what: str = "broadcast",
    ) -> bytes:
        """``_wire.broadcast_bytes`` through the ring; a failure but a RemoteError poisons it."""
        if src != 0:  # the caller checked that src is a group index
            msg = (
                f"src={src}: a message_queue group broadcasts only from its first rank "
                "(src=0); use the original group for other sources"
            )
            raise ValueError(msg)
        if group.lifetime.closed:
            group.lifetime.check_open()
        with self._lock:
            if self._closed or self._failure is not None:
                self._refuse()
            try:
                if self._reader is None:
                    return self._write(group, payload, error, what)
                return self._read(group, self._reader, what)
            except RemoteError:
                raise  # a failure every rank received in step: the ring is still in order
            except BaseException as exc:
                if exc is error:  # the writer's own error, sent as a marker: in step too
                    raise
                self._failure = f"{what} on rank {group.rank}: {type(exc).__name__}: {exc}"
                self._leave()
                raise

    def _refuse(self) -> None:
        if self._closed:
            msg = (
                f"the `with pdist.message_queue(...)` block of group {self._g.name!r} has "
                "exited and its shared-memory ring is gone; broadcast inside the block, or on "
                "the original group"
            )
        else:
            msg = (
                f"this message_queue on group {self._g.name!r} is unusable after an earlier "
                f"failure ({self._failure}); the ranks may be out of step: leave the "
                "`with pdist.message_queue(...)` block (open a new one to go on)"
            )
        raise PdistError(msg)

    def _write(
        self, group: Group, payload: bytes | None, error: BaseException | None, what: str
    ) -> bytes:
        seq = self._seq + 1
        free = seq - self._chunks  # every reader must have consumed this one
        message = _wire.frame(payload, error, group.rank)
        if not self._slot_free(free, what):
            load, peers = self._words.load, group.ranks[1:]

            def waiting() -> str:
                slow = [r for r, w in zip(peers, self._progress, strict=True) if load(w) < free]
                return f"for ranks {slow} to consume message {free} and free a slot"

            ready = functools.partial(self._slot_free, free, what)
            self._wait(ready, self._timeout, "the group's timeout", waiting, what)
        overflow = len(message) > self._chunk_bytes
        data, base = b"" if overflow else message, self._slot(seq)
        self._region[base + ALIGN : base + ALIGN + len(data)] = data
        _SLOT_WORDS.pack_into(self._region, base + 8, len(data), _OVERFLOW if overflow else _INLINE)
        self._words.store(base >> 3, seq)  # release: after the data
        self._seq = seq
        if overflow:
            _wire.broadcast_bytes(group, payload, 0, error=error, what=what)
        if error is not None:
            _agree.raise_own(group, error, what, wrap_pdist=True)
        return payload or b""

    def _slot_free(self, free: int, what: str) -> bool:
        """Whether every reader consumed message ``free``; raises if one claims an unwritten one."""
        load = self._words.load
        for r, word in enumerate(self._progress):
            consumed = load(word)
            if consumed > self._seq:
                msg = (
                    f"{what} on message_queue group {self._g.name!r}: rank "
                    f"{self._g.ranks[r + 1]} reports message {consumed} consumed, but only "
                    f"{self._seq} were written; the ring is corrupt or another process writes to it"
                )
                raise PdistError(msg)
            if consumed < free:
                return False
        return True

    def _read(self, group: Group, reader: int, what: str) -> bytes:
        seq = self._seq + 1
        base = self._slot(seq)
        if self._words.load(base >> 3) != seq and not self._published(seq, what):

            def waiting() -> str:
                return f"for message {seq} from the writer (rank {group.ranks[0]})"

            ready = functools.partial(self._published, seq, what)
            self._wait(ready, self._idle, f"{IDLE_TIMEOUT_ENV} / idle_timeout", waiting, what)
        length, kind = _SLOT_WORDS.unpack_from(self._region, base + 8)
        data = self._region[base + ALIGN : base + ALIGN + min(length, self._chunk_bytes)]
        if kind not in (_INLINE, _OVERFLOW) or len(data) != length:
            raise self._corrupt(seq, f"its slot holds kind {kind} and length {length}", what)
        self._words.store(self._progress[reader], seq)  # release: after the copy-out
        self._seq = seq
        if kind == _OVERFLOW:
            return _wire.broadcast_bytes(group, None, 0, what=what)
        return _wire.unframe(data, group, what)

    def _published(self, seq: int, what: str) -> bool:
        """Whether message ``seq`` is in its slot; raises if the slot holds any other message."""
        value = self._words.load(self._slot(seq) >> 3)  # acquire: before the copy-out
        if value == seq:
            return True
        if value != max(seq - self._chunks, 0):  # the slot's previous message (or none)
            raise self._corrupt(seq, f"its slot holds message {value}", what)
        return False

    def _slot(self, seq: int) -> int:
        """Byte offset of the slot of message ``seq``."""
        return self._slot0 + (seq % self._chunks) * self._stride

    def _corrupt(self, seq: int, detail: str, what: str) -> PdistError:
        msg = (
            f"{what} on message_queue group {self._g.name!r}: rank {self._g.rank} expected "
            f"message {seq} but {detail}; the ring is corrupt or the ranks are out of step"
        )
        return PdistError(msg)

    def _wait(
        self, ready: _Test, timeout: float | None, limit: str, text: _Text, what: str
    ) -> None:
        """Spin, yield, then sleep in growing steps until ``ready()``, for ``timeout`` at most."""
        g, start = self._g, time.monotonic()
        every = min(_LOG_SECONDS, self._timeout)
        next_check, next_log, sleep = start + _PEER_CHECK_SECONDS, start + every, 1e-6
        while not ready():
            now = time.monotonic()
            waited = now - start
            if waited < _SPIN_SECONDS:
                continue
            problem = None
            if self._closed or g.is_closed:
                block = "message_queue" if self._closed else "distributed()"
                problem = f"the {block} block exited while rank {g.rank} waited {text()}"
            elif timeout is not None and waited > timeout:
                problem = (
                    f"rank {g.rank} waited {waited:.1f}s {text()} ({limit}: {timeout:g}s); "
                    "did a rank die or stop calling the broadcasts?"
                )
            elif now >= next_check or self._words.load(_LEFT):
                next_check = now + _PEER_CHECK_SECONDS
                for w in filter(_Watch.exited, self._watches):  # first: a peer gone names it
                    problem = f"rank {w.rank} (pid {w.pid}) exited while rank {g.rank} waited "
                    problem += text()
                    self._words.store(_DEAD, g.ranks.index(w.rank) + 1)
                left, dead = self._words.load(_LEFT), self._words.load(_DEAD)
                if problem is None and left and not ready():  # (published, then left: fine)
                    gone = "left the queue (its block raised, or it gave up on it after a failure)"
                    who, did = (dead, "exited") if dead else (left, gone)  # a death: the cause
                    problem = f"rank {g.ranks[who - 1]} {did} while rank {g.rank} waited {text()}"
            if problem is not None:
                raise PdistError(f"{what} on message_queue group {g.name!r}: {problem}")
            if now >= next_log:
                next_log = now + every
                shown = "none" if timeout is None else f"{timeout:g}s"
                logger.info(
                    "pdist: rank %d has waited %.0fs %s on message_queue group %r (%s: %s)",
                    *(g.rank, waited, text(), g.name, limit, shown),
                )
            if waited < _YIELD_SECONDS:
                os.sched_yield()
            else:
                time.sleep(sleep)
                sleep = min(sleep * 2, _MAX_SLEEP)

    def _leave(self) -> None:
        """Tell the other ranks, waiting or about to, that this one stops using the ring."""
        if not self._released and not self._words.load(_LEFT):
            self._words.store(_LEFT, self._g.rank_in_group + 1)

    def close(self, *, failed: bool = False) -> None:
        """Refuse further use, wake a waiting thread, and unmap the ring.

        ``failed``: the block exits through an exception; the ranks that wait for this one
        raise rather than wait on.
        """
        self._closed = True
        with self._lock:
            if failed:
                self._leave()
            if not self._released:
                self._released = True
                self._words.release()
                with contextlib.suppress(BufferError):  # a view alive elsewhere keeps it mapped
                    self._region.close()
                for fd in (w.fd for w in self._watches if w.fd is not None):
                    os.close(fd)


class _QueuePlan(NamedTuple):
    """What every rank agreed on at set-up (``pids``: when all share a pid namespace)."""

    chunk_bytes: int
    chunks: int
    path: str
    pids: dict[int, int] | None


def _check_arguments(chunk_bytes: int, chunks: int, idle_timeout: Any) -> tuple[Any, ...]:
    """``(idle seconds, atomics, None)``, or ``(None, None, error)`` to send every rank."""
    try:
        for name, value in (("chunk_bytes", chunk_bytes), ("chunks", chunks)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                msg = f"{name}={value!r} must be a positive int; pass the same one on every rank"
                raise ValueError(msg)
        if idle_timeout is not None:
            return to_seconds(idle_timeout, "idle_timeout"), _atomics(), None
        idle = env_seconds(IDLE_TIMEOUT_ENV, 0.0, zero_means_forever=True) or None
        return idle, _atomics(), None
    except (TypeError, ValueError, PdistError) as exc:
        return None, None, exc


def _queue_plan(g: Group, chunk_bytes: int, chunks: int, error: BaseException | None) -> _QueuePlan:
    """Exchange the set-up records, check them and the host: the same verdict on every rank."""
    mine: dict[str, Any] = {"chunk_bytes": chunk_bytes, "chunks": chunks, "pid": os.getpid()}
    mine["segment"] = f"{_SEGMENT_PREFIX}{uuid.uuid4().hex}" if g.is_first_rank else None
    mine["pid_namespace"] = None
    with contextlib.suppress(OSError):
        st = os.stat("/proc/self/ns/pid")
        mine["pid_namespace"] = f"{st.st_dev}:{st.st_ino}"
    records = _wire.exchange(g, mine, error=error, what=_WHAT)
    records = [r if isinstance(r, dict) else {} for r in records]  # a peer's is only JSON
    for field in ("chunk_bytes", "chunks"):
        values = {rank: record.get(field) for rank, record in zip(g.ranks, records, strict=True)}
        if len(set(values.values())) > 1:
            msg = (
                f"message_queue on group {g.name!r}: {field} differs across ranks: "
                f"{_agree.ranks_by_value(values)}; pass the same chunk_bytes and chunks on "
                "every rank"
            )
            raise RankMismatchError(msg)
    segment = records[0].get("segment")
    if not isinstance(segment, str) or not _SEGMENT_NAME.fullmatch(segment):
        # Readers build the path themselves from a checked name: a writer cannot make them
        # open (or remove) anything but a pdist segment in the shared-memory directory.
        msg = (
            f"message_queue on group {g.name!r}: the writer (rank {g.ranks[0]}) named the "
            f"segment {segment!r}; readers open only {shm_dir()}/{_SEGMENT_PREFIX}<32 hex "
            "digits>, never another path"
        )
        raise PdistError(msg)
    # Pids are watched only when every rank sent one, all in one pid namespace (a str).
    pids = {rank: record.get("pid") for rank, record in zip(g.ranks, records, strict=True)}
    spaces = [r.get("pid_namespace") for r in records]
    known = all(type(ns) is str for ns in spaces) and len(set(spaces)) == 1
    known = known and all(type(pid) is int and pid > 0 for pid in pids.values())
    host = next(b for b in host_blocks(g) if g.ranks[0] in b)
    others = [r for r in g.ranks if r not in host]
    if others:
        msg = (
            f"message_queue needs every rank of group {g.name!r} on one host; ranks {others} "
            f"are on another host than rank {g.ranks[0]}"
        )
        raise PdistError(msg)
    return _QueuePlan(
        chunk_bytes, chunks, os.path.join(shm_dir(), segment), pids if known else None
    )


def _map(g: Group, plan: _QueuePlan) -> mmap.mmap:
    """The writer creates, reserves and stamps the segment; a reader opens and checks it."""
    create, verb = g.is_first_rank, "create" if g.is_first_rank else "open"
    size = ALIGN * g.world_size + plan.chunks * (ALIGN + aligned(plan.chunk_bytes))
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_CREAT | os.O_EXCL if create else 0)
    try:
        fd = os.open(plan.path, flags, 0o600)
    except OSError as exc:
        msg = f"rank {g.rank} could not {verb} the ring {plan.path}: {exc}"
        raise PdistError(msg) from exc
    try:
        st = os.fstat(fd)
        if create:
            try:
                # posix_fallocate reserves the pages: with ftruncate alone, a full tmpfs
                # (Docker's /dev/shm is 64 MB) kills a later write with SIGBUS.
                if hasattr(os, "posix_fallocate"):
                    os.posix_fallocate(fd, 0, size)
                else:  # pragma: no cover - not Linux
                    os.ftruncate(fd, size)
            except (OSError, OverflowError) as exc:  # OverflowError: a size no file can have
                msg = (
                    f"rank {g.rank} could not reserve {size} bytes for the ring in {shm_dir()}: "
                    f"{exc}; give it more room (docker run --shm-size=...) or pass a smaller "
                    f"chunk_bytes x chunks (now {plan.chunk_bytes} x {plan.chunks})"
                )
                raise PdistError(msg) from exc
        elif not stat.S_ISREG(st.st_mode) or st.st_size != size:
            kind = "file" if stat.S_ISREG(st.st_mode) else "special file"
            msg = f"rank {g.rank} found {plan.path} is not a ring of {size} bytes (a {kind} of "
            msg += f"{st.st_size} bytes); another process owns that name"
            raise PdistError(msg)
        region = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    header = _HEADER.pack(_MAGIC, g.world_size - 1, plan.chunk_bytes, plan.chunks)
    if create:
        region[: _HEADER.size] = header
    elif region[: _HEADER.size] != header:
        region.close()
        msg = f"rank {g.rank} found {plan.path} is not a pdist ring of this shape"
        raise PdistError(msg)
    return region


@contextlib.contextmanager
def _removed_on_sigterm(path: str) -> Iterator[None]:
    """A SIGTERM with its default action (no ``finally`` runs) removes ``path`` first."""
    main = threading.current_thread() is threading.main_thread()
    if not main or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return

    def remove_and_end(signum: int, frame: object) -> None:
        with contextlib.suppress(OSError):
            os.unlink(path)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.raise_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, remove_and_end)
    try:
        yield
    finally:
        if signal.getsignal(signal.SIGTERM) is remove_and_end:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _mapped(g: Group, plan: _QueuePlan) -> mmap.mmap:
    """This rank's ring, after two status rounds: created, then opened by all."""
    region: mmap.mmap | None = None
    with _removed_on_sigterm(plan.path) if g.is_first_rank else contextlib.nullcontext():
        try:
            for writers_turn in (True, False):
                failure: BaseException | None = None
                if g.is_first_rank == writers_turn:
                    try:
                        region = _map(g, plan)
                    except Exception as exc:
                        failure = exc
                _agree.status(g, failure, what=_WHAT)
        except BaseException:
            if region is not None:
                region.close()
            raise
        finally:
            with contextlib.suppress(OSError):
                os.unlink(plan.path)
    assert region is not None  # both statuses passed: every rank mapped the ring
    return region


@contextlib.contextmanager
def message_queue(
    group: Group | DistContext,
    *,
    chunk_bytes: int = 4 << 20,
    chunks: int = 6,
    idle_timeout: float | timedelta | None = None,
) -> Iterator[Group]:
    """Yield a copy of ``group`` whose object broadcasts from its first rank use shared memory.

    [`broadcast_object`][pdist.broadcast_object] and the metadata of
    [`broadcast_tensor_dict`][pdist.broadcast_tensor_dict] go through a ring of ``chunks`` slots
    of ``chunk_bytes`` in ``/dev/shm``; a larger message goes over the CPU
    group. The writer waits for a slot at most the group's timeout, a reader
    ``idle_timeout``; either notices a dead peer within a second.

    Note:
        Every rank of the group must enter it, with the same
        ``chunk_bytes`` and ``chunks``; broadcasts on the yielded group must
        come from its first rank (``src=0``), inside this block.

    Args:
        group: The group (a context means its world); its ranks share a host.
        chunk_bytes: Bytes per slot.
        chunks: Number of slots: how far the writer may run ahead of a reader.
        idle_timeout: Seconds (or a ``timedelta``) a reader waits for the next
            message; None reads ``PDIST_MQ_IDLE_TIMEOUT_SEC`` (unset or ``0``: forever).

    Raises:
        ValueError: On a one-rank group, when an argument is invalid.
        RankMismatchError: On every rank, when ranks pass different sizes.
        PdistError: On every rank (elsewhere a ``RemoteError`` of its type), naming
            the failing rank: an invalid argument, a segment that could not be created,
            reserved (a full ``/dev/shm``) or opened, ranks on different hosts, a
            segment outside pdist's.
    """
    g = as_group(group)
    idle, atomics, error = _check_arguments(chunk_bytes, chunks, idle_timeout)
    if g.world_size == 1:
        if error is not None:
            raise error
        yield g
        return
    plan = _queue_plan(g, chunk_bytes, chunks, error)
    queue = _MessageQueue(g, _mapped(g, plan), atomics, idle, plan.pids)
    try:
        yield attrs.evolve(g, mq=queue)
    except BaseException:
        queue.close(failed=True)  # the others stop waiting for this rank
        raise
    queue.close()
