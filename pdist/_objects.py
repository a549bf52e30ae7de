"""Object collectives and tensor-dict send/recv/broadcast on a Group.

Every object function uses the payload format of ``_payload``: the
skeleton (the pickle, with dense tensors taken out) and a plain-data header
travel over the CPU group in pdist's own framing (no numpy needed); tensors
of at least ``DEFAULT_MIN_TENSOR_BYTES`` travel as tensors, in buckets per
transport, straight into the memory they are rebuilt from. Tensors arrive on
the receiver's device (a CUDA tensor from ``cuda:3`` lands on the receiver's
``cuda:N``; CPU tensors stay on the CPU). Receivers accept ``safe=``:
``True`` unpickles through torch's ``weights_only`` allow-list, an iterable of
classes extends that list.

Failures travel: a rank that cannot encode sends an error marker instead of
its message; when buckets follow, a status step (an 8-byte all-reduce for the
collectives, one short message back for send/recv) carries the failures of
decoding, allocating and packing before any bucket moves. Every rank then
raises the same :class:`~pdist.PdistError`, naming the failing rank.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from . import _payload, _wire
from ._broadcast import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_MIN_TENSOR_BYTES,
    broadcast_tree,
    global_rank_of,
    raise_local,
    settle_or_raise,
)
from ._errors import PdistError, RankMismatchError
from ._group import DistContext, Group, as_group
from ._serialize import Safe, loads, safe_or_error

__all__ = [
    "all_gather_object",
    "broadcast_object",
    "broadcast_tensor_dict",
    "gather_object",
    "recv_object",
    "recv_tensor_dict",
    "send_object",
    "send_tensor_dict",
]

_KINDS = ("cpu", "device")
_WHOLE = 1 << 62  # gathers move each rank's bytes of one transport as one region


def _wait(works: list[Any]) -> None:
    for work in works:
        if work is not None:
            work.wait()


def _encode_for_gather(
    g: Group, obj: Any, safe: object
) -> tuple[Safe, _payload.Encoded | None, BaseException | None]:
    """This rank's part of a gather: the checked ``safe``, its encoding, or the local failure.

    Each rank's tensors go in one bucket per transport (aligned, so that the
    gathered regions can be cut into ranks' buckets).
    """
    checked, error = safe_or_error(safe, g.rank)
    if error is not None:
        return checked, None, error
    try:
        encoded = _payload.encode(
            obj,
            g.device,
            min_tensor_bytes=DEFAULT_MIN_TENSOR_BYTES,
            bucket_bytes=_WHOLE,
            pad_to=_payload.ALIGN,
        )
    except Exception as exc:
        return checked, None, exc
    return checked, encoded, None


def broadcast_object(
    group: Group | DistContext, obj: Any = None, src: int = 0, *, safe: Safe = False
) -> Any:
    """Broadcast a picklable ``obj`` from group index ``src``; every rank returns it.

    Small objects take one collective; dense tensors inside travel as
    tensors (see :func:`~pdist.broadcast_object_list`). On a group from
    :func:`~pdist.message_queue`, broadcasts from its first rank send their
    header through shared memory instead.

    .. note:: All ranks of the group must call it; ``obj`` is ignored on receivers.

    Args:
        group: The group (a context means its world).
        obj: The object (source only).
        src: Group index of the source (the same valid index on every rank:
            the caller's precondition).
        safe: Receivers only: ``True`` unpickles through an allow-list (builtin
            containers and scalars, tensors, dtypes, devices); an iterable of
            classes extends it. Anything else raises :class:`~pdist.PdistError`
            naming it, without running it.

    Returns:
        The source's object (on the source, ``obj`` itself).

    Raises:
        PdistError: On every rank, if the source cannot pickle ``obj``; on a
            receiver that refuses or cannot rebuild it.
    """
    return broadcast_tree(as_group(group), obj, src, safe=safe, what="broadcast_object")


# --------------------------------------------------------------------------- gathers


def _kind_sizes(decoded: _payload.Decoded, source: str) -> dict[str, int]:
    """Bytes per transport of one rank's payload (at most one bucket per transport)."""
    sizes: dict[str, int] = {}
    for bucket in decoded.buckets:
        if bucket.kind in sizes or bucket.nbytes % _payload.ALIGN:
            msg = f"{source} sent a corrupt payload: buckets {decoded.buckets} for a gather"
            raise PdistError(msg)
        sizes[bucket.kind] = bucket.nbytes
    return sizes


class _Regions:
    """Receive memory for one transport of a gather: one region per rank, in one allocation.

    When the ranks send about as much as each other (``even``), every rank's
    region is a row of the largest size, so one all-gather (or gather) moves
    them all; otherwise regions are packed tight and each rank with data
    sends its own (one broadcast or send per such rank), so that one large
    rank does not make every rank allocate world_size times its size.
    """

    def __init__(self, sizes: list[int], device: torch.device, *, allocate: bool) -> None:
        self.sizes = sizes
        self.top = max(sizes)
        self.even = 2 * sum(sizes) >= len(sizes) * self.top
        if self.even:
            self.offsets = [r * self.top for r in range(len(sizes))]
            total = self.top * len(sizes)
        else:
            self.offsets, total = _payload.layout(sizes)
        self.out = _payload.buffer(total if allocate else 0, device)

    def region(self, r: int) -> torch.Tensor:
        return self.out[self.offsets[r] : self.offsets[r] + self.sizes[r]]

    def row(self, r: int) -> torch.Tensor:
        return self.out[self.offsets[r] : self.offsets[r] + self.top]


def _bucket_index(encoded: _payload.Encoded | None, kind: str) -> int | None:
    if encoded is None:
        return None
    return next((i for i, b in enumerate(encoded.buckets) if b.kind == kind), None)


def _views(
    g: Group, decodeds: Sequence[_payload.Decoded], regions: dict[str, _Regions]
) -> list[list[torch.Tensor]]:
    """Every rank's tensors, as views of the regions (which may still be filling)."""
    views = []
    for r, decoded in enumerate(decodeds):
        buckets = [regions[b.kind].region(r) for b in decoded.buckets]
        views.append(_payload.tensors_of(decoded, buckets, g.device))
    return views


def all_gather_object(group: Group | DistContext, obj: Any, *, safe: Safe = False) -> list[Any]:
    """Every rank's ``obj``, in group order, on every rank.

    Dense tensors travel as tensors: the skeletons and headers in one
    all-gather (one collective when every rank's fits 4 KiB), then, when
    tensors of at least 1 KiB are present, an 8-byte status all-reduce and one
    all-gather per transport (CPU, device), straight into the memory the
    tensors are rebuilt from. The count does not grow with the number of
    tensors. Tensors land on the receiver's device.

    As with torch, every entry is a copy, the caller's own included (rebuilt
    from the gathered bytes): changing it does not change ``obj``.

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
    safe, encoded, error = _encode_for_gather(g, obj, safe)
    if g.world_size == 1:
        if error is not None:
            raise error
        assert encoded is not None
        return [_local_copy(g, encoded)]
    bodies = _wire.all_gather_bytes(
        g, None if encoded is None else encoded.body, error=error, what=what
    )
    sources = [f"rank {r}" for r in g.ranks]
    counts = [_payload.bucket_count(b, source=s) for b, s in zip(bodies, sources, strict=True)]
    failure: BaseException | None = None
    decodeds: list[_payload.Decoded] = []
    regions: dict[str, _Regions] = {}
    views: list[list[torch.Tensor]] = []
    sends: dict[str, torch.Tensor] = {}
    try:
        decodeds = [_payload.decode(b, source=s) for b, s in zip(bodies, sources, strict=True)]
        per_rank = [_kind_sizes(d, s) for d, s in zip(decodeds, sources, strict=True)]
        for kind in _KINDS:
            sizes = [p.get(kind, 0) for p in per_rank]
            if max(sizes):
                regions[kind] = _Regions(
                    sizes, _payload.transport_device(kind, g.device), allocate=True
                )
        views = _views(g, decodeds, regions)
        sends = _pack_own(g, encoded, regions)
    except Exception as exc:
        failure = exc
    settle_or_raise(g, failure, status=any(counts), what=what)
    works = []
    for kind, reg in regions.items():
        pg = _payload.process_group(g, kind)
        if reg.even:
            works.append(_wire.all_gather_into(reg.out, sends[kind], pg, async_op=True))
            continue
        for r, size in enumerate(reg.sizes):
            if size:
                works.append(dist.broadcast(reg.region(r), src=g.ranks[r], group=pg, async_op=True))
    _wait(works)
    return [
        loads(d.skeleton, v, d.storage, safe=False if r == g.rank_in_group else safe)
        for r, (d, v) in enumerate(zip(decodeds, views, strict=True))
    ]


def _pack_own(
    g: Group, encoded: _payload.Encoded | None, regions: dict[str, _Regions]
) -> dict[str, torch.Tensor]:
    """Put this rank's bytes where the gathers send them from; returns them per transport.

    Packed straight into the rank's own region (which is also where its own,
    copied, entry is rebuilt from), or a lone tensor's own memory when its
    row needs no padding.
    """
    me = g.rank_in_group
    sends = {}
    for kind, reg in regions.items():
        index = _bucket_index(encoded, kind)
        size = reg.sizes[me]
        row = reg.row(me) if reg.even else reg.region(me)
        if index is not None and encoded is not None:
            if reg.even and size == reg.top and encoded.lone(index):
                sends[kind] = encoded.pack(index)  # gloo/NCCL copy it into this rank's row
                continue
            encoded.pack_into(index, row[:size])
        row[size:].zero_()
        sends[kind] = row
    return sends


def _local_copy(g: Group, encoded: _payload.Encoded) -> Any:
    """The object rebuilt from its own encoding: what a one-rank gather returns (a copy)."""
    decoded = _payload.decode(encoded.body)
    buckets = _payload.empty_buckets(decoded, g.device)
    for i, flat in enumerate(buckets):
        encoded.pack_into(i, flat)
    return _payload.materialize(decoded, buckets, g.device)


def gather_object(
    group: Group | DistContext, obj: Any, dst: int = 0, *, safe: Safe = False
) -> list[Any] | None:
    """Every rank's ``obj`` in group order on group index ``dst``; None elsewhere.

    Dense tensors travel as tensors: a fixed-size record per rank in one
    all-gather, the skeletons and headers in one gather (after a status
    all-reduce when the longest is 1 MiB or more), then, when tensors of
    at least 1 KiB are present, an 8-byte status all-reduce and one gather
    per transport straight into the memory the tensors are rebuilt from. As
    with torch, the destination's own entry is a copy.

    .. note:: All ranks of the group must call it.

    Args:
        group: The group (a context means its world).
        obj: This rank's picklable object.
        dst: Group index of the destination (the same valid index on every
            rank: the caller's precondition).
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
    dst_global = global_rank_of(g, dst, "dst")
    safe, encoded, error = _encode_for_gather(g, obj, safe)
    if g.world_size == 1:
        if error is not None:
            raise error
        assert encoded is not None
        return [_local_copy(g, encoded)]
    # One fixed-size record per rank: status, body length, bytes per transport.
    sizes = [0, 0] if encoded is None else [_bucket_size(encoded, k) for k in _KINDS]
    body = b"" if encoded is None else encoded.body
    mine = torch.tensor([int(error is not None), len(body), *sizes], dtype=torch.int64)
    rows = [torch.empty(4, dtype=torch.int64) for _ in g.ranks]
    dist.all_gather(rows, mine, group=g.cpu_group)
    records = [r.tolist() for r in rows]
    if any(rec[0] for rec in records):
        _wire.all_gather_bytes(g, None if error is not None else b"", error=error, what=what)
        msg = f"{what} on group {g.name!r}: a rank reported a failure but sent no error marker"
        raise PdistError(msg)
    if any(min(rec[1:]) < 0 or rec[1] == 0 for rec in records):
        msg = f"{what} on group {g.name!r}: a rank sent a corrupt size record {records}"
        raise PdistError(msg)
    is_dst = g.rank_in_group == dst
    # Known alike on every rank (from the records), whatever fails below.
    buckets_follow = any(rec[2] or rec[3] for rec in records)
    longest = max(rec[1] for rec in records)

    def make() -> list[torch.Tensor]:
        mine = _wire.padded(body, longest, g, what)
        return [mine, *(_wire.allocate(longest, g, what) for _ in g.ranks if is_dst)]

    padded, *outs = _wire.allocated(g, longest, make, what)
    dist.gather(padded, outs if is_dst else None, dst=dst_global, group=g.cpu_group)
    failure: BaseException | None = None
    decodeds: list[_payload.Decoded] = []
    regions: dict[str, _Regions] = {}
    views: list[list[torch.Tensor]] = []
    sends: dict[str, torch.Tensor] = {}
    try:
        for k, kind in enumerate(_KINDS):
            kind_sizes = [rec[2 + k] for rec in records]
            if max(kind_sizes):
                regions[kind] = _Regions(
                    kind_sizes, _payload.transport_device(kind, g.device), allocate=is_dst
                )
        if is_dst:
            for r, (out, rec) in enumerate(zip(outs, records, strict=True)):
                source = f"rank {g.ranks[r]}"
                decoded = _payload.decode(_wire.bytes_of(out, rec[1]), source=source)
                if _kind_sizes(decoded, source) != {
                    kind: rec[2 + k] for k, kind in enumerate(_KINDS) if rec[2 + k]
                }:
                    msg = f"{source} sent a payload whose buckets differ from its size record"
                    raise PdistError(msg)
                decodeds.append(decoded)
            views = _views(g, decodeds, regions)
            sends = _pack_own(g, encoded, regions)
        else:
            sends = _own_sends(g, encoded, regions)
    except Exception as exc:
        failure = exc
    settle_or_raise(g, failure, status=buckets_follow, what=what)
    works = []
    me = g.rank_in_group
    for kind, reg in regions.items():
        pg = _payload.process_group(g, kind)
        if reg.even:
            rows_out = [reg.row(r) for r in range(g.world_size)] if is_dst else None
            work = dist.gather(sends[kind], rows_out, dst=dst_global, group=pg, async_op=True)
            works.append(work)
        elif is_dst:
            works += [
                dist.irecv(reg.region(r), src=g.ranks[r], group=pg)
                for r, size in enumerate(reg.sizes)
                if size and r != me
            ]
        elif reg.sizes[me]:
            works.append(dist.isend(sends[kind], dst=dst_global, group=pg))
    _wait(works)
    if not is_dst:
        return None
    return [
        loads(d.skeleton, v, d.storage, safe=False if r == me else safe)
        for r, (d, v) in enumerate(zip(decodeds, views, strict=True))
    ]


def _bucket_size(encoded: _payload.Encoded, kind: str) -> int:
    index = _bucket_index(encoded, kind)
    return 0 if index is None else encoded.buckets[index].nbytes


def _own_sends(
    g: Group, encoded: _payload.Encoded | None, regions: dict[str, _Regions]
) -> dict[str, torch.Tensor]:
    """A gather's sender side: this rank's bytes per transport, padded to the row when even."""
    me = g.rank_in_group
    sends = {}
    for kind, reg in regions.items():
        size = reg.sizes[me]
        length = reg.top if reg.even else size
        index = _bucket_index(encoded, kind)
        if index is not None and encoded is not None and size == length and encoded.lone(index):
            sends[kind] = encoded.pack(index)
            continue
        flat = torch.empty(
            length, dtype=torch.uint8, device=_payload.transport_device(kind, g.device)
        )
        if index is not None and encoded is not None:
            encoded.pack_into(index, flat[:size])
        flat[size:].zero_()
        sends[kind] = flat
    return sends


# --------------------------------------------------------------------------- point to point


def _point_to_point_peer(g: Group, index: int | None, default_global: int, name: str) -> int:
    if index is not None:
        global_rank_of(g, index, name)  # its error names the calling rank too
    peer = g.peer_index(index, default_global, name)
    if peer == g.rank_in_group:
        msg = (
            f"{name}={peer} on rank {g.rank} is this rank itself; pass another group index "
            f"of group {g.name!r} (0..{g.world_size - 1})"
        )
        raise ValueError(msg)
    return peer


def _send_payload(
    g: Group,
    peer: int,
    make: Any,
    *,
    what: str,
    pad_to: int = 1,
    split: Group | None = None,
) -> None:
    """Send a payload to group index ``peer``: header, the receiver's status, then buckets.

    ``make()`` returns the object (its checks raise into an error marker).
    With ``split`` (an all-gather group), only this rank's part of each
    bucket is sent.
    """
    encoded = None
    flats: list[torch.Tensor] = []
    try:
        encoded = _payload.encode(
            make(),
            g.device,
            min_tensor_bytes=DEFAULT_MIN_TENSOR_BYTES,
            bucket_bytes=DEFAULT_BUCKET_BYTES,
            pad_to=pad_to,
            split=split.world_size if isinstance(split, Group) else 1,
        )
        flats = encoded.pack_all()  # before the header, so that a failure travels in it
    except Exception as exc:
        _wire.send_bytes(g, None, peer, error=exc, what=what)
        raise  # unreachable: send_bytes raised
    _wire.send_bytes(g, encoded.body, peer, what=what)
    if not encoded.buckets:
        return
    _wire.recv_bytes(g, peer, what=what)  # the receiver's status: raises if it failed
    peer_global = g.ranks[peer]
    works = []
    for bucket, flat in zip(encoded.buckets, flats, strict=True):
        part = flat
        if split is not None and split.world_size > 1:
            part = flat.chunk(split.world_size)[split.rank_in_group]
        pg = _payload.process_group(g, bucket.kind)
        works.append(dist.isend(part.contiguous(), dst=peer_global, group=pg))
    _wait(works)


def send_object(group: Group | DistContext, obj: Any, dst: int) -> None:
    """Send a picklable ``obj`` to group index ``dst``, which calls :func:`recv_object`.

    Dense tensors of at least 1 KiB travel as tensors in buckets after the
    header (the receiver first answers with a short status, so that its
    failure reaches the sender instead of leaving it waiting). If ``obj``
    cannot be pickled, the receiver raises too, and so does the sender.

    Args:
        group: The group (a context means its world).
        obj: The object.
        dst: Group index of the receiver (another rank; a valid index is the
            caller's precondition).

    Raises:
        PdistError: This rank or the receiver failed (on both, naming it).
    """
    g = as_group(group)
    peer = _point_to_point_peer(g, dst, g.next_rank, "dst")
    _send_payload(g, peer, lambda: obj, what="send_object")


def _recv_payload(
    g: Group,
    peer: int,
    *,
    safe: object,
    what: str,
    error: BaseException | None = None,
    split: Group | None = None,
) -> Any:
    """Receive what :func:`_send_payload` sent from group index ``peer``."""
    safe_checked: Safe = False
    if error is None:
        safe_checked, error = safe_or_error(safe, g.rank)
    splitting = split is not None and split.world_size > 1
    header_error: BaseException | None = None
    body = b""
    try:
        body = _wire.recv_bytes(g, peer, what=what)
    except _wire.RemoteError as exc:
        if not splitting:
            raise
        header_error = exc
    count = 0
    failure = error
    decoded: _payload.Decoded | None = None
    buffers: list[torch.Tensor] = []
    tensors: list[torch.Tensor] = []
    source = f"rank {g.ranks[peer]} (the sender of {what})"
    if header_error is None:
        try:
            count = _payload.bucket_count(body, source=source)
        except PdistError as exc:
            if not splitting:
                raise
            header_error = exc
    if header_error is None and failure is None:
        try:
            decoded = _payload.decode(body, source=source)
            parts = split.world_size if split is not None else 1
            if decoded.split != parts:
                msg = (
                    f"all_gather_group on rank {g.rank} has {parts} rank(s) but rank "
                    f"{g.ranks[peer]} sent each bucket in {decoded.split} part(s); pass "
                    "all_gather_groups of the same size on both sides (or None on both)"
                )
                raise ValueError(msg)
            buffers = _payload.empty_buckets(decoded, g.device)
            tensors = _payload.tensors_of(decoded, buffers, g.device)
        except Exception as exc:
            failure = exc
    if splitting:
        assert split is not None
        failure = _settle_split(split, decoded, failure or header_error, what)
        if header_error is not None:
            raise header_error
    if count:
        _wire.send_bytes(g, b"", peer, error=failure, what=what)  # raises on failure
    elif failure is not None:
        raise_local(failure, g, what)
    assert decoded is not None
    peer_global = g.ranks[peer]
    for bucket, data in zip(decoded.buckets, buffers, strict=True):
        pg = _payload.process_group(g, bucket.kind)
        if splitting:
            assert split is not None
            part = data.chunk(split.world_size)[split.rank_in_group]
            dist.recv(part, src=peer_global, group=pg)
            _wire.all_gather_into(data, part, _payload.process_group(split, bucket.kind))
        else:
            dist.recv(data, src=peer_global, group=pg)
    return loads(decoded.skeleton, tensors, decoded.storage, safe=safe_checked)


def _settle_split(
    split: Group, decoded: _payload.Decoded | None, failure: BaseException | None, what: str
) -> BaseException | None:
    """Receivers sharing an all-gather group agree on success and on the bucket layout.

    Every receiver of the group takes part (whatever its own header held), so
    that one receiver's failure reaches the others before they wait in the
    all-gathers. Returns the failure to report back to this rank's sender.
    """
    layout = [] if decoded is None else [list(b) for b in decoded.buckets]
    digest = hashlib.sha256(repr(layout).encode()).digest()
    h = int.from_bytes(digest[:8], "little") >> 1
    flags = torch.tensor([int(failure is not None), h, -h], dtype=torch.int64)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=split.cpu_group)
    if int(flags[0]):
        try:
            _wire.all_gather_bytes(
                split, None if failure is not None else b"", error=failure, what=what
            )
        except PdistError as exc:
            return exc
    if int(flags[1]) != -int(flags[2]):
        msg = (
            f"{what}: the ranks of all_gather_group {split.name!r} {list(split.ranks)} received "
            "headers with different bucket layouts; every sender of a stage must send the "
            "same dict structure"
        )
        return RankMismatchError(msg)
    return failure


