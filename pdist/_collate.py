"""Evaluation: a sampler without padding and a collation back into dataset order.

``collate_batches`` reserves the memory of its gathers, then all-gathers every
rank's sample count and metadata record (JSON), or the marker of what failed: one
round trip when every rank has batches. At most three all-gathers per transport
then carry the leaves as raw bytes, straight into dataset order, in memory of the
call's own.
"""

from __future__ import annotations

import collections
import itertools
import json
import math
import struct
from collections.abc import Callable, Iterator, Sequence, Sized
from typing import Any, NamedTuple

import torch
from torch.utils.data import Sampler

from . import _agree, _plain, _transfer, _wire
from ._buffers import ALIGN, aligned, allocate
from ._departures import wait_all
from ._errors import PdistError, RankMismatchError
from ._group import DistContext, Group, as_group
from ._serialize import dtype_name, dtype_of

__all__ = ["EvalSampler", "collate_batches"]


class EvalSampler(Sampler[int]):
    """Give rank ``r`` of ``group`` the indices ``r, r + W, r + 2W, ...`` (``W`` = group size).

    Unlike ``torch.utils.data.DistributedSampler`` it never pads with duplicates, so
    metrics over the outputs [`collate_batches`][pdist.collate_batches] gathers are exact.

    Args:
        dataset: Anything with a ``len()``.
        group: The group the dataset is split over (a context means its world).
    """

    def __init__(self, dataset: Sized, group: Group | DistContext) -> None:
        g = as_group(group)
        self._indices = range(g.rank_in_group, len(dataset), g.world_size)

    def __iter__(self) -> Iterator[int]:
        return iter(self._indices)

    def __len__(self) -> int:
        return len(self._indices)


Spec = Any  # "T" for a tensor leaf, or (kind, keys, children)
_WHAT = "collate_batches"


class _Leaf(NamedTuple):
    """What every rank agreed on about one leaf."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    device_type: str

    @property
    def nbytes(self) -> int:  # per sample
        return math.prod(self.shape) * self.dtype.itemsize


class _Local(NamedTuple):
    """This rank's batches, checked: leaf by leaf (columns)."""

    spec: Spec  # None: no batches
    columns: list[list[torch.Tensor]]
    leaves: list[_Leaf]
    samples: int


_NO_BATCHES = _Local(None, [], [], 0)


def _flatten(obj: Any, path: str, leaves: list[tuple[str, torch.Tensor]]) -> Spec:
    if isinstance(obj, torch.Tensor):
        leaves.append((path or "<root>", obj))
        return "T"
    if isinstance(obj, dict):
        for k in obj:
            if not _plain_key(k):
                msg = (
                    f"{path or 'a batch'} has the key {k!r} "
                    f"({type(k).__name__}); keys travel between ranks as plain data: use str, "
                    "int, float, bool, None or tuples of them"
                )
                raise TypeError(msg)
        children = tuple(_flatten(v, f"{path}[{k!r}]", leaves) for k, v in obj.items())
        return ("dict", tuple(obj), children)
    if isinstance(obj, (list, tuple)):
        children = tuple(_flatten(v, f"{path}[{i}]", leaves) for i, v in enumerate(obj))
        return ("list" if isinstance(obj, list) else "tuple", len(obj), children)
    msg = (
        f"{path or 'a batch'} is a {type(obj).__name__}; batches hold "
        "tensors in (nested) dicts, lists and tuples"
    )
    raise TypeError(msg)


def _plain_key(key: Any) -> bool:
    if isinstance(key, tuple):
        return all(_plain_key(k) for k in key)
    return key is None or isinstance(key, (str, int, float))


def _unflatten(spec: Spec, leaves: Iterator[Any]) -> Any:
    if spec == "T":
        return next(leaves)
    kind, keys, children = spec
    values = [_unflatten(c, leaves) for c in children]
    if kind == "dict":
        return dict(zip(keys, values, strict=True))
    return values if kind == "list" else tuple(values)


