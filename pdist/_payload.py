"""The object wire format: a body (prefix, JSON header, skeleton, inline bytes) and buckets.

``encode`` pickles an object with its tensors set aside (``_serialize``); tensors
below ``min_tensor_bytes`` travel inline in the body, the others as raw bytes in
buckets per transport kind, each bounded by ``bucket_bytes`` (``_transfer.plan``).
Receivers rebuild tensors as views of the buckets, on their own device. An
object without tensors travels as ``[lean magic][skeleton]``. Nothing before the
skeleton is pickle, every field a peer sends is checked, and nothing here moves data.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from typing import Any, NamedTuple

import attrs
import torch

from . import _plain
from ._buffers import ALIGN, bytes_of, tensor_bytes
from ._errors import PdistError
from ._serialize import DTYPES, TensorSpec, dtype_name, dtype_of, dumps, loads, shaped
from ._transfer import KINDS, Fill, Staging, fills, plan, slabs, staging, transport_device

__all__ = [
    "KEEP_FACTOR",
    "Bucket",
    "Decoded",
    "Encoded",
    "bucket_count",
    "decode",
    "encode",
    "materialize",
    "owned",
    "receive_buffers",
    "tensors_of",
]

GRAD, PARAM, DEVICE, STORAGE = 1, 2, 4, 8  # header flags
_PREFIX = struct.Struct("<4sII")  # magic, header length, bucket count
_MAGIC = b"pdP1"
_LEAN = b"pdP0"  # a body of only a skeleton (no tensors): the magic, then the pickle
_FIELDS = {"s", "d", "b", "t", "k", "p"}  # skeleton length, dtypes, buckets, tensors, parts, part
_MAX_DIMS = 64
_JSON = json.JSONEncoder(separators=(",", ":"), check_circular=False)  # ours has no cycle
KEEP_FACTOR = 4  # a received tensor keeps at most this many times its bytes alive (owned)
_JSON_IN = json.JSONDecoder()  # json.loads detects the bytes' encoding in Python first
_INT64 = 1 << 63  # sizes, shapes and offsets torch can hold are below it


def _viewable() -> frozenset[torch.dtype]:
    """The dtypes a flat uint8 buffer can be viewed as, except quantized ones (never dense)."""
    probe, out = torch.empty(64, dtype=torch.uint8), set()
    for dtype in DTYPES:
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


@attrs.define
class Encoded:
    """A message body and the buckets that follow it; the send buffers are staged on first use."""

    body: bytes
    buckets: list[Bucket]
    fills: list[Fill]
    _staging: Staging | None = None

    def _staged(self) -> Staging:
        if self._staging is None:  # allocated on first use
            self._staging = staging(self.fills, [b.nbytes for b in self.buckets])
        return self._staging

    def pack(self, index: int) -> torch.Tensor:
        """The flat uint8 buffer of bucket ``index``, packed."""
        return self.fills[index].pack(self._staged()[index])

    def pack_all(self) -> list[torch.Tensor]:
        """Every bucket packed (its staging is the sender's own)."""
        return [self.pack(i) for i in range(len(self.buckets))]

    @property
    def kinds(self) -> list[str]:
        """The transport kind of each bucket."""
        return [b.kind for b in self.buckets]


def encode(
    obj: Any,
    device: torch.device,
    *,
    min_tensor_bytes: int | None = None,
    bucket_bytes: int = 1 << 62,
    pad_to: int = 1,
    split: int = 1,
    part: int = 0,
) -> Encoded:
    """Encode ``obj`` (``min_tensor_bytes=None``: every tensor inline) for a group on ``device``.

    ``split``, ``part``: each bucket travels in ``split`` parts, of which the sender sends ``part``.
    """
    skeleton, entries = dumps(obj)
    if not entries:
        return Encoded(_LEAN + skeleton, [], [])
    dtypes: dict[torch.dtype, int] = {}
    records: list[list[Any]] = []
    inline: list[bytes] = []
    inline_size = 0
    bucketed: list[torch.Tensor] = []
    placed: list[list[Any]] = []  # the records of ``bucketed``, placed by the plan
    sizes: list[int] = []
    kinds: list[str] = []
    cpu_group = device.type == "cpu"
    for t, is_storage in entries:
        flags = (
            (GRAD if t.requires_grad else 0)
            | (PARAM if type(t) is torch.nn.Parameter else 0)
            | (0 if t.is_cpu else DEVICE)
            | (STORAGE if is_storage else 0)
        )
        nbytes = t.nbytes
        code = dtypes.setdefault(t.dtype, len(dtypes))
        record = [code, flags, -1, inline_size, t.shape]  # a tuple: JSON writes a list
        records.append(record)
        if min_tensor_bytes is None or nbytes < min_tensor_bytes or nbytes == 0:
            inline.append(bytes_of(tensor_bytes(t).cpu()))
            inline_size += nbytes
        else:
            bucketed.append(t)
            placed.append(record)
            sizes.append(nbytes)
            kinds.append("cpu" if cpu_group or not flags & DEVICE else "device")
    planned = plan(sizes, bucket_bytes, kinds=kinds)
    for b, bucket in enumerate(planned):
        for p in bucket.parts:
            placed[p.tensor][2:4] = b, p.offset
    fills_ = fills(planned, bucketed, device)
    buckets = [Bucket(f.kind, (f.size + pad_to - 1) // pad_to * pad_to) for f in fills_]
    names = [dtype_name(d) for d in dtypes]
    header = {"s": len(skeleton), "d": names, "b": [list(b) for b in buckets]}
    header.update({"t": records, "k": split, "p": part})
    data = _JSON.encode(header).encode()
    body = b"".join([_PREFIX.pack(_MAGIC, len(data), len(buckets)), data, skeleton, *inline])
    return Encoded(body, buckets, fills_)


def _corrupt(source: str, detail: str) -> PdistError:
    return PdistError(f"{source} sent a corrupt payload: {detail}")


def bucket_count(body: bytes, *, source: str = "a peer") -> int:
    """How many buckets follow a message body (from its prefix; PdistError if none)."""
    if body[:4] == _LEAN:
        return 0
    if len(body) < _PREFIX.size:
        raise _corrupt(source, f"{len(body)} bytes, shorter than the payload prefix")
    magic, _, count = _PREFIX.unpack_from(body)
    if magic != _MAGIC:
        raise _corrupt(source, f"unknown payload magic {magic!r}")
    return int(count)


class Decoded(NamedTuple):
    """A parsed message body, waiting for its buckets (a NamedTuple: one is made per message)."""

    skeleton: bytes
    specs: list[TensorSpec]
    storage: list[bool]
    places: list[tuple[int, int, int]]  # (bucket, byte offset, elements); bucket -1: inline
    buckets: list[Bucket]
    blob: bytes
    split: int = 1
    part: int = 0


def _is_int(value: object, low: int = 0) -> bool:
    return type(value) is int and low <= value < _INT64


def _header(body: bytes, count: int, source: str) -> tuple[dict[str, Any], int]:
    """The JSON header of ``body`` with its scalar fields checked, and where the skeleton starts."""
    header_len = _PREFIX.unpack_from(body)[1]
    start = _PREFIX.size + header_len
    if start > len(body):
        raise _corrupt(source, f"a header of {header_len} bytes in a body of {len(body)}")
    try:
        text = body[_PREFIX.size : start].decode()  # pdist writes UTF-8 without whitespace
        header, end = _JSON_IN.raw_decode(text)
        if end != len(text):
            raise ValueError(text)
    except (UnicodeDecodeError, ValueError):  # a RecursionError is caught by ``decode``
        raise _corrupt(source, "the header is not JSON") from None
    if not isinstance(header, dict) or set(header) != _FIELDS:
        # Checked here, not on every header: the fields' own checks refuse deeper nesting.
        if _plain.deeper_than(header, 4):
            raise _corrupt(source, "the header nests too deeply")
        raise _corrupt(source, "the header does not have the fields s, d, b, t, k, p")
    if not _is_int(header["k"], 1) or not _is_int(header["p"]) or header["p"] >= header["k"]:
        raise _corrupt(source, f"split {header['k']!r:.40} part {header['p']!r:.40}")
    if not _is_int(header["s"]) or start + header["s"] > len(body):
        raise _corrupt(source, f"skeleton length {header['s']!r:.40}")
    if not isinstance(header["d"], list) or not isinstance(header["t"], list):
        raise _corrupt(source, "the dtype or tensor table is not a list")
    raw = header["b"]
    if not isinstance(raw, list) or len(raw) != count:
        raise _corrupt(source, f"the bucket list does not hold the {count} buckets announced")
    for b in raw:
        if not (isinstance(b, list) and len(b) == 2 and b[0] in KINDS and _is_int(b[1])):
            raise _corrupt(source, f"bucket {b!r:.80}")
    return header, start


_Kind = tuple[TensorSpec, bool, int, int]  # spec, is a storage, elements, bytes


def _kind(r: list[Any], dtypes: list[torch.dtype], source: str) -> _Kind:
    """What a record's dtype code, flags and shape make of a tensor, checked (``r``: the record)."""
    code, flags, _, _, shape = r
    if not (0 <= code < len(dtypes) and 0 <= flags < 16):
        raise _corrupt(source, f"tensor record {r!r:.120}")
    numel = 1
    for d in shape:
        if not 0 <= d < _INT64:
            raise _corrupt(source, f"tensor record {r!r:.120}")
        numel *= d
    dtype = dtypes[code]
    if flags & STORAGE and (dtype != torch.uint8 or flags & (GRAD | PARAM) or len(shape) != 1):
        raise _corrupt(source, f"storage record {r!r:.120}")
    if flags & GRAD and not (dtype.is_floating_point or dtype.is_complex):
        raise _corrupt(source, f"requires_grad on a {dtype} tensor in {r!r:.120}")
    if dtype not in _VIEWABLE:
        raise _corrupt(source, f"a {dtype} tensor travelling as bytes in {r!r:.120}")
    nbytes = numel * dtype.itemsize
    if nbytes >= _INT64:
        raise _corrupt(source, f"tensor record {r!r:.120} of {nbytes} bytes")
    device = "device" if flags & DEVICE else "cpu"
    spec = TensorSpec(dtype, tuple(shape), device, bool(flags & GRAD), bool(flags & PARAM))
    return spec, bool(flags & STORAGE), numel, nbytes


def _row(
    r: object,
    count: int,
    dtypes: list[torch.dtype],
    blob: int,
    source: str,
    kinds: dict[tuple[int, ...], _Kind],
) -> tuple[TensorSpec, bool, tuple[int, int, int], int]:
    """``(spec, is a storage, (bucket, offset, elements), end)`` of one tensor record, checked.

    ``kinds`` holds the checked kinds of the records before (a model repeats a few shapes).
    """
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
    ):
        raise _corrupt(source, f"tensor record {r!r:.120}")
    for d in shape:  # ints only, so that equal keys mean equal records (True == 1)
        if type(d) is not int:
            raise _corrupt(source, f"tensor record {r!r:.120}")
    key = (code, flags, *shape)
    kind = kinds.get(key)
    if kind is None:
        kind = kinds[key] = _kind(r, dtypes, source)
    spec, is_storage, numel, nbytes = kind
    if bucket < 0 and offset + nbytes > blob:
        raise _corrupt(source, f"inline tensor {r!r:.120} past the end of the body")
    return spec, is_storage, (bucket, offset, numel), offset + nbytes


def decode(body: bytes, *, source: str = "a peer") -> Decoded:
    """Parse a message body, checking every field (a bad one raises ``PdistError``)."""
    if body[:4] == _LEAN:
        return Decoded(body[4:], [], [], [], [], b"", 1)
    try:
        count = bucket_count(body, source=source)
        header, start = _header(body, count, source)
        dtypes = [dtype_of(n) for n in header["d"]]
        buckets = [Bucket(b[0], b[1]) for b in header["b"]]
        blob = body[start + header["s"] :]
        specs, storage, places, ends = [], [], [], [-1] * count
        kinds: dict[tuple[int, ...], _Kind] = {}
        for r in header["t"]:
            spec, is_storage, place, end = _row(r, count, dtypes, len(blob), source, kinds)
            if place[0] >= 0 and end > ends[place[0]]:
                ends[place[0]] = end
            specs.append(spec)
            storage.append(is_storage)
            places.append(place)
    except RecursionError:  # JSON nested past the interpreter's limit (parsing or printing it)
        raise _corrupt(source, "the header nests too deeply") from None
    # A bucket is as large as its tensors, padded to under split * ALIGN bytes more (``encode``):
    # a receiver allocates no more than the tensors announced.
    slack = header["k"] * ALIGN
    for i, (b, end) in enumerate(zip(buckets, ends, strict=True)):
        if not end <= b.nbytes < end + slack:
            raise _corrupt(source, f"bucket {i} of {b.nbytes} bytes for tensors ending at {end}")
    skeleton = body[start : start + header["s"]]
    return Decoded(skeleton, specs, storage, places, buckets, blob, header["k"], header["p"])


def receive_buffers(decoded: Decoded, device: torch.device) -> list[torch.Tensor]:
    """Fresh receive buffers for the buckets of ``decoded`` (one slab per transport).

    The received tensors are views of them: the results own this memory.
    """
    if not decoded.buckets:
        return []  # a small object: no torch call at all
    places = [(b.kind, transport_device(b.kind, device)) for b in decoded.buckets]
    sizes = [b.nbytes for b in decoded.buckets]
    return slabs(places, sizes, "the received tensors")  # type: ignore[return-value]


def _slices(
    bucket: torch.Tensor, dtype: torch.dtype, places: list[tuple[int, int]]
) -> list[torch.Tensor]:
    """Flat ``dtype`` views of ``bucket`` at increasing ``(byte offset, elements)``, in one call."""
    size = dtype.itemsize
    typed = bucket[: bucket.numel() // size * size].view(dtype)
    sizes: list[int] = []  # of the pieces: the tensors, and the gaps between them
    tensors: list[int] = []  # which pieces are the tensors
    position = 0
    for offset, numel in places:
        start = offset // size
        if offset % size or start < position:
            msg = f"corrupt bucket layout: a {dtype} tensor at byte offset {offset}"
            raise PdistError(msg)
        if start > position:
            sizes.append(start - position)
        tensors.append(len(sizes))
        sizes.append(numel)
        position = start + numel
    if position > typed.numel():
        msg = f"corrupt bucket layout: {position} {dtype} elements in a bucket of {typed.numel()}"
        raise PdistError(msg)
    pieces = typed.split_with_sizes([*sizes, typed.numel() - position])
    return [pieces[i] for i in tensors]


def tensors_of(
    decoded: Decoded, buckets: Sequence[torch.Tensor], device: torch.device
) -> list[torch.Tensor]:
    """The received tensors, as views of ``buckets`` (which may still be filling)."""
    if not decoded.specs:
        return []
    tensors: list[torch.Tensor | None] = [None] * len(decoded.specs)
    # Tensors of one dtype in one bucket are sliced together: (bucket, dtype) -> (offset, index).
    together: dict[tuple[int, torch.dtype], list[tuple[int, int]]] = {}
    for k, (spec, (index, offset, numel)) in enumerate(
        zip(decoded.specs, decoded.places, strict=True)
    ):
        if index >= 0:
            together.setdefault((index, spec.dtype), []).append((offset, k))
            continue
        end = offset + numel * spec.dtype.itemsize
        if end > offset:
            raw = torch.frombuffer(bytearray(decoded.blob[offset:end]), dtype=torch.uint8)
        else:  # frombuffer refuses an empty buffer
            raw = torch.empty(0, dtype=torch.uint8)
        t = shaped(spec, raw if spec.dtype == torch.uint8 else raw.view(spec.dtype))
        tensors[k] = t.to(device) if spec.device_type != "cpu" and device.type != "cpu" else t
    for (index, dtype), members in together.items():
        members.sort()
        places = [(offset, decoded.places[k][2]) for offset, k in members]
        for (_, k), flat in zip(members, _slices(buckets[index], dtype, places), strict=True):
            tensors[k] = shaped(decoded.specs[k], flat)
    return tensors  # type: ignore[return-value]  # every index was filled


def owned(decoded: Decoded, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The received tensors, each copied out of its slab if it would keep far more alive.

    Call once the buckets are filled. A 300-element tensor that arrived beside a 64 MiB one
    would keep the whole receive slab alive for as long as it lives (and a child process it
    is handed to would map the whole slab): a result keeps at most ``KEEP_FACTOR`` times
    its own bytes alive. Storage entries are copied by the unpickler already.
    """
    out = []
    for spec, t, is_storage in zip(decoded.specs, tensors, decoded.storage, strict=True):
        own = max(t.numel() * t.element_size(), ALIGN)
        if not is_storage and t.untyped_storage().nbytes() > KEEP_FACTOR * own:
            t = shaped(spec, t.detach().reshape(-1).clone())  # a Parameter stays one
        out.append(t)
    return out


def materialize(decoded: Decoded, buckets: Sequence[torch.Tensor], device: torch.device) -> Any:
    """Rebuild the object from a decoded body and its filled buckets (plain unpickling)."""
    tensors = owned(decoded, tensors_of(decoded, buckets, device))
    return loads(decoded.skeleton, tensors, decoded.storage)
