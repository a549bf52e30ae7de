"""Pickled-object collectives and tensor-dict send/recv/broadcast on a Group.

Objects travel over the CPU group in pdist's own framing (no numpy needed);
tensors inside them arrive on the receiver's device (a CUDA tensor from
``cuda:3`` lands on the receiver's ``cuda:N``; CPU tensors stay on the CPU).
Receivers accept ``safe=``: ``True`` unpickles through torch's ``weights_only``
allow-list, an iterable of classes extends that list.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from . import _payload, _wire
from ._broadcast import DEFAULT_BUCKET_BYTES, DEFAULT_MIN_TENSOR_BYTES, broadcast_tree
from ._group import DistContext, Group, as_group
from ._serialize import Safe

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


def _encode_inline(group: Group, obj: Any) -> tuple[bytes | None, BaseException | None]:
    try:
        return _payload.encode(obj, group.device).body, None
    except Exception as exc:
        return None, exc


def _decode_inline(group: Group, body: bytes, safe: Safe) -> Any:
    return _payload.materialize(_payload.decode(body, safe=safe), [], group.device, safe=safe)


def broadcast_object(
    group: Group | DistContext, obj: Any = None, src: int = 0, *, safe: Safe = False
) -> Any:
    """Broadcast a picklable ``obj`` from group index ``src``; every rank returns it.

    Small objects take one collective. On a group from
    :func:`~pdist.message_queue`, broadcasts from its first rank go through
    shared memory instead.

    .. note:: All ranks of the group must call it; ``obj`` is ignored on receivers.

    Args:
        group: The group (a context means its world).
        obj: The object (source only).
        src: Group index of the source.
        safe: Receivers only: ``True`` unpickles through an allow-list (builtin
            containers and scalars, tensors, dtypes, devices); an iterable of
            classes extends it. Anything else raises :class:`~pdist.PdistError`
            naming it, without running it.

    Returns:
        The source's object (on the source, ``obj`` itself).

    Raises:
        PdistError: On every rank, if the source cannot pickle ``obj``.
    """
    return broadcast_tree(as_group(group), obj, src, safe=safe, what="broadcast_object")


def all_gather_object(group: Group | DistContext, obj: Any, *, safe: Safe = False) -> list[Any]:
    """Every rank's ``obj``, in group order, on every rank (two collectives).

    .. note:: All ranks of the group must call it.

    Raises:
        PdistError: On every rank, if some rank cannot pickle its object.
    """
    g = as_group(group)
    if g.world_size == 1:
        return [obj]
    body, error = _encode_inline(g, obj)
    bodies = _wire.all_gather_bytes(g, body, error=error, what="all_gather_object")
    return [
        obj if i == g.rank_in_group else _decode_inline(g, b, safe) for i, b in enumerate(bodies)
    ]


def gather_object(
    group: Group | DistContext, obj: Any, dst: int = 0, *, safe: Safe = False
) -> list[Any] | None:
    """Every rank's ``obj`` in group order on group index ``dst``; None elsewhere.

    .. note:: All ranks of the group must call it.

    Raises:
        PdistError: On every rank, if some rank cannot pickle its object.
    """
    g = as_group(group)
    g.global_rank(dst, name="dst")
    if g.world_size == 1:
        return [obj]
    body, error = _encode_inline(g, obj)
    bodies = _wire.gather_bytes(g, body, dst, error=error, what="gather_object")
    if bodies is None:
        return None
    return [
        obj if i == g.rank_in_group else _decode_inline(g, b, safe) for i, b in enumerate(bodies)
    ]


def send_object(group: Group | DistContext, obj: Any, dst: int) -> None:
    """Send a picklable ``obj`` to group index ``dst``, which calls :func:`recv_object`.

    If ``obj`` cannot be pickled, the receiver raises too, and so does the sender.
    """
    g = as_group(group)
    body, error = _encode_inline(g, obj)
    _wire.send_bytes(g, body, dst, error=error, what="send_object")


def recv_object(group: Group | DistContext, src: int, *, safe: Safe = False) -> Any:
    """Receive the object group index ``src`` sent with :func:`send_object`."""
    g = as_group(group)
    return _decode_inline(g, _wire.recv_bytes(g, src, what="recv_object"), safe)


def _check_dict(tensor_dict: object) -> Mapping[Any, Any]:
    if not isinstance(tensor_dict, Mapping):
        msg = f"tensor_dict must be a dict, got {type(tensor_dict).__name__}"
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

    The metadata travels in one message over the CPU group (through shared
    memory on a :func:`~pdist.message_queue` group); CPU tensors then go over
    the CPU group and device tensors over the device group, coalesced into
    buckets; empty tensors cost nothing.

    .. note:: All ranks of the group must call it; ``tensor_dict`` is ignored on receivers.

    Returns:
        The source's dict (on the source, ``tensor_dict`` itself).
    """
    return broadcast_tree(  # type: ignore[no-any-return]
        as_group(group),
        tensor_dict,
        src,
        safe=safe,
        check=_check_dict,
        what="broadcast_tensor_dict",
    )


