"""One wire format for every object transport: a header, a skeleton, inline bytes, buckets.

``encode`` pickles an object with its tensors set aside (see ``_serialize``).
Tensors below ``min_tensor_bytes`` travel inline, as bytes in the message
body; the others are packed, as raw bytes, into buckets per transport kind
(``"cpu"``: over the CPU group; ``"device"``: over the device group, on the
group's device), each bucket bounded by ``bucket_bytes`` (a larger tensor gets
a bucket of its own and is sent without a copy). Receivers rebuild tensors as
views of the received buckets. Non-CPU tensors land on the receiver's device,
never on the sender's.

Body layout: ``[u32 header length][header pickle][skeleton][inline blob]``;
the header is ``(skeleton length, specs, places, buckets)`` where a place is
``(bucket index or -1 for inline, byte offset)`` and a bucket is
``(kind, nbytes)``.
"""

from __future__ import annotations

import pickle
import struct
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch

from ._errors import PdistError
from ._serialize import PROTOCOL, Safe, TensorSpec, dumps, loads, rebuild, spec_of, tensor_bytes
from ._wire import bytes_of, tensor_of

__all__ = ["ALIGN", "Bucket", "Decoded", "Encoded", "decode", "encode", "materialize"]

ALIGN = 64
"""Byte alignment of tensors inside a bucket, so every dtype can view its slice."""

_LEN = struct.Struct("<I")


@attrs.frozen
class Bucket:
    """One coalesced transfer: ``kind`` is ``"cpu"`` or ``"device"``."""

    kind: str
    nbytes: int


@attrs.frozen
class Encoded:
    """A message body and the bucket buffers that follow it (source side)."""

    body: bytes
    buckets: list[Bucket]
    data: list[torch.Tensor]


@attrs.frozen
class Decoded:
    """A parsed message body (receiver side), waiting for its buckets."""

    skeleton: bytes
    specs: list[TensorSpec]
    places: list[tuple[int, int]]
    buckets: list[Bucket]
    blob: bytes


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _kind(t: torch.Tensor, device: torch.device) -> str:
    return "cpu" if t.device.type == "cpu" or device.type == "cpu" else "device"


def _pack(parts: list[torch.Tensor], offsets: list[int], total: int, device: torch.device) -> torch.Tensor:
    if len(parts) == 1 and offsets[0] == 0:
        return parts[0]  # a lone tensor goes without a copy
    if all(p.numel() % ALIGN == 0 for p in parts):
        return torch.cat(parts)  # offsets are then contiguous already
    flat = torch.zeros(total, dtype=torch.uint8, device=device)
    for part, offset in zip(parts, offsets, strict=True):
        flat[offset : offset + part.numel()].copy_(part)
    return flat


def encode(
    obj: Any,
    device: torch.device,
    *,
    min_tensor_bytes: int | None = None,
    bucket_bytes: int = 1 << 62,
    pad_to: int = 1,
) -> Encoded:
    """Encode ``obj`` for the group whose device is ``device``.

    ``min_tensor_bytes=None`` sends every tensor inline. Bucket sizes are
    padded to a multiple of ``pad_to`` (for transports that split buckets).
    """
    skeleton, tensors = dumps(obj)
    specs = [spec_of(t) for t in tensors]
    places: list[tuple[int, int]] = []
    inline: list[bytes] = []
    inline_size = 0
    open_buckets: dict[str, int] = {}
    contents: list[tuple[str, list[torch.Tensor], list[int], int]] = []
    for t, spec in zip(tensors, specs, strict=True):
        nbytes = spec.nbytes
        if min_tensor_bytes is None or nbytes < min_tensor_bytes:
            inline.append(bytes_of(tensor_bytes(t.detach().cpu())))
            places.append((-1, inline_size))
            inline_size += nbytes
            continue
        kind = _kind(t, device)
        src = t if kind == "cpu" or t.device == device else t.to(device)
        src = src.cpu() if kind == "cpu" else src
        index = open_buckets.get(kind)
        if index is None or contents[index][3] + nbytes > bucket_bytes:
            index = open_buckets[kind] = len(contents)
            contents.append((kind, [], [], 0))
        kind_, parts, offsets, size = contents[index]
        offset = _aligned(size)
        parts.append(tensor_bytes(src))
        offsets.append(offset)
        contents[index] = (kind_, parts, offsets, offset + nbytes)
        places.append((index, offset))
    buckets: list[Bucket] = []
    data: list[torch.Tensor] = []
    for kind, parts, offsets, size in contents:
        total = (size + pad_to - 1) // pad_to * pad_to
        target = torch.device("cpu") if kind == "cpu" else device
        flat = _pack(parts, offsets, size, target)
        if flat.numel() < total:
            flat = torch.cat([flat, flat.new_zeros(total - flat.numel())])
        buckets.append(Bucket(kind, total))
        data.append(flat)
    header = pickle.dumps(
        (
            len(skeleton),
            [attrs.astuple(s) for s in specs],
            places,
            [(b.kind, b.nbytes) for b in buckets],
        ),
        protocol=PROTOCOL,
    )
    body = b"".join([_LEN.pack(len(header)), header, skeleton, *inline])
    return Encoded(body, buckets, data)


def decode(body: bytes, *, safe: Safe = False) -> Decoded:
    """Parse a message body (the header is read through the safe unpickler when ``safe``)."""
    (header_len,) = _LEN.unpack_from(body)
    start = _LEN.size + header_len
    header = loads(body[_LEN.size : start], [], safe=safe)
    skeleton_len, specs, places, buckets = header
    return Decoded(
        skeleton=body[start : start + skeleton_len],
        specs=[TensorSpec(*s) for s in specs],
        places=[tuple(p) for p in places],
        buckets=[Bucket(k, n) for k, n in buckets],
        blob=body[start + skeleton_len :],
    )


def empty_buckets(decoded: Decoded, device: torch.device) -> list[torch.Tensor]:
    """Receive buffers for the buckets of ``decoded``."""
    return [
        torch.empty(b.nbytes, dtype=torch.uint8, device="cpu" if b.kind == "cpu" else device)
        for b in decoded.buckets
    ]


def materialize(
    decoded: Decoded,
    buckets: Sequence[torch.Tensor],
    device: torch.device,
    *,
    safe: Safe = False,
    on_tensor: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> Any:
    """Rebuild the object from a decoded body and its received buckets."""
    tensors: list[torch.Tensor] = []
    for spec, (index, offset) in zip(decoded.specs, decoded.places, strict=True):
        n = spec.nbytes
        if index < 0:
            raw = tensor_of(decoded.blob[offset : offset + n])
            t = rebuild(spec, raw[:n])
            if spec.device_type != "cpu" and device.type != "cpu":
                t = t.to(device)
        else:
            if index >= len(buckets):
                msg = f"a received tensor refers to bucket {index} of {len(buckets)}"
                raise PdistError(msg)
            t = rebuild(spec, buckets[index][offset : offset + n])
        tensors.append(on_tensor(t) if on_tensor is not None else t)
    return loads(decoded.skeleton, tensors, safe=safe)
