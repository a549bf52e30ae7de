"""Object gathers: every rank's skeleton in one message, tensors in one region per transport.

The ranks agree that every one could decode and allocate before any tensor
moves. When the ranks send about as much as each other, one all-gather (or
gather) of equal rows moves every rank's region; otherwise each rank sends its
own, so that one large rank does not make every rank allocate W times its bytes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from . import _agree, _check, _payload, _rooted, _wire
from ._buffers import ALIGN, allocate, bytes_of, filled, offsets
from ._compat import all_gather_into
from ._departures import naming, wait_all
from ._errors import PdistError
from ._group import DistContext, Group, as_group
from ._objects import DEFAULT_MIN_TENSOR_BYTES
from ._payload import KINDS, Decoded, Encoded
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
        encoded = _payload.encode(
            obj,
            g.device,
            min_tensor_bytes=DEFAULT_MIN_TENSOR_BYTES,
            bucket_bytes=_WHOLE,
            pad_to=ALIGN,
        )
    except Exception as exc:
        return checked, None, exc
    return checked, encoded, None


def _alone(g: Group, encoded: Encoded | None, error: BaseException | None) -> list[Any]:
    """A one-rank gather: the object rebuilt from its own encoding (a copy)."""
    if error is not None:
        raise error
    assert encoded is not None
    decoded = _payload.decode(encoded.body)
    buckets = _payload.receive_buffers(decoded, g.device)
    for i, flat in enumerate(buckets):
        encoded.fills[i].pack(flat)
    return [_payload.materialize(decoded, buckets, g.device)]


def _sizes(encoded: Encoded | Decoded | None) -> list[int]:
    """Bytes per transport kind (at most one bucket each in a gather)."""
    buckets = [] if encoded is None else encoded.buckets
    return [sum(b.nbytes for b in buckets if b.kind == kind) for kind in KINDS]


class _Regions:
    """Receive memory for one transport of a gather: one region per rank, in one allocation.

    ``even``: every region is a row of the largest size, moved by one collective.
    """

    def __init__(self, sizes: list[int], device: torch.device, *, receiving: bool) -> None:
        self.sizes, self.top = sizes, max(sizes)
        self.even = 2 * sum(sizes) >= len(sizes) * self.top
        if self.even:
            self.starts, total = [r * self.top for r in range(len(sizes))], self.top * len(sizes)
        else:
            self.starts, total = offsets(sizes)
        self.device, size = device, total if receiving else 0
        self.out = allocate(size, device, what="the gathered tensors")

    def region(self, r: int) -> torch.Tensor:
        return self.out[self.starts[r] : self.starts[r] + self.sizes[r]]

    def row(self, r: int) -> torch.Tensor:
        return self.out[self.starts[r] : self.starts[r] + self.top]

    def send(self, me: int, encoded: Encoded | None, bucket: int | None) -> torch.Tensor:
        """This rank's bytes to send: in its own region, a row-sized buffer, or a lone tensor."""
        size, length = self.sizes[me], self.top if self.even else self.sizes[me]
        # A lone tensor travels in place, except where its region is what moves: an uneven
        # gather's receiving rank sends from that region and rebuilds its own entry from it.
        in_place = size == length and (self.even or not self.out.numel())
        if bucket is not None and encoded is not None and in_place and encoded.lone(bucket):
            return encoded.pack(bucket)
        if self.out.numel():  # a receiving rank rebuilds its own entry from its region
            flat = self.row(me) if self.even else self.region(me)
        else:
            flat = allocate(length, self.device, what="a gather")
        if bucket is not None and encoded is not None:
            encoded.fills[bucket].pack(flat[:size])
        flat[size:].zero_()
        return flat


class _Plan(NamedTuple):
    """Every rank's decoded body, the regions per transport, views of them, this rank's sends."""

    decodeds: list[Decoded]
    regions: dict[str, _Regions]
    views: list[list[torch.Tensor]]
    sends: dict[str, torch.Tensor]


