"""Framed bytes over a Group's CPU (gloo) group: the transport of metadata and skeletons.

A message is a header (status, body length) and a body: a payload, or an error
marker (``_errors``) on which every receiver raises the same error. It travels
as a fixed-size first chunk plus, only when longer, the rest; before a rest of
``STATUS_MIN_BYTES`` or more every receiver reports whether it could allocate
it, so that one out of memory makes every rank raise instead of leaving the sender waiting.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from . import _agree, _plain, _rooted, _seams
from ._buffers import allocate, bytes_of, filled
from ._departures import naming
from ._errors import ERROR, HEADER, OK, PdistError, encode_marker
from ._group import Group
from ._inflight import recorded

__all__ = [
    "FIRST_MESSAGE_BYTES",
    "STATUS_MIN_BYTES",
    "all_gather_bytes",
    "broadcast_bytes",
    "exchange",
    "frame",
    "gather_bytes",
    "recv_bytes",
    "reserve",
    "send_bytes",
    "unframe",
]

FIRST_MESSAGE_BYTES = 4096  # the fixed first chunk of a message: smaller ones take one collective
STATUS_MIN_BYTES = 1 << 20  # a rest this large moves only once every receiver has allocated it

Move = Callable[[torch.Tensor], object]
Report = Callable[[BaseException | None], object]
T = TypeVar("T")


def frame(payload: bytes | None, error: BaseException | None, rank: int) -> bytes:
    """A message: header and ``payload``, or an error marker when ``error`` is given."""
    body = encode_marker(rank, error) if error is not None else payload or b""
    message = HEADER.pack(ERROR if error is not None else OK, len(body)) + body
    return _seams.outgoing(message)


def unframe(data: bytes, group: Group, what: str, own: BaseException | None = None) -> bytes:
    """The body of a message, or raise the failure it carries (``own``: this rank's error)."""
    if len(data) < HEADER.size:
        msg = f"{what} on group {group.name!r}: a peer sent a truncated message"
        raise PdistError(msg)
    status, length = HEADER.unpack_from(data)
    body = data[HEADER.size : HEADER.size + length]
    if length < 0 or len(body) != length:
        msg = f"{what} on group {group.name!r}: corrupt message header (length {length})"
        raise PdistError(msg)
    if status == ERROR:
        _agree.raise_marker(group, what, body, own)
    if status != OK:
        msg = f"{what} on group {group.name!r}: corrupt message header (status {status})"
        raise PdistError(msg)
    return body


def _send(
    message: bytes, group: Group, move: Move, status: Callable[[], object], what: str
) -> None:
    """Send ``message``; when its rest cannot be allocated, an error marker, then raise."""
    size = FIRST_MESSAGE_BYTES
    first, rest, failure = filled(message[:size], size, what=None), None, None
    if len(message) > size:
        try:
            rest = filled(message[size:], what=what)
        except Exception as exc:
            marker = encode_marker(group.rank, exc)[: size - HEADER.size]  # the first chunk alone
            message = _seams.outgoing(HEADER.pack(ERROR, len(marker)) + marker)
            first, failure = filled(message[:size], size, what=None), exc
    move(first)
    if rest is not None:
        if rest.numel() >= STATUS_MIN_BYTES:
            status()
        move(rest)
    if failure is not None:
        _agree.raise_own(group, failure, what, wrap_pdist=True)


def reserve(make: Callable[[], T], nbytes: int, report: Report) -> T:
    """``make()`` (an allocation); from ``STATUS_MIN_BYTES`` on, ``report`` tells the peers."""
    failure: PdistError | None = None
    try:
        made = make()
    except PdistError as exc:
        failure = exc
    if nbytes >= STATUS_MIN_BYTES:
        report(failure)
    if failure is not None:
        raise failure
    return made


def _receive(group: Group, move: Move, report: Report, what: str) -> bytes:
    """One framed message through ``move``; ``report`` tells whether this rank allocated it."""
    size = FIRST_MESSAGE_BYTES
    first = torch.empty(size, dtype=torch.uint8)
    move(first)
    total = HEADER.size + HEADER.unpack(bytes_of(first, HEADER.size))[1]
    if total <= size:
        return bytes_of(first, total)  # a negative length gives a truncated message
    rest = reserve(lambda: allocate(total - size, what=what), total - size, report)
    move(rest)
    return bytes_of(first) + bytes_of(rest)


def _named(group: Group, what: str, move: Callable[..., object], **where: Any) -> Move:
    """``move`` with ``where`` bound, whose failure names the rank that left, if known."""

    def named(t: torch.Tensor) -> object:
        with naming(group, what):
            return move(t, **where)

    return named


@recorded("broadcast")
def broadcast_bytes(
    group: Group, payload: bytes | None, src: int, *, error: BaseException | None = None, what: str
) -> bytes:
    """Broadcast ``payload`` (or the source's ``error``) from group index ``src`` to every rank."""
    group.global_rank(src)
    move = _named(group, what, _rooted.broadcast_from, pg=group.cpu_group, index=src)
    if group.rank_in_group == src:
        message = frame(payload, error, group.rank)
        _send(message, group, move, lambda: _agree.status(group, None, what=what), what)
        return unframe(message, group, what, own=error)
    data = _receive(group, move, lambda failure: _agree.status(group, failure, what=what), what)
    return unframe(data, group, what)


@recorded("send", p2p=True)
def send_bytes(
    group: Group, payload: bytes | None, dst: int, *, error: BaseException | None = None, what: str
) -> None:
    """Send ``payload`` (or ``error``) to group index ``dst``, which calls ``recv_bytes``."""
    group.global_rank(dst, name="dst")
    move = _named(group, what, _rooted.send_to, pg=group.cpu_group, index=dst)
    message = frame(payload, error, group.rank)
    _send(message, group, move, lambda: _agree.recv_status(group, dst, what=what), what)
    unframe(message, group, what, own=error)


@recorded("recv", p2p=True)
def recv_bytes(group: Group, src: int, *, what: str) -> bytes:
    """Receive what group index ``src`` sent with ``send_bytes``."""
    group.global_rank(src)
    move = _named(group, what, _rooted.recv_from, pg=group.cpu_group, index=src)
    data = _receive(
        group, move, lambda failure: _agree.send_status(group, src, failure, what=what), what
    )
    return unframe(data, group, what)


@recorded("all_gather")
def all_gather_bytes(
    group: Group, payload: bytes | None, *, error: BaseException | None = None, what: str
) -> list[bytes]:
    """Every rank's ``payload`` in group order; a rank's ``error`` raises on every rank."""
    message = frame(payload, error, group.rank)
    size, pg = FIRST_MESSAGE_BYTES, group.cpu_group
    firsts = [torch.empty(size, dtype=torch.uint8) for _ in group.ranks]
    first = filled(message[:size], size, what=None)
    with naming(group, what):
        dist.all_gather(firsts, first, group=pg)
    lengths = [HEADER.size + HEADER.unpack(bytes_of(f, HEADER.size))[1] for f in firsts]
    rest = max(lengths) - size
    rests: list[torch.Tensor] = []
    if rest > 0:  # every rank's rest, padded to the longest
        mine, *rests = reserve(
            lambda: (
                [filled(message[size:], rest, what=what)]
                + [allocate(rest, what=what) for _ in group.ranks]
            ),
            rest,
            lambda failure: _agree.status(group, failure, what=what),
        )
        with naming(group, what):
            dist.all_gather(rests, mine, group=pg)
    messages = [
        bytes_of(f, min(n, size)) + (bytes_of(rests[r], n - size) if n > size else b"")
        for r, (f, n) in enumerate(zip(firsts, lengths, strict=True))
    ]
    for m in sorted(messages, key=lambda m: m[:1] == bytes([OK])):  # failures first
        unframe(m, group, what, own=error)
    return [m[HEADER.size :] for m in messages]


def gather_bytes(
    group: Group,
    payload: bytes | None,
    dst: int,
    *,
    error: BaseException | None = None,
    record: Sequence[int] = (),
    what: str,
) -> tuple[list[list[int]], list[bytes]]:
    """Every rank's ``record`` (ints, one length everywhere) on every rank; payloads on ``dst``.

    One all-gather of int64 rows carries each rank's failure flag, payload length and
    ``record``, so that a rank's ``error`` raises on every rank before the payloads move
    (``_agree.raise_agreed``); then one gather of rows of the longest length. Elsewhere
    than ``dst`` the payload list is empty.
    """
    body = payload or b""
    mine = torch.tensor([int(error is not None), len(body), *record], dtype=torch.int64)
    rows = [torch.empty(mine.numel(), dtype=torch.int64) for _ in group.ranks]
    with naming(group, what):
        dist.all_gather(rows, mine, group=group.cpu_group)
    records = [r.tolist() for r in rows]
    if any(rec[0] for rec in records):
        _agree.raise_agreed(group, error, what=what)
    if any(min(rec[1:], default=0) < 0 or rec[1] == 0 for rec in records):
        msg = f"{what} on group {group.name!r}: a rank sent a corrupt size record {records}"
        raise PdistError(msg)
    longest, is_dst = max(rec[1] for rec in records), group.rank_in_group == dst
    buffers = reserve(
        lambda: [
            filled(body, longest, what=what),
            *([allocate(longest, what=what) for _ in group.ranks] if is_dst else []),
        ],
        longest,
        lambda failure: _agree.status(group, failure, what=what),
    )
    with naming(group, what):
        _rooted.gather_to(buffers[0], buffers[1:] if is_dst else None, group.cpu_group, dst)
    bodies = [bytes_of(out, rec[1]) for out, rec in zip(buffers[1:], records, strict=False)]
    return [rec[2:] for rec in records], bodies


def exchange(
    group: Group, record: Any, *, error: BaseException | None = None, what: str
) -> list[Any]:
    """Every rank's small plain-data ``record``, as JSON; a rank's ``error`` raises on all."""
    payload: bytes | None = None
    if error is None:
        try:
            payload = json.dumps(record, separators=(",", ":")).encode()
        except (TypeError, ValueError) as exc:
            error = exc
    gathered = all_gather_bytes(group, payload, error=error, what=what)
    out = []
    for rank, data in zip(group.ranks, gathered, strict=True):
        try:
            out.append(_plain.loads(data))
        except (UnicodeDecodeError, ValueError):
            msg = f"{what} on group {group.name!r}: rank {rank} sent a record that is not JSON"
            raise PdistError(msg) from None
    return out
