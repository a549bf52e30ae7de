"""One wire format for every object transport: prefix, header, skeleton, inline bytes, buckets.

``encode`` pickles an object with its dense tensors (and the storages of
tensors pickled whole) set aside (see ``_serialize``). Tensors below
``min_tensor_bytes`` travel inline, as bytes in the message body; the others
are packed, as raw bytes, into buckets per transport kind (``"cpu"``: over the
CPU group; ``"device"``: over the device group, on the group's device), each
bucket bounded by ``bucket_bytes`` (a larger tensor gets a bucket of its own
and is sent without a copy). Receivers rebuild tensors as views of the
received buckets. Non-CPU tensors land on the receiver's device, never on the
sender's.

Body layout: ``[prefix][header][skeleton][inline blob]``. Nothing before the
skeleton is pickle:

- the prefix is a struct ``(magic, header length, bucket count)``, so a
  receiver knows whether buckets (and the status collective before them)
  follow before it decodes anything else;
- the header is JSON: ``{"s": skeleton length, "d": [dtype names], "b":
  [[kind, nbytes], ...], "t": [[dtype index, flags, bucket or -1 for inline,
  byte offset, [shape]], ...], "z": 1 when a status follows the buckets,
  "k": in how many parts each bucket travels}``,
  flags being :data:`GRAD`, :data:`PARAM`, :data:`DEVICE` and :data:`STORAGE`.

Every field a peer sends is checked before use; a malformed one raises
:class:`~pdist.PdistError` saying what was wrong.
"""

from __future__ import annotations

import json
import math
import mmap
import struct
from collections.abc import Sequence
from typing import Any, NamedTuple

import attrs
import torch
import torch.distributed as dist

from ._errors import PdistError
from ._group import Group
from ._serialize import (
    TensorSpec,
    dtype_name,
    dtype_of,
    dumps,
    loads,
    rebuild,
    resolved,
    shaped,
    tensor_bytes,
)
from ._wire import bytes_of, tensor_of

__all__ = [
    "ALIGN",
    "DEVICE",
    "GRAD",
    "PARAM",
    "STORAGE",
    "Bucket",
    "Decoded",
    "Encoded",
    "Fill",
    "aligned",
    "bucket_count",
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
    "tensors_of",
    "transport_device",
]

ALIGN = 64
"""Byte alignment of tensors inside a bucket, so every dtype can view its slice."""

GRAD, PARAM, DEVICE, STORAGE = 1, 2, 4, 8
"""Header flags: requires_grad, an ``nn.Parameter``, a non-CPU tensor, a storage's bytes."""

_PREFIX = struct.Struct("<4sII")  # magic, header length, bucket count
_MAGIC = b"pdP1"
_KINDS = ("cpu", "device")
_MAX_DIMS = 64
_INT64 = 1 << 63  # sizes, shapes and offsets torch can hold are below it


def _viewable() -> frozenset[torch.dtype]:
    """The dtypes a flat uint8 buffer can be viewed as, except quantized ones (never dense)."""
    probe = torch.empty(64, dtype=torch.uint8)
    out = set()
    for dtype in {d for d in vars(torch).values() if isinstance(d, torch.dtype)}:
        if "qint" in str(dtype) or "quint" in str(dtype):
            continue
        try:
            probe.view(dtype)
        except (RuntimeError, TypeError):
            continue
        out.add(dtype)
    return frozenset(out)


_VIEWABLE = _viewable()


class Bucket(NamedTuple):
    """One coalesced transfer: ``kind`` is ``"cpu"`` or ``"device"``."""

    kind: str
    nbytes: int


@attrs.frozen
class Decoded:
    """A parsed message body (receiver side), waiting for its buckets."""

    skeleton: bytes
    specs: list[TensorSpec]
    storage: list[bool]
    places: list[tuple[int, int]]
    buckets: list[Bucket]
    blob: bytes
    late_status: bool = False
    split: int = 1


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


