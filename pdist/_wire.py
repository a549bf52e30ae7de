"""Byte-level transport over a Group's CPU (gloo) group: the shared mechanics.

Everything that exchanges metadata or pickled payloads goes through here.
A message is a header (status, length) and a body; it travels as a fixed-size
first chunk plus, only when longer, the rest, so small messages take a single
collective. A rank that fails while preparing its part sends an error marker
instead of its payload: then every rank raises the same :class:`RemoteError`
(the failing one with its original error as the cause), and nobody waits.

A message's rest of :data:`STATUS_MIN_BYTES` or more is preceded by a status
step (an 8-byte all-reduce, or a short reply from the receiver of a send):
a receiver that cannot allocate it (out of memory, or a length no buffer can
hold) then makes every rank raise instead of leaving the sender waiting.
Senders allocate both chunks before anything moves, and send an error
marker when they cannot.

Nothing a peer sends here is unpickled: an error marker is a struct (the
failing rank, the error's type name and text as UTF-8), and metadata records
(:func:`exchange`) are JSON. Only the payloads a user asked to send are
pickles, and those are decoded by the callers, through the safe unpickler
when asked.
"""

from __future__ import annotations

import ctypes
import json
import struct
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ._errors import PdistError
from ._group import Group, recorded

__all__ = [
    "FIRST_MESSAGE_BYTES",
    "STATUS_MIN_BYTES",
    "RemoteError",
    "RemoteTypeError",
    "RemoteValueError",
    "agree",
    "all_gather_bytes",
    "all_gather_into",
    "allocate",
    "allocated",
    "broadcast_bytes",
    "bytes_of",
    "exchange",
    "frame",
    "padded",
    "recv_bytes",
    "reraise_own",
    "send_bytes",
    "settle",
    "tensor_of",
    "unframe",
]

FIRST_MESSAGE_BYTES = 4096
"""Size of the fixed first chunk of a message: smaller messages take one collective."""

STATUS_MIN_BYTES = 1 << 20
"""A message's rest of this size or more moves only after every receiver has allocated it.

Below it, an allocation cannot realistically fail, and the status step would
cost more than the transfer it guards.
"""

_HEADER = struct.Struct("<Bq")  # status, body length
_OK, _ERROR = 1, 2
_MARKER = struct.Struct("<qI")  # failing rank, length of the error's type name (then the text)
_MAX_MARKER_TEXT = 16 << 10


class RemoteError(PdistError):
    """A rank failed while preparing its part of a collective; every rank raises this."""


class RemoteTypeError(RemoteError, TypeError):
    """A rank's ``TypeError`` (a bad argument), raised on every rank of the collective."""


class RemoteValueError(RemoteError, ValueError):
    """A rank's ``ValueError`` (a bad argument), raised on every rank of the collective."""


# A bad argument on one rank stays a TypeError/ValueError on every rank, as it would locally.
_REMOTE_TYPES: dict[str, type[RemoteError]] = {
    "TypeError": RemoteTypeError,
    "ValueError": RemoteValueError,
    "RemoteTypeError": RemoteTypeError,
    "RemoteValueError": RemoteValueError,
}


def tensor_of(data: bytes | bytearray | memoryview, size: int | None = None) -> torch.Tensor:
    """A uint8 CPU tensor holding ``data``, zero-padded to ``size`` bytes."""
    return _filled(torch.empty(max(len(data), size or 0), dtype=torch.uint8), data)


def _filled(out: torch.Tensor, data: bytes | bytearray | memoryview) -> torch.Tensor:
    n = len(data)
    if n:
        ctypes.memmove(out.data_ptr(), bytes(data), n)
    out[n:].zero_()  # the padding goes on the wire: never this process's stale memory
    return out


def bytes_of(t: torch.Tensor, n: int | None = None, offset: int = 0) -> bytes:
    """``n`` bytes (default: all) of a contiguous CPU tensor, from byte ``offset``."""
    count = t.numel() * t.element_size() - offset if n is None else n
    if count <= 0:
        return b""
    return ctypes.string_at(t.data_ptr() + offset, count)


def allocate(nbytes: int, group: Group, what: str) -> torch.Tensor:
    """An uninitialized uint8 CPU buffer of ``nbytes`` for received data.

    Raises:
        PdistError: It cannot be allocated (out of memory, or a size no buffer
            can have, such as one a corrupt header announced).
    """
    try:
        return torch.empty(nbytes, dtype=torch.uint8)
    except Exception as exc:  # RuntimeError (out of memory), OverflowError...
        msg = (
            f"rank {group.rank} could not allocate {nbytes} bytes for the data of {what} on "
            f"group {group.name!r} ({type(exc).__name__}: {str(exc)[:200]}); free memory or "
            "send less in one call"
        )
        raise PdistError(msg) from exc