def _follow(obj: Any, spec: Spec, leaves: list[torch.Tensor]) -> bool:
    """Collect the leaves of ``obj`` if it has the (container) structure ``spec``."""
    kind, keys, children = spec
    if kind == "dict":
        if not isinstance(obj, dict) or tuple(obj) != keys:
            return False
        obj = obj.values()
    elif not isinstance(obj, list if kind == "list" else tuple) or len(obj) != keys:
        return False
    for value, child in zip(obj, children, strict=True):
        if child == "T" and isinstance(value, torch.Tensor):  # most leaves: no call
            leaves.append(value)
        elif child == "T" or not _follow(value, child, leaves):
            return False
    return True


def _leaf_problem(t: torch.Tensor, device: torch.device) -> str | None:
    """Why ``t`` cannot be gathered as raw bytes (None: it can)."""
    if t.is_nested:
        return "a nested tensor; pad it (torch.nested.to_padded_tensor) first"
    if t.layout != torch.strided:
        return f"a {t.layout} tensor; collate_batches gathers dense tensors: pass .to_dense()"
    if t.is_quantized:
        return "a quantized tensor; pass .dequantize()"
    if getattr(type(t), "__torch_dispatch__", None) is not torch.Tensor.__torch_dispatch__:
        # Its own dispatch (DTensor, FakeTensor...): packing its data into a plain buffer fails,
        # and it would fail only after the ranks without samples entered the gather.
        return (
            f"a {type(t).__name__}, a tensor subclass with its own dispatch; pass plain "
            "tensors (for a DTensor: .full_tensor() or .to_local())"
        )
    if t.device.type != "cpu" and t.device != device:
        return (
            f"on {t.device}; collate_batches gathers CPU tensors and tensors on the group's "
            f"device {device}: move it with .cpu() or .to({str(device)!r})"
        )
    return None


def _own_batches(batches: Any, device: torch.device) -> _Local:
    if not isinstance(batches, Sequence) or isinstance(batches, (str, bytes)):
        got = "None" if batches is None else f"a {type(batches).__name__}"
        msg = (
            f"batches must be a list of this rank's per-batch outputs, got "
            f"{got}; pass [] on a rank without samples"
        )
        raise TypeError(msg)
    if not batches:
        return _NO_BATCHES
    named: list[tuple[str, torch.Tensor]] = []
    spec = _flatten(batches[0], "", named)
    root = ("tuple", 1, (spec,))  # _follow walks containers: each batch goes in a 1-tuple
    names, firsts = [name for name, _ in named], [t for _, t in named]
    _check_batch(0, names, firsts, firsts, device)
    like = [(type(t), t.dtype, t.layout, t.is_cpu, t.device, t.shape) for t in firsts]
    columns = [[t] for t in firsts]
    for i in range(1, len(batches)):
        leaves: list[torch.Tensor] = []
        if not _follow((batches[i],), root, leaves):
            msg = f"batch {i} has another structure than batch 0"
            raise ValueError(msg)
        if not _alike(leaves, like):
            _check_batch(i, names, leaves, firsts, device)
        for t, column in zip(leaves, columns, strict=True):
            column.append(t)
    metadata = [_Leaf(t.dtype, tuple(t.shape[1:]), t.device.type) for t in firsts]
    count = sum(t.shape[0] for t in columns[0]) if columns else 0
    return _Local(spec, columns, metadata, count)


def _alike(leaves: list[torch.Tensor], like: list[tuple[Any, ...]]) -> bool:
    """A few cheap checks that a batch's leaves are like batch 0's (else ``_check_batch``)."""
    count = None
    for t, (kind, dtype, layout, cpu, device, shape) in zip(leaves, like, strict=True):
        if type(t) is not kind or t.is_nested:  # a nested tensor raises when its shape is read
            return False
        size = t.shape  # read once: each tensor attribute costs a call
        if count is None:
            count = size[0] if size else -1
        if (
            t.dtype is not dtype
            or t.layout is not layout
            or not (t.is_cpu if cpu else t.device == device)
            or (size != shape and (not size or size[1:] != shape[1:]))
            or size[0] != count
        ):
            return False
    return True