def _plan(
    g: Group,
    bodies: list[bytes],
    sizes: list[list[int]] | None,
    encoded: Encoded | None,
    receiving: bool,
) -> _Plan:
    """Decode ``bodies`` (each matching its rank's ``sizes`` record), and lay out the regions."""
    decodeds = []
    for r, body in enumerate(bodies):
        decoded = _payload.decode(body, source=f"rank {g.ranks[r]}")
        if sizes is not None and _sizes(decoded) != sizes[r]:
            msg = f"rank {g.ranks[r]} sent a payload whose buckets differ from its size record"
            raise PdistError(msg)
        decodeds.append(decoded)
    sizes = [_sizes(d) for d in decodeds] if sizes is None else sizes
    regions = {
        kind: _Regions(
            [s[k] for s in sizes], _payload.transport_device(kind, g.device), receiving=receiving
        )
        for k, kind in enumerate(KINDS)
        if max(s[k] for s in sizes)
    }
    views = [
        _payload.tensors_of(d, [regions[b.kind].region(r) for b in d.buckets], g.device)
        for r, d in enumerate(decodeds)
    ]
    me = g.rank_in_group
    bucket_of = {b.kind: i for i, b in enumerate([] if encoded is None else encoded.buckets)}
    sends = {kind: reg.send(me, encoded, bucket_of.get(kind)) for kind, reg in regions.items()}
    return _Plan(decodeds, regions, views, sends)


def _agreed(g: Group, make: Callable[[], _Plan], *, together: bool, what: str) -> _Plan:
    """``make()``, then every rank learns whether every rank could (``together``: data follows)."""
    plan, failure = _Plan([], {}, [], {}), None
    try:
        plan = make()
    except Exception as exc:
        failure = exc
    if together:
        _agree.status(g, failure, what=what)
    elif failure is not None:
        _agree.raise_own(g, failure, what)
    return plan


def _rebuilt(g: Group, plan: _Plan, safe: Safe) -> list[Any]:
    me = g.rank_in_group
    return [
        loads(d.skeleton, v, d.storage, safe=False if r == me else safe)
        for r, (d, v) in enumerate(zip(plan.decodeds, plan.views, strict=True))
    ]


def all_gather_object(group: Group | DistContext, obj: Any, *, safe: Safe = False) -> list[Any]:
    """Every rank's ``obj``, in group order, on every rank (each a copy, as with torch).

    Dense tensors travel as tensors and land on the receiver's device.

    Note:
        All ranks of the group must call it.

    Args:
        group: The group (a context means its world).
        obj: This rank's picklable object.
        safe: Unpickle the other ranks' objects through an allow-list (see
            [`broadcast_object`][pdist.broadcast_object]).

    Returns:
        ``[object of group index 0, object of group index 1, ...]``.

    Raises:
        PdistError: On every rank, if some rank cannot pickle its object or
            passes a bad argument (also a ``TypeError`` then), naming it; on a
            rank that refuses or cannot rebuild another's object.
    """
    g = as_group(group)
    what = "all_gather_object"
    _check.agree_name(g, what)
    safe, encoded, error = _encode_own(g, obj, safe)
    if g.world_size == 1:
        return _alone(g, encoded, error)
    body = None if encoded is None else encoded.body
    bodies = _wire.all_gather_bytes(g, body, error=error, what=what)
    counts = [
        _payload.bucket_count(b, source=f"rank {r}") for b, r in zip(bodies, g.ranks, strict=True)
    ]
    plan = _agreed(
        g, lambda: _plan(g, bodies, None, encoded, True), together=any(counts), what=what
    )
    works = []
    for kind, reg in plan.regions.items():
        pg = g.transport(kind)
        if reg.even:
            works.append(all_gather_into(reg.out, plan.sends[kind], pg, async_op=True))
            continue
        works += [
            _rooted.broadcast_from(reg.region(r), pg, r, async_op=True)
            for r, size in enumerate(reg.sizes)
            if size
        ]
    wait_all(g, works, what)
    return _rebuilt(g, plan, safe)