def padded(
    data: bytes | bytearray | memoryview, size: int, group: Group, what: str
) -> torch.Tensor:
    """:func:`tensor_of` in a buffer from :func:`allocate` (its failure a PdistError)."""
    return _filled(allocate(max(len(data), size), group, what), data)


def all_gather_into(
    out: torch.Tensor, mine: torch.Tensor, pg: dist.ProcessGroup, *, async_op: bool = False
) -> Any:
    """All-gather ``mine`` from every rank into the contiguous ``out`` (rank-major).

    Returns the work handle when ``async_op``.
    """
    # torch 2.13 renamed all_gather_into_tensor (now deprecated) to all_gather_single.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(out, mine, group=pg, async_op=async_op)


def _marker(rank: int, error: BaseException) -> bytes:
    """An error marker's body: plain data, never a pickle."""
    kind = type(error).__name__.encode()
    text = str(error).encode(errors="replace")[:_MAX_MARKER_TEXT]
    return _MARKER.pack(rank, len(kind)) + kind + text


def _read_marker(body: bytes, group: Group, what: str) -> tuple[int, str, str]:
    """``(rank, type name, text)`` of an error marker; a malformed one raises PdistError."""
    if len(body) < _MARKER.size:
        msg = f"{what} on group {group.name!r}: a peer sent a truncated error marker"
        raise PdistError(msg)
    rank, kind_len = _MARKER.unpack_from(body)
    if kind_len > len(body) - _MARKER.size or rank not in group.ranks:
        msg = f"{what} on group {group.name!r}: a peer sent a malformed error marker"
        raise PdistError(msg)
    kind = body[_MARKER.size : _MARKER.size + kind_len].decode(errors="replace")
    text = body[_MARKER.size + kind_len :].decode(errors="replace")
    return rank, kind, text


def frame(payload: bytes | None, error: BaseException | None, rank: int) -> bytes:
    """A message: header and ``payload``, or an error marker when ``error`` is given."""
    body = _marker(rank, error) if error is not None else payload or b""
    return _HEADER.pack(_ERROR if error is not None else _OK, len(body)) + body


def _failure(group: Group, what: str, rank: int, kind: str, text: str) -> RemoteError:
    error_type = _REMOTE_TYPES.get(kind, RemoteError)
    return error_type(f"{what} on group {group.name!r} failed on rank {rank}: {kind}: {text}")


def unframe(data: bytes, group: Group, what: str) -> bytes:
    """The body of a message, or raise the remote failure it carries."""
    if len(data) < _HEADER.size:
        msg = f"{what} on group {group.name!r}: a peer sent a truncated message"
        raise PdistError(msg)
    status, length = _HEADER.unpack_from(data)
    body = data[_HEADER.size : _HEADER.size + length]
    if length < 0 or len(body) != length:
        msg = f"{what} on group {group.name!r}: corrupt message header (length {length})"
        raise PdistError(msg)
    if status == _ERROR:
        raise _failure(group, what, *_read_marker(body, group, what))
    if status != _OK:
        msg = f"{what} on group {group.name!r}: corrupt message header (status {status})"
        raise PdistError(msg)
    return body


def _chunks(message: bytes) -> list[torch.Tensor]:
    """The fixed-size first chunk of ``message`` and, when it is longer, the rest."""
    size = FIRST_MESSAGE_BYTES
    chunks = [tensor_of(message[:size], size)]
    if len(message) > size:
        chunks.append(tensor_of(message[size:]))
    return chunks


def _outgoing(message: bytes, rank: int) -> tuple[list[torch.Tensor], BaseException | None]:
    """The chunks of ``message``, allocated before anything moves.

    When they cannot be allocated (out of memory), the chunks of an error
    marker instead, and the error, which the sender raises after sending them.
    """
    try:
        return _chunks(message), None
    except Exception as exc:
        return _chunks(frame(None, exc, rank)), exc


def _send_chunks(
    chunks: list[torch.Tensor],
    move: Callable[[torch.Tensor], object],
    status: Callable[[], object],
) -> None:
    """Move a message's chunks; before a large rest, ``status()`` hears from the receivers."""
    for i, chunk in enumerate(chunks):
        if i and chunk.numel() >= STATUS_MIN_BYTES:
            status()
        move(chunk)


