"""Byte-level transport over a Group's CPU (gloo) group: the shared mechanics.

Everything that exchanges metadata or pickled payloads goes through here.
A message is a header (status, length) and a body; it travels as a fixed-size
first chunk plus, only when longer, the rest, so small messages take a single
collective. A rank that fails while preparing its part sends an error marker
instead of its payload: then every rank raises the same :class:`RemoteError`
(the failing one with its original error as the cause), and nobody waits.
"""

from __future__ import annotations

import ctypes
import pickle
import struct
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ._context import Group
from ._errors import PdistError

__all__ = [
    "FIRST_MESSAGE_BYTES",
    "RemoteError",
    "all_gather_bytes",
    "all_gather_into",
    "broadcast_bytes",
    "bytes_of",
    "exchange",
    "gather_bytes",
    "recv_bytes",
    "send_bytes",
    "tensor_of",
]

FIRST_MESSAGE_BYTES = 4096
"""Size of the fixed first chunk of a message: smaller messages take one collective."""

_HEADER = struct.Struct("<Bq")  # status, body length
_OK, _ERROR = 1, 2


class RemoteError(PdistError):
    """A rank failed while preparing its part of a collective; every rank raises this."""


def tensor_of(data: bytes | bytearray | memoryview, size: int | None = None) -> torch.Tensor:
    """A uint8 CPU tensor holding ``data``, zero-padded to ``size`` bytes."""
    n = len(data)
    out = torch.empty(max(n, size or 0), dtype=torch.uint8)
    if n:
        ctypes.memmove(out.data_ptr(), bytes(data), n)
    return out


def bytes_of(t: torch.Tensor, n: int | None = None, offset: int = 0) -> bytes:
    """``n`` bytes (default: all) of a contiguous CPU tensor, from byte ``offset``."""
    count = t.numel() * t.element_size() - offset if n is None else n
    if count <= 0:
        return b""
    return ctypes.string_at(t.data_ptr() + offset, count)


def all_gather_into(
    out: torch.Tensor, mine: torch.Tensor, pg: dist.ProcessGroup, *, async_op: bool = False
) -> Any:
    """All-gather ``mine`` from every rank into the contiguous ``out`` (rank-major).

    Returns the work handle when ``async_op``.
    """
    # torch 2.13 renamed all_gather_into_tensor (now deprecated) to all_gather_single.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(out, mine, group=pg, async_op=async_op)


def _frame(payload: bytes | None, error: BaseException | None, rank: int) -> bytes:
    if error is not None:
        body = pickle.dumps((rank, type(error).__name__, str(error)))
        return _HEADER.pack(_ERROR, len(body)) + body
    body = payload or b""
    return _HEADER.pack(_OK, len(body)) + body


def _failure(group: Group, what: str, rank: int, kind: str, text: str) -> RemoteError:
    return RemoteError(f"{what} on group {group.name!r} failed on rank {rank}: {kind}: {text}")


def _unframe(data: bytes, group: Group, what: str) -> bytes:
    """The body of a message, or raise the remote failure it carries."""
    status, length = _HEADER.unpack_from(data)
    body = data[_HEADER.size : _HEADER.size + length]
    if status == _ERROR:
        raise _failure(group, what, *pickle.loads(body))
    if status != _OK:
        msg = f"{what} on group {group.name!r}: corrupt message header (status {status})"
        raise PdistError(msg)
    return body


def _move(message: bytes | None, move: Callable[[torch.Tensor], object]) -> bytes:
    """Send (``message`` given) or receive (None) one framed message through ``move``."""
    size = FIRST_MESSAGE_BYTES
    if message is not None:
        move(tensor_of(message[:size], size))
        if len(message) > size:
            move(tensor_of(message[size:]))
        return message
    first = torch.empty(size, dtype=torch.uint8)
    move(first)
    _status, length = _HEADER.unpack(bytes_of(first, _HEADER.size))
    total = _HEADER.size + length
    if total <= size:
        return bytes_of(first, total)
    rest = torch.empty(total - size, dtype=torch.uint8)
    move(rest)
    return bytes_of(first) + bytes_of(rest)


def _reraise_own(error: BaseException | None, group: Group, what: str, rank: int) -> None:
    if error is not None:
        raise _failure(group, what, rank, type(error).__name__, str(error)) from error


def broadcast_bytes(
    group: Group,
    payload: bytes | None,
    src: int,
    *,
    error: BaseException | None = None,
    what: str = "broadcast",
) -> bytes:
    """Broadcast ``payload`` from group index ``src`` over the CPU group; returns it on every rank.

    One collective when the payload fits the first chunk, two otherwise. When
    the source passes ``error``, every rank raises the same :class:`RemoteError`.
    """
    src_global = group.global_rank(src)
    pg = group.cpu_group
    is_src = group.rank_in_group == src
    message = _frame(payload, error, group.rank) if is_src else None
    data = _move(message, lambda t: dist.broadcast(t, src=src_global, group=pg))
    if is_src:
        _reraise_own(error, group, what, group.rank)
    return _unframe(data, group, what)


