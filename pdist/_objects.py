"""Object broadcasts: the skeleton in one message, tensors in buckets.

A payload (``_payload``) travels as one framed message over the CPU group
(``_wire``; shared memory on a [`message_queue`][pdist.message_queue] group), then the
larger tensors as raw bytes, one collective per bucket, straight into the
memory they are rebuilt from. Before buckets move the ranks agree (``_agree``)
that every one could decode and allocate, so one rank's failure raises on
every rank instead of leaving the others in a transfer.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch

from . import _check, _payload, _transfer, _wire
from ._departures import wait_all
from ._errors import PdistError
from ._group import DistContext, Group, as_group
from ._serialize import Safe, loads, safe_or_error

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "DEFAULT_MIN_TENSOR_BYTES",
    "broadcast_object",
    "broadcast_object_list",
    "broadcast_tensor_dict",
    "check_tensor_dict",
]

DEFAULT_MIN_TENSOR_BYTES = 1024  # smaller tensors travel inside the header message
DEFAULT_BUCKET_BYTES = 16 << 20  # bound of one coalesced bucket (a larger tensor travels alone)


def _broadcast(
    group: Group,
    obj: Any,
    src: int,
    *,
    safe: object = False,
    min_tensor_bytes: int = DEFAULT_MIN_TENSOR_BYTES,
    check: Callable[[Any], object] | None = None,
    error: BaseException | None = None,
    what: str,
) -> Any:
    """Broadcast ``obj`` from ``src``; ``check``'s error on the source, or ``error``, travels."""
    if group.header_transport is None:  # a message queue's broadcast takes no collective
        _check.agree_name(group, what, src=src)
    group.global_rank(src)
    if error is None:
        safe, error = safe_or_error(safe, group.rank)
    if error is None and check is not None and group.rank_in_group == src:
        try:
            check(obj)
        except Exception as exc:
            error = exc
    if group.world_size == 1:
        if error is not None:
            raise error
        return obj
    transport = group.header_transport
    header = _wire.broadcast_bytes if transport is None else transport.broadcast_bytes
    if group.rank_in_group == src:
        return _broadcast_out(group, obj, src, header, error, min_tensor_bytes, what)
    body = header(group, None, src, what=what)
    source = f"rank {group.ranks[src]} (the source of {what})"
    count = _payload.bucket_count(body, source=source)

    def receive() -> tuple[_payload.Decoded, list[torch.Tensor]]:
        decoded = _payload.decode(body, source=source)
        return decoded, _payload.receive_buffers(decoded, group.device)

    # Buckets follow: every rank learns whether every rank can take them.
    (decoded, buffers), _ = _transfer.prepare(
        group, receive, error=error, together=count > 0, what=what
    )
    if not decoded.buckets and not decoded.specs:  # a skeleton alone (most small objects)
        return loads(decoded.skeleton, [], [], safe=safe)  # type: ignore[arg-type]
    kinds = [b.kind for b in decoded.buckets]
    works = _transfer.broadcast_buckets(group, kinds, buffers, src, what=what, wait=False)
    # The views are made while the buckets fill (a corrupt layout raises once they have);
    # unpickling waits for the data, since a leaf's __setstate__ may read its tensors.
    try:
        tensors = _payload.tensors_of(decoded, buffers, group.device)
    finally:
        wait_all(group, works, what)
    tensors = _payload.owned(decoded, tensors)  # filled: a small one leaves its slab
    return loads(decoded.skeleton, tensors, decoded.storage, safe=safe)  # type: ignore[arg-type]


def _broadcast_out(
    group: Group,
    obj: Any,
    src: int,
    header: Any,
    error: BaseException | None,
    min_tensor_bytes: int,
    what: str,
) -> Any:
    """The source's half of ``_broadcast``: buckets are packed while the receivers allocate."""
    try:
        if error is not None:
            raise error
        encoded = _payload.encode(
            obj, group.device, min_tensor_bytes=min_tensor_bytes, bucket_bytes=DEFAULT_BUCKET_BYTES
        )
    except Exception as exc:
        header(group, None, src, error=exc, what=what)
        raise  # unreachable: the header raised for the source too
    header(group, encoded.body, src, what=what)
    if not encoded.buckets:
        return obj
    packed, _ = _transfer.prepare(group, encoded.pack_all, what=what)
    _transfer.broadcast_buckets(group, encoded.kinds, packed, src, what=what)
    return obj


