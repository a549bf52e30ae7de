"""Point-to-point objects and tensor dicts: header, the receiver's answer, then buckets.

The sender packs every bucket before the header, so that its failure travels in
it; the receiver answers the header (``_agree.send_status``) before any bucket moves, so
that its failure to decode or allocate reaches the sender instead of leaving it waiting.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch

from . import _agree, _check, _transfer, _wire
from ._buffers import ALIGN
from ._departures import wait_all
from ._errors import PdistError, RankMismatchError
from ._group import DistContext, Group, as_group
from ._objects import DEFAULT_BUCKET_BYTES, DEFAULT_MIN_TENSOR_BYTES, check_tensor_dict
from ._payload import Decoded, bucket_count, decode, encode, receive_buffers, tensors_of
from ._serialize import Safe, loads, safe_or_error

__all__ = ["recv_object", "recv_tensor_dict", "send_object", "send_tensor_dict"]


def _peer(g: Group, index: int | None, default_global: int, name: str) -> int:
    if index is not None:
        g.global_rank(index, name=name)
    peer = g.peer_index(index, default_global, name)
    if peer == g.rank_in_group:
        msg = (
            f"{name}={peer} on rank {g.rank} is this rank itself; pass another group index "
            f"of group {g.name!r} (0..{g.world_size - 1})"
        )
        raise ValueError(msg)
    return peer


def _check_ends(g: Group, peer: int, name: str, travels: str) -> None:
    """Check mode: the two ends swap what they pass first (``_check.agree_ends``).

    So that a tensor ``send``/``recv`` on the other end raises on both instead of pairing
    its transfer with this call's header.
    """
    send = functools.partial(_wire.send_bytes, g, dst=peer, what=f"{name} (check mode)")
    recv = functools.partial(_wire.recv_bytes, g, peer, what=f"{name} (check mode)")
    _check.agree_ends(g, name, lambda: travels, peer=peer, send=send, recv=recv)


def _part(flat: torch.Tensor, split: Group | None) -> torch.Tensor:
    """This rank's part of a bucket that travels split over ``split`` (the whole without)."""
    if split is None or split.world_size == 1:
        return flat
    return flat.chunk(split.world_size)[split.rank_in_group]


def _send_payload(
    g: Group, peer: int, make: Callable[[], Any], *, what: str, split: Group | None = None
) -> None:
    """Send ``make()`` (or what it raises) to ``peer``; with ``split``, only this rank's parts."""
    parts = 1 if split is None else split.world_size
    try:
        obj = make()  # checks ``split`` too
        encoded = encode(
            obj,
            g.device,
            min_tensor_bytes=DEFAULT_MIN_TENSOR_BYTES,
            bucket_bytes=DEFAULT_BUCKET_BYTES,
            pad_to=parts * ALIGN if parts > 1 else 1,
            split=parts,
            part=0 if split is None else split.rank_in_group,
        )
        packed = encoded.pack_all()  # a failure travels in the header
    except Exception as exc:
        _wire.send_bytes(g, None, peer, error=exc, what=what)
        raise  # unreachable: send_bytes raised
    _wire.send_bytes(g, encoded.body, peer, what=what)
    if not encoded.buckets:
        return
    _agree.recv_status(g, peer, what=what)  # the receiver's status: raises if it failed
    pieces = [_part(flat, split).contiguous() for flat in packed]
    _transfer.send_buckets(g, encoded.kinds, pieces, peer, what=what)


