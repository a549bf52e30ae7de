"""Same-host fast path: a shared-memory ring buffer for object broadcasts from a group's first rank.

Inference engines broadcast a small scheduling object to every worker on every
step; a socket collective's latency dominates that step. Inside
``message_queue(group)``, the group's first rank (the writer) writes each
message into a slot of a ring in ``/dev/shm`` and the other ranks (readers)
read it from there.

Ring layout, every part on its own 64-byte line: a header (magic, readers,
chunk_bytes, chunks), one ``u64`` per reader (the last sequence number it
consumed), then ``chunks`` slots of ``[u64 seq][u64 length][u64 kind]`` and
``chunk_bytes`` of data. The writer fills slot ``s % chunks`` once every reader
has consumed message ``s - chunks``. A message larger than a slot travels over
the CPU group, announced by an overflow marker in the ring.

Memory ordering. The writer stores a slot's data, length and kind, then
publishes its sequence number with a *release* store; a reader loads the
sequence number with *acquire*, copies the data out, then publishes its
progress with a release store, which the writer loads with acquire before it
reuses the slot. Python has no fences, so these two words go through
libatomic's ``__atomic_store_8`` / ``__atomic_load_8`` (through ctypes) with
``__ATOMIC_RELEASE`` / ``__ATOMIC_ACQUIRE``; on aarch64 they are ``stlr`` and
``ldar`` (read off Debian's GCC 12 libatomic). Without libatomic, x86-64
needs nothing more (TSO: a store is not reordered with older stores, a load
not with older loads, and each access is a separate C call the compiler
cannot move); on other CPUs the queue then refuses to start, naming the
package to install.

Failures. Set-up fails together: every rank first exchanges its arguments
(and its pid), so bad or differing arguments raise on every rank; the
segment is created only after everyone has arrived, then announced, opened
and unlinked between two quick collectives, and every rank removes it on
its way out, so a dead writer's segment goes too. After a failure of the
queue itself (a timeout, a dead peer, an interrupted wait, a corrupt slot)
the queue is poisoned: every later broadcast on it raises.
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
from typing import Any, Protocol

import attrs

from . import _agree, _wire
from ._env import env_seconds, to_seconds
from ._errors import PdistError, RankMismatchError, RemoteError
from ._group import DistContext, Group, as_group
from ._topology import host_blocks, shm_dir

__all__ = ["IDLE_TIMEOUT_ENV", "message_queue"]

logger = logging.getLogger("pdist")

IDLE_TIMEOUT_ENV = "PDIST_MQ_IDLE_TIMEOUT_SEC"
"""How long a reader waits for the next message (unset or ``0``: forever)."""

_LINE = 64
_HEADER = struct.Struct("<8sQQQ")  # magic, readers, chunk_bytes, chunks
_MAGIC = b"pdistmq1"
_SLOT_WORDS = struct.Struct("<QQ")  # length, kind (after the sequence number)
_INLINE, _OVERFLOW = 1, 2
_SEGMENT_PREFIX = "pdist-mq-"
_SEGMENT_NAME = re.compile(r"pdist-mq-[0-9a-f]{32}")
_SPIN_SECONDS = 20e-6
_YIELD_SECONDS = 2e-3
_MAX_SLEEP = 1e-3
_PEER_CHECK_SECONDS = 0.5
_LOG_SECONDS = 60.0
_WHAT = "message_queue"

# C11 memory orders, as GCC's __atomic builtins and libatomic number them.
_ACQUIRE, _RELEASE = 2, 3
_STRONGLY_ORDERED = frozenset({"x86_64", "amd64", "i386", "i686"})


def _lines(n: int) -> int:
    return (n + _LINE - 1) // _LINE * _LINE


# --------------------------------------------------------------------------- atomics


class _Atomics(Protocol):
    """Acquire loads and release stores of aligned 8-byte words at raw addresses."""

    name: str

    def load(self, address: int) -> int:
        """Load with acquire ordering."""
        ...

    def store(self, address: int, value: int) -> None:
        """Store with release ordering."""
        ...


def _libatomic_functions(lib: ctypes.CDLL) -> tuple[Any, Any]:
    # Outside a class: a class body would mangle the double-underscore names.
    load, store = lib.__atomic_load_8, lib.__atomic_store_8
    load.argtypes, load.restype = [ctypes.c_void_p, ctypes.c_int], ctypes.c_uint64
    store.argtypes, store.restype = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int], None
    return load, store


class _LibAtomic:
    """libatomic's ``__atomic_load_8(p, ACQUIRE)`` and ``__atomic_store_8(p, v, RELEASE)``."""

    name = "libatomic"

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._load, self._store = _libatomic_functions(lib)

    def load(self, address: int) -> int:
        """Load with acquire ordering."""
        return int(self._load(address, _ACQUIRE))

    def store(self, address: int, value: int) -> None:
        """Store with release ordering."""
        self._store(address, value, _RELEASE)


