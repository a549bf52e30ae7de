"""The one transfer path: plan buckets, prepare under one status, move them.

Every feature that moves many tensors does the same three things, written here once:

1. **Plan** (``plan``, a pure function of sizes, so that every member plans alike):
   tensors go in order into the open bucket of their transport kind at ``ALIGN``
   offsets, a bucket holding at most ``limit`` bytes; a tensor of ``alone`` bytes or
   more travels in buckets of its own, chunks of at most ``limit``. Each part names a
   byte range of one tensor, so a receiver can take a chunk straight into its
   destination or cast it there (``_weights``). ``Fill`` packs a planned bucket of whole
   tensors (one concatenation where it can); a lone contiguous tensor is its own bucket
   (no staging copy).
2. **Prepare** (``prepare``): the step that allocates and checks runs inside a ``try``;
   its failure travels to every member in the one status round (``_agree.status``), or
   to the one peer of a point-to-point transfer (``_agree.send_status``), so that no
   member is left waiting in a transfer a failed member never joins.
3. **Move** (``broadcast_buckets``, ``send_buckets``, ``recv_buckets``,
   ``all_gather_regions``, ``gather_regions``): one asynchronous call per bucket on the
   group's transport for its kind (``group.transport``), by group index (``_rooted``),
   then one wait for all of them that names a member that left (``_departures.wait_all``).

What the bytes mean stays with each feature: the object format in ``_payload``, dataset
order in ``_collate``, ``load_state_dict`` semantics in ``_weights``. Staging memory comes
from ``_buffers`` and is never a result's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple, TypeVar, cast

import attrs
import torch
import torch.distributed as dist

from . import _agree, _rooted, _seams
from ._buffers import ALIGN, allocate, offsets, resolved, slab, tensor_bytes
from ._compat import all_gather_into
from ._departures import wait_all
from ._group import Group

__all__ = [
    "KINDS",
    "Fill",
    "Part",
    "Planned",
    "Regions",
    "Staging",
    "all_gather_regions",
    "broadcast_buckets",
    "chunk_bytes",
    "direct",
    "fills",
    "gather_regions",
    "plan",
    "prepare",
    "recv_buckets",
    "send_buckets",
    "slabs",
    "staging",
    "start_all_gather",
    "straight",
    "take",
    "transport_device",
]

KINDS = ("cpu", "device")  # bytes over the CPU group, or the device group on its device
T = TypeVar("T")
Kinds = Sequence[str]  # the transport kind of each bucket: "cpu" or "device"
Buffers = Sequence[torch.Tensor]  # the flat uint8 buffer of each bucket


def transport_device(kind: str, device: torch.device) -> torch.device:
    """Where a transport kind's bytes live: the CPU for ``"cpu"``, else the group's ``device``."""
    return torch.device("cpu") if kind == "cpu" else device


class Part(NamedTuple):
    """Bytes ``[start, stop)`` of tensor ``tensor``, at byte ``offset`` of their bucket."""

    tensor: int
    offset: int
    start: int
    stop: int


class Planned(NamedTuple):
    """One bucket of a plan: its transport kind, its parts, its length in bytes."""

    kind: str
    parts: tuple[Part, ...]
    nbytes: int


def plan(
    sizes: Sequence[int],
    limit: int,
    *,
    kinds: Sequence[str] | None = None,
    alone: int | None = None,
) -> list[Planned]:
    """The buckets of tensors of ``sizes`` bytes, in the order they close (the same everywhere).

    A tensor goes into the open bucket of its kind (``kinds``; default all ``"cpu"``) at
    the next ``ALIGN`` offset, unless it would end past ``limit``: then that bucket closes
    and a new one opens with it (a tensor larger than ``limit`` fills one alone). With
    ``alone``, a tensor of that many bytes or more travels by itself in chunks of at most
    ``limit`` (aligned), while the open bucket stays open. Empty tensors take no part.
    """
    out: list[Planned] = []
    open_: dict[str, list[Any]] = {}  # kind -> [first tensor, parts, bytes used]
    chunk = max(limit // ALIGN * ALIGN, ALIGN)
    for i, n in enumerate(sizes):
        kind = "cpu" if kinds is None else kinds[i]
        if n == 0:
            continue
        if alone is not None and n >= alone:
            out += [
                Planned(kind, (Part(i, 0, a, min(a + chunk, n)),), min(chunk, n - a))
                for a in range(0, n, chunk)
            ]
            continue
        bucket = open_.get(kind)
        offset = 0 if bucket is None else -(-bucket[2] // ALIGN) * ALIGN
        if bucket is None or offset + n > limit:
            if bucket is not None:
                out.append(Planned(kind, tuple(bucket[1]), bucket[2]))
            bucket = open_[kind] = [i, [], 0]
            offset = 0
        bucket[1].append(_new(Part, (i, offset, 0, n)))  # (a NamedTuple's own __new__ is slow)
        bucket[2] = offset + n
    for kind, (_, parts, used) in sorted(open_.items(), key=lambda item: item[1][0]):
        out.append(Planned(kind, tuple(parts), used))
    return out


_new = tuple.__new__


def _typed(flat: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return (flat if t.dtype == torch.uint8 else flat.view(t.dtype)).view(t.shape)


# Dtypes a bucket of one of them is packed in, with one C++ call and no per-tensor view
_CAT_DTYPES = frozenset(
    {torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32}
    | {torch.int16, torch.int8, torch.uint8, torch.bool}
)


@attrs.define
class Fill:
    """Whole tensors (as sent) at aligned ``offsets`` in one bucket, packed on demand.

    A tensor off the bucket's ``device`` is never lone: it is copied there when packed.
    ``dtype``: the dtype of every tensor while they are contiguous on ``device`` and end
    on ``ALIGN`` bytes, so that they pack with one concatenation (else None).
    """

    kind: str
    device: torch.device
    index: int
    tensors: list[torch.Tensor] = attrs.field(factory=list)
    offsets: list[int] = attrs.field(factory=list)
    size: int = 0
    dtype: torch.dtype | None = None

    def add(self, t: torch.Tensor, offset: int) -> None:
        """Place ``t`` at byte ``offset`` (after the tensors placed before)."""
        data = resolved(t) if t.is_conj() or t.is_neg() else t  # such views have no bytes
        here = data.is_cpu if self.kind == "cpu" else data.device == self.device
        if not self.tensors:
            self.dtype = data.dtype
        if self.dtype is not None and not (
            here and data.nbytes % ALIGN == 0 and data.dtype == self.dtype and data.is_contiguous()
        ):
            self.dtype = None
        self.tensors.append(data)
        self.offsets.append(offset)
        self.size = offset + data.nbytes

    def lone(self, total: int) -> bool:
        """Whether the bucket is one contiguous tensor travelling in place (no staging copy)."""
        return (
            len(self.tensors) == 1
            and total == self.size
            and self.tensors[0].is_contiguous()
            and self.tensors[0].device == self.device
        )

    def pack(self, flat: torch.Tensor | None) -> torch.Tensor:
        """The bucket packed into ``flat`` (zero-padded past the tensors); None: a lone tensor."""
        _seams.packing(self.index)
        if flat is None:
            return tensor_bytes(self.tensors[0])
        if self.dtype is not None:  # the offsets are contiguous: one copy in C++
            out = flat[: self.size]
            with torch.no_grad():
                if self.dtype in _CAT_DTYPES:
                    parts = [t if t.dim() == 1 else t.view(-1) for t in self.tensors]
                    torch.cat(parts, out=out.view(self.dtype))
                else:
                    torch.cat([tensor_bytes(t) for t in self.tensors], out=out)
            flat[self.size :].zero_()
            return flat
        flat.zero_()  # the padding between parts goes on the wire: never stale memory
        for t, offset in zip(self.tensors, self.offsets, strict=True):
            # (.to first: a lazy or functional tensor cannot be copied into a CPU view)
            _typed(flat[offset : offset + t.nbytes], t).copy_(t.detach().to(flat.device))
        return flat


def fills(
    planned: Sequence[Planned], tensors: Sequence[torch.Tensor], device: torch.device
) -> list[Fill]:
    """The ``Fill`` of each planned bucket of whole ``tensors``, for a group on ``device``."""
    out = []
    for index, bucket in enumerate(planned):
        fill = Fill(bucket.kind, transport_device(bucket.kind, device), index)
        for part in bucket.parts:
            fill.add(tensors[part.tensor], part.offset)
        out.append(fill)
    return out


def straight(t: torch.Tensor, device: torch.device) -> bool:
    """Whether ``t``'s own memory holds its values in order on ``device`` (a wire as is)."""
    return t.is_contiguous() and t.device == device and not (t.is_conj() or t.is_neg())


