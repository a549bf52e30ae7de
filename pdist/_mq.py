"""Same-host fast path: a shared-memory ring buffer for object broadcasts from a group's first rank.

Inference engines broadcast a small scheduling object to every worker on every
step; a socket collective's latency dominates that step. Inside
``message_queue(group)``, the group's first rank writes each message into a
slot of a ring in ``/dev/shm`` and the other ranks read it from there.

Ring layout: a header of one ``u64`` per reader (the last sequence number it
consumed), then ``chunks`` slots of ``[u64 seq][u64 length][u64 kind][data]``.
The writer fills slot ``s % chunks`` once every reader has consumed message
``s - chunks``, writing the data first and the sequence number last (an
aligned 8-byte store); readers wait for the sequence number, copy the data
out, then publish their progress. A message larger than a slot travels over
the CPU group, announced by an overflow marker in the ring.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import time
import uuid
from collections.abc import Callable, Iterator

import attrs

from . import _wire
from ._errors import PdistError
from ._group import DistContext, Group, as_group
from ._payload import aligned
from ._topology import host_blocks, shm_dir

__all__ = ["message_queue"]

_WORD = 8
_SLOT_HEADER = 3 * _WORD
_INLINE, _OVERFLOW = 1, 2
_SPIN_SECONDS = 20e-6
_YIELD_SECONDS = 2e-3
_MAX_SLEEP = 1e-3


class _Ring:
    """One mapping of the ring; the writer and every reader hold their own."""

    def __init__(self, region: mmap.mmap, readers: int, chunk_bytes: int, chunks: int) -> None:
        self.region = region
        self.readers = readers
        self.chunk_bytes = chunk_bytes
        self.chunks = chunks
        self._slot0 = aligned(readers * _WORD)

    @staticmethod
    def size(readers: int, chunk_bytes: int, chunks: int) -> int:
        return aligned(readers * _WORD) + chunks * aligned(_SLOT_HEADER + chunk_bytes)

    def _word(self, offset: int) -> ctypes.c_uint64:
        return ctypes.c_uint64.from_buffer(self.region, offset)

    def slot(self, seq: int) -> int:
        return self._slot0 + (seq % self.chunks) * aligned(_SLOT_HEADER + self.chunk_bytes)

    def consumed(self, reader: int) -> int:
        return int(self._word(reader * _WORD).value)

    def set_consumed(self, reader: int, seq: int) -> None:
        self._word(reader * _WORD).value = seq

    def published(self, seq: int) -> int:
        return int(self._word(self.slot(seq)).value)

    def write(self, seq: int, kind: int, data: bytes) -> None:
        base = self.slot(seq)
        self.region[base + _SLOT_HEADER : base + _SLOT_HEADER + len(data)] = data
        self._word(base + _WORD).value = len(data)
        self._word(base + 2 * _WORD).value = kind
        self._word(base).value = seq  # last: publishes the slot

    def read(self, seq: int) -> tuple[int, bytes]:
        base = self.slot(seq)
        length = int(self._word(base + _WORD).value)
        kind = int(self._word(base + 2 * _WORD).value)
        return kind, self.region[base + _SLOT_HEADER : base + _SLOT_HEADER + length]


def _wait(ready: Callable[[], bool], timeout: float, describe: str) -> None:
    """Spin briefly, then yield, then sleep in growing steps until ``ready()``; bounded."""
    start = time.monotonic()
    sleep = 1e-6
    while not ready():
        waited = time.monotonic() - start
        if waited < _SPIN_SECONDS:
            continue
        if waited > timeout:
            msg = f"{describe} for {waited:.1f}s (the group's timeout); did a rank die?"
            raise PdistError(msg)
        if waited < _YIELD_SECONDS:
            os.sched_yield()
        else:
            time.sleep(sleep)
            sleep = min(sleep * 2, _MAX_SLEEP)


@attrs.define(eq=False)
class _MessageQueue:
    """The queue of one rank: writer (group index 0) or reader."""

    ring: _Ring
    reader: int | None  # None on the writer
    timeout: float
    seq: int = 0  # the next message's sequence number (starting at 1)

    def broadcast_bytes(
        self,
        group: Group,
        payload: bytes | None,
        src: int,
        *,
        error: BaseException | None = None,
        what: str = "broadcast",
    ) -> bytes:
        """Like ``_wire.broadcast_bytes``, through the ring (src must be 0)."""
        group.global_rank(src)
        if src != 0:
            msg = (
                f"src={src}: a message_queue group broadcasts only from its first rank (src=0); "
                "use the original group for other sources"
            )
            raise ValueError(msg)
        self.seq += 1
        seq = self.seq
        ring = self.ring
        if self.reader is None:
            message = _wire.frame(payload, error, group.rank)
            _wait(
                lambda: all(ring.consumed(r) >= seq - ring.chunks for r in range(ring.readers)),
                self.timeout,
                f"{what}: the writer waited for readers to free a slot",
            )
            if len(message) <= ring.chunk_bytes:
                ring.write(seq, _INLINE, message)
            else:
                ring.write(seq, _OVERFLOW, b"")
                _wire.broadcast_bytes(group, payload, 0, error=error, what=what)
            _wire.reraise_own(error, group, what, group.rank)
            return payload or b""
        reader = self.reader
        _wait(
            lambda: ring.published(seq) == seq,
            self.timeout,
            f"{what}: a reader waited for the writer",
        )
        kind, data = ring.read(seq)
        ring.set_consumed(reader, seq)
        if kind == _OVERFLOW:
            return _wire.broadcast_bytes(group, None, 0, what=what)
        return _wire.unframe(data, group, what)

    def close(self) -> None:
        with contextlib.suppress(BufferError):  # a view still alive keeps the mapping
            self.ring.region.close()


@contextlib.contextmanager
def message_queue(
    group: Group | DistContext, *, chunk_bytes: int = 4 << 20, chunks: int = 6
) -> Iterator[Group]:
    """Yield a copy of ``group`` whose object broadcasts from its first rank use shared memory.

    :func:`~pdist.broadcast_object` and the metadata of
    :func:`~pdist.broadcast_tensor_dict` go through a ring of ``chunks`` slots
    of ``chunk_bytes`` in ``/dev/shm`` instead of a collective; a larger
    message still arrives (over the CPU group). The original group is
    untouched. Waiting ranks spin briefly, then yield, then sleep in short
    steps; a reader that waits longer than the group's timeout raises
    :class:`~pdist.PdistError`. The segment is unlinked as soon as every rank
    has attached, so it never outlives the group.

    .. note:: Every rank of the group must enter it; broadcasts on the yielded
       group must come from its first rank (``src=0``).

    Raises:
        PdistError: On every rank, when the ranks do not all share a host
            (naming the ranks on other hosts).
        ValueError: ``chunk_bytes`` or ``chunks`` is not a positive int.
    """
    g = as_group(group)
    for name, value in (("chunk_bytes", chunk_bytes), ("chunks", chunks)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            msg = f"{name}={value!r} must be a positive int"
            raise ValueError(msg)
    if g.world_size == 1:
        yield g
        return
    first_host = next(b for b in host_blocks(g) if g.ranks[0] in b)
    others = [r for r in g.ranks if r not in first_host]
    if others:
        msg = (
            f"message_queue needs every rank of group {g.name!r} on one host; ranks {others} "
            f"are on another host than rank {g.ranks[0]}"
        )
        raise PdistError(msg)
    readers = g.world_size - 1
    size = _Ring.size(readers, chunk_bytes, chunks)
    path = None
    segment = b""
    if g.is_first_rank:
        path = os.path.join(shm_dir(), f"pdist-mq-{uuid.uuid4().hex}")
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
            region = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        segment = path.encode()
    try:
        segment = _wire.broadcast_bytes(g, segment, 0, what="message_queue")
        if path is None:
            fd = os.open(segment.decode(), os.O_RDWR)
            try:
                region = mmap.mmap(fd, size)
            finally:
                os.close(fd)
        # Every rank attached: nothing needs the name any more.
        _wire.all_gather_bytes(g, b"", what="message_queue")
    finally:
        if path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
    queue = _MessageQueue(
        ring=_Ring(region, readers, chunk_bytes, chunks),
        reader=None if g.is_first_rank else g.rank_in_group - 1,
        timeout=g.timeout.total_seconds(),
    )
    try:
        yield attrs.evolve(g, mq=queue)
    finally:
        queue.close()