class _PlainWords:
    """Plain aligned 8-byte loads and stores: release/acquire on x86-64 (TSO) only."""

    name = "plain (x86 TSO)"

    def load(self, address: int) -> int:
        """Load (acquire on x86)."""
        return int(ctypes.c_uint64.from_address(address).value)

    def store(self, address: int, value: int) -> None:
        """Store (release on x86)."""
        ctypes.c_uint64.from_address(address).value = value


def _open_libatomic() -> ctypes.CDLL | None:
    for name in ("libatomic.so.1", "libatomic.so", None):
        name = name or ctypes.util.find_library("atomic")  # slow (runs ldconfig): last
        if name:
            try:
                # PyDLL keeps the GIL over these few instructions: a spinning reader must
                # not hand the GIL to another thread on every poll.
                return ctypes.PyDLL(name)
            except OSError:
                continue
    return None


def _choose_atomics(machine: str, lib: ctypes.CDLL | None) -> _Atomics:
    if lib is not None:
        return _LibAtomic(lib)
    if machine.lower() in _STRONGLY_ORDERED:
        return _PlainWords()
    msg = (
        f"message_queue needs libatomic on {machine} (a weakly ordered CPU) to publish ring "
        "slots in order; install it (Debian/Ubuntu: apt install libatomic1; RHEL/Fedora: "
        "dnf install libatomic) or use the group without message_queue"
    )
    raise PdistError(msg)


@functools.cache
def _atomics() -> _Atomics:
    return _choose_atomics(platform.machine(), _open_libatomic())


# --------------------------------------------------------------------------- the ring


class _Ring:
    """One mapping of the ring; the writer and every reader hold their own."""

    def __init__(
        self, region: mmap.mmap, readers: int, chunk_bytes: int, chunks: int, atomics: _Atomics
    ) -> None:
        self.region = region
        self.readers = readers
        self.chunk_bytes = chunk_bytes
        self.chunks = chunks
        self.atomics = atomics
        self._slot0 = _LINE * (1 + readers)
        self._stride = _LINE + _lines(chunk_bytes)
        # An export of the mapping, for raw addresses; released before the mapping closes.
        self._view: Any = (ctypes.c_char * len(region)).from_buffer(region)
        self._address = ctypes.addressof(self._view)

    @staticmethod
    def size(readers: int, chunk_bytes: int, chunks: int) -> int:
        """Bytes of a ring for ``readers`` readers and ``chunks`` slots of ``chunk_bytes``."""
        return _LINE * (1 + readers) + chunks * (_LINE + _lines(chunk_bytes))

    def header(self) -> bytes:
        """What the writer stamps at the start of the segment."""
        return _HEADER.pack(_MAGIC, self.readers, self.chunk_bytes, self.chunks)

    def stamp(self) -> None:
        """Write the header (the writer, before announcing the segment)."""
        self.region[: _HEADER.size] = self.header()

    def stamped(self) -> bool:
        """Whether the segment carries this ring's header (a reader, after opening it)."""
        return self.region[: _HEADER.size] == self.header()

    def slot(self, seq: int) -> int:
        """Byte offset of the slot of message ``seq``."""
        return self._slot0 + (seq % self.chunks) * self._stride

    def consumed(self, reader: int) -> int:
        """The last message ``reader`` consumed (acquire)."""
        return self.atomics.load(self._address + _LINE * (1 + reader))

    def set_consumed(self, reader: int, seq: int) -> None:
        """Publish that ``reader`` consumed message ``seq`` (release: after its copy-out)."""
        self.atomics.store(self._address + _LINE * (1 + reader), seq)

    def published(self, seq: int) -> int:
        """The sequence number the slot of ``seq`` holds now (acquire)."""
        return self.atomics.load(self._address + self.slot(seq))

    def write(self, seq: int, kind: int, data: bytes) -> None:
        """Fill the slot of ``seq``, then publish it (release: after the data)."""
        base = self.slot(seq)
        self.region[base + _LINE : base + _LINE + len(data)] = data
        _SLOT_WORDS.pack_into(self.region, base + 8, len(data), kind)
        self.atomics.store(self._address + base, seq)

    def read(self, seq: int) -> tuple[int, int, bytes]:
        """``(kind, length, data)`` of the published slot of ``seq``; data is empty if corrupt."""
        base = self.slot(seq)
        length, kind = _SLOT_WORDS.unpack_from(self.region, base + 8)
        if length > self.chunk_bytes:
            return kind, length, b""
        return kind, length, self.region[base + _LINE : base + _LINE + length]

    def close(self) -> None:
        """Unmap (a view still alive elsewhere keeps the mapping until it goes)."""
        self._view = None
        with contextlib.suppress(BufferError):
            self.region.close()