def _recv_payload(
    g: Group,
    peer: int,
    *,
    safe: object,
    what: str,
    error: BaseException | None = None,
    split: Group | None = None,
) -> Any:
    """Receive what ``_send_payload`` sent from group index ``peer``."""
    checked: Safe = False
    if error is None:
        checked, error = safe_or_error(safe, g.rank)
    stage = split if split is not None and split.world_size > 1 else None
    source = f"rank {g.ranks[peer]} (the sender of {what})"
    try:
        body = _wire.recv_bytes(g, peer, what=what)
        count = bucket_count(body, source=source)
    except PdistError as exc:  # the sender failed, or sent no pdist payload
        if stage is not None:  # the other receivers of the stage raise too
            _agree_split(stage, None, error or exc, what)
        raise
    decoded: Decoded | None = None
    buffers: list[torch.Tensor] = []
    tensors: list[torch.Tensor] = []
    if error is None:
        try:
            decoded = decode(body, source=source)
            _check_part(g, peer, decoded, stage)
            buffers = receive_buffers(decoded, g.device)
            tensors = tensors_of(decoded, buffers, g.device)
        except Exception as exc:
            error = exc
    if stage is not None:
        error = _agree_split(stage, decoded, error, what)
    # The sender waits for this rank's answer only when buckets follow.
    _transfer.prepare(g, lambda: None, error=error, together=count > 0, peer=peer, what=what)
    assert decoded is not None
    kinds, parts = [b.kind for b in decoded.buckets], [_part(data, split) for data in buffers]
    _transfer.recv_buckets(g, kinds, parts, peer, what=what)
    if stage is not None:
        works = [
            _transfer.start_all_gather(stage, kind, data, part)
            for kind, data, part in zip(kinds, buffers, parts, strict=True)
        ]
        wait_all(stage, works, what)
    return loads(decoded.skeleton, tensors, decoded.storage, safe=checked)


def _check_part(g: Group, peer: int, decoded: Decoded, stage: Group | None) -> None:
    """Raise unless this rank's share of each bucket is the part the sender sent (if any)."""
    parts, me = (1, 0) if stage is None else (stage.world_size, stage.rank_in_group)
    if not decoded.buckets:  # nothing travels split
        return
    if decoded.split != parts:
        msg = (
            f"all_gather_group on rank {g.rank} has {parts} rank(s) but rank "
            f"{g.ranks[peer]} sent each bucket in {decoded.split} part(s); pass "
            "all_gather_groups of the same size on both sides (or None on both)"
        )
        raise ValueError(msg)
    if decoded.part != me:
        msg = (
            f"rank {g.ranks[peer]} sent part {decoded.part} of each bucket to rank {g.rank}, "
            f"index {me} of its all_gather_group: pair each sender with the receiver at its "
            "own index in the stage"
        )
        raise ValueError(msg)


def _agree_split(
    split: Group, decoded: Decoded | None, failure: BaseException | None, what: str
) -> BaseException | None:
    """The receivers of one all-gather group agree on success and layout; returns the failure.

    Every receiver takes part, so that one's failure reaches the others before the all-gathers.
    """
    layout = repr([] if decoded is None else [list(b) for b in decoded.buckets])
    try:
        same = _agree.status(split, failure, what=what, summary=layout)
    except PdistError as exc:
        return exc
    if not same:
        msg = (
            f"{what}: the ranks of all_gather_group {split.name!r} {list(split.ranks)} received "
            "headers with different bucket layouts; every sender of a stage must send the "
            "same dict structure"
        )
        return RankMismatchError(msg)
    return failure


def send_object(group: Group | DistContext, obj: Any, dst: int) -> None:
    """Send a picklable ``obj`` to group index ``dst``, which calls ``recv_object``.

    If ``obj`` cannot be pickled, the receiver raises too.

    Args:
        group: The group (a context means its world).
        obj: The object.
        dst: Group index of the receiver (another rank).

    Raises:
        PdistError: This rank or the receiver failed (on both, naming it).
    """
    g = as_group(group)
    peer = _peer(g, dst, g.next_rank, "dst")
    _check_ends(g, peer, "send_object", "an object")
    _send_payload(g, peer, lambda: obj, what="send_object")


