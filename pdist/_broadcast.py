"""Structured broadcast: the skeleton in one message, tensors in coalesced buckets.

A drop-in for ``torch.distributed.broadcast_object_list`` that pickles only
the skeleton. The header (skeleton, tensor specs, bucket layout and small
tensors inline) travels in one framed message, which is a single collective
when it fits the fixed first chunk; then each bucket is one collective.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from . import _payload, _wire
from ._group import DistContext, Group, as_group
from ._serialize import Safe, loads

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "DEFAULT_MIN_TENSOR_BYTES",
    "broadcast_object_list",
    "broadcast_tree",
    "check_tree",
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

_CONTAINERS = (dict, OrderedDict, list, tuple)


def _is_namedtuple(obj: object) -> bool:
    return isinstance(obj, tuple) and hasattr(type(obj), "_fields")


def check_tree(obj: Any) -> None:
    """Refuse cycles, shared mutable containers and unsupported container subclasses.

    Raises:
        ValueError: Naming the path (``[0]['a']``) where the problem is.
    """
    seen: dict[int, str] = {}
    on_path: set[int] = set()

    def visit(node: Any, path: str) -> None:
        if not isinstance(node, (dict, list, tuple)):
            return
        kind = type(node)
        if kind not in _CONTAINERS and not _is_namedtuple(node):
            msg = (
                f"unsupported container type {kind.__qualname__} at {path or 'the root'}; "
                "use dict, list, tuple or a namedtuple"
            )
            raise ValueError(msg)
        key = id(node)
        if key in on_path:
            msg = f"cycle: the container at {path} contains itself"
            raise ValueError(msg)
        if not isinstance(node, tuple):
            if key in seen:
                msg = (
                    f"shared container: {path} is the same object as {seen[key] or 'the root'}; "
                    "send a copy or restructure the payload"
                )
                raise ValueError(msg)
            seen[key] = path
        on_path.add(key)
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for k, v in items:
            visit(v, f"{path}[{k!r}]")
        on_path.discard(key)

    visit(obj, "")


def _transfer(group: Group, bucket: _payload.Bucket, data: torch.Tensor, src_global: int) -> Any:
    pg = _payload.process_group(group, bucket.kind)
    return dist.broadcast(data, src=src_global, group=pg, async_op=True)


def broadcast_tree(
    group: Group,
    obj: Any,
    src: int,
    *,
    safe: Safe = False,
    min_tensor_bytes: int = DEFAULT_MIN_TENSOR_BYTES,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    check: Callable[[Any], object] | None = None,
    what: str = "broadcast",
) -> Any:
    """Broadcast ``obj`` from group index ``src``; the engine behind the object broadcasts.

    ``check`` validates ``obj`` on the source; whatever it raises reaches
    every rank. The header goes through the group's shared-memory queue when
    it has one (:func:`~pdist.message_queue`), else over the CPU group. The
    source returns ``obj`` itself; receivers return the rebuilt object.
    """
    src_global = group.global_rank(src)
    if group.world_size == 1:
        if check is not None:
            check(obj)
        return obj
    send_header = _wire.broadcast_bytes if group._mq is None else group._mq.broadcast_bytes
    if group.rank_in_group == src:
        try:
            if check is not None:
                check(obj)
            encoded = _payload.encode(
                obj, group.device, min_tensor_bytes=min_tensor_bytes, bucket_bytes=bucket_bytes
            )
        except Exception as exc:
            send_header(group, None, src, error=exc, what=what)
            raise  # unreachable: send_header raised for the source too
        send_header(group, encoded.body, src, what=what)
        # Bucket k+1 is packed while bucket k is on the wire.
        works = [
            _transfer(group, bucket, encoded.pack(i), src_global)
            for i, bucket in enumerate(encoded.buckets)
        ]
        for work in works:
            work.wait()
        return obj
    body = send_header(group, None, src, what=what)
    decoded = _payload.decode(body, safe=safe)
    buffers = _payload.empty_buckets(decoded, group.device)
    works = [
        _transfer(group, bucket, data, src_global)
        for bucket, data in zip(decoded.buckets, buffers, strict=True)
    ]
    # Views of the buckets can be made while they fill; unpickling waits for the data,
    # since a leaf's __setstate__ may read the tensors it holds.
    tensors = _payload.tensors_of(decoded, buffers, group.device)
    for work in works:
        work.wait()
    return loads(decoded.skeleton, tensors, safe=safe)


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
    the skeleton: tensors travel as tensors, coalesced into one collective per
    (transport, 16 MiB) bucket, and are rebuilt on the receivers as views of
    the received buckets. A payload whose header fits 4 KiB takes a single
    collective in total. Repeated references to one tensor arrive as one
    tensor. Containers are dict, list, tuple and namedtuple; other leaves are
    pickled with the skeleton. CUDA tensors land on the receiver's device.

    If the source finds a cycle, a shared container or an unsupported
    container subclass in the payload (or cannot pickle it), every rank
    raises the same :class:`~pdist.PdistError`; nobody waits.

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
        TypeError: ``object_list`` is not a list.
        ValueError: ``src`` is outside the group.
        PdistError: The source could not encode the payload (on every rank).
    """
    g = as_group(group)
    if not isinstance(object_list, list):
        msg = f"object_list must be a list, got {type(object_list).__name__}"
        raise TypeError(msg)
    if (
        isinstance(min_tensor_bytes, bool)
        or not isinstance(min_tensor_bytes, int)
        or min_tensor_bytes < 0
    ):
        msg = f"min_tensor_bytes={min_tensor_bytes!r} must be a non-negative int"
        raise ValueError(msg)
    result = broadcast_tree(
        g,
        object_list,
        src,
        safe=safe,
        min_tensor_bytes=min_tensor_bytes,
        check=check_tree,
        what="broadcast_object_list",
    )
    if result is not object_list:
        object_list[:] = result
