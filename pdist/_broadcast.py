"""Structured broadcast: the skeleton in one message, tensors in coalesced buckets.

A drop-in for ``torch.distributed.broadcast_object_list`` that pickles only
the skeleton. The header (skeleton, tensor specs, bucket layout and small
tensors inline) travels in one framed message, which is a single collective
when it fits the fixed first chunk. When buckets follow, one 8-byte status
all-reduce lets a failure on any rank reach every rank before they move;
then each bucket is one collective.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from . import _payload, _wire
from ._errors import PdistError
from ._group import DistContext, Group, as_group
from ._serialize import Safe, loads, safe_or_error

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "DEFAULT_MIN_TENSOR_BYTES",
    "broadcast_object_list",
    "broadcast_tree",
    "global_rank_of",
    "raise_local",
    "settle_or_raise",
]

DEFAULT_MIN_TENSOR_BYTES = 1024
"""Tensors smaller than this travel inside the header message (see docs/guide/objects.md).

Measured with ``python -m pdist bench``: below ~1 KiB, copying a tensor's
bytes into the header costs less than the separate bucket collective it
would otherwise need, and a header with a few such tensors still fits the
4 KiB first message (one collective in total).
"""

DEFAULT_BUCKET_BYTES = 16 << 20
"""Upper bound of one coalesced bucket (a larger tensor travels alone, uncopied).

Bounded buckets let the source pack bucket k+1 while bucket k is on the wire.
The buckets of one transport share one allocation (``_payload.slab``).
Measured on case (b) of ``python -m pdist bench``: 4 to 32 MiB buckets take
the same time; 1 and 2 MiB buckets cost 20-25% more (more collectives).
"""


def global_rank_of(group: Group, index: int, name: str) -> int:
    """``group.global_rank(index)``, its error naming the calling rank too.

    A ``src``/``dst`` that only one rank gets wrong cannot be known to the
    others: it is the caller's precondition, and raises on that rank alone.
    """
    try:
        return group.global_rank(index, name=name)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{exc} (on rank {group.rank})") from None


def _transfer(group: Group, bucket: _payload.Bucket, data: torch.Tensor, src_global: int) -> Any:
    pg = _payload.process_group(group, bucket.kind)
    return dist.broadcast(data, src=src_global, group=pg, async_op=True)


def raise_local(error: BaseException, group: Group, what: str) -> NoReturn:
    """Raise a receiver's own failure when no collective follows that could carry it."""
    if isinstance(error, PdistError):
        raise error
    _wire.reraise_own(error, group, what, group.rank)
    raise error  # unreachable: reraise_own raised


def settle_or_raise(
    group: Group, failure: BaseException | None, *, status: bool, what: str
) -> None:
    """Report this rank's local ``failure``: through the status all-reduce when ``status``.

    ``status`` (buckets follow) must be known alike on every rank; then every
    rank raises if one failed (``_wire.settle``). Without it no
    collective follows, nobody waits, and only the failing rank raises.
    """
    if status:
        _wire.settle(group, failure, what=what)
    elif failure is not None:
        raise_local(failure, group, what)


def broadcast_tree(
    group: Group,
    obj: Any,
    src: int,
    *,
    safe: object = False,
    min_tensor_bytes: int = DEFAULT_MIN_TENSOR_BYTES,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    check: Callable[[Any], object] | None = None,
    error: BaseException | None = None,
    what: str = "broadcast",
) -> Any:
    """Broadcast ``obj`` from group index ``src``; the engine behind the object broadcasts.

    The header goes through the group's shared-memory queue when it has one
    (:func:`~pdist.message_queue`), else over the CPU group. When buckets
    follow, every rank then reports its local status in one small all-reduce
    (the source: staging and packing the first bucket; receivers: decoding
    and allocating) before they move, so a failure anywhere raises on every
    rank instead of leaving the others waiting. The source packs bucket k+1
    while bucket k is on the wire; when a bucket after the first needs
    packing (a copy, not a lone tensor sent in place), a second status
    all-reduce after the last bucket reports whether all of them were packed
    (a failure there still sends every bucket, so nobody waits, then raises
    everywhere). The source returns ``obj`` itself; receivers return the
    rebuilt object.

    Failures: ``check`` validates ``obj`` on the source; whatever it raises,
    or the source's ``error`` (a bad argument found by the caller), reaches
    every rank as an error marker. A receiver's ``error`` (or ``safe=``
    argument that is not valid) travels through the status all-reduce when
    buckets follow; without buckets only that receiver raises (the others
    are done and nobody waits).
    """
    src_global = global_rank_of(group, src, "src")
    if error is None:
        safe, error = safe_or_error(safe, group.rank)
    if group.world_size == 1:
        if error is not None:
            raise error
        if check is not None:
            check(obj)
        return obj
    transport = group.header_transport
    send_header = _wire.broadcast_bytes if transport is None else transport.broadcast_bytes
    if group.rank_in_group == src:
        try:
            if error is not None:
                raise error
            if check is not None:
                check(obj)
            encoded = _payload.encode(
                obj, group.device, min_tensor_bytes=min_tensor_bytes, bucket_bytes=bucket_bytes
            )
        except Exception as exc:
            send_header(group, None, src, error=exc, what=what)
            raise  # unreachable: send_header raised for the source too
        send_header(group, encoded.body, src, what=what)
        if not encoded.buckets:
            return obj
        # Staging and the first bucket are ready before the status (so that their failure
        # travels there); bucket k+1 is packed while bucket k is on the wire.
        failure: BaseException | None = None
        flat = None
        try:
            encoded.allocate()
            flat = encoded.pack(0)
        except Exception as exc:
            failure = exc
        _wire.settle(group, failure, what=what)
        assert flat is not None
        works = []
        for i, bucket in enumerate(encoded.buckets):
            works.append(_transfer(group, bucket, flat, src_global))
            if i + 1 < len(encoded.buckets):
                try:
                    flat = encoded.unpacked(i + 1) if failure else encoded.pack(i + 1)
                except Exception as exc:  # the receivers still get every bucket, then the error
                    failure = exc
                    flat = encoded.unpacked(i + 1)
        for work in works:
            work.wait()
        # Without a late status the later buckets are lone tensors sent in place (no packing).
        settle_or_raise(group, failure, status=encoded.late_status, what=what)
        return obj
    body = send_header(group, None, src, what=what)
    source = f"rank {src_global} (the source of {what})"
    count = _payload.bucket_count(body, source=source)
    failure = error
    decoded: _payload.Decoded | None = None
    buffers: list[torch.Tensor] = []
    if failure is None:
        try:
            decoded = _payload.decode(body, source=source)
            buffers = _payload.empty_buckets(decoded, group.device)
        except Exception as exc:
            failure = exc
    settle_or_raise(group, failure, status=count > 0, what=what)
    assert decoded is not None  # set whenever no failure was raised
    works = [
        _transfer(group, bucket, data, src_global)
        for bucket, data in zip(decoded.buckets, buffers, strict=True)
    ]
    # The views are made while the buckets fill; a failure waits for the transfers, so that
    # the source is not left sending, then raises (on every rank when a status follows).
    tensors: list[torch.Tensor] = []
    late: BaseException | None = None
    try:
        tensors = _payload.tensors_of(decoded, buffers, group.device)
    except Exception as exc:
        late = exc
    # Unpickling waits for the data, since a leaf's __setstate__ may read the tensors it holds.
    for work in works:
        work.wait()
    # A late status says whether the source packed every later bucket.
    settle_or_raise(group, late, status=decoded.late_status, what=what)
    return loads(decoded.skeleton, tensors, decoded.storage, safe=safe)  # type: ignore[arg-type]


