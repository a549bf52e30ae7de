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

import math
import mmap
import pickle
import struct
from collections.abc import Sequence
from typing import Any, NamedTuple

import attrs
import torch
import torch.distributed as dist

from ._errors import PdistError
from ._group import Group
from ._serialize import (
    PROTOCOL,
    Safe,
    TensorSpec,
    dumps,
    loads,
    rebuild,
    shaped,
    spec_of,
    tensor_bytes,
)
from ._wire import bytes_of, tensor_of

__all__ = [
    "ALIGN",
    "Bucket",
    "Decoded",
    "Encoded",
    "Fill",
    "aligned",
    "buffer",
    "cpu_buffer",
    "decode",
    "empty_buckets",
    "encode",
    "layout",
    "materialize",
    "place",
    "process_group",
    "slab",
    "staging",
    "transport_device",
]

ALIGN = 64
"""Byte alignment of tensors inside a bucket, so every dtype can view its slice."""

_LEN = struct.Struct("<I")


class Bucket(NamedTuple):
    """One coalesced transfer: ``kind`` is ``"cpu"`` or ``"device"``."""

    kind: str
    nbytes: int


@attrs.frozen
class Decoded:
    """A parsed message body (receiver side), waiting for its buckets."""

    skeleton: bytes
    specs: list[TensorSpec]
    places: list[tuple[int, int]]
    buckets: list[Bucket]
    blob: bytes


_HUGE_MIN_BYTES = 32 << 20  # glibc's largest mapping threshold


def cpu_buffer(nbytes: int) -> torch.Tensor:
    """An uninitialized uint8 CPU buffer; large ones are backed by transparent huge pages.

    glibc hands out blocks of 32 MiB and more as fresh mappings, whose first
    write costs a page fault per 4 KiB page: for a 128 MiB receive buffer that
    costs about as much as the transfer itself. Transparent huge pages cut the
    faults 512-fold (``python -m pdist bench``, case (a)). Smaller blocks come
    from the heap, where a block freed by the previous call is reused warm; a
    fresh mapping would cost more there (measured: 1.0-1.8 ms against
    0.2-0.9 ms to allocate and fill 5-16 MiB on two ranks).
    """
    if nbytes < _HUGE_MIN_BYTES or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(nbytes, dtype=torch.uint8)
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(region, dtype=torch.uint8)  # the tensor keeps the region alive


def buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    """An uninitialized uint8 buffer on ``device`` (see :func:`cpu_buffer` for the CPU)."""
    if device.type == "cpu":
        return cpu_buffer(nbytes)
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def aligned(n: int) -> int:
    """``n`` rounded up to a multiple of ``ALIGN``."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


def layout(sizes: Sequence[int]) -> tuple[list[int], int]:
    """Byte offsets of consecutive parts of ``sizes`` bytes, each ``ALIGN``-ed, and the total."""
    offsets, total = [], 0
    for n in sizes:
        offsets.append(total)
        total = aligned(total + n)
    return offsets, total


def slab(sizes: Sequence[int], device: torch.device) -> list[torch.Tensor]:
    """Uninitialized uint8 buffers of ``sizes`` bytes on ``device``, carved from one allocation.

    The buckets of one transfer are alive together, so their total decides
    which memory backs them (see :func:`cpu_buffer`). Every buffer starts
    ``ALIGN``-ed.
    """
    offsets, total = layout(sizes)
    whole = buffer(total, device)
    return [whole[o : o + n] for o, n in zip(offsets, sizes, strict=True)]


@attrs.define
class Fill:
    """Tensors laid out in one bucket (at ``ALIGN``-ed byte offsets), packed on demand."""

    kind: str
    device: torch.device
    tensors: list[torch.Tensor] = attrs.field(factory=list)
    offsets: list[int] = attrs.field(factory=list)
    size: int = 0

    def add(self, t: torch.Tensor, nbytes: int) -> int:
        """Reserve ``nbytes`` of room for ``t``; returns its byte offset in the bucket."""
        offset = aligned(self.size)
        self.tensors.append(t)
        self.offsets.append(offset)
        self.size = offset + nbytes
        return offset

    def _lone(self, total: int) -> bool:
        return len(self.tensors) == 1 and total == self.size and self.tensors[0].is_contiguous()

    def pack(self, flat: torch.Tensor | None) -> torch.Tensor:
        """The bucket packed into ``flat`` (zero-padded past the tensors).

        ``flat`` is None for a lone tensor (see :func:`staging`), which goes without a copy.
        """
        if flat is None:
            return tensor_bytes(self.tensors[0])
        parts = [tensor_bytes(t) for t in self.tensors]
        if all(p.numel() % ALIGN == 0 for p in parts):
            # Offsets are then contiguous: one copy in C++.
            torch.cat(parts, out=flat[: self.size])
            flat[self.size :].zero_()
            return flat
        flat.zero_()  # the padding between parts
        for part, offset in zip(parts, self.offsets, strict=True):
            flat[offset : offset + part.numel()].copy_(part)
        return flat

    def receive_buffer(self, flat: torch.Tensor | None) -> torch.Tensor:
        """Where to receive this bucket: ``flat``, or the lone tensor itself when it is None."""
        return tensor_bytes(self.tensors[0]) if flat is None else flat

    def unpack(self, buffer: torch.Tensor) -> None:
        """Copy a received bucket into the tensors of ``add`` (not needed for a lone tensor)."""
        for t, offset in zip(self.tensors, self.offsets, strict=True):
            n = t.nbytes
            t.detach().copy_(buffer[offset : offset + n].view(t.dtype).view(t.shape))


def transport_device(kind: str, device: torch.device) -> torch.device:
    """Where a transport kind's bytes live: the CPU for ``"cpu"``, else the group's ``device``."""
    return torch.device("cpu") if kind == "cpu" else device


def process_group(group: Group, kind: str) -> dist.ProcessGroup:
    """The torch group that carries a transport kind: the CPU group for ``"cpu"``."""
    return group.cpu_group if kind == "cpu" else group.device_group


def place(
    fills: list[Fill], t: torch.Tensor, device: torch.device, bucket_bytes: int
) -> tuple[int, int]:
    """Put ``t`` into the open bucket of its transport, opening a new one when full.

    CPU tensors (and everything on a CPU group) go over the CPU group, other
    tensors over the device group, on ``device``. Returns ``(bucket index,
    byte offset)``.
    """
    # Tensors already where they travel from are kept as they are (packing detaches them).
    if t.is_cpu or device.type == "cpu":
        kind, data = "cpu", t if t.is_cpu else t.detach().cpu()
    else:
        kind, data = "device", t if t.device == device else t.detach().to(device)
    # The open bucket of a kind is its last one, found from the end (at most two kinds).
    index = len(fills) - 1
    while index >= 0 and fills[index].kind != kind:
        index -= 1
    nbytes = t.nbytes
    if index < 0 or aligned(fills[index].size) + nbytes > bucket_bytes:
        index = len(fills)
        fills.append(Fill(kind, transport_device(kind, device)))
    return index, fills[index].add(data, nbytes)


def staging(fills: list[Fill], sizes: list[int]) -> list[torch.Tensor | None]:
    """Buffers for the buckets of ``fills`` (of ``sizes`` bytes): one slab per transport.

    A lone tensor's bucket travels in place and gets None.
    """
    out: list[torch.Tensor | None] = [None] * len(fills)
    for kind in ("cpu", "device"):
        copied = [i for i, f in enumerate(fills) if f.kind == kind and not f._lone(sizes[i])]
        if copied:
            flats = slab([sizes[i] for i in copied], fills[copied[0]].device)
            for i, flat in zip(copied, flats, strict=True):
                out[i] = flat
    return out


@attrs.frozen
class Encoded:
    """A message body and the buckets that follow it (source side)."""

    body: bytes
    buckets: list[Bucket]
    _fills: list[Fill] = attrs.field(alias="fills")
    _staging: list[torch.Tensor | None] = attrs.field(alias="staging")

    def pack(self, index: int) -> torch.Tensor:
        """The flat uint8 buffer of bucket ``index`` (packed now, so packing can overlap sends)."""
        return self._fills[index].pack(self._staging[index])


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
    fills: list[Fill] = []
    for t in tensors:
        nbytes = t.nbytes
        if min_tensor_bytes is None or nbytes < min_tensor_bytes:
            inline.append(bytes_of(tensor_bytes(t.cpu())))
            places.append((-1, inline_size))
            inline_size += nbytes
            continue
        places.append(place(fills, t, device, bucket_bytes))
    buckets = [Bucket(f.kind, (f.size + pad_to - 1) // pad_to * pad_to) for f in fills]
    header = pickle.dumps(
        (len(skeleton), specs, places, [tuple(b) for b in buckets]),
        protocol=PROTOCOL,
    )
    body = b"".join([_LEN.pack(len(header)), header, skeleton, *inline])
    return Encoded(body, buckets, fills, staging(fills, [b.nbytes for b in buckets]))


def decode(body: bytes, *, safe: Safe = False) -> Decoded:
    """Parse a message body (the header is read through the safe unpickler when ``safe``)."""
    (header_len,) = _LEN.unpack_from(body)
    start = _LEN.size + header_len
    header = loads(body[_LEN.size : start], [], safe=safe)
    skeleton_len, specs, places, buckets = header
    return Decoded(
        skeleton=body[start : start + skeleton_len],
        specs=list(map(TensorSpec._make, specs)),
        places=places,
        buckets=[Bucket(k, n) for k, n in buckets],
        blob=body[start + skeleton_len :],
    )


def empty_buckets(decoded: Decoded, device: torch.device) -> list[torch.Tensor]:
    """Receive buffers for the buckets of ``decoded`` (one slab per transport)."""
    out: list[torch.Tensor | None] = [None] * len(decoded.buckets)
    for kind in ("cpu", "device"):
        members = [i for i, b in enumerate(decoded.buckets) if b.kind == kind]
        sizes = [decoded.buckets[i].nbytes for i in members]
        for i, flat in zip(members, slab(sizes, transport_device(kind, device)), strict=True):
            out[i] = flat
    if any(t is None for t in out):
        msg = f"unknown transport in buckets {decoded.buckets}"
        raise PdistError(msg)
    return out  # type: ignore[return-value]


def _slices(
    bucket: torch.Tensor, dtype: torch.dtype, places: list[tuple[int, int]]
) -> list[torch.Tensor]:
    """Flat ``dtype`` views of ``bucket`` at ``(byte offset, elements)`` places, in one call.

    The places must be increasing and not overlap (as ``Fill.add`` lays them out).
    """
    size = dtype.itemsize
    typed = bucket[: bucket.numel() // size * size].view(dtype)
    sizes, position = [], 0
    for offset, numel in places:
        start = offset // size
        if offset % size or start < position:
            msg = f"corrupt bucket layout: a {dtype} tensor at byte offset {offset}"
            raise PdistError(msg)
        sizes += [start - position, numel]
        position = start + numel
    if position > typed.numel():
        msg = f"corrupt bucket layout: {position} {dtype} elements in a bucket of {typed.numel()}"
        raise PdistError(msg)
    pieces = typed.split_with_sizes([*sizes, typed.numel() - position])
    return list(pieces[1::2])  # every other piece is the gap before a tensor


def tensors_of(
    decoded: Decoded,
    buckets: Sequence[torch.Tensor],
    device: torch.device,
) -> list[torch.Tensor]:
    """The received tensors, as views of ``buckets`` (which may still be filling)."""
    tensors: list[torch.Tensor | None] = [None] * len(decoded.specs)
    # Tensors of one dtype in one bucket are sliced together: (bucket, dtype) -> tensor indices.
    groups: dict[tuple[int, torch.dtype], list[int]] = {}
    for k, (spec, (index, offset)) in enumerate(zip(decoded.specs, decoded.places, strict=True)):
        if index < 0:
            n = spec.nbytes
            t = rebuild(spec, tensor_of(decoded.blob[offset : offset + n])[:n])
            tensors[k] = t.to(device) if spec.device_type != "cpu" and device.type != "cpu" else t
        elif index >= len(buckets):
            msg = f"a received tensor refers to bucket {index} of {len(buckets)}"
            raise PdistError(msg)
        else:
            groups.setdefault((index, spec.torch_dtype), []).append(k)
    for (index, dtype), members in groups.items():
        members.sort(key=lambda k: decoded.places[k][1])
        places = [(decoded.places[k][1], math.prod(decoded.specs[k].shape)) for k in members]
        for k, flat in zip(members, _slices(buckets[index], dtype, places), strict=True):
            tensors[k] = shaped(decoded.specs[k], flat)
    return tensors  # type: ignore[return-value]  # every index was filled


def materialize(
    decoded: Decoded,
    buckets: Sequence[torch.Tensor],
    device: torch.device,
    *,
    safe: Safe = False,
) -> Any:
    """Rebuild the object from a decoded body and its received buckets."""
    return loads(decoded.skeleton, tensors_of(decoded, buckets, device), safe=safe)
