"""Fail together: the primitives every feature builds on, written once.

Every feature that crosses ranks checks locally, then the ranks agree that they
can go on, then data moves. ``status`` is one small all-gather over the CPU
group: when a rank failed, every rank raises the same error naming it, so nobody
is left waiting in the transfer that would have followed; with a summary it
also compares a digest. ``send_status`` and ``recv_status`` do the same for the
two ends of a point-to-point transfer, and ``exchange_counts`` for an all-to-all of small
records (counts) that a failure rides on. Once every rank knows that some rank
failed, ``raise_agreed`` exchanges the failures and raises the same error
everywhere. Failures travel as fixed-size marker slots.
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable, Mapping, Sequence
from typing import NoReturn, cast

import torch
import torch.distributed as dist

from . import _rooted
from ._buffers import bytes_of, filled
from ._departures import naming
from ._errors import (
    ERROR,
    HEADER,
    OK,
    PdistError,
    RankMismatchError,
    decode_marker,
    encode_marker,
    failure,
    kind_name,
)
from ._group import Group
from ._inflight import recorded

__all__ = [
    "agree",
    "check_same",
    "exchange_counts",
    "first_failing",
    "raise_agreed",
    "raise_marker",
    "raise_own",
    "ranks_by_value",
    "recv_status",
    "send_status",
    "status",
]

_SLOT = 4096  # bytes per rank of a failure: a framed message's first chunk (``_wire``)
_SUMMARY = 512  # bytes per rank of a summary shown in a mismatch message


def _raise_failure(
    group: Group, what: str, rank: int, kind: str, text: str, own: BaseException | None
) -> NoReturn:
    """Raise the error of a failure on ``rank`` (``own``: this rank's error, if it failed).

    A rank's own failure comes first: a rank that failed too raises its own error, as
    it would alone, and only a rank that did not fail raises the one that names ``rank``.
    """
    if own is not None:
        rank, kind, text = group.rank, kind_name(own), str(own)
    message = f"{what} on group {group.name!r} failed on rank {rank}: {kind}: {text}"
    error = failure(message, kind, own)
    raise error from error.__cause__  # the failing rank's own error; None for the peers


def raise_marker(group: Group, what: str, body: bytes, own: BaseException | None) -> NoReturn:
    """Raise the failure an error marker ``body`` from a peer carries."""
    found = decode_marker(body, group.ranks)
    if found is None:
        msg = f"{what} on group {group.name!r}: a peer sent a malformed error marker"
        raise PdistError(msg)
    _raise_failure(group, what, *found, own=own)


def _slot(rank: int, error: BaseException | None) -> torch.Tensor:
    """A rank's fixed-size slot: a framed message (``_wire``), empty or an error marker."""
    marker = b"" if error is None else encode_marker(rank, error)[: _SLOT - HEADER.size]
    return filled(
        HEADER.pack(OK if error is None else ERROR, len(marker)) + marker, _SLOT, what=None
    )


def _raise_from_slots(
    group: Group, slots: list[torch.Tensor], error: BaseException | None, what: str
) -> NoReturn:
    for slot in slots:
        status, length = HEADER.unpack(bytes_of(slot, HEADER.size))
        if status == ERROR:
            body = bytes_of(slot, min(max(length, 0), _SLOT - HEADER.size), HEADER.size)
            raise_marker(group, what, body, error)
    # Only a peer that is not pdist raises the flag without sending a marker.
    msg = f"{what} on group {group.name!r}: a rank reported a failure but sent no error marker"
    raise PdistError(msg)


@recorded("status")
def status(
    group: Group, error: BaseException | None, *, what: str, summary: str | bytes | None = None
) -> bool:
    """Every rank reports its ``error``, and all raise if one failed; True: same ``summary``."""
    if group.world_size == 1:
        if error is not None:
            raise_own(group, error, what, wrap_pdist=True)
        return True
    h = 0
    if summary is not None:  # 63 bits: fits an int64
        data = summary.encode() if isinstance(summary, str) else summary
        h = int.from_bytes(hashlib.sha256(data).digest()[:8], "little") >> 1
    # An all-gather, not an all-reduce: gloo's small all-gather takes half the time.
    rows = [torch.empty(2, dtype=torch.int64) for _ in group.ranks]
    mine = torch.tensor([0 if error is None else 1, h], dtype=torch.int64)
    with naming(group, what):
        dist.all_gather(rows, mine, group=group.cpu_group)
    if any(int(r[0]) for r in rows):
        raise_agreed(group, error, what=what)
    return all(int(r[1]) == h for r in rows)


def raise_agreed(group: Group, error: BaseException | None, *, what: str) -> NoReturn:
    """Once every rank knows that some rank failed: exchange the failures, raise the first."""
    slots = [torch.empty(_SLOT, dtype=torch.uint8) for _ in group.ranks]
    with naming(group, what):
        dist.all_gather(slots, _slot(group.rank, error), group=group.cpu_group)
    _raise_from_slots(group, slots, error, what)


def raise_own(
    group: Group, error: BaseException, what: str, *, wrap_pdist: bool = False
) -> NoReturn:
    """Raise this rank's failure as the peers would (a PdistError as is, unless ``wrap_pdist``)."""
    if isinstance(error, PdistError) and not wrap_pdist:
        raise error
    _raise_failure(group, what, group.rank, kind_name(error), str(error), error)


def send_status(group: Group, peer: int, error: BaseException | None, *, what: str) -> None:
    """Tell group index ``peer`` (in ``recv_status``) whether this end can go on; raises if not."""
    with naming(group, what):
        _rooted.send_to(_slot(group.rank, error), group.cpu_group, peer)
    if error is not None:
        raise_own(group, error, what, wrap_pdist=True)


def recv_status(group: Group, peer: int, *, what: str) -> None:
    """Learn from group index ``peer`` (``send_status``) whether it could go on; raises if not."""
    slot = torch.empty(_SLOT, dtype=torch.uint8)
    with naming(group, what):
        _rooted.recv_from(slot, group.cpu_group, peer)
    if int(slot[0]) != OK:
        _raise_from_slots(group, [slot], None, what)


def agree(group: Group, summary: str | bytes) -> list[str] | None:
    """None if every rank passed the same ``summary``, else every rank's (only then they travel)."""
    if status(group, None, what="agree", summary=summary):
        return None
    data = summary.encode() if isinstance(summary, str) else summary
    rows = [torch.empty(_SUMMARY, dtype=torch.uint8) for _ in group.ranks]
    dist.all_gather(rows, filled(data[:_SUMMARY], _SUMMARY, what=None), group=group.cpu_group)
    return [bytes_of(r).rstrip(b"\0").decode(errors="replace") for r in rows]


def exchange_counts(
    group: Group,
    records: Sequence[Sequence[int]] | None,
    error: BaseException | None,
    *,
    width: int,
    what: str,
) -> list[list[int]]:
    """Send ``records[j]`` (``width`` ints) to group index ``j``; get what each rank sent here.

    One ``all_to_all_single`` of int64 over the CPU group. A rank with an
    ``error`` (``records`` None) sends a marker row instead: then every rank
    raises that rank's error, the same everywhere. All ranks must pass records
    of one width (or None with an error).
    """
    p = group.world_size
    if error is not None or records is None:
        # The marker: a status of -1, as wide as the others' records (the widths agree).
        send = torch.full((p, width + 1), -1, dtype=torch.int64)
    else:
        send = torch.tensor([[0, *r] for r in records], dtype=torch.int64).view(p, width + 1)
    if p == 1:
        if error is not None:
            raise_own(group, error, what, wrap_pdist=True)
        return [list(r) for r in records] if records is not None else []
    recv = torch.empty_like(send)
    with naming(group, what):  # a peer gone here is named
        dist.all_to_all_single(recv, send, group=group.cpu_group)
    if bool((recv[:, 0] < 0).any()):
        raise_agreed(group, error, what=what)  # every rank raises the first failing rank's error
    return cast("list[list[int]]", recv[:, 1:].tolist())


def ranks_by_value(values: Mapping[int, Hashable], *, value_first: bool = True) -> str:
    """``"a on ranks [0, 2]; b on rank 1"`` (or ``"ranks [0, 2]: a; ranks [1]: b"``)."""
    by_value: dict[Hashable, list[int]] = {}
    for rank, value in values.items():
        by_value.setdefault(value, []).append(rank)
    if not value_first:
        return "; ".join(f"ranks {ranks}: {value}" for value, ranks in by_value.items())
    return "; ".join(
        f"{value} on rank{'s' if len(r) > 1 else ''} {r if len(r) > 1 else r[0]}"
        for value, r in by_value.items()
    )


def check_same(group: Group, what: str, summary: str, error: BaseException | None) -> None:
    """Raise on every rank, alike, unless all passed the same ``summary`` and no ``error``."""
    text = f"{kind_name(error)}: {error}" if error is not None else summary
    summaries = agree(group, text)
    if summaries is not None:
        parts = ranks_by_value(dict(zip(group.ranks, summaries, strict=True)), value_first=False)
        msg = f"{what}: ranks passed different arguments; {parts}"
        raise RankMismatchError(msg)
    if error is not None:
        raise type(error)(f"{what}: {error}")


def first_failing(group: Group, failed: bool) -> int | None:
    """The lowest group index whose rank passed ``failed``, agreed in one all-reduce (or None)."""
    if group.world_size == 1:
        return group.rank_in_group if failed else None
    n = group.world_size
    flag = torch.tensor([n - 1 - group.rank_in_group if failed else -1], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group.cpu_group)
    worst = int(flag.item())
    return None if worst < 0 else n - 1 - worst