def _check_list(object_list: object, rank: int) -> None:
    if not isinstance(object_list, list):
        msg = (
            f"object_list={object_list!r:.80} on rank {rank} must be a list, got "
            f"{type(object_list).__name__}; pass the items on the source and a list to fill "
            "on the other ranks (such as [None])"
        )
        raise TypeError(msg)


def _check_min_bytes(min_tensor_bytes: object, rank: int) -> None:
    if (
        isinstance(min_tensor_bytes, bool)
        or not isinstance(min_tensor_bytes, int)
        or min_tensor_bytes < 0
    ):
        msg = (
            f"min_tensor_bytes={min_tensor_bytes!r:.80} on rank {rank} must be a non-negative "
            f"int; pass a byte count such as {DEFAULT_MIN_TENSOR_BYTES}"
        )
        raise ValueError(msg)


def broadcast_object_list(
    group: Group | DistContext,
    object_list: list[Any],
    src: int = 0,
    *,
    min_tensor_bytes: int = DEFAULT_MIN_TENSOR_BYTES,
    safe: Safe = False,
) -> None:
    """Broadcast ``object_list`` from group index ``src`` into every rank's list, in place.

    A drop-in for ``torch.distributed.broadcast_object_list`` that pickles only
    the skeleton: dense tensors travel as tensors, coalesced into one
    collective per (transport, 16 MiB) bucket, and are rebuilt on the
    receivers as views of the received buckets. Anything picklable travels,
    as with torch: container subclasses (``defaultdict``...), shared and
    self-containing containers keep their classes and structure; repeated
    references to one tensor arrive as one tensor; ``nn.Parameter`` stays a
    parameter; sparse, quantized, nested and subclass tensors are pickled
    whole. CUDA tensors land on the receiver's device.

    A payload whose header fits 4 KiB takes a single collective in total.
    With buckets, one small status all-reduce precedes them, so that a
    failure on any rank (the source packing, a receiver decoding or
    allocating) raises on every rank.

    If the source's arguments are wrong or it cannot pickle the payload,
    every rank raises the same :class:`~pdist.PdistError`, naming the
    source; nobody waits. A receiver's bad argument raises on every rank when
    buckets follow, and on that receiver alone otherwise (the others have
    all they need). ``src`` is the caller's precondition: it must be the same
    valid index on every rank.

    .. note:: All ranks of the group must call it. Receivers' lists are
       replaced by the source's items (their length may differ).

    Args:
        group: The group (a context means its world).
        object_list: Items to send (source) or the list to fill (receivers).
        src: Group index of the source.
        min_tensor_bytes: Tensors smaller than this travel inside the header.
        safe: Receivers only: unpickle through an allow-list (see
            :func:`~pdist.broadcast_object`).

    Raises:
        ValueError: ``src`` is outside the group (on the calling rank only).
        PdistError: A rank failed (on every rank, naming it); it is also a
            ``TypeError`` or ``ValueError`` when that rank's arguments were wrong.
    """
    g = as_group(group)
    error: BaseException | None = None
    try:
        _check_list(object_list, g.rank)
        _check_min_bytes(min_tensor_bytes, g.rank)
    except (TypeError, ValueError) as exc:
        error = exc
    result = broadcast_tree(
        g,
        object_list,
        src,
        safe=safe,
        min_tensor_bytes=min_tensor_bytes,
        error=error,
        what="broadcast_object_list",
    )
    if result is object_list:
        return
    if not isinstance(result, list):
        msg = (
            f"broadcast_object_list: the source (group index {src}) sent a "
            f"{type(result).__name__}, not a list"
        )
        raise PdistError(msg)
    object_list[:] = result