def send_bytes(
    group: Group,
    payload: bytes | None,
    dst: int,
    *,
    error: BaseException | None = None,
    what: str = "send",
) -> None:
    """Send ``payload`` to group index ``dst`` (which calls :func:`recv_bytes`)."""
    dst_global = group.global_rank(dst, name="dst")
    pg = group.cpu_group
    _move(_frame(payload, error, group.rank), lambda t: dist.send(t, dst=dst_global, group=pg))
    _reraise_own(error, group, what, group.rank)


def recv_bytes(group: Group, src: int, *, what: str = "recv") -> bytes:
    """Receive what group index ``src`` sent with :func:`send_bytes`."""
    src_global = group.global_rank(src)
    pg = group.cpu_group
    data = _move(None, lambda t: dist.recv(t, src=src_global, group=pg))
    return _unframe(data, group, what)


def _exchange_sizes(group: Group, message: bytes) -> tuple[list[int], bool]:
    status = message[0]
    mine = torch.tensor([len(message), status], dtype=torch.int64)
    rows = [torch.empty(2, dtype=torch.int64) for _ in group.ranks]
    dist.all_gather(rows, mine, group=group.cpu_group)
    lengths = [int(r[0]) for r in rows]
    failed = any(int(r[1]) != _OK for r in rows)
    return lengths, failed


def _all_gather_messages(group: Group, message: bytes, lengths: list[int]) -> list[bytes]:
    longest = max(lengths)
    outs = [torch.empty(longest, dtype=torch.uint8) for _ in group.ranks]
    dist.all_gather(outs, tensor_of(message, longest), group=group.cpu_group)
    return [bytes_of(out, n) for out, n in zip(outs, lengths, strict=True)]


def _unframe_all(messages: list[bytes], group: Group, what: str) -> list[bytes]:
    failures = [m for m in messages if m[0] != _OK]
    if failures:
        _unframe(failures[0], group, what)
    return [_unframe(m, group, what) for m in messages]


def all_gather_bytes(
    group: Group,
    payload: bytes | None,
    *,
    error: BaseException | None = None,
    what: str = "all_gather",
) -> list[bytes]:
    """Every rank's ``payload`` in group order, over the CPU group.

    One collective when every message fits the fixed first chunk, two
    otherwise. A rank that passes ``error`` sends an error marker; then every
    rank raises the same :class:`RemoteError`, naming the first failing rank.
    """
    message = _frame(payload, error, group.rank)
    size, pg = FIRST_MESSAGE_BYTES, group.cpu_group
    firsts = [torch.empty(size, dtype=torch.uint8) for _ in group.ranks]
    dist.all_gather(firsts, tensor_of(message[:size], size), group=pg)
    lengths = [_HEADER.size + _HEADER.unpack(bytes_of(f, _HEADER.size))[1] for f in firsts]
    longest = max(lengths)
    if longest <= size:
        messages = [bytes_of(f, n) for f, n in zip(firsts, lengths, strict=True)]
    else:
        rests = [torch.empty(longest - size, dtype=torch.uint8) for _ in group.ranks]
        dist.all_gather(rests, tensor_of(message[size:], longest - size), group=pg)
        messages = [
            bytes_of(f, min(n, size)) + (bytes_of(r, n - size) if n > size else b"")
            for f, r, n in zip(firsts, rests, lengths, strict=True)
        ]
    return _unframe_all(messages, group, what)


def gather_bytes(
    group: Group,
    payload: bytes | None,
    dst: int,
    *,
    error: BaseException | None = None,
    what: str = "gather",
) -> list[bytes] | None:
    """Every rank's ``payload`` on group index ``dst`` (None elsewhere).

    The size exchange carries each rank's status, so when a rank passes
    ``error`` every rank switches to an all-gather and raises the same
    :class:`RemoteError`.
    """
    dst_global = group.global_rank(dst, name="dst")
    message = _frame(payload, error, group.rank)
    lengths, failed = _exchange_sizes(group, message)
    if failed:
        _unframe_all(_all_gather_messages(group, message, lengths), group, what)
    longest = max(lengths)
    mine = tensor_of(message, longest)
    if group.rank_in_group != dst:
        dist.gather(mine, None, dst=dst_global, group=group.cpu_group)
        return None
    outs = [torch.empty(longest, dtype=torch.uint8) for _ in group.ranks]
    dist.gather(mine, outs, dst=dst_global, group=group.cpu_group)
    messages = [bytes_of(out, n) for out, n in zip(outs, lengths, strict=True)]
    return _unframe_all(messages, group, what)


def exchange(group: Group, record: Any, *, what: str = "metadata exchange") -> list[Any]:
    """All-gather a small picklable ``record`` from every rank (pdist's own metadata only).

    If the record cannot be pickled on some rank, every rank raises.
    """
    try:
        payload: bytes | None = pickle.dumps(record, protocol=pickle.HIGHEST_PROTOCOL)
        error = None
    except Exception as exc:
        payload, error = None, exc
    return [pickle.loads(b) for b in all_gather_bytes(group, payload, error=error, what=what)]