# --------------------------------------------------------------------------- peers


class _Watch:
    """A peer whose exit a waiting rank notices (ranks in one pid namespace only)."""

    def __init__(self, rank: int, pid: int) -> None:
        self.rank = rank
        self.pid = pid
        # A pidfd where the kernel has them: immune to pid reuse, readable once the peer exits.
        self._poll: select.poll | None = None
        self._fd: int | None = None
        try:
            self._fd = os.pidfd_open(pid)
        except (AttributeError, OSError):
            return
        self._poll = select.poll()
        self._poll.register(self._fd, select.POLLIN)

    def exited(self) -> bool:
        """Whether the peer's process has ended."""
        if self._poll is not None:
            return bool(self._poll.poll(0))
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False

    def close(self) -> None:
        """Release the pidfd."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd, self._poll = None, None


def _pid_namespace() -> str | None:
    try:
        st = os.stat("/proc/self/ns/pid")
    except OSError:
        return None
    return f"{st.st_dev}:{st.st_ino}"


# --------------------------------------------------------------------------- the queue


class _MessageQueue:
    """The queue of one rank: the writer (group index 0) or a reader.

    Implements :class:`~pdist._group.HeaderTransport`.
    """

    def __init__(
        self,
        ring: _Ring,
        reader: int | None,
        timeout: float,
        idle_timeout: float | None,
        watches: list[_Watch],
    ) -> None:
        self._ring = ring
        self._reader = reader  # None on the writer
        self._timeout = timeout
        self._idle_timeout = idle_timeout
        self._watches = watches
        self._seq = 0  # the last message written or consumed (the first is 1)
        self._failure: str | None = None
        self._closed = False
        self._released = False
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
        """Like ``_wire.broadcast_bytes``, through the ring (``src`` must be 0).

        Raises:
            ValueError: ``src`` is not 0.
            PdistError: The ``distributed()`` block or the ``message_queue`` block has
                exited, the queue failed earlier, or this call failed (then it is poisoned).
                A ``RemoteError`` when the writer sent an error marker (on every rank;
                the queue stays usable).
        """
        group.global_rank(src)
        if src != 0:
            msg = (
                f"src={src}: a message_queue group broadcasts only from its first rank (src=0); "
                "use the original group for other sources"
            )
            raise ValueError(msg)
        group.lifetime.check_open()
        with self._lock:
            self._check_usable(group)
            try:
                if self._reader is None:
                    return self._write(group, payload, error, what)
                return self._read(group, self._reader, what)
            except RemoteError:
                raise  # a failure every rank received in step: the ring is still in order
            except BaseException as exc:
                self._failure = f"{what} on rank {group.rank}: {type(exc).__name__}: {exc}"
                raise

    def _check_usable(self, group: Group) -> None:
        if self._closed:
            msg = (
                f"the `with pdist.message_queue(...)` block of group {group.name!r} has exited "
                "and its shared-memory ring is gone; broadcast inside the block, or on the "
                "original group"
            )
            raise PdistError(msg)
        if self._failure is not None:
            msg = (
                f"this message_queue on group {group.name!r} is unusable after an earlier "
                f"failure ({self._failure}); the ranks may be out of step: leave the "
                "`with pdist.message_queue(...)` block (open a new one to go on)"
            )
            raise PdistError(msg)

    def _write(
        self, group: Group, payload: bytes | None, error: BaseException | None, what: str
    ) -> bytes:
        ring = self._ring
        seq = self._seq + 1
        free = seq - ring.chunks  # every reader must have consumed this one
        message = _wire.frame(payload, error, group.rank)

        def ready() -> bool:
            for r in range(ring.readers):
                consumed = ring.consumed(r)
                if consumed > self._seq:
                    msg = (
                        f"{what} on message_queue group {group.name!r}: rank {group.ranks[r + 1]} "
                        f"reports message {consumed} consumed, but only {self._seq} were "
                        "written; the ring is corrupt or another process writes to it"
                    )
                    raise PdistError(msg)
                if consumed < free:
                    return False
            return True

        def waiting_for() -> str:
            slow = [group.ranks[r + 1] for r in range(ring.readers) if ring.consumed(r) < free]
            return f"for ranks {slow} to consume message {free} and free a slot"

        self._wait(group, ready, self._timeout, "the group's timeout", waiting_for, what)
        if len(message) <= ring.chunk_bytes:
            ring.write(seq, _INLINE, message)
            self._seq = seq
        else:
            ring.write(seq, _OVERFLOW, b"")
            self._seq = seq
            _wire.broadcast_bytes(group, payload, 0, error=error, what=what)
        if error is not None:
            _agree.raise_own(group, error, what, wrap_pdist=True)
        return payload or b""

    def _read(self, group: Group, reader: int, what: str) -> bytes:
        ring = self._ring
        seq = self._seq + 1
        before = seq - ring.chunks if seq > ring.chunks else 0  # the slot's previous message

        def corrupt(detail: str) -> PdistError:
            msg = (
                f"{what} on message_queue group {group.name!r}: rank {group.rank} expected "
                f"message {seq} but {detail}; the ring is corrupt or the ranks are out of step"
            )
            return PdistError(msg)

        def ready() -> bool:
            value = ring.published(seq)
            if value == seq:
                return True
            if value != before:
                raise corrupt(f"its slot holds message {value}")
            return False

        def waiting_for() -> str:
            return f"for message {seq} from the writer (rank {group.ranks[0]})"

        label = f"{IDLE_TIMEOUT_ENV} / idle_timeout"
        self._wait(group, ready, self._idle_timeout, label, waiting_for, what)
        kind, length, data = ring.read(seq)
        if kind not in (_INLINE, _OVERFLOW) or len(data) != length:
            raise corrupt(f"its slot holds kind {kind} and length {length}")
        ring.set_consumed(reader, seq)
        self._seq = seq
        if kind == _OVERFLOW:
            return _wire.broadcast_bytes(group, None, 0, what=what)
        return _wire.unframe(data, group, what)

    def _wait(
        self,
        group: Group,
        ready: Callable[[], bool],
        timeout: float | None,
        limit: str,
        waiting_for: Callable[[], str],
        what: str,
    ) -> None:
        """Spin briefly, then yield, then sleep in growing steps until ``ready()``.

        Bounded by ``timeout`` (None: forever); notices a peer's exit within
        about half a second (same pid namespace) and logs every minute, or
        every group timeout when that is shorter.
        """
        start = time.monotonic()
        sleep = 1e-6
        next_check = start + _PEER_CHECK_SECONDS
        every = min(_LOG_SECONDS, self._timeout)
        next_log = start + every
        while not ready():
            now = time.monotonic()
            waited = now - start
            if waited < _SPIN_SECONDS:
                continue
            if self._closed or group.is_closed:
                block = "message_queue" if self._closed else "distributed()"
                msg = (
                    f"{what} on message_queue group {group.name!r}: the {block} block "
                    f"exited while rank {group.rank} waited {waiting_for()}"
                )
                raise PdistError(msg)
            if timeout is not None and waited > timeout:
                msg = (
                    f"{what} on message_queue group {group.name!r}: rank {group.rank} waited "
                    f"{waited:.1f}s {waiting_for()} ({limit}: {timeout:g}s); did a rank die "
                    "or stop calling the broadcasts?"
                )
                raise PdistError(msg)
            if now >= next_check:
                next_check = now + _PEER_CHECK_SECONDS
                for watch in self._watches:
                    if watch.exited():
                        msg = (
                            f"{what} on message_queue group {group.name!r}: rank {watch.rank} "
                            f"(pid {watch.pid}) exited while rank {group.rank} waited "
                            f"{waiting_for()}"
                        )
                        raise PdistError(msg)
            if now >= next_log:
                next_log = now + every
                logger.info(
                    "pdist: rank %d has waited %.0fs %s on message_queue group %r (%s: %s)",
                    group.rank,
                    waited,
                    waiting_for(),
                    group.name,
                    limit,
                    "none" if timeout is None else f"{timeout:g}s",
                )
            if waited < _YIELD_SECONDS:
                os.sched_yield()
            else:
                time.sleep(sleep)
                sleep = min(sleep * 2, _MAX_SLEEP)

    def close(self) -> None:
        """Refuse further use, wake a waiting thread, and unmap the ring."""
        self._closed = True
        with self._lock:
            if self._released:
                return
            self._released = True
            self._ring.close()
            for watch in self._watches:
                watch.close()


# --------------------------------------------------------------------------- set-up


def _idle_seconds(idle_timeout: float | timedelta | None) -> float | None:
    if idle_timeout is not None:
        return to_seconds(idle_timeout, "idle_timeout")
    seconds = env_seconds(IDLE_TIMEOUT_ENV, 0.0, zero_means_forever=True)
    return seconds or None


def _check_arguments(
    chunk_bytes: int, chunks: int, idle_timeout: float | timedelta | None
) -> tuple[float | None, _Atomics]:
    for name, value in (("chunk_bytes", chunk_bytes), ("chunks", chunks)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            msg = f"{name}={value!r} must be a positive int; pass the same one on every rank"
            raise ValueError(msg)
    return _idle_seconds(idle_timeout), _atomics()


def _segment_name() -> str:
    """A fresh segment name (the writer's): pdist's prefix and 128 random bits."""
    return f"{_SEGMENT_PREFIX}{uuid.uuid4().hex}"


def _positive_int(g: Group, records: list[Any], field: str) -> dict[int, int]:
    values = {}
    for rank, record in zip(g.ranks, records, strict=True):
        value = record.get(field) if isinstance(record, dict) else None
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            msg = (
                f"message_queue on group {g.name!r}: rank {rank} sent a malformed set-up "
                f"record ({field}={value!r}); do all ranks run the same pdist version?"
            )
            raise PdistError(msg)
        values[rank] = value
    return values


@attrs.frozen
class _Plan:
    """What every rank agreed on at set-up."""

    chunk_bytes: int
    chunks: int
    path: str
    pids: dict[int, int] | None  # global rank -> pid, when all share a pid namespace


def _plan(g: Group, records: list[Any]) -> _Plan:
    """Check the set-up records; the same verdict on every rank (the writer's included)."""
    sizes = {}
    for field in ("chunk_bytes", "chunks"):
        values = _positive_int(g, records, field)
        if len(set(values.values())) > 1:
            by_value: dict[int, list[int]] = {}
            for rank, value in values.items():
                by_value.setdefault(value, []).append(rank)
            parts = "; ".join(
                f"{value} on rank{'s' if len(r) > 1 else ''} {r if len(r) > 1 else r[0]}"
                for value, r in by_value.items()
            )
            msg = (
                f"message_queue on group {g.name!r}: {field} differs across ranks: {parts}; "
                "pass the same chunk_bytes and chunks on every rank"
            )
            raise RankMismatchError(msg)
        sizes[field] = values[g.ranks[0]]
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
    pids = _positive_int(g, records, "pid")
    # Anything but a str (such as a list from another version) means an unknown namespace.
    spaces = {
        ns if isinstance(ns, str) else None for ns in (r.get("pid_namespace") for r in records)
    }
    same_space = len(spaces) == 1 and None not in spaces
    return _Plan(
        sizes["chunk_bytes"],
        sizes["chunks"],
        os.path.join(shm_dir(), segment),
        pids if same_space else None,
    )


def _create(g: Group, plan: _Plan, ring_size: int) -> mmap.mmap:
    """The writer's segment: created, reserved (so a full /dev/shm fails now) and mapped."""
    flags = os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(plan.path, flags, 0o600)
    except OSError as exc:
        msg = f"rank {g.rank} could not create the ring {plan.path}: {exc}"
        raise PdistError(msg) from exc
    try:
        try:
            # posix_fallocate reserves the pages: with ftruncate alone, a full tmpfs
            # (Docker's /dev/shm is 64 MB) kills a later write with SIGBUS.
            if hasattr(os, "posix_fallocate"):
                os.posix_fallocate(fd, 0, ring_size)
            else:  # pragma: no cover - not Linux
                os.ftruncate(fd, ring_size)
        except (OSError, OverflowError) as exc:  # OverflowError: a size no file can have
            msg = (
                f"rank {g.rank} could not reserve {ring_size} bytes for the ring in "
                f"{shm_dir()}: {exc}; give it more room (docker run --shm-size=...) or pass a "
                f"smaller chunk_bytes x chunks (now {plan.chunk_bytes} x {plan.chunks})"
            )
            raise PdistError(msg) from exc
        return mmap.mmap(fd, ring_size)
    finally:
        os.close(fd)


def _open(g: Group, plan: _Plan, ring_size: int) -> mmap.mmap:
    """A reader's mapping of the writer's segment, checked to be the ring it expects."""
    try:
        fd = os.open(plan.path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        msg = f"rank {g.rank} could not open the ring {plan.path}: {exc}"
        raise PdistError(msg) from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size != ring_size:
            msg = (
                f"rank {g.rank} found {plan.path} is not a ring of {ring_size} bytes "
                f"(a {'file' if stat.S_ISREG(st.st_mode) else 'special file'} of "
                f"{st.st_size} bytes); another process owns that name"
            )
            raise PdistError(msg)
        return mmap.mmap(fd, ring_size)
    finally:
        os.close(fd)


@contextlib.contextmanager
def _removed_on_sigterm(path: str) -> Iterator[None]:
    """While the segment has a name: a SIGTERM removes it before ending the process.

    Only in the main thread, and only when SIGTERM has its default action
    (which ends the process without running ``finally`` blocks); a handler
    the program installed is left alone. Python runs the handler between
    bytecodes, so at the latest when the collective it waits in returns.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
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


def _attach(
    g: Group,
    chunk_bytes: int,
    chunks: int,
    idle: float | None,
    atomics: _Atomics | None,
    error: BaseException | None,
) -> _MessageQueue:
    """Set up this rank's queue; fails on every rank together.

    Collectives on the CPU group: the set-up records, host detection (three),
    then, with the segment in place, its announcement and the attach verdict.
    The segment exists only between those last two, after every rank arrived.
    """
    record = {
        "chunk_bytes": chunk_bytes,
        "chunks": chunks,
        "segment": _segment_name() if g.is_first_rank else None,
        "pid": os.getpid(),
        "pid_namespace": _pid_namespace(),
    }
    plan = _plan(g, _wire.exchange(g, record, error=error, what=_WHAT))
    first_host = next(b for b in host_blocks(g) if g.ranks[0] in b)
    others = [r for r in g.ranks if r not in first_host]
    if others:
        msg = (
            f"message_queue needs every rank of group {g.name!r} on one host; ranks {others} "
            f"are on another host than rank {g.ranks[0]}"
        )
        raise PdistError(msg)
    assert atomics is not None  # no error: _check_arguments returned them
    readers = g.world_size - 1
    shape = (plan.chunk_bytes, plan.chunks)
    ring_size = _Ring.size(readers, *shape)
    ring: _Ring | None = None
    guard = _removed_on_sigterm(plan.path) if g.is_first_rank else contextlib.nullcontext()
    with guard:
        try:
            failure: BaseException | None = None
            if g.is_first_rank:
                try:
                    ring = _Ring(_create(g, plan, ring_size), readers, *shape, atomics)
                    ring.stamp()
                except Exception as exc:
                    failure = exc
            _wire.broadcast_bytes(g, b"", 0, error=failure, what=_WHAT)
            if not g.is_first_rank:
                try:
                    ring = _Ring(_open(g, plan, ring_size), readers, *shape, atomics)
                    if not ring.stamped():
                        msg = f"rank {g.rank} found {plan.path} is not a pdist ring of this shape"
                        raise PdistError(msg)
                except Exception as exc:
                    failure = exc
            _wire.all_gather_bytes(g, b"", error=failure, what=_WHAT)
        except BaseException:
            if ring is not None:
                ring.close()
            raise
        finally:
            # Everyone attached, or set-up failed: nobody needs the name any more. Every
            # rank removes it, so it goes even when the writer died after creating it.
            with contextlib.suppress(OSError):
                os.unlink(plan.path)
    assert ring is not None  # both collectives passed: every rank mapped the ring
    if plan.pids is None:
        watches = []
    elif g.is_first_rank:
        watches = [_Watch(r, plan.pids[r]) for r in g.ranks[1:]]
    else:
        watches = [_Watch(g.ranks[0], plan.pids[g.ranks[0]])]
    return _MessageQueue(
        ring=ring,
        reader=None if g.is_first_rank else g.rank_in_group - 1,
        timeout=g.timeout.total_seconds(),
        idle_timeout=idle,
        watches=watches,
    )


@contextlib.contextmanager
def message_queue(
    group: Group | DistContext,
    *,
    chunk_bytes: int = 4 << 20,
    chunks: int = 6,
    idle_timeout: float | timedelta | None = None,
) -> Iterator[Group]:
    """Yield a copy of ``group`` whose object broadcasts from its first rank use shared memory.

    :func:`~pdist.broadcast_object` and the metadata of
    :func:`~pdist.broadcast_tensor_dict` go through a ring of ``chunks`` slots
    of ``chunk_bytes`` in ``/dev/shm`` instead of a collective; a larger
    message still arrives (over the CPU group). The original group is
    untouched. Waiting ranks spin briefly, then yield, then sleep in short
    steps. The segment is reserved in full at set-up (so a full ``/dev/shm``
    fails here, on every rank) and unlinked as soon as every rank has
    attached, so it never outlives the group.

    Waits: the writer waits for a free slot at most the group's timeout. A
    reader waits for the next message ``idle_timeout`` (by default
    ``PDIST_MQ_IDLE_TIMEOUT_SEC``; unset or ``0``: forever), logging every
    minute, since an inference worker may sit idle for hours. Either side
    notices within a second when the process of the rank it waits for exits
    (ranks in one pid namespace). After a failure of the queue itself (a
    timeout, a dead peer, an interrupted wait, a corrupt slot) every later
    broadcast on the group raises; an error the writer sends (a payload it
    cannot encode) reaches every rank and leaves the queue usable.

    .. note:: Every rank of the group must enter it, with the same
       ``chunk_bytes`` and ``chunks``; broadcasts on the yielded group must
       come from its first rank (``src=0``), inside this block and inside
       the ``distributed()`` block.

    Args:
        group: The group (a context means its world); its ranks share a host.
        chunk_bytes: Bytes per slot; a larger message goes over the CPU group.
        chunks: Number of slots: how far the writer may run ahead of a reader.
        idle_timeout: Seconds (or a ``timedelta``) a reader waits for the next
            message before it raises; None reads ``PDIST_MQ_IDLE_TIMEOUT_SEC``.

    Raises:
        ValueError: On a one-rank group, when an argument is invalid.
        RankMismatchError: On every rank, when ranks pass different
            ``chunk_bytes`` or ``chunks``.
        PdistError: On every rank, naming the rank, when a rank passed an
            invalid argument, the writer could not create or reserve the
            segment (a full or read-only ``/dev/shm``) or a reader could not
            open it (each a ``RemoteError``, with the failing rank's own
            error as the cause there); when the ranks do not all share a host
            (naming the ranks on other hosts); or when the writer named a
            segment outside pdist's (readers refuse it).
    """
    g = as_group(group)
    atomics: _Atomics | None = None
    idle: float | None = None
    error: BaseException | None = None
    try:
        idle, atomics = _check_arguments(chunk_bytes, chunks, idle_timeout)
    except (TypeError, ValueError, PdistError) as exc:
        error = exc
    if g.world_size == 1:
        if error is not None:
            raise error
        yield g
        return
    queue = _attach(g, chunk_bytes, chunks, idle, atomics, error)
    try:
        yield attrs.evolve(g, mq=queue)
    finally:
        queue.close()