def _typed(flat: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``flat`` (uint8, ``ALIGN``-ed) seen as a tensor of ``t``'s dtype and shape."""
    return (flat if t.dtype == torch.uint8 else flat.view(t.dtype)).view(t.shape)


@attrs.define
class Fill:
    """Tensors laid out in one bucket (at ``ALIGN``-ed byte offsets), packed on demand.

    ``tensors`` are what is sent (on the transport's device, conjugation and
    negation resolved); ``targets`` are where :meth:`unpack` writes received
    data (the original tensors, which may live elsewhere); ``aliased[i]``
    says whether ``tensors[i]`` is ``targets[i]``'s own memory.
    """

    kind: str
    device: torch.device
    tensors: list[torch.Tensor] = attrs.field(factory=list)
    targets: list[torch.Tensor] = attrs.field(factory=list)
    aliased: list[bool] = attrs.field(factory=list)
    offsets: list[int] = attrs.field(factory=list)
    size: int = 0

    def add(
        self, data: torch.Tensor, nbytes: int, target: torch.Tensor | None = None, *, alias: bool
    ) -> int:
        """Reserve ``nbytes`` of room for ``data``; returns its byte offset in the bucket."""
        offset = aligned(self.size)
        self.tensors.append(data)
        self.targets.append(data if target is None else target)
        self.aliased.append(alias)
        self.offsets.append(offset)
        self.size = offset + nbytes
        return offset

    def lone(self, total: int, *, receiving: bool = False) -> bool:
        """Whether the bucket is one contiguous tensor travelling in place (no staging copy).

        A receiver also needs the tensor to be its target's own memory.
        """
        return (
            len(self.tensors) == 1
            and total == self.size
            and self.tensors[0].is_contiguous()
            and (self.aliased[0] or not receiving)
        )

    def pack(self, flat: torch.Tensor | None) -> torch.Tensor:
        """The bucket packed into ``flat`` (zero-padded past the tensors).

        ``flat`` is None for a lone tensor (see :func:`staging`), which goes without a copy.
        """
        if flat is None:
            return tensor_bytes(self.tensors[0])
        if all(t.is_contiguous() for t in self.tensors):
            parts = [tensor_bytes(t) for t in self.tensors]
            if all(p.numel() % ALIGN == 0 for p in parts):
                # Offsets are then contiguous: one copy in C++.
                torch.cat(parts, out=flat[: self.size])
                flat[self.size :].zero_()
                return flat
        flat.zero_()  # the padding between parts
        for t, offset in zip(self.tensors, self.offsets, strict=True):
            n = t.nbytes
            if t.is_contiguous():
                flat[offset : offset + n].copy_(tensor_bytes(t))
            else:  # strided: one copy straight into place
                _typed(flat[offset : offset + n], t).copy_(t.detach())
        return flat

    def receive_buffer(self, flat: torch.Tensor | None) -> torch.Tensor:
        """Where to receive this bucket: ``flat``, or the lone tensor itself when it is None."""
        return tensor_bytes(self.tensors[0]) if flat is None else flat

    def unpack(self, buffer: torch.Tensor) -> None:
        """Copy a received bucket into the targets (not needed for a lone aliased tensor)."""
        for t, offset in zip(self.targets, self.offsets, strict=True):
            t.detach().copy_(_typed(buffer[offset : offset + t.nbytes], t))


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
    tensors over the device group, on ``device``. A tensor elsewhere is
    copied there to be sent; :meth:`Fill.unpack` writes received data back
    into ``t`` itself. Returns ``(bucket index, byte offset)``.
    """
    # Packing detaches; only pending conjugation or negation needs resolving (a copy) now.
    alias = not (t.is_conj() or t.is_neg())
    data = t if alias else resolved(t)
    if data.is_cpu or device.type == "cpu":
        kind = "cpu"
        if not data.is_cpu:
            data, alias = data.cpu(), False
    else:
        kind = "device"
        if data.device != device:
            data, alias = data.to(device), False
    # The open bucket of a kind is its last one, found from the end (at most two kinds).
    index = len(fills) - 1
    while index >= 0 and fills[index].kind != kind:
        index -= 1
    nbytes = data.nbytes
    if index < 0 or aligned(fills[index].size) + nbytes > bucket_bytes:
        index = len(fills)
        fills.append(Fill(kind, transport_device(kind, device)))
    return index, fills[index].add(data, nbytes, t, alias=alias)


def staging(
    fills: list[Fill], sizes: list[int], *, receiving: bool = False
) -> list[torch.Tensor | None]:
    """Buffers for the buckets of ``fills`` (of ``sizes`` bytes): one slab per transport.

    A lone tensor's bucket travels in place and gets None.
    """
    out: list[torch.Tensor | None] = [None] * len(fills)
    for kind in _KINDS:
        copied = [
            i
            for i, f in enumerate(fills)
            if f.kind == kind and not f.lone(sizes[i], receiving=receiving)
        ]
        if copied:
            flats = slab([sizes[i] for i in copied], fills[copied[0]].device)
            for i, flat in zip(copied, flats, strict=True):
                out[i] = flat
    return out


@attrs.define
class Encoded:
    """A message body and the buckets that follow it (source side)."""

    body: bytes
    buckets: list[Bucket]
    _fills: list[Fill] = attrs.field(alias="fills")
    _staging: list[torch.Tensor | None] | None = attrs.field(default=None, alias="staging")
    late_status: bool = False
    """Whether a bucket after the first is packed by copying (a broadcast that packs it while
    the previous one is on the wire then reports the packing's status after the buckets)."""

    def lone(self, index: int) -> bool:
        """Whether bucket ``index`` is one tensor sent in place (:meth:`pack` copies nothing)."""
        return self._fills[index].lone(self.buckets[index].nbytes)

    def allocate(self) -> None:
        """Allocate the staging memory of the buckets that need a copy (once)."""
        if self._staging is None:
            self._staging = staging(self._fills, [b.nbytes for b in self.buckets])

    def pack(self, index: int) -> torch.Tensor:
        """The flat uint8 buffer of bucket ``index`` (staging memory is allocated on first use)."""
        self.allocate()
        assert self._staging is not None
        return self._fills[index].pack(self._staging[index])

    def unpacked(self, index: int) -> torch.Tensor:
        """Bucket ``index``'s buffer without packing it (what is sent after a packing failure)."""
        self.allocate()
        assert self._staging is not None
        flat = self._staging[index]
        return self._fills[index].receive_buffer(flat)

    def pack_all(self) -> list[torch.Tensor]:
        """Every bucket's flat buffer, packed now."""
        return [self.pack(i) for i in range(len(self.buckets))]

    def pack_into(self, index: int, flat: torch.Tensor) -> None:
        """Pack bucket ``index`` into ``flat`` (its size in bytes), for transports that gather."""
        self._fills[index].pack(flat)


def encode(
    obj: Any,
    device: torch.device,
    *,
    min_tensor_bytes: int | None = None,
    bucket_bytes: int = 1 << 62,
    pad_to: int = 1,
    split: int = 1,
) -> Encoded:
    """Encode ``obj`` for the group whose device is ``device``.

    ``min_tensor_bytes=None`` sends every tensor inline. Bucket sizes are
    padded to a multiple of ``pad_to`` (for transports that split buckets);
    ``split`` tells the receiver in how many parts each bucket travels.
    """
    skeleton, entries = dumps(obj)
    dtypes: dict[str, int] = {}
    records: list[list[Any]] = []
    inline: list[bytes] = []
    inline_size = 0
    fills: list[Fill] = []
    for t, is_storage in entries:
        nbytes = t.nbytes
        flags = (
            (GRAD if t.requires_grad else 0)
            | (PARAM if type(t) is torch.nn.Parameter else 0)
            | (0 if t.is_cpu else DEVICE)
            | (STORAGE if is_storage else 0)
        )
        if min_tensor_bytes is None or nbytes < min_tensor_bytes:
            inline.append(bytes_of(tensor_bytes(t).cpu()))
            bucket, offset = -1, inline_size
            inline_size += nbytes
        else:
            bucket, offset = place(fills, t, device, bucket_bytes)
        code = dtypes.setdefault(dtype_name(t.dtype), len(dtypes))
        records.append([code, flags, bucket, offset, list(t.shape)])
    buckets = [Bucket(f.kind, (f.size + pad_to - 1) // pad_to * pad_to) for f in fills]
    late = any(not f.lone(b.nbytes) for f, b in zip(fills[1:], buckets[1:], strict=True))
    header = json.dumps(
        {
            "s": len(skeleton),
            "d": list(dtypes),
            "b": [list(b) for b in buckets],
            "t": records,
            "z": int(late),
            "k": split,
        },
        separators=(",", ":"),
    ).encode()
    prefix = _PREFIX.pack(_MAGIC, len(header), len(buckets))
    body = b"".join([prefix, header, skeleton, *inline])
    return Encoded(body, buckets, fills, late_status=late)


def _corrupt(source: str, detail: str) -> PdistError:
    return PdistError(f"{source} sent a corrupt payload: {detail}")


def bucket_count(body: bytes, *, source: str = "a peer") -> int:
    """How many buckets follow a message body (read from its fixed prefix only).

    Raises:
        PdistError: The body is not a pdist payload.
    """
    if len(body) < _PREFIX.size:
        raise _corrupt(source, f"{len(body)} bytes, shorter than the payload prefix")
    magic, _, count = _PREFIX.unpack_from(body)
    if magic != _MAGIC:
        raise _corrupt(source, f"unknown payload magic {magic!r}")
    return int(count)


def _is_int(value: object, low: int = 0) -> bool:
    return type(value) is int and low <= value < _INT64


def _record_kind(
    code: int, flags: int, dtypes: list[torch.dtype], names: list[str], r: object, source: str
) -> tuple[str, str, bool, bool, bool, int]:
    """The spec fields a tensor record's dtype index and flags stand for, checked."""
    if not (0 <= code < len(dtypes) and 0 <= flags < 16):
        raise _corrupt(source, f"tensor record {r!r:.120}")
    dtype = dtypes[code]
    if flags & STORAGE and (dtype != torch.uint8 or flags & (GRAD | PARAM)):
        raise _corrupt(source, f"storage record {r!r:.120}")
    if flags & GRAD and not (dtype.is_floating_point or dtype.is_complex):
        raise _corrupt(source, f"requires_grad on a {dtype} tensor in {r!r:.120}")
    if dtype not in _VIEWABLE:
        raise _corrupt(source, f"a {dtype} tensor travelling as bytes in {r!r:.120}")
    return (
        names[code],
        "device" if flags & DEVICE else "cpu",
        bool(flags & GRAD),
        bool(flags & PARAM),
        bool(flags & STORAGE),
        dtype.itemsize,
    )


def decode(body: bytes, *, source: str = "a peer") -> Decoded:
    """Parse a message body, checking every field (a bad one raises :class:`~pdist.PdistError`)."""
    try:
        return _decode(body, source)
    except RecursionError:  # JSON nested past the interpreter's limit (parsing or printing it)
        raise _corrupt(source, "the header nests too deeply") from None


def _decode(body: bytes, source: str) -> Decoded:
    count = bucket_count(body, source=source)
    _, header_len, _ = _PREFIX.unpack_from(body)
    start = _PREFIX.size + header_len
    if start > len(body):
        raise _corrupt(source, f"a header of {header_len} bytes in a body of {len(body)}")
    try:
        header = json.loads(body[_PREFIX.size : start])
    except (UnicodeDecodeError, ValueError):
        raise _corrupt(source, "the header is not JSON") from None
    if not isinstance(header, dict) or set(header) != {"s", "d", "b", "t", "z", "k"}:
        raise _corrupt(source, "the header does not have the fields s, d, b, t, z, k")
    if not _is_int(header["k"], 1):
        raise _corrupt(source, f"split {header['k']!r:.40}")
    skeleton_len, names, raw_buckets, records = header["s"], header["d"], header["b"], header["t"]
    if header["z"] not in (0, 1) or type(header["z"]) is not int or (header["z"] and count < 2):
        raise _corrupt(source, f"late status flag {header['z']!r:.40} with {count} buckets")
    if not _is_int(skeleton_len) or start + skeleton_len > len(body):
        raise _corrupt(source, f"skeleton length {skeleton_len!r:.40}")
    if not isinstance(names, list):
        raise _corrupt(source, "dtype table is not a list")
    dtypes = [dtype_of(n) for n in names]
    if not isinstance(raw_buckets, list) or len(raw_buckets) != count:
        raise _corrupt(source, f"the bucket list does not hold the {count} buckets announced")
    buckets = []
    for b in raw_buckets:
        if not (isinstance(b, list) and len(b) == 2 and b[0] in _KINDS and _is_int(b[1])):
            raise _corrupt(source, f"bucket {b!r:.80}")
        buckets.append(Bucket(b[0], b[1]))
    if not isinstance(records, list):
        raise _corrupt(source, "the tensor table is not a list")
    blob = body[start + skeleton_len :]
    specs, storage, places = [], [], []
    ends = [-1] * count  # per bucket: where its last tensor ends (-1: no tensor in it)
    # What a (dtype, flags) pair allows is checked once per distinct pair.
    kinds: dict[tuple[int, int], tuple[str, str, bool, bool, bool, int]] = {}
    for r in records:
        if type(r) is not list or len(r) != 5:
            raise _corrupt(source, f"tensor record {r!r:.120}")
        code, flags, bucket, offset, shape = r
        if not (
            type(code) is int
            and type(flags) is int
            and type(bucket) is int
            and type(offset) is int
            and type(shape) is list
            and -1 <= bucket < count
            and 0 <= offset < _INT64
            and len(shape) <= _MAX_DIMS
            and all(type(d) is int and 0 <= d < _INT64 for d in shape)
        ):
            raise _corrupt(source, f"tensor record {r!r:.120}")
        kind = kinds.get((code, flags))
        if kind is None:
            kind = kinds[code, flags] = _record_kind(code, flags, dtypes, names, r, source)
        name, device_type, grad, param, is_storage, itemsize = kind
        if is_storage and len(shape) != 1:
            raise _corrupt(source, f"storage record {r!r:.120}")
        nbytes = math.prod(shape) * itemsize
        if nbytes >= _INT64:
            raise _corrupt(source, f"tensor record {r!r:.120} of {nbytes} bytes")
        if bucket < 0 and offset + nbytes > len(blob):
            raise _corrupt(source, f"inline tensor {r!r:.120} past the end of the body")
        if bucket >= 0:
            ends[bucket] = max(ends[bucket], offset + nbytes)
        specs.append(TensorSpec(name, tuple(shape), device_type, grad, param))
        storage.append(is_storage)
        places.append((bucket, offset))
    # A bucket is as large as its tensors, padded to at most split * ALIGN bytes (``encode``):
    # a receiver allocates no more than the tensors announced.
    slack = header["k"] * ALIGN
    for i, (b, end) in enumerate(zip(buckets, ends, strict=True)):
        if not end <= b.nbytes < end + slack:
            raise _corrupt(source, f"bucket {i} of {b.nbytes} bytes for tensors ending at {end}")
    return Decoded(
        skeleton=body[start : start + skeleton_len],
        specs=specs,
        storage=storage,
        places=places,
        buckets=buckets,
        blob=blob,
        late_status=bool(header["z"]),
        split=header["k"],
    )


def empty_buckets(decoded: Decoded, device: torch.device) -> list[torch.Tensor]:
    """Receive buffers for the buckets of ``decoded`` (one slab per transport).

    Raises:
        PdistError: They cannot be allocated (out of memory).
    """
    out: list[torch.Tensor] = [torch.empty(0, dtype=torch.uint8)] * len(decoded.buckets)
    for kind in _KINDS:
        members = [i for i, b in enumerate(decoded.buckets) if b.kind == kind]
        sizes = [decoded.buckets[i].nbytes for i in members]
        if members:
            target = transport_device(kind, device)
            try:
                flats = slab(sizes, target)
            except Exception as exc:  # RuntimeError (out of memory), OSError from mmap...
                msg = (
                    f"could not allocate {sum(sizes)} bytes on {target} for the received "
                    f"tensors ({type(exc).__name__}: {str(exc)[:200]}); free memory or send less "
                    "in one call"
                )
                raise PdistError(msg) from exc
            for i, flat in zip(members, flats, strict=True):
                out[i] = flat
    return out


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


def materialize(decoded: Decoded, buckets: Sequence[torch.Tensor], device: torch.device) -> Any:
    """Rebuild the object from a decoded body and its received buckets (plain unpickling)."""
    tensors = tensors_of(decoded, buckets, device)
    return loads(decoded.skeleton, tensors, decoded.storage)
