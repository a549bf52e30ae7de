"""Object gathers: every rank's skeleton in one message, tensors in one region per transport.

As with the broadcasts (``_objects``), the ranks agree that every one of them
could decode and allocate before any tensor moves. Each rank's tensors travel
as one aligned region per transport: when the ranks send about as much as each
other, one all-gather (or gather) of equal rows moves them all; otherwise each
rank with data sends its own region, so that one large rank does not make
every rank allocate world-size times its bytes.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from . import _agree, _wire
from ._buffers import ALIGN, allocate, bytes_of, filled, offsets
from ._compat import all_gather_into
from ._errors import PdistError
from ._group import DistContext, Group, as_group
from ._objects import DEFAULT_MIN_TENSOR_BYTES
from ._payload import (
    KINDS,
    Decoded,
    Encoded,
    bucket_count,
    decode,
    encode,
    receive_buffers,
    tensors_of,
    transport_device,
)
from ._serialize import Safe, loads, safe_or_error

__all__ = ["all_gather_object", "gather_object"]

_WHOLE = 1 << 62  # each rank's bytes of one transport travel as one region


def _encode_own(
    g: Group, obj: Any, safe: object
) -> tuple[Safe, Encoded | None, BaseException | None]:
    """This rank's part of a gather: one aligned bucket per transport, or its failure."""
    checked, error = safe_or_error(safe, g.rank)
    if error is not None:
        return checked, None, error
    try:
        encoded = encode(
            obj,
            g.device,
            min_tensor_bytes=DEFAULT_MIN_TENSOR_BYTES,
            bucket_bytes=_WHOLE,
            pad_to=ALIGN,
        )
    except Exception as exc:
        return checked, None, exc
    return checked, encoded, None


def _sizes(encoded: Encoded | Decoded | None) -> list[int]:
    """Bytes per transport kind (at most one bucket each in a gather)."""
    buckets = [] if encoded is None else encoded.buckets
    return [sum(b.nbytes for b in buckets if b.kind == kind) for kind in KINDS]


class _Regions:
    """Receive memory for one transport of a gather: one region per rank, in one allocation.

    When the ranks send about as much as each other (``even``) every region is
    a row of the largest size, so one all-gather (or gather) moves them all;
    otherwise regions are packed tight and each rank with data sends its own,
    so that one large rank does not make every rank allocate W times its size.
    """

    def __init__(self, sizes: list[int], device: torch.device, *, receiving: bool) -> None:
        self.sizes, self.top = sizes, max(sizes)
        self.even = 2 * sum(sizes) >= len(sizes) * self.top
        if self.even:
            self.starts, total = [r * self.top for r in range(len(sizes))], self.top * len(sizes)
        else:
            self.starts, total = offsets(sizes)
        self.out = allocate(total if receiving else 0, device, what="the gathered tensors")
        self.device = device

    def region(self, r: int) -> torch.Tensor:
        return self.out[self.starts[r] : self.starts[r] + self.sizes[r]]

    def row(self, r: int) -> torch.Tensor:
        return self.out[self.starts[r] : self.starts[r] + self.top]

    def send(self, me: int, encoded: Encoded | None, bucket: int | None) -> torch.Tensor:
        """This rank's bytes of the transport, where the gather sends them from.

        Packed straight into this rank's own region when it has one (its own
        entry is rebuilt from there), else into a buffer of the row's size; a
        lone tensor that fills its row travels from its own memory.
        """
        size, length = self.sizes[me], self.top if self.even else self.sizes[me]
        if bucket is not None and encoded is not None and size == length and encoded.lone(bucket):
            return encoded.pack(bucket)
        own = self.out.numel() > 0
        flat = (
            (self.row(me) if self.even else self.region(me))
            if own
            else allocate(length, self.device, what="a gather")
        )
        if bucket is not None and encoded is not None:
            encoded.fills[bucket].pack(flat[:size])
        flat[size:].zero_()
        return flat


def _bucket_of(encoded: Encoded | None, kind: str) -> int | None:
    if encoded is None:
        return None
    return next((i for i, b in enumerate(encoded.buckets) if b.kind == kind), None)