def _check_batch(
    i: int,
    names: list[str],
    leaves: list[torch.Tensor],
    firsts: list[torch.Tensor],
    device: torch.device,
) -> None:
    for name, t in zip(names, leaves, strict=True):  # first: a nested tensor has no shape
        problem = _leaf_problem(t, device)
        if problem is not None:
            msg = f"leaf {name} of batch {i} is {problem}"
            raise ValueError(msg)
    if any(t.dim() == 0 for t in leaves):
        msg = f"batch {i} has a 0-d tensor; the sample dimension comes first"
        raise ValueError(msg)
    sizes = {t.shape[0] for t in leaves}
    if len(sizes) > 1:
        msg = f"the leaves of batch {i} hold different sample counts {sorted(sizes)}"
        raise ValueError(msg)
    for name, first, t in zip(names, firsts, leaves, strict=True):
        if t.dtype != first.dtype or t.shape[1:] != first.shape[1:]:
            msg = (
                f"leaf {name} is {t.dtype} {tuple(t.shape[1:])} in batch {i} "
                f"but {first.dtype} {tuple(first.shape[1:])} in batch 0"
            )
            raise ValueError(msg)
        if t.device != first.device:
            msg = (
                f"leaf {name} is on {t.device} in batch {i} but on "
                f"{first.device} in batch 0; keep each leaf on one device"
            )
            raise ValueError(msg)


_COUNT = struct.Struct("<q")  # a message: this rank's sample count, then its record
_NONE = b"null"  # the record of a rank without batches
_FIELDS = ("dtype", "trailing shape", "device type")


def _tuples(value: Any) -> Any:
    """A record as it left its rank: JSON carries tuples as lists."""
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def _parse_leaf_record(g: Group, rank: int, record: bytes) -> tuple[Spec, tuple[str, ...], Any]:
    """The structure, the leaf names and the leaves' metadata in ``rank``'s ``record``."""
    try:
        spec, leaves = _tuples(_plain.loads(record))
        named: list[tuple[str, torch.Tensor]] = []
        # Rebuilding the structure checks it, and names the leaves as their rank did.
        if _flatten(_unflatten(spec, itertools.repeat(torch.empty(0))), "", named) != spec:
            raise ValueError(spec)
        if len(leaves) != len(named) or any(len(leaf) != len(_FIELDS) for leaf in leaves):
            raise ValueError(leaves)
    except (TypeError, ValueError, RecursionError):
        msg = (
            f"collate_batches on group {g.name!r}: rank {rank} sent a malformed metadata "
            "record; do all ranks run the same pdist version?"
        )
        raise PdistError(msg) from None
    return spec, tuple(name for name, _ in named), leaves


def _differences(g: Group, records: dict[int, bytes]) -> RankMismatchError:
    """What differs between the ranks' ``records`` (which are not all equal)."""
    parsed = {rank: _parse_leaf_record(g, rank, record) for rank, record in records.items()}
    what = "the metadata record"
    values: dict[int, Any] = {rank: rank for rank in parsed}
    if len({repr(spec) for spec, _, _ in parsed.values()}) > 1:
        what, values = "the structure (leaves)", {r: names for r, (_, names, _) in parsed.items()}
    else:
        names = next(iter(parsed.values()))[1]
        for i, (field, label) in itertools.product(range(len(names)), enumerate(_FIELDS)):
            by_rank = {rank: leaves[i][field] for rank, (_, _, leaves) in parsed.items()}
            if len(set(by_rank.values())) > 1:
                what, values = f"the {label} of leaf {names[i]}", by_rank
                break
    parts = _agree.ranks_by_value(values, value_first=True)
    return RankMismatchError(f"collate_batches: {what} differs across ranks: {parts}")