def broadcast_object(
    group: Group | DistContext, obj: Any = None, src: int = 0, *, safe: Safe = False
) -> Any:
    """Broadcast a picklable ``obj`` from group index ``src``; every rank returns it.

    Dense tensors inside travel as tensors and land on the receiver's device.

    Note:
        All ranks of the group must call it; ``obj`` is ignored on receivers.

    Args:
        group: The group (a context means its world).
        obj: The object (source only).
        src: Group index of the source (the same valid index on every rank).
        safe: Receivers only: ``True`` unpickles through torch's ``weights_only``
            allow-list, an iterable of classes extends it; anything else raises
            [`PdistError`][pdist.PdistError] naming it, without running it.

    Returns:
        The source's object (on the source, ``obj`` itself).

    Raises:
        PdistError: On every rank, if the source cannot pickle ``obj``; on a
            receiver that refuses or cannot rebuild it.
    """
    return _broadcast(as_group(group), obj, src, safe=safe, what="broadcast_object")


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
    the skeleton: dense tensors travel as tensors and arrive on the receiver's device.

    Note:
        All ranks of the group must call it. Receivers' lists are
        replaced by the source's items (their length may differ).

    Args:
        group: The group (a context means its world).
        object_list: Items to send (source) or the list to fill (receivers).
        src: Group index of the source.
        min_tensor_bytes: Tensors smaller than this travel inside the header.
        safe: Receivers only: unpickle through an allow-list (see
            [`broadcast_object`][pdist.broadcast_object]).

    Raises:
        ValueError: ``src`` is outside the group (on the calling rank only).
        PdistError: A rank failed (on every rank, naming it; also a ``TypeError``
            or ``ValueError`` for a bad argument, which raises on that receiver
            alone when no buckets follow: the others have all they need).
    """
    g, what = as_group(group), "broadcast_object_list"
    error: BaseException | None = None
    if not isinstance(object_list, list):
        msg = (
            f"object_list={object_list!r:.80} on rank {g.rank} must be a list, got "
            f"{type(object_list).__name__}; pass the items on the source and a list to fill "
            "on the other ranks (such as [None])"
        )
        error = TypeError(msg)
    elif (
        isinstance(min_tensor_bytes, bool)
        or not isinstance(min_tensor_bytes, int)
        or min_tensor_bytes < 0
    ):
        msg = (
            f"min_tensor_bytes={min_tensor_bytes!r:.80} on rank {g.rank} must be a non-negative "
            f"int; pass a byte count such as {DEFAULT_MIN_TENSOR_BYTES}"
        )
        error = ValueError(msg)
    result = _broadcast(
        g, object_list, src, safe=safe, min_tensor_bytes=min_tensor_bytes, error=error, what=what
    )
    if result is object_list:
        return
    if not isinstance(result, list):
        msg = f"{what}: the source (group index {src}) sent a {type(result).__name__}, not a list"
        raise PdistError(msg)
    object_list[:] = result


def check_tensor_dict(tensor_dict: object, rank: int) -> Mapping[Any, Any]:
    """``tensor_dict`` if it is a mapping; else a ``TypeError`` naming ``rank``."""
    if not isinstance(tensor_dict, Mapping):
        msg = (
            f"tensor_dict must be a dict, got {type(tensor_dict).__name__} "
            f"({tensor_dict!r:.60}) on rank {rank}; pass a dict of tensors and values"
        )
        raise TypeError(msg)
    return tensor_dict


def broadcast_tensor_dict(
    group: Group | DistContext,
    tensor_dict: Mapping[Any, Any] | None = None,
    src: int = 0,
    *,
    safe: Safe = False,
) -> dict[Any, Any]:
    """Broadcast a (nested) dict of tensors and other values from group index ``src``.

    Note:
        All ranks of the group must call it; ``tensor_dict`` is ignored on receivers.

    Returns:
        The source's dict (on the source, ``tensor_dict`` itself).

    Raises:
        PdistError: On every rank, if the source's ``tensor_dict`` is not a
            dict (also a ``TypeError``) or cannot be encoded.
    """
    g = as_group(group)
    check = functools.partial(check_tensor_dict, rank=g.rank)
    return _broadcast(  # type: ignore[no-any-return]
        g, tensor_dict, src, safe=safe, check=check, what="broadcast_tensor_dict"
    )