def _prepare(
    g: Group,
    sizes: list[list[int]],
    decodeds: list[Decoded],
    encoded: Encoded | None,
    receiving: bool,
) -> tuple[dict[str, _Regions], list[list[torch.Tensor]], dict[str, torch.Tensor]]:
    """Regions per transport, every rank's tensors as views of them, and this rank's sends."""
    regions = {
        kind: _Regions([s[k] for s in sizes], transport_device(kind, g.device), receiving=receiving)
        for k, kind in enumerate(KINDS)
        if max(s[k] for s in sizes)
    }
    views = [
        tensors_of(d, [regions[b.kind].region(r) for b in d.buckets], g.device)
        for r, d in enumerate(decodeds)
    ]
    sends = {
        kind: reg.send(g.rank_in_group, encoded, _bucket_of(encoded, kind))
        for kind, reg in regions.items()
    }
    return regions, views, sends


def _rebuilt(
    g: Group, decodeds: list[Decoded], views: list[list[torch.Tensor]], safe: Safe
) -> list[Any]:
    me = g.rank_in_group
    return [
        loads(d.skeleton, v, d.storage, safe=False if r == me else safe)
        for r, (d, v) in enumerate(zip(decodeds, views, strict=True))
    ]


def all_gather_object(group: Group | DistContext, obj: Any, *, safe: Safe = False) -> list[Any]:
    """Every rank's ``obj``, in group order, on every rank.

    Dense tensors travel as tensors (one all-gather per transport, whatever
    their number) and land on the receiver's device. As with torch, every
    entry is a copy, the caller's own included.

    .. note:: All ranks of the group must call it.

    Args:
        group: The group (a context means its world).
        obj: This rank's picklable object.
        safe: Unpickle the other ranks' objects through an allow-list (see
            :func:`~pdist.broadcast_object`).

    Returns:
        ``[object of group index 0, object of group index 1, ...]``.

    Raises:
        PdistError: On every rank, if some rank cannot pickle its object or
            passes a bad argument (also a ``TypeError`` then), naming it; on a
            rank that refuses or cannot rebuild another's object.
    """
    g = as_group(group)
    what = "all_gather_object"
    safe, encoded, error = _encode_own(g, obj, safe)
    if g.world_size == 1:
        if error is not None:
            raise error
        assert encoded is not None
        return [_local_copy(g, encoded)]
    bodies = _wire.all_gather_bytes(
        g, None if encoded is None else encoded.body, error=error, what=what
    )
    sources = [f"rank {r}" for r in g.ranks]
    counts = [bucket_count(b, source=s) for b, s in zip(bodies, sources, strict=True)]
    failure: BaseException | None = None
    decodeds: list[Decoded] = []
    regions: dict[str, _Regions] = {}
    views: list[list[torch.Tensor]] = []
    sends: dict[str, torch.Tensor] = {}
    try:
        decodeds = [decode(b, source=s) for b, s in zip(bodies, sources, strict=True)]
        regions, views, sends = _prepare(g, [_sizes(d) for d in decodeds], decodeds, encoded, True)
    except Exception as exc:
        failure = exc
    _agree.settle(g, failure, together=any(counts), what=what)
    works = []
    for kind, reg in regions.items():
        pg = g.transport(kind)
        if reg.even:
            works.append(all_gather_into(reg.out, sends[kind], pg, async_op=True))
            continue
        works += [
            dist.broadcast(reg.region(r), src=g.ranks[r], group=pg, async_op=True)
            for r, size in enumerate(reg.sizes)
            if size
        ]
    for work in works:
        work.wait()
    return _rebuilt(g, decodeds, views, safe)


def _local_copy(g: Group, encoded: Encoded) -> Any:
    """The object rebuilt from its own encoding: what a one-rank gather returns (a copy)."""
    decoded = decode(encoded.body)
    buckets = receive_buffers(decoded, g.device)
    for i, flat in enumerate(buckets):
        encoded.fills[i].pack(flat)
    return loads(decoded.skeleton, tensors_of(decoded, buckets, g.device), decoded.storage)