def recv_object(group: Group | DistContext, src: int, *, safe: Safe = False) -> Any:
    """Receive the object group index ``src`` sent with :func:`send_object`.

    Args:
        group: The group (a context means its world).
        src: Group index of the sender (another rank; a valid index is the
            caller's precondition).
        safe: Unpickle through an allow-list (see :func:`~pdist.broadcast_object`).

    Returns:
        The object, its tensors on this rank's device (CPU tensors stay on the CPU).

    Raises:
        PdistError: The sender failed, or this rank refused or could not
            rebuild the object (then the sender raises too when tensors were
            to follow).
    """
    g = as_group(group)
    peer = _point_to_point_peer(g, src, g.prev_rank, "src")
    return _recv_payload(g, peer, safe=safe, what="recv_object")


# --------------------------------------------------------------------------- tensor dicts


def _check_dict(tensor_dict: object, rank: int) -> Mapping[Any, Any]:
    if not isinstance(tensor_dict, Mapping):
        msg = (
            f"tensor_dict must be a dict, got {type(tensor_dict).__name__} "
            f"({tensor_dict!r:.60}) on rank {rank}; pass a dict of tensors and values"
        )
        raise TypeError(msg)
    return tensor_dict


def _check_ag(all_gather_group: object, g: Group) -> Group | None:
    if all_gather_group is None or isinstance(all_gather_group, Group):
        if all_gather_group is not None and g.rank not in all_gather_group.ranks:
            msg = (
                f"all_gather_group={all_gather_group.name!r} on rank {g.rank} does not "
                f"contain this rank (its ranks: {list(all_gather_group.ranks)}); pass the "
                "group of this rank's pipeline stage, or None"
            )
            raise ValueError(msg)
        return all_gather_group
    msg = (
        f"all_gather_group={all_gather_group!r:.60} on rank {g.rank} must be a pdist Group or None"
    )
    raise TypeError(msg)