def _receive(
    move: Callable[[torch.Tensor], object],
    status: Callable[[BaseException | None], object],
    group: Group,
    what: str,
) -> bytes:
    """Receive one framed message through ``move``.

    Before a rest of :data:`STATUS_MIN_BYTES` or more, ``status`` reports
    whether this rank could allocate it (and raises on failure); a smaller
    rest that cannot be allocated raises here.
    """
    size = FIRST_MESSAGE_BYTES
    first = torch.empty(size, dtype=torch.uint8)
    move(first)
    _status, length = _HEADER.unpack(bytes_of(first, _HEADER.size))
    total = _HEADER.size + length
    if total <= size:
        return bytes_of(first, total)
    rest: torch.Tensor | None = None
    failure: BaseException | None = None
    try:
        rest = allocate(total - size, group, what)
    except PdistError as exc:
        failure = exc
    if total - size >= STATUS_MIN_BYTES:
        status(failure)
    elif failure is not None:
        raise failure
    assert rest is not None  # status raised otherwise
    move(rest)
    return bytes_of(first) + bytes_of(rest)


def reraise_own(error: BaseException | None, group: Group, what: str, rank: int) -> None:
    """On the failing rank: raise the :class:`RemoteError` its peers raise, from ``error``."""
    if error is not None:
        raise _failure(group, what, rank, type(error).__name__, str(error)) from error


@recorded("broadcast")
def broadcast_bytes(
    group: Group,
    payload: bytes | None,
    src: int,
    *,
    error: BaseException | None = None,
    what: str = "broadcast",
) -> bytes:
    """Broadcast ``payload`` from group index ``src`` over the CPU group; returns it on every rank.

    One collective when the payload fits the first chunk, two otherwise (and a
    status all-reduce before a rest of :data:`STATUS_MIN_BYTES` or more). When
    the source passes ``error``, or a rank cannot allocate the message, every
    rank raises the same :class:`RemoteError`.
    """
    src_global = group.global_rank(src)
    pg = group.cpu_group

    def move(t: torch.Tensor) -> None:
        dist.broadcast(t, src=src_global, group=pg)

    if group.rank_in_group == src:
        message = frame(payload, error, group.rank)
        chunks, failure = _outgoing(message, group.rank)
        _send_chunks(chunks, move, lambda: settle(group, None, what=what))
        reraise_own(error or failure, group, what, group.rank)
        return unframe(message, group, what)
    data = _receive(move, lambda failure: settle(group, failure, what=what), group, what)
    return unframe(data, group, what)


@recorded("send", p2p=True)
def send_bytes(
    group: Group,
    payload: bytes | None,
    dst: int,
    *,
    error: BaseException | None = None,
    what: str = "send",
) -> None:
    """Send ``payload`` to group index ``dst`` (which calls :func:`recv_bytes`).

    Before a rest of :data:`STATUS_MIN_BYTES` or more, the receiver answers
    whether it could allocate it; if not, both raise.
    """
    dst_global = group.global_rank(dst, name="dst")
    pg = group.cpu_group

    def move(t: torch.Tensor) -> None:
        dist.send(t, dst=dst_global, group=pg)

    chunks, failure = _outgoing(frame(payload, error, group.rank), group.rank)
    _send_chunks(chunks, move, lambda: recv_bytes(group, dst, what=what))
    reraise_own(error or failure, group, what, group.rank)


@recorded("recv", p2p=True)
def recv_bytes(group: Group, src: int, *, what: str = "recv") -> bytes:
    """Receive what group index ``src`` sent with :func:`send_bytes`."""
    src_global = group.global_rank(src)
    pg = group.cpu_group

    def move(t: torch.Tensor) -> None:
        dist.recv(t, src=src_global, group=pg)

    def status(failure: BaseException | None) -> None:
        send_bytes(group, b"", src, error=failure, what=what)  # raises on failure

    return unframe(_receive(move, status, group, what), group, what)


def _unframe_all(messages: list[bytes], group: Group, what: str) -> list[bytes]:
    failures = [m for m in messages if m[:1] != bytes([_OK])]  # a truncated one is corrupt
    if failures:
        unframe(failures[0], group, what)
    return [unframe(m, group, what) for m in messages]


def allocated(
    group: Group, nbytes: int, make: Callable[[], list[torch.Tensor]], what: str
) -> list[torch.Tensor]:
    """``make()``'s buffers for a transfer of ``nbytes`` per rank, or raise on every rank.

    From :data:`STATUS_MIN_BYTES` on, a status all-reduce follows the
    allocation, so that a rank that could not allocate makes every rank raise
    before the transfer; below it, the failure (which does not realistically
    happen) raises on this rank only. All ranks must pass the same ``nbytes``.
    """
    buffers: list[torch.Tensor] = []
    failure: BaseException | None = None
    try:
        buffers = make()
    except Exception as exc:  # out of memory
        failure = exc
    if nbytes >= STATUS_MIN_BYTES:
        settle(group, failure, what=what)
    elif failure is not None:
        raise failure
    return buffers