def _gather_bodies(
    g: Group, encoded: Encoded | None, error: BaseException | None, dst_global: int, what: str
) -> tuple[list[list[int]], list[bytes]]:
    """Every rank's size record, and (on the destination) every body: two collectives.

    One fixed-size record per rank (failed, body length, bytes per transport)
    goes to every rank; a failure there raises everywhere. Then the bodies,
    padded to the longest, are gathered to the destination.
    """
    body = b"" if encoded is None else encoded.body
    mine = torch.tensor([int(error is not None), len(body), *_sizes(encoded)], dtype=torch.int64)
    rows = [torch.empty(4, dtype=torch.int64) for _ in g.ranks]
    dist.all_gather(rows, mine, group=g.cpu_group)
    records = [r.tolist() for r in rows]
    if any(rec[0] for rec in records):
        _agree.spread(g, error, what=what)
    if any(min(rec[1:]) < 0 or rec[1] == 0 for rec in records):
        msg = f"{what} on group {g.name!r}: a rank sent a corrupt size record {records}"
        raise PdistError(msg)
    longest, is_dst = max(rec[1] for rec in records), g.rank == dst_global
    padded, outs, failure = torch.empty(0, dtype=torch.uint8), [], None
    try:
        padded = filled(body, longest, what=what)
        outs = [allocate(longest, what=what) for _ in g.ranks] if is_dst else []
    except PdistError as exc:
        failure = exc
    _agree.settle(g, failure, together=longest >= _wire.STATUS_MIN_BYTES, what=what)
    dist.gather(padded, outs if is_dst else None, dst=dst_global, group=g.cpu_group)
    return records, [bytes_of(out, rec[1]) for out, rec in zip(outs, records, strict=False)]


def gather_object(
    group: Group | DistContext, obj: Any, dst: int = 0, *, safe: Safe = False
) -> list[Any] | None:
    """Every rank's ``obj`` in group order on group index ``dst``; None elsewhere.

    Dense tensors travel as tensors (one gather per transport); as with
    torch, the destination's own entry is a copy.

    .. note:: All ranks of the group must call it.

    Args:
        group: The group (a context means its world).
        obj: This rank's picklable object.
        dst: Group index of the destination (the same valid index on every rank).
        safe: Destination only: unpickle through an allow-list (see
            :func:`~pdist.broadcast_object`).

    Returns:
        On ``dst``, ``[object of group index 0, ...]``; None on the other ranks.

    Raises:
        PdistError: On every rank, if some rank cannot pickle its object or
            passes a bad argument, naming it; on ``dst``, if it refuses or
            cannot rebuild an object.
    """
    g = as_group(group)
    what = "gather_object"
    dst_global = g.global_rank(dst, name="dst")
    safe, encoded, error = _encode_own(g, obj, safe)
    if g.world_size == 1:
        if error is not None:
            raise error
        assert encoded is not None
        return [_local_copy(g, encoded)]
    records, bodies = _gather_bodies(g, encoded, error, dst_global, what)
    is_dst = g.rank_in_group == dst
    failure: BaseException | None = None
    decodeds: list[Decoded] = []
    regions: dict[str, _Regions] = {}
    views: list[list[torch.Tensor]] = []
    sends: dict[str, torch.Tensor] = {}
    try:
        for r, body in enumerate(bodies):
            decoded = decode(body, source=f"rank {g.ranks[r]}")
            if _sizes(decoded) != records[r][2:]:
                msg = f"rank {g.ranks[r]} sent a payload whose buckets differ from its size record"
                raise PdistError(msg)
            decodeds.append(decoded)
        regions, views, sends = _prepare(g, [rec[2:] for rec in records], decodeds, encoded, is_dst)
    except Exception as exc:
        failure = exc
    _agree.settle(g, failure, together=any(rec[2] or rec[3] for rec in records), what=what)
    for work in _gather_regions(g, regions, sends, dst_global, is_dst):
        work.wait()
    return _rebuilt(g, decodeds, views, safe) if is_dst else None


def _gather_regions(
    g: Group, regions: dict[str, _Regions], sends: dict[str, torch.Tensor], dst: int, is_dst: bool
) -> list[Any]:
    works: list[Any] = []
    me = g.rank_in_group
    for kind, reg in regions.items():
        pg = g.transport(kind)
        if reg.even:
            rows = [reg.row(r) for r in range(g.world_size)] if is_dst else None
            works.append(dist.gather(sends[kind], rows, dst=dst, group=pg, async_op=True))
        elif is_dst:
            works += [
                dist.irecv(reg.region(r), src=g.ranks[r], group=pg)
                for r, size in enumerate(reg.sizes)
                if size and r != me
            ]
        elif reg.sizes[me]:
            works.append(dist.isend(sends[kind], dst=dst, group=pg))
    return works