def _sample_counts(g: Group, messages: list[bytes]) -> list[int]:
    """Every rank's sample count; RankMismatchError if EvalSampler cannot produce them."""
    counts = [_COUNT.unpack_from(m)[0] if len(m) >= _COUNT.size else -1 for m in messages]
    total, world = sum(counts), g.world_size
    expected = [len(range(r, total, world)) for r in range(world)]
    if counts != expected:
        msg = (
            f"collate_batches: samples per rank {counts} are not what EvalSampler gives for "
            f"{total} samples over {world} ranks ({expected}); shard the dataset with EvalSampler"
        )
        raise RankMismatchError(msg)
    return counts


def collate_batches(group: Group | DistContext, batches: Sequence[Any]) -> Any:
    """Gather every rank's evaluation outputs, in dataset order, on every rank.

    ``batches`` is this rank's list of per-batch outputs (a tensor, or nested
    dicts/lists/tuples of tensors, sample dimension first) from an
    [`EvalSampler`][pdist.EvalSampler] over ``group``; a rank with no samples passes ``[]``.
    Leaves are dense tensors on the CPU or on the group's device; dict keys are
    str, int, float, bool, None or tuples of them.

    Note:
        All ranks of the group must call it. Whatever goes wrong on one
        rank raises on every rank, naming that rank.

    Returns:
        On every rank, the whole dataset's outputs in index order, as one tensor
        or the same nested structure; None when no rank has any batch.

    Raises:
        RankMismatchError: On every rank, when ranks disagree about the keys,
            trailing shapes, dtypes or devices of the leaves, or hold sample
            counts that EvalSampler cannot produce.
        PdistError: On every rank, when some rank's own ``batches`` are
            malformed or it cannot allocate its buffers: a ``RemoteError``
            naming the rank (that rank's own error is its cause there).
        TypeError: On a one-rank group, when ``batches`` is not a list.
        ValueError: On a one-rank group, when ``batches`` is malformed.
    """
    g = as_group(group)
    if g.world_size == 1:
        local = _own_batches(batches, g.device)
        if local.spec is None:
            return None
        with torch.no_grad():
            leaves = (torch.cat(c) for c in local.columns)  # fresh memory, as on W ranks
            return _unflatten(local.spec, leaves)
    try:
        local, error = _own_batches(batches, g.device), None
    except Exception as exc:
        local, error = _NO_BATCHES, exc
    agreed = _agree_leaves(g, local, error)
    if agreed is None:
        return None
    local, memory, counts = agreed
    call = _Call(
        local.columns,
        local.leaves,
        g.rank_in_group,
        g.world_size,
        max(counts),
        local.samples,
        sum(counts),
    )
    return _unflatten(local.spec, iter(_gather_leaves(g, call, memory)))


def _agree_leaves(
    g: Group, local: _Local, error: BaseException | None
) -> tuple[_Local, _Memory, list[int]] | None:
    """The agreed leaves, this rank's memory and the counts; None when no rank has batches."""
    memory: _Memory = {}
    if local.spec is not None:  # else no batches, or error
        try:
            memory = _reserve(g, local.leaves, local.samples + 1)
        except PdistError as exc:
            error = exc
    leaves = [[dtype_name(x.dtype), x.shape, x.device_type] for x in local.leaves]
    record = _NONE if local.spec is None else json.dumps([local.spec, leaves]).encode()
    message = _COUNT.pack(local.samples) + record
    messages = _wire.all_gather_bytes(g, message, error=error, what=_WHAT)
    records = {r: m[_COUNT.size :] for r, m in zip(g.ranks, messages, strict=True)}
    present = {r: record for r, record in records.items() if record != _NONE}
    if not present:
        return None
    if len(set(present.values())) > 1:
        raise _differences(g, present)
    counts = _sample_counts(g, messages)
    if len(present) == g.world_size:
        return local, memory, counts

    def adopt() -> tuple[_Local, _Memory]:  # a rank without batches takes the common record
        if local.spec is not None:
            return local, memory
        spec, _, sent = _parse_leaf_record(g, *next(iter(present.items())))
        received = [_Leaf(dtype_of(d), shape, device) for d, shape, device in sent]
        return _Local(spec, [], received, 0), _reserve(g, received, max(counts))

    (local, memory), _ = _transfer.prepare(g, adopt, what=_WHAT)
    return local, memory, counts