def _split(
    data: torch.Tensor, bucket: _payload.Bucket, group: Group, ag: Group | None
) -> tuple[torch.Tensor, Any]:
    pg = _payload.process_group(group, bucket.kind)
    if ag is None or ag.world_size == 1:
        return data, pg
    return data.chunk(ag.world_size)[ag.rank_in_group], pg


def _gather_parts(part: torch.Tensor, bucket: _payload.Bucket, ag: Group) -> torch.Tensor:
    pg = _payload.process_group(ag, bucket.kind)
    parts = [torch.empty_like(part) for _ in ag.ranks]
    dist.all_gather(parts, part, group=pg)
    return torch.cat(parts)


def send_tensor_dict(
    group: Group | DistContext,
    tensor_dict: Mapping[Any, Any],
    dst: int | None = None,
    *,
    all_gather_group: Group | None = None,
) -> None:
    """Send a (nested) dict of tensors to group index ``dst`` (default: the next rank).

    Metadata goes in one message over the CPU group, then the tensors in
    buckets (CPU tensors over the CPU group, device tensors over the device
    group). With ``all_gather_group`` of size k (e.g. the TP group of a
    pipeline stage), this rank sends only its 1/k of every bucket and the
    receivers, who pass their own ``all_gather_group``, all-gather the rest.

    .. note:: The destination must call :func:`recv_tensor_dict` with a
       matching ``all_gather_group`` size.
    """
    g = as_group(group)
    _check_dict(tensor_dict)
    peer = g.peer_index(dst, g.next_rank, "dst")
    pad = 1 if all_gather_group is None else all_gather_group.world_size * _payload.ALIGN
    try:
        encoded = _payload.encode(
            tensor_dict,
            g.device,
            min_tensor_bytes=DEFAULT_MIN_TENSOR_BYTES,
            bucket_bytes=DEFAULT_BUCKET_BYTES,
            pad_to=pad,
        )
    except Exception as exc:
        _wire.send_bytes(g, None, peer, error=exc, what="send_tensor_dict")
        raise  # unreachable: send_bytes raised
    _wire.send_bytes(g, encoded.body, peer, what="send_tensor_dict")
    peer_global = g.ranks[peer]
    for i, bucket in enumerate(encoded.buckets):
        part, pg = _split(encoded.pack(i), bucket, g, all_gather_group)
        dist.send(part.contiguous(), dst=peer_global, group=pg)


def recv_tensor_dict(
    group: Group | DistContext,
    src: int | None = None,
    *,
    all_gather_group: Group | None = None,
    safe: Safe = False,
) -> dict[Any, Any]:
    """Receive the dict group index ``src`` (default: the previous rank) sent.

    Returns:
        The dict, with tensors on this rank's device (CPU tensors stay on the CPU).
    """
    g = as_group(group)
    peer = g.peer_index(src, g.prev_rank, "src")
    body = _wire.recv_bytes(g, peer, what="recv_tensor_dict")
    decoded = _payload.decode(body, safe=safe)
    buffers = _payload.empty_buckets(decoded, g.device)
    peer_global = g.ranks[peer]
    for i, (bucket, data) in enumerate(zip(decoded.buckets, buffers, strict=True)):
        part, pg = _split(data, bucket, g, all_gather_group)
        recv_part = torch.empty_like(part)
        dist.recv(recv_part, src=peer_global, group=pg)
        if all_gather_group is not None and all_gather_group.world_size > 1:
            buffers[i] = _gather_parts(recv_part, bucket, all_gather_group)
        else:
            buffers[i] = recv_part
    return _payload.materialize(decoded, buffers, g.device, safe=safe)  # type: ignore[no-any-return]
