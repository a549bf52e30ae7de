"""Object gathers: every rank's skeleton in one message, tensors in one region per transport.

The ranks agree that every one could decode and allocate before any tensor
moves. When the ranks send about as much as each other, one all-gather (or
gather) of equal rows moves every rank's region; otherwise each rank sends its
own, so that one large rank does not make every rank allocate W times its bytes.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch

from . import _check, _payload, _transfer, _wire
from ._buffers import ALIGN
from ._errors import PdistError
from ._group import DistContext, Group, as_group
from ._objects import DEFAULT_MIN_TENSOR_BYTES
from ._payload import Decoded, Encoded
from ._serialize import Safe, loads, safe_or_error
from ._transfer import KINDS, Regions, transport_device

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


class _Layout(NamedTuple):
    """Every rank's decoded body, the regions per transport, views of them, this rank's sends."""

    decodeds: list[Decoded]
    regions: dict[str, Regions]
    views: list[list[torch.Tensor]]
    sends: dict[str, torch.Tensor]


def _lay_out(
    g: Group,
    bodies: list[bytes],
    sizes: list[list[int]] | None,
    encoded: Encoded | None,
    receiving: bool,
) -> _Layout:
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
        kind: Regions([s[k] for s in sizes], transport_device(kind, g.device), receiving=receiving)
        for k, kind in enumerate(KINDS)
        if max(s[k] for s in sizes)
    }
    views = [
        _payload.tensors_of(d, [regions[b.kind].region(r) for b in d.buckets], g.device)
        for r, d in enumerate(decodeds)
    ]
    fills = {} if encoded is None else {f.kind: f for f in encoded.fills}  # one per kind
    sends = {kind: reg.send(g.rank_in_group, fills.get(kind)) for kind, reg in regions.items()}
    return _Layout(decodeds, regions, views, sends)


def _rebuilt(g: Group, layout: _Layout, safe: Safe) -> list[Any]:
    me = g.rank_in_group
    return [
        loads(d.skeleton, v, d.storage, safe=False if r == me else safe)
        for r, (d, v) in enumerate(zip(layout.decodeds, layout.views, strict=True))
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
    make = functools.partial(_lay_out, g, bodies, None, encoded, True)
    layout, _ = _transfer.prepare(g, make, together=any(counts), what=what)
    _transfer.all_gather_regions(g, layout.regions, layout.sends, what=what)
    return _rebuilt(g, layout, safe)


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
    g.global_rank(dst, name="dst")
    safe, encoded, error = _encode_own(g, obj, safe)
    if g.world_size == 1:
        return _alone(g, encoded, error)
    body = None if encoded is None else encoded.body
    sizes, bodies = _wire.gather_bytes(g, body, dst, error=error, record=_sizes(encoded), what=what)
    is_dst = g.rank_in_group == dst
    make = functools.partial(_lay_out, g, bodies, sizes, encoded, is_dst)
    layout, _ = _transfer.prepare(g, make, together=any(any(s) for s in sizes), what=what)
    _transfer.gather_regions(g, layout.regions, layout.sends, dst, what=what)
    return _rebuilt(g, layout, safe) if is_dst else None