_Memory = dict[str, torch.Tensor]  # per transport: where its gathers land
_OWN_GATHER_MIN_BYTES = 256 << 10
_PIPELINE_MIN_BYTES = 1 << 20
_MAX_GATHERS = 3  # per transport: two of their own (_runs), one shared
_COLUMN = 16  # leaves sharing a row start at multiples of this: every dtype can view them


def _transport(leaf: _Leaf) -> str:
    return "cpu" if leaf.device_type == "cpu" else "device"


def _reserve(g: Group, leaves: list[_Leaf], rows: int) -> _Memory:
    """Memory per transport for ``rows`` rows per rank, reserved before anything moves."""
    per_row: dict[str, int] = collections.Counter()
    for leaf in leaves:  # with room for each leaf's and each gather's alignment gap
        per_row[_transport(leaf)] += leaf.nbytes + _COLUMN
    memory: _Memory = {}
    for kind, row in per_row.items():
        device = torch.device("cpu") if kind == "cpu" else g.device
        per_rank = rows * (row + _MAX_GATHERS * _COLUMN) + _MAX_GATHERS * ALIGN
        memory[kind] = allocate(g.world_size * per_rank, device, what=_WHAT)
    return memory


class _Call(NamedTuple):
    """What every gather of one ``collate_batches`` call shares."""

    local: list[list[torch.Tensor]]  # this rank's batches, leaf by leaf
    specs: list[_Leaf]
    rank: int  # in the group
    world: int
    rows: int  # samples per rank and leaf on the wire: the largest count (the rest is padding)
    samples: int  # this rank's samples
    total: int