def _pieces(t: torch.Tensor, start: int, stop: int) -> Iterator[tuple[torch.Tensor, int]]:
    """Views of ``t`` covering its elements ``[start, stop)`` (row-major), with their offsets.

    A partial row, whole rows, a partial row (recursively). ``t`` may have any strides (a
    transposed tensor): at most ``2 * dim + 1`` views, and no contiguous copy of the whole
    tensor is ever made.
    """
    if t.dim() == 0:
        yield t, 0
        return
    row = t[0].numel() if t.shape[0] else 0
    if row == 0 or stop <= start:
        return
    first, last = -(-start // row), stop // row  # the whole rows are [first, last)
    if first > last:  # inside one row
        r = start // row
        yield from _pieces(t[r], start - r * row, stop - r * row)
        return
    if start < first * row:
        yield from _pieces(t[first - 1], start - (first - 1) * row, row)
    if last > first:
        yield t[first:last], first * row - start
    if stop > last * row:
        for view, offset in _pieces(t[last], 0, stop - last * row):
            yield view, offset + last * row - start


def chunk_bytes(t: torch.Tensor, start: int, stop: int, device: torch.device) -> torch.Tensor:
    """Bytes ``[start, stop)`` of ``t``'s elements in row-major order, contiguous on ``device``.

    A contiguous ``t`` is sliced (a view); any other (transposed, conjugate, negative) is
    read piece by piece into a buffer of the chunk's size, never copied whole. Sliced in
    its own dtype first, so that only that part moves to ``device`` and devices that cannot
    view bytes (torch's lazy) still work.
    """
    size, t = t.element_size(), t.detach()
    if straight(t, t.device):
        part = t.reshape(-1)[start // size : stop // size]
    else:
        part = torch.empty((stop - start) // size, dtype=t.dtype, device=t.device)
        for view, offset in _pieces(t, start // size, stop // size):
            part[offset : offset + view.numel()].view(view.shape).copy_(view)
    if part.device != device:
        part = part.to(device)
    return tensor_bytes(part)


def direct(dest: torch.Tensor, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether ``dest``'s own memory can receive ``dtype`` bytes on ``device`` (no staging)."""
    return dest.dtype == dtype and straight(dest, device)


def take(part: Part, wire: torch.Tensor, dest: torch.Tensor, dtype: torch.dtype) -> None:
    """Cast ``part``'s bytes in ``wire`` (values of ``dtype``) into ``dest``, in place.

    ``dest`` may have any dtype, device and strides: it is filled as ``copy_`` fills it
    (as ``load_state_dict`` does), a chunk written into its elements ``[start, stop)``
    view by view, never through a contiguous copy of the whole.
    """
    values = wire[part.offset : part.offset + part.stop - part.start].view(dtype)
    if part.start == 0 and values.numel() == dest.numel():
        dest.copy_(values.view(dest.shape))
        return
    for view, offset in _pieces(dest, part.start // dtype.itemsize, part.stop // dtype.itemsize):
        view.copy_(values[offset : offset + view.numel()].view(view.shape))


Staging = list[torch.Tensor | None]  # buffers of buckets (None: a lone tensor's own memory)


def slabs(
    places: Sequence[tuple[str, torch.device] | None], sizes: Sequence[int], what: str
) -> Staging:
    """Fresh buffers of ``sizes`` bytes at ``(kind, device)`` places, one slab per kind."""
    out: Staging = [None] * len(sizes)
    for kind in KINDS:
        members = [(i, p[1]) for i, p in enumerate(places) if p is not None and p[0] == kind]
        if members:
            _, flats = slab([sizes[i] for i, _ in members], members[0][1], what=what)
            for (i, _), flat in zip(members, flats, strict=True):
                out[i] = flat
    return out


def staging(fills: Sequence[Fill], sizes: Sequence[int]) -> Staging:
    """Buffers for the buckets of ``fills`` (of ``sizes`` bytes); None for a lone tensor's."""
    places = [None if f.lone(n) else (f.kind, f.device) for f, n in zip(fills, sizes, strict=True)]
    return slabs(places, sizes, "staging")


def prepare(
    group: Group,
    make: Callable[[], T],
    *,
    what: str,
    error: BaseException | None = None,
    together: bool = True,
    peer: int | None = None,
    summary: Callable[[], str] | None = None,
) -> tuple[T, bool]:
    """``make()`` (unless ``error``), then every member learns whether every member could.

    The prepare step of a transfer: whatever allocates or checks before data moves runs
    in ``make``, and its failure travels in the one status round, so that no member is
    left waiting in a transfer that a failed member never joins.

    Args:
        group: The group of the transfer.
        make: The prepare step (allocations, checks); not called when ``error`` is given.
        what: The call, named in the errors.
        error: A failure found before (a bad argument): it travels instead.
        together: Data follows, so every member takes part (``_agree.status``); False:
            nothing follows, and a failure raises on this member alone.
        peer: This member is the receiving end of a point-to-point transfer: it answers
            group index ``peer`` (``_agree.send_status``) instead of a round.
        summary: Made after ``make``; its digest travels in the same round.

    Returns:
        What ``make`` made, and whether every member passed the same ``summary``.

    Raises:
        PdistError: On every member taking part, when one failed (``RemoteError`` naming
            it; a member that failed raises its own error, as ``_agree`` does).
    """
    made: T | None = None
    if error is None:
        try:
            made = make()
        except Exception as exc:
            error = exc
    same = True
    if not together:
        if error is not None:
            _agree.raise_own(group, error, what)
    elif peer is not None:
        _agree.send_status(group, peer, error, what=what)
    else:
        text = None if summary is None else summary()
        same = _agree.status(group, error, what=what, summary=text)
    return cast("T", made), same


def broadcast_buckets(
    group: Group, kinds: Kinds, buffers: Buffers, src: int, *, what: str, wait: bool = True
) -> list[Any]:
    """Broadcast each bucket (a transport kind, a buffer) from group index ``src``.

    Returns:
        The works, when not ``wait`` (else they were waited for).
    """
    works = [
        _rooted.broadcast_from(flat, group.transport(kind), src, async_op=True)
        for kind, flat in zip(kinds, buffers, strict=True)
    ]
    if wait:
        wait_all(group, works, what)
    return [] if wait else works


def send_buckets(group: Group, kinds: Kinds, buffers: Buffers, peer: int, *, what: str) -> None:
    """Send each bucket to group index ``peer``, which calls ``recv_buckets``."""
    pairs = zip(kinds, buffers, strict=True)
    wait_all(group, [_rooted.isend_to(t, group.transport(k), peer) for k, t in pairs], what)


def recv_buckets(group: Group, kinds: Kinds, buffers: Buffers, peer: int, *, what: str) -> None:
    """Receive each bucket from group index ``peer`` (its ``send_buckets``)."""
    pairs = zip(kinds, buffers, strict=True)
    wait_all(group, [_rooted.irecv_from(t, group.transport(k), peer) for k, t in pairs], what)


class Regions:
    """Receive memory of one transport of a gather: a region per member, one allocation.

    ``even``: every region is a row of the largest size, moved by one collective;
    otherwise each member's region moves by itself, so that one large member does not
    make every member allocate W times its bytes. ``receiving`` False: no memory here.
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
        """Member ``r``'s bytes."""
        return self.out[self.starts[r] : self.starts[r] + self.sizes[r]]

    def row(self, r: int) -> torch.Tensor:
        """Member ``r``'s row of an even gather (its region and padding)."""
        return self.out[self.starts[r] : self.starts[r] + self.top]

    def send(self, me: int, fill: Fill | None) -> torch.Tensor:
        """This member's bytes to send: its own region, a row-sized buffer, or a lone tensor."""
        size, length = self.sizes[me], self.top if self.even else self.sizes[me]
        # A lone tensor travels in place, except where its region is what moves: an uneven
        # gather's receiving member sends from that region and rebuilds its own entry from it.
        in_place = size == length and (self.even or not self.out.numel())
        if fill is not None and in_place and fill.lone(size):
            return fill.pack(None)
        if self.out.numel():  # a receiving member rebuilds its own entry from its region
            flat = self.row(me) if self.even else self.region(me)
        else:
            flat = allocate(length, self.device, what="a gather")
        if fill is not None:
            fill.pack(flat[:size])
        flat[size:].zero_()
        return flat


def start_all_gather(
    group: Group, kind: str, out: torch.Tensor | list[torch.Tensor], mine: torch.Tensor
) -> Any:
    """Start one all-gather of ``mine`` on ``kind``'s transport; its work.

    ``out``: one rank-major tensor, or a view per member, of any strides (gloo writes
    straight into them: ``collate_batches`` gathers into dataset order so).
    """
    pg = group.transport(kind)
    if isinstance(out, list):
        return dist.all_gather(out, mine, group=pg, async_op=True)
    return all_gather_into(out, mine, pg, async_op=True)


def all_gather_regions(
    group: Group, regions: dict[str, Regions], sends: dict[str, torch.Tensor], *, what: str
) -> None:
    """Every member's ``sends[kind]`` into every member's ``regions[kind]``."""
    works = []
    for kind, reg in regions.items():
        pg = group.transport(kind)
        if reg.even:
            works.append(start_all_gather(group, kind, reg.out, sends[kind]))
            continue
        works += [
            _rooted.broadcast_from(reg.region(r), pg, r, async_op=True)
            for r, size in enumerate(reg.sizes)
            if size
        ]
    wait_all(group, works, what)


def gather_regions(
    group: Group,
    regions: dict[str, Regions],
    sends: dict[str, torch.Tensor],
    dst: int,
    *,
    what: str,
) -> None:
    """Every member's ``sends[kind]`` into ``regions[kind]`` on group index ``dst``."""
    me, is_dst, works = group.rank_in_group, group.rank_in_group == dst, []
    for kind, reg in regions.items():
        pg = group.transport(kind)
        if reg.even:
            rows = [reg.row(r) for r in range(group.world_size)] if is_dst else None
            works.append(_rooted.gather_to(sends[kind], rows, pg, dst, async_op=True))
        elif is_dst:
            works += [
                _rooted.irecv_from(reg.region(r), pg, r)
                for r, size in enumerate(reg.sizes)
                if size and r != me
            ]
        elif reg.sizes[me]:
            works.append(_rooted.isend_to(sends[kind], pg, dst))
    wait_all(group, works, what)