def broadcast_tensor_dict(
    group: Group | DistContext,
    tensor_dict: Mapping[Any, Any] | None = None,
    src: int = 0,
    *,
    safe: Safe = False,
) -> dict[Any, Any]:
    """Broadcast a (nested) dict of tensors and other values from group index ``src``.

    The metadata travels in one message over the CPU group (through shared
    memory on a :func:`~pdist.message_queue` group); CPU tensors then go over
    the CPU group and device tensors over the device group, coalesced into
    buckets, after an 8-byte status all-reduce; empty tensors cost nothing.

    .. note:: All ranks of the group must call it; ``tensor_dict`` is ignored on receivers.

    Returns:
        The source's dict (on the source, ``tensor_dict`` itself).

    Raises:
        PdistError: On every rank, if the source's ``tensor_dict`` is not a
            dict (also a ``TypeError``) or cannot be encoded.
    """
    g = as_group(group)
    return broadcast_tree(  # type: ignore[no-any-return]
        g,
        tensor_dict,
        src,
        safe=safe,
        check=lambda d: _check_dict(d, g.rank),
        what="broadcast_tensor_dict",
    )


def send_tensor_dict(
    group: Group | DistContext,
    tensor_dict: Mapping[Any, Any],
    dst: int | None = None,
    *,
    all_gather_group: Group | None = None,
) -> None:
    """Send a (nested) dict of tensors to group index ``dst`` (default: the next rank).

    Metadata goes in one message over the CPU group; the receiver answers
    with a short status; then the tensors travel in buckets (CPU tensors over
    the CPU group, device tensors over the device group). With
    ``all_gather_group`` of size k (e.g. the TP group of a pipeline stage),
    this rank sends only its 1/k of every bucket and the receivers, who pass
    their own ``all_gather_group``, all-gather the rest.

    If ``tensor_dict`` is not a dict or cannot be encoded, the receiver
    raises too (and, with ``all_gather_group``, the whole receiving stage).

    .. note:: The destination must call :func:`recv_tensor_dict` with a
       matching ``all_gather_group`` size.
    """
    g = as_group(group)
    peer = _point_to_point_peer(g, dst, g.next_rank, "dst")

    def make() -> Mapping[Any, Any]:
        _check_ag(all_gather_group, g)
        return _check_dict(tensor_dict, g.rank)

    pad = 1
    if isinstance(all_gather_group, Group):
        pad = all_gather_group.world_size * _payload.ALIGN
    _send_payload(g, peer, make, what="send_tensor_dict", pad_to=pad, split=all_gather_group)