@recorded("all_gather")
def all_gather_bytes(
    group: Group,
    payload: bytes | None,
    *,
    error: BaseException | None = None,
    what: str = "all_gather",
) -> list[bytes]:
    """Every rank's ``payload`` in group order, over the CPU group.

    One collective when every message fits the fixed first chunk, two
    otherwise (and a status all-reduce before rests of
    :data:`STATUS_MIN_BYTES` or more). A rank that passes ``error``, or cannot
    allocate the messages, makes every rank raise the same
    :class:`RemoteError`, naming the first failing rank.
    """
    message = frame(payload, error, group.rank)
    size, pg = FIRST_MESSAGE_BYTES, group.cpu_group
    firsts = [torch.empty(size, dtype=torch.uint8) for _ in group.ranks]
    dist.all_gather(firsts, tensor_of(message[:size], size), group=pg)
    lengths = [_HEADER.size + _HEADER.unpack(bytes_of(f, _HEADER.size))[1] for f in firsts]
    longest = max(lengths)
    if longest <= size:
        messages = [bytes_of(f, n) for f, n in zip(firsts, lengths, strict=True)]
    else:
        rest = longest - size

        def make() -> list[torch.Tensor]:
            mine = padded(message[size:], rest, group, what)
            return [mine, *(allocate(rest, group, what) for _ in group.ranks)]

        mine, *rests = allocated(group, rest, make, what)
        dist.all_gather(rests, mine, group=pg)
        messages = [
            bytes_of(f, min(n, size)) + (bytes_of(r, n - size) if n > size else b"")
            for f, r, n in zip(firsts, rests, lengths, strict=True)
        ]
    return _unframe_all(messages, group, what)


def exchange(
    group: Group,
    record: Any,
    *,
    error: BaseException | None = None,
    what: str = "metadata exchange",
) -> list[Any]:
    """All-gather a small plain-data ``record`` from every rank, as JSON (never pickle).

    ``record`` holds only what JSON carries (dicts with str keys, lists,
    str, int, float, bool, None); tuples arrive as lists. If it cannot be
    encoded on some rank, or a rank passes ``error`` (a local failure, such as
    a bad argument), every rank raises the same :class:`RemoteError`; a
    record that does not decode raises :class:`~pdist.PdistError` on the
    receiver.
    """
    payload: bytes | None = None
    if error is None:
        try:
            payload = json.dumps(record, separators=(",", ":")).encode()
        except (TypeError, ValueError) as exc:
            error = exc
    out = []
    try:
        gathered = all_gather_bytes(group, payload, error=error, what=what)
    except RemoteError as exc:
        if error is not None:
            raise exc from error
        raise
    for rank, data in zip(group.ranks, gathered, strict=True):
        try:
            out.append(json.loads(data))
        except (UnicodeDecodeError, ValueError, RecursionError):  # RecursionError: nested deep
            msg = f"{what} on group {group.name!r}: rank {rank} sent a record that is not JSON"
            raise PdistError(msg) from None
    return out


@recorded("agree")
def agree(group: Group, digest: bytes) -> bool:
    """Whether every rank of ``group`` passed the same ``digest`` (one small all-reduce).

    Compares the first 63 bits: the maximum and the minimum over the group
    (``max(-h)``) are equal exactly when all agree. The CPU group carries it.

    .. note:: All ranks of the group must call it.
    """
    if group.world_size == 1:
        return True
    h = int.from_bytes(digest[:8], "little", signed=False) >> 1
    both = torch.tensor([h, -h], dtype=torch.int64)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group.cpu_group)
    return int(both[0]) == -int(both[1])


@recorded("settle")
def settle(group: Group, error: BaseException | None, *, what: str) -> None:
    """Every rank reports whether its local step failed; if one did, every rank raises.

    The status collective of the multi-step transfers: after the header went
    out and before buckets move, each rank passes the error of its local work
    (decoding, allocating, packing), or None. Costs one 8-byte all-reduce when
    all went well; otherwise the markers follow in an all-gather and every
    rank raises the same :class:`RemoteError`, naming the first failing rank.

    .. note:: All ranks of the group must call it.
    """
    if group.world_size == 1:
        reraise_own(error, group, what, group.rank)
        return
    flag = torch.tensor([0 if error is None else 1], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group.cpu_group)
    if int(flag[0]) == 0:
        return
    try:
        all_gather_bytes(group, None if error is not None else b"", error=error, what=what)
    except RemoteError as exc:
        if error is not None:
            raise exc from error
        raise
    # Only a peer that is not pdist raises the flag without sending a marker.
    msg = f"{what} on group {group.name!r}: a rank reported a failure but sent no error marker"
    raise PdistError(msg)