def recv_object(group: Group | DistContext, src: int, *, safe: Safe = False) -> Any:
    """Receive the object group index ``src`` sent with [`send_object`][pdist.send_object].

    Args:
        group: The group (a context means its world).
        src: Group index of the sender (another rank).
        safe: Unpickle through an allow-list (see [`broadcast_object`][pdist.broadcast_object]).

    Returns:
        The object, its tensors on this rank's device (CPU tensors stay on the CPU).

    Raises:
        PdistError: The sender failed, or this rank refused or could not rebuild
            the object (then the sender raises too when tensors were to follow).
    """
    g = as_group(group)
    peer = _peer(g, src, g.prev_rank, "src")
    _check_ends(g, peer, "recv_object", "an object")
    return _recv_payload(g, peer, safe=safe, what="recv_object")


def _check_split(all_gather_group: object, g: Group) -> Group | None:
    if all_gather_group is not None and not isinstance(all_gather_group, Group):
        msg = (
            f"all_gather_group={all_gather_group!r:.60} on rank {g.rank} must be a pdist "
            "Group or None"
        )
        raise TypeError(msg)
    if all_gather_group is not None and g.rank not in all_gather_group.ranks:
        msg = (
            f"all_gather_group={all_gather_group.name!r} on rank {g.rank} does not "
            f"contain this rank (its ranks: {list(all_gather_group.ranks)}); pass the "
            "group of this rank's pipeline stage, or None"
        )
        raise ValueError(msg)
    return all_gather_group


def send_tensor_dict(
    group: Group | DistContext,
    tensor_dict: Mapping[Any, Any],
    dst: int | None = None,
    *,
    all_gather_group: Group | None = None,
) -> None:
    """Send a (nested) dict of tensors to group index ``dst`` (default: the next rank).

    With ``all_gather_group`` of size k (a pipeline stage's TP group), this rank
    sends its 1/k of every bucket and the receivers all-gather the rest. If
    ``tensor_dict`` is not a dict or cannot be encoded, the receivers raise too.

    Note:
        The destination must call [`recv_tensor_dict`][pdist.recv_tensor_dict] with a
        matching ``all_gather_group`` size, at this rank's index in its own
        (else both stages raise).
    """
    g = as_group(group)
    peer = _peer(g, dst, g.next_rank, "dst")
    _check_ends(g, peer, "send_tensor_dict", "a tensor dict")

    def make() -> Mapping[Any, Any]:
        _check_split(all_gather_group, g)
        return check_tensor_dict(tensor_dict, g.rank)

    split = all_gather_group if isinstance(all_gather_group, Group) else None
    _send_payload(g, peer, make, what="send_tensor_dict", split=split)


def recv_tensor_dict(
    group: Group | DistContext,
    src: int | None = None,
    *,
    all_gather_group: Group | None = None,
    safe: Safe = False,
) -> dict[Any, Any]:
    """Receive the dict group index ``src`` (default: the previous rank) sent.

    With ``all_gather_group``, each rank receives its part of every bucket and
    the group all-gathers the rest (one receiver's failure raises on all of
    them and their senders).

    Note:
        Every receiver of a stage must pass the stage's
        ``all_gather_group``: one that passes None or another group raises, but
        cannot reach the others of the stage, which then wait for the timeout.

    Returns:
        The dict (of the sender's mapping type), with tensors on this rank's
        device (CPU tensors stay on the CPU).
    """
    g = as_group(group)
    what = "recv_tensor_dict"
    peer = _peer(g, src, g.prev_rank, "src")
    _check_ends(g, peer, what, "a tensor dict")
    error: BaseException | None = None
    split: Group | None = None
    try:
        split = _check_split(all_gather_group, g)
    except (TypeError, ValueError) as exc:
        error = exc
    out = _recv_payload(g, peer, safe=safe, what=what, error=error, split=split)
    # send_tensor_dict accepts any Mapping: refusing one here would fail after the sender
    # returned, on this side only.
    if not isinstance(out, Mapping):
        msg = f"{what}: rank {g.ranks[peer]} sent a {type(out).__name__}, not a dict"
        raise PdistError(msg)
    return out  # type: ignore[return-value]  # the sender's Mapping type
