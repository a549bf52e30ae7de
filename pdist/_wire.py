"""Byte-level transport over a Group's CPU (gloo) group: the shared mechanics.

Everything that exchanges metadata or pickled payloads goes through here:
fixed-size first messages, length-prefixed byte exchanges and the error
marker that lets a failing source make every receiver raise too.
"""

from __future__ import annotations

import ctypes
import pickle
import struct
from typing import Any

import torch
import torch.distributed as dist

from ._context import Group
from ._errors import PdistError

__all__ = [
    "FIRST_MESSAGE_BYTES",
    "RemoteError",
    "all_gather_bytes",
    "broadcast_bytes",
    "bytes_of",
    "exchange",
    "tensor_of",
]

FIRST_MESSAGE_BYTES = 4096
"""Size of the fixed first message of a broadcast: small payloads need one collective."""

_HEADER = struct.Struct("<Bq")  # status, payload length
_OK, _ERROR = 1, 2


class RemoteError(PdistError):
    """Another rank failed while preparing its part of a collective; this rank raises too."""


def tensor_of(data: bytes | bytearray | memoryview, size: int | None = None) -> torch.Tensor:
    """A uint8 CPU tensor holding ``data``, zero-padded to ``size`` bytes."""
    n = len(data)
    out = torch.zeros(max(n, size or 0), dtype=torch.uint8)
    if n:
        ctypes.memmove(out.data_ptr(), bytes(data), n)
    return out


def bytes_of(t: torch.Tensor, n: int | None = None, offset: int = 0) -> bytes:
    """The first ``n`` bytes (default: all) of a contiguous CPU tensor, from ``offset``."""
    count = t.numel() * t.element_size() - offset if n is None else n
    if count <= 0:
        return b""
    return ctypes.string_at(t.data_ptr() + offset, count)


def _pack(status: int, payload: bytes) -> bytes:
    return _HEADER.pack(status, len(payload)) + payload


def error_payload(rank: int, exc: BaseException) -> bytes:
    """The error marker a failing rank sends instead of its payload."""
    return _pack(_ERROR, pickle.dumps((rank, type(exc).__name__, str(exc))))


def _unpack(data: bytes, group: Group, what: str) -> bytes:
    status, length = _HEADER.unpack_from(data)
    body = data[_HEADER.size : _HEADER.size + length]
    if status == _ERROR:
        rank, kind, text = pickle.loads(body)
        msg = f"{what} on group {group.name!r} failed on rank {rank}: {kind}: {text}"
        raise RemoteError(msg)
    if status != _OK:
        msg = f"{what} on group {group.name!r}: corrupt message header (status {status})"
        raise PdistError(msg)
    return body


def broadcast_bytes(
    group: Group,
    payload: bytes | None,
    src: int,
    *,
    error: BaseException | None = None,
    what: str = "broadcast",
) -> bytes:
    """Broadcast ``payload`` from group index ``src`` over the CPU group.

    A payload that fits the fixed first message takes one collective; a longer
    one takes a second for the rest. When ``error`` is given on the source,
    the receivers get an error marker and raise :class:`RemoteError`, and the
    source re-raises ``error`` after sending it.
    """
    src_global = group.global_rank(src)
    pg = group.cpu_group
    is_src = group.rank_in_group == src
    if is_src:
        if error is not None:
            message = error_payload(group.rank, error)
        else:
            assert payload is not None
            message = _pack(_OK, payload)
        first = tensor_of(message[:FIRST_MESSAGE_BYTES], FIRST_MESSAGE_BYTES)
    else:
        first = torch.empty(FIRST_MESSAGE_BYTES, dtype=torch.uint8)
    dist.broadcast(first, src=src_global, group=pg)
    head = bytes_of(first, _HEADER.size)
    _status, length = _HEADER.unpack(head)
    total = _HEADER.size + length
    if total > FIRST_MESSAGE_BYTES:
        if is_src:
            rest = tensor_of(message[FIRST_MESSAGE_BYTES:])
        else:
            rest = torch.empty(total - FIRST_MESSAGE_BYTES, dtype=torch.uint8)
        dist.broadcast(rest, src=src_global, group=pg)
        data = bytes_of(first) + bytes_of(rest)
    else:
        data = bytes_of(first, total)
    if is_src and error is not None:
        raise error
    return _unpack(data, group, what)


def all_gather_bytes(
    group: Group,
    payload: bytes | None,
    *,
    error: BaseException | None = None,
    what: str = "all_gather",
) -> list[bytes]:
    """Every rank's ``payload`` in group order (two collectives on the CPU group).

    A rank that passes ``error`` sends an error marker; then every rank raises
    (the failing rank its own ``error``, the others :class:`RemoteError`).
    """
    message = error_payload(group.rank, error) if error is not None else _pack(_OK, payload or b"")
    pg = group.cpu_group
    size = torch.tensor([len(message)], dtype=torch.int64)
    sizes = [torch.empty(1, dtype=torch.int64) for _ in group.ranks]
    dist.all_gather(sizes, size, group=pg)
    lengths = [int(s.item()) for s in sizes]
    longest = max(lengths)
    mine = tensor_of(message, longest)
    outs = [torch.empty(longest, dtype=torch.uint8) for _ in group.ranks]
    dist.all_gather(outs, mine, group=pg)
    if error is not None:
        raise error
    failures: list[RemoteError] = []
    results: list[bytes] = []
    for out, n in zip(outs, lengths, strict=False):
        try:
            results.append(_unpack(bytes_of(out, n), group, what))
        except RemoteError as exc:
            failures.append(exc)
    if failures:
        raise failures[0]
    return results


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