def _runs(specs: list[_Leaf], leaves: list[int], gathered_rows: int) -> list[list[int]]:
    """Split one transport's leaves into runs of one gather each (at most three).

    The (at most two) largest groups of leaves of equal row bytes, if large, get a
    gather of their own, the rest share one; a lone large group is split in two, so
    that packing the second half overlaps the first's transfer.
    """

    def nbytes(run: list[int]) -> int:
        return len(run) * specs[run[0]].nbytes * gathered_rows

    by_row: dict[int, list[int]] = collections.defaultdict(list)
    for i in leaves:
        by_row[specs[i].nbytes].append(i)
    ranked = sorted(by_row.values(), key=nbytes, reverse=True)
    own = [run for run in ranked[: _MAX_GATHERS - 1] if nbytes(run) >= _OWN_GATHER_MIN_BYTES]
    rest = sorted(i for run in ranked if run not in own for i in run)
    if len(own) == 1 and len(own[0]) > 1 and nbytes(own[0]) >= _PIPELINE_MIN_BYTES:
        own = [own[0][: len(own[0]) // 2], own[0][len(own[0]) // 2 :]]
    return own + ([rest] if rest else [])


def _layout(specs: list[_Leaf], run: list[int]) -> tuple[int, int, list[tuple[int, int]]]:
    """How ``run`` travels: ``blocks`` of ``[rows, width]`` bytes, each leaf's (block, offset).

    Leaves of equal row bytes take a block each; others share one, side by side.
    """
    widths = [specs[i].nbytes for i in run]
    if len(set(widths)) == 1:
        return len(run), widths[0], [(k, 0) for k in range(len(run))]
    places, width = [], 0
    for w in widths:
        places.append((0, width))
        width = -(-(width + w) // _COLUMN) * _COLUMN
    return 1, width, places


def _pack(call: _Call, run: list[int], mine: torch.Tensor) -> None:
    """This rank's batches of each leaf of ``run``, placed in ``mine`` as ``_layout`` says.

    The bytes no sample fills are zeroed: the wire never carries stale process memory.
    """
    blocks, width, places = _layout(call.specs, run)
    grid = mine.view(blocks, call.rows, width)
    (grid if blocks < len(run) else grid[:, call.samples :]).zero_()
    with torch.no_grad():  # cat(out=) refuses inputs that require grad
        for i, (block, offset) in zip(run, places, strict=True):
            spec, samples = call.specs[i], call.samples
            if samples:
                out = grid[block, :samples, offset : offset + spec.nbytes].view(spec.dtype)
                torch.cat(call.local[i], out=out.view(samples, *spec.shape))  # one copy


def _own(call: _Call, gathered: torch.Tensor) -> torch.Tensor:
    """This rank's part of a gather, in the gather's own memory.

    In place on a device; gloo reads it before anything is copied out there.
    """
    return gathered.view(call.world, -1)[call.rank]


def _gather(
    g: Group, call: _Call, cpu: bool, run: list[int], gathered: torch.Tensor
) -> Callable[[], list[tuple[int, torch.Tensor]]]:
    """Start the gather of ``run``, packed; ``finish()`` gives ``(leaf index, leaf)`` pairs.

    Rank ``j``'s row ``r`` is dataset index ``r * W + j``: in a ``[blocks, rows,
    W, width]`` buffer the rows are in dataset order. gloo writes rank ``j``'s
    part straight into the view ``[:, :, j]``; a device interleaves with one copy.
    """
    world, rows = call.world, call.rows
    blocks, width, places = _layout(call.specs, run)
    mine = _own(call, gathered)
    grid = gathered.view(blocks, rows, world, width)
    if cpu:  # as the widest words a row holds: gloo's copy into the strided views is faster
        dtype = next(d for d in (torch.int64, torch.int32, torch.uint8) if width % d.itemsize == 0)
        words = gathered.view(dtype).view(blocks, rows, world, width // dtype.itemsize)
        outs, source = [words[:, :, j] for j in range(world)], mine.view(dtype)
        work = _transfer.start_all_gather(g, "cpu", outs, source.view(words[:, :, 0].shape))
    else:
        work = _transfer.start_all_gather(g, "device", gathered, mine)

    def finish() -> list[tuple[int, torch.Tensor]]:
        wait_all(g, [work], _WHAT)
        table = grid
        if not cpu:  # the gather was rank-major: interleave (a copy)
            table = gathered.view(world, blocks, rows, width).permute(1, 2, 0, 3)
        table = table.reshape(blocks, rows * world, width)[:, : call.total]
        result = []
        for i, (block, offset) in zip(run, places, strict=True):
            spec = call.specs[i]
            leaf = table[block, :, offset : offset + spec.nbytes].view(spec.dtype)
            result.append((i, leaf.view(call.total, *spec.shape).contiguous()))  # copies a column
        return result

    return finish


def _regions(call: _Call, memory: _Memory) -> Iterator[tuple[str, list[int], torch.Tensor]]:
    """Each gather's transport, leaves and place in ``memory`` (leaves with bytes to move)."""
    by_transport: dict[str, list[int]] = collections.defaultdict(list)
    for i, spec in enumerate(call.specs):
        if call.rows and spec.nbytes:
            by_transport[_transport(spec)].append(i)
    for kind, leaves in by_transport.items():
        used = 0
        for run in _runs(call.specs, leaves, call.rows * call.world):
            blocks, width, _ = _layout(call.specs, run)
            size = blocks * call.rows * call.world * width
            start, used = used, aligned(used + size)
            yield kind, run, memory[kind][start : start + size]


def _gather_leaves(g: Group, call: _Call, memory: _Memory) -> list[torch.Tensor]:
    """Every leaf gathered in dataset order, in ``memory`` reserved by ``_reserve``."""
    gathered: dict[int, torch.Tensor] = {}
    for i, spec in enumerate(call.specs):
        if not (call.rows and spec.nbytes):  # nothing to move, e.g. a [N, 0] leaf
            device = torch.device("cpu") if _transport(spec) == "cpu" else g.device
            gathered[i] = torch.empty((call.total, *spec.shape), dtype=spec.dtype, device=device)
    finishes = []
    for kind, run, region in _regions(call, memory):  # packing the next overlaps a gather
        _pack(call, run, _own(call, region))
        finishes.append(_gather(g, call, kind == "cpu", run, region))
    for finish in finishes:
        gathered.update(finish())
    return [gathered[i] for i in range(len(call.specs))]