def _gather_bodies(
    g: Group, encoded: Encoded | None, error: BaseException | None, dst_global: int, what: str
) -> tuple[list[list[int]], list[bytes]]:
    """Every rank's size record (failed, body length, bytes per transport), every body on dst."""
    body = b"" if encoded is None else encoded.body
    mine = torch.tensor([int(error is not None), len(body), *_sizes(encoded)], dtype=torch.int64)
    rows = [torch.empty(4, dtype=torch.int64) for _ in g.ranks]
    with naming(g, what):
        dist.all_gather(rows, mine, group=g.cpu_group)
    records = [r.tolist() for r in rows]
    if any(rec[0] for rec in records):
        _agree.raise_agreed(g, error, what=what)
    if any(min(rec[1:]) < 0 or rec[1] == 0 for rec in records):
        msg = f"{what} on group {g.name!r}: a rank sent a corrupt size record {records}"
        raise PdistError(msg)
    longest, is_dst = max(rec[1] for rec in records), g.rank == dst_global
    buffers = _wire.reserve(
        lambda: [
            filled(body, longest, what=what),
            *([allocate(longest, what=what) for _ in g.ranks] if is_dst else []),
        ],
        longest,
        lambda failure: _agree.status(g, failure, what=what),
    )
    dst = g.ranks.index(dst_global)
    with naming(g, what):
        _rooted.gather_to(buffers[0], buffers[1:] if is_dst else None, g.cpu_group, dst)
    return records, [bytes_of(out, rec[1]) for out, rec in zip(buffers[1:], records, strict=False)]


def gather_object(
    group: Group | DistContext, obj: Any, dst: int = 0, *, safe: Safe = False
) -> list[Any] | None:
    """Every rank's ``obj`` in group order on group index ``dst`` (copies); None elsewhere.

    Note:
        All ranks of the group must call it.

    Args:
        group: The group (a context means its world).
        obj: This rank's picklable object.
        dst: Group index of the destination (the same valid index on every rank).
        safe: Destination only: unpickle through an allow-list (see
            [`broadcast_object`][pdist.broadcast_object]).

    Returns:
        On ``dst``, ``[object of group index 0, ...]``; None on the other ranks.

    Raises:
        PdistError: On every rank, if some rank cannot pickle its object or
            passes a bad argument, naming it; on ``dst``, if it refuses or
            cannot rebuild an object.
    """
    g = as_group(group)
    what = "gather_object"
    _check.agree_name(g, what, dst=dst)
    dst_global = g.global_rank(dst, name="dst")
    safe, encoded, error = _encode_own(g, obj, safe)
    if g.world_size == 1:
        return _alone(g, encoded, error)
    records, bodies = _gather_bodies(g, encoded, error, dst_global, what)
    is_dst = g.rank_in_group == dst
    sizes = [rec[2:] for rec in records]
    make = functools.partial(_plan, g, bodies, sizes, encoded, is_dst)
    plan = _agreed(g, make, together=any(any(s) for s in sizes), what=what)
    works: list[Any] = []
    for kind, reg in plan.regions.items():
        pg = g.transport(kind)
        if reg.even:
            rows = [reg.row(r) for r in range(g.world_size)] if is_dst else None
            works.append(_rooted.gather_to(plan.sends[kind], rows, pg, dst, async_op=True))
        elif is_dst:
            works += [
                _rooted.irecv_from(reg.region(r), pg, r)
                for r, size in enumerate(reg.sizes)
                if size and r != g.rank_in_group
            ]
        elif reg.sizes[g.rank_in_group]:
            works.append(_rooted.isend_to(plan.sends[kind], pg, dst))
    wait_all(g, works, what)
    return _rebuilt(g, plan, safe) if is_dst else None