def recv_tensor_dict(
    group: Group | DistContext,
    src: int | None = None,
    *,
    all_gather_group: Group | None = None,
    safe: Safe = False,
) -> dict[Any, Any]:
    """Receive the dict group index ``src`` (default: the previous rank) sent.

    Buckets are received straight into the memory the tensors are rebuilt
    from (with ``all_gather_group``, each rank receives its part in place and
    the group all-gathers the rest around it). With ``all_gather_group``, the
    receivers of the group first agree, in one small all-reduce, that every
    one of them is ready and got the same layout, so that one receiver's
    failure raises on all of them (and on their senders).

    .. note:: Every receiver of a stage must pass the stage's
       ``all_gather_group`` (the caller's precondition): one that passes None
       or another group raises, but cannot reach the others of the stage,
       which then wait in the all-reduce until the group's timeout.

    Returns:
        The dict (of the sender's mapping type), with tensors on this rank's
        device (CPU tensors stay on the CPU).
    """
    g = as_group(group)
    what = "recv_tensor_dict"
    peer = _point_to_point_peer(g, src, g.prev_rank, "src")
    error: BaseException | None = None
    split: Group | None = None
    try:
        split = _check_ag(all_gather_group, g)
    except (TypeError, ValueError) as exc:
        error = exc
    out = _recv_payload(g, peer, safe=safe, what=what, error=error, split=split)
    # send_tensor_dict accepts any Mapping: refusing one here would fail after the sender
    # returned, on this side only.
    if not isinstance(out, Mapping):
        msg = f"{what}: rank {g.ranks[peer]} sent a {type(out).__name__}, not a dict"
        raise PdistError(msg)
    return out  # type: ignore[return-value]  # the sender's Mapping type
