"""Evaluation: a sampler without padding and a collation back into dataset order.

``EvalSampler`` strides a dataset over ranks without padding, and
``collate_batches`` gathers every rank's outputs back into dataset order.

``collate_batches`` issues a bounded number of collectives, whatever the
number of leaves: one metadata exchange for the whole structure (one
collective on the CPU group when it fits 4 KiB), one small all-reduce once
every rank has allocated its buffers, then at most three all-gathers per
transport (CPU group for CPU tensors, device group for device tensors)
carrying the leaves as raw bytes. On the CPU group, leaves of equal row size
are gathered straight into dataset order (see ``_gather_rows``).

Fail together: everything a rank checks about its own batches (their type,
structure, devices, layouts) travels in the metadata exchange, as an error
marker when it fails, and a failed allocation travels through the
all-reduce; then every rank raises the same error, naming the rank. The
records are plain data (JSON), never pickles.

Measured and left out: exchanging the rows through /dev/shm segments when
the group shares a host (tmpfs pages cost about 3 ms per 5 MB per call, more
than the gloo transfer they replace), and packing while the metadata
exchange is in flight (4% faster, for a speculative send layout).
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Iterator, Sequence, Sized
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

from . import _agree, _wire
from ._buffers import allocate, offsets
from ._compat import all_gather_into
from ._errors import PdistError, RankMismatchError
from ._group import DistContext, Group, as_group
from ._serialize import dtype_name, dtype_of

__all__ = ["EvalSampler", "collate_batches"]


class EvalSampler(Sampler[int]):
    """Give rank ``r`` of ``group`` the indices ``r, r + W, r + 2W, ...`` (``W`` = group size).

    Unlike ``torch.utils.data.DistributedSampler`` it never pads with
    duplicates, so metrics computed over the gathered outputs are exact:
    every index appears exactly once across the ranks, and ranks beyond the
    dataset's size get no index at all. :func:`collate_batches` undoes the
    striding.

    Args:
        dataset: Anything with a ``len()``.
        group: The group the dataset is split over (a context means its world).
    """

    def __init__(self, dataset: Sized, group: Group | DistContext) -> None:
        g = as_group(group)
        self._size = len(dataset)
        self._rank = g.rank_in_group
        self._world = g.world_size

    def __iter__(self) -> Iterator[int]:
        return iter(range(self._rank, self._size, self._world))

    def __len__(self) -> int:
        return len(range(self._rank, self._size, self._world))


# --------------------------------------------------------------------------- structure

Spec = Any  # "T" for a tensor leaf, or (kind, keys, children)

_WHAT = "collate_batches"


def _flatten(obj: Any, path: str, leaves: list[tuple[str, torch.Tensor]]) -> Spec:
    if isinstance(obj, torch.Tensor):
        leaves.append((path or "<root>", obj))
        return "T"
    if isinstance(obj, dict):
        keys = tuple(obj)
        for k in keys:
            if not _plain_key(k):
                msg = (
                    f"{path or 'a batch'} has the key {k!r} "
                    f"({type(k).__name__}); keys travel between ranks as plain data: use str, "
                    "int, float, bool, None or tuples of them"
                )
                raise TypeError(msg)
        return ("dict", keys, tuple(_flatten(obj[k], f"{path}[{k!r}]", leaves) for k in keys))
    if isinstance(obj, (list, tuple)):
        kind = "list" if isinstance(obj, list) else "tuple"
        children = tuple(_flatten(v, f"{path}[{i}]", leaves) for i, v in enumerate(obj))
        return (kind, len(obj), children)
    msg = (
        f"{path or 'a batch'} is a {type(obj).__name__}; batches hold "
        "tensors in (nested) dicts, lists and tuples"
    )
    raise TypeError(msg)


def _plain_key(key: Any) -> bool:
    if isinstance(key, tuple):
        return all(_plain_key(k) for k in key)
    return key is None or isinstance(key, (str, int, float))


def _unflatten(spec: Spec, leaves: Iterator[torch.Tensor]) -> Any:
    if spec == "T":
        return next(leaves)
    kind, keys, children = spec
    values = [_unflatten(c, leaves) for c in children]
    if kind == "dict":
        return dict(zip(keys, values, strict=True))
    return values if kind == "list" else tuple(values)


def _follow(obj: Any, spec: Spec, leaves: list[torch.Tensor]) -> bool:
    """Collect the leaves of ``obj`` if it has the structure ``spec`` (False otherwise)."""
    if spec == "T":
        leaves.append(obj)
        return isinstance(obj, torch.Tensor)
    kind, keys, children = spec
    if kind == "dict":
        if not isinstance(obj, dict) or tuple(obj) != keys:
            return False
        return all(_follow(obj[k], c, leaves) for k, c in zip(keys, children, strict=True))
    if not isinstance(obj, list if kind == "list" else tuple) or len(obj) != keys:
        return False
    return all(_follow(v, c, leaves) for v, c in zip(obj, children, strict=True))


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


def _local(batches: Any, device: torch.device) -> tuple[Spec, list[str], list[list[torch.Tensor]]]:
    """This rank's batches, leaf by leaf (columns); raises ValueError/TypeError on bad input."""
    if not isinstance(batches, Sequence) or isinstance(batches, (str, bytes)):
        got = "None" if batches is None else f"a {type(batches).__name__}"
        msg = (
            f"batches must be a list of this rank's per-batch outputs, got "
            f"{got}; pass [] on a rank without samples"
        )
        raise TypeError(msg)
    if not batches:
        return None, [], []
    named: list[tuple[str, torch.Tensor]] = []
    spec = _flatten(batches[0], "", named)
    names = [name for name, _ in named]
    firsts = [t for _, t in named]
    columns: list[list[torch.Tensor]] = [[] for _ in firsts]
    for i, batch in enumerate(batches):
        leaves: list[torch.Tensor] = []
        if i == 0:
            leaves = firsts
        elif not _follow(batch, spec, leaves):
            msg = f"batch {i} has another structure than batch 0"
            raise ValueError(msg)
        if any(t.dim() == 0 for t in leaves):
            msg = f"batch {i} has a 0-d tensor; the sample dimension comes first"
            raise ValueError(msg)
        sizes = {t.shape[0] for t in leaves}
        if len(sizes) > 1:
            msg = f"the leaves of batch {i} hold different sample counts {sorted(sizes)}"
            raise ValueError(msg)
        for name, first, t, column in zip(names, firsts, leaves, columns, strict=True):
            problem = _leaf_problem(t, device)
            if problem is not None:
                msg = f"leaf {name} of batch {i} is {problem}"
                raise ValueError(msg)
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
            column.append(t.detach() if t.requires_grad else t)
    return spec, names, columns


# --------------------------------------------------------------------------- metadata records


class _Leaf(NamedTuple):
    """What every rank agreed on about one leaf: its dtype, trailing shape and device type."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    device_type: str

    @property
    def nbytes(self) -> int:
        """Bytes per sample."""
        return math.prod(self.shape) * self.dtype.itemsize


def _record(spec: Spec, names: list[str], local: list[list[torch.Tensor]]) -> dict[str, Any]:
    """This rank's metadata: plain data (the exchange carries JSON; tuples arrive as lists)."""
    return {
        "spec": spec,
        "names": names,
        "leaves": [[dtype_name(c[0].dtype), list(c[0].shape[1:]), c[0].device.type] for c in local],
        "count": sum(t.shape[0] for t in local[0]) if local else 0,
    }


def _tuples(value: Any) -> Any:
    """A record as it left its rank: the exchange's JSON carries tuples as lists."""
    if isinstance(value, list):
        return tuple(_tuples(v) for v in value)
    return value


def _leaf_count(spec: Spec) -> int:
    """The number of leaves of a received ``spec``; ValueError when it is not one."""
    if spec == "T":
        return 1
    if not isinstance(spec, tuple) or len(spec) != 3 or not isinstance(spec[2], tuple):
        raise ValueError(spec)
    kind, keys, children = spec
    if kind == "dict":
        if not isinstance(keys, tuple) or len(keys) != len(children):
            raise ValueError(spec)
    elif kind not in ("list", "tuple") or keys != len(children) or isinstance(keys, bool):
        raise ValueError(spec)
    return sum(_leaf_count(c) for c in children)


_Present = tuple[Spec, tuple[str, ...], tuple[tuple[str, tuple[int, ...], str], ...]]


def _parse(g: Group, records: list[Any]) -> tuple[list[int], dict[int, _Present]]:
    """Sample counts per rank, and the structure of every rank that has batches.

    Raises:
        PdistError: A record is not what pdist sends (the same on every rank).
    """
    counts: list[int] = []
    present: dict[int, _Present] = {}
    for rank, record in zip(g.ranks, records, strict=True):
        try:
            count = record["count"]
            if isinstance(count, bool) or not isinstance(count, int) or count < 0:
                raise ValueError(count)
            counts.append(count)
            if record["spec"] is None:
                continue
            spec = _tuples(record["spec"])
            n = _leaf_count(spec)
            names = tuple(record["names"])
            leaves = tuple(
                (dtype, tuple(shape), device) for dtype, shape, device in record["leaves"]
            )
            if len(names) != n or len(leaves) != n or not all(isinstance(s, str) for s in names):
                raise ValueError(names)
            for dtype, shape, device in leaves:
                if not isinstance(dtype, str) or not isinstance(device, str):
                    raise ValueError(dtype)
                if not all(
                    isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
                ):
                    raise ValueError(shape)
            present[rank] = (spec, names, leaves)
        except (KeyError, TypeError, ValueError, RecursionError):
            msg = (
                f"collate_batches on group {g.name!r}: rank {rank} sent a malformed metadata "
                "record; do all ranks run the same pdist version?"
            )
            raise PdistError(msg) from None
    return counts, present


def _describe(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {ranks if len(ranks) > 1 else ranks[0]}"


def _disagreement(what: str, values: dict[int, Any]) -> str:
    by_value: dict[Any, list[int]] = collections.defaultdict(list)
    for rank, value in values.items():
        by_value[value].append(rank)
    parts = [f"{value} on {_describe(ranks)}" for value, ranks in by_value.items()]
    return f"collate_batches: {what} differs across ranks: " + "; ".join(parts)


def _validate(
    g: Group, counts: list[int], present: dict[int, _Present]
) -> tuple[Spec, list[_Leaf]]:
    """Check the ranks' records agree; the same verdict on every rank."""
    if not present:
        return None, []
    if len({repr(spec) for spec, _, _ in present.values()}) > 1:
        by_rank = {r: names for r, (_, names, _) in present.items()}
        raise RankMismatchError(_disagreement("the structure (leaves)", by_rank))
    spec, names, first_leaves = next(iter(present.values()))
    leaves: list[_Leaf] = []
    for i, name in enumerate(names):
        for field, label in ((0, "dtype"), (1, "trailing shape"), (2, "device type")):
            values = {r: rec[2][i][field] for r, rec in present.items()}
            if len(set(values.values())) > 1:
                raise RankMismatchError(_disagreement(f"the {label} of leaf {name}", values))
        sent_dtype, shape, device_type = first_leaves[i]
        try:
            dtype = dtype_of(sent_dtype)
        except PdistError:
            msg = (
                f"collate_batches on group {g.name!r}: leaf {name} has dtype {sent_dtype!r}, "
                "which this rank's torch does not know; run one torch version on every rank"
            )
            raise PdistError(msg) from None
        leaves.append(_Leaf(dtype, shape, device_type))
    total, world = sum(counts), g.world_size
    expected = [len(range(r, total, world)) for r in range(world)]
    if counts != expected:
        msg = (
            f"collate_batches: samples per rank {counts} are not what EvalSampler gives for "
            f"{total} samples over {world} ranks ({expected}); shard the dataset with EvalSampler"
        )
        raise RankMismatchError(msg)
    return spec, leaves


def collate_batches(group: Group | DistContext, batches: Sequence[Any]) -> Any:
    """Gather every rank's evaluation outputs, in dataset order, on every rank.

    ``batches`` is this rank's list of per-batch outputs (a tensor, or nested
    dicts/lists/tuples of tensors, with the sample dimension first), produced
    from an :class:`EvalSampler` over ``group``. Every rank gets the outputs of
    the whole dataset in the original index order, as one tensor or the same
    nested structure. A rank with no samples passes an empty list and still
    gets the full result. Leaves are dense tensors on the CPU or on the
    group's device; dict keys are str, int, float, bool, None or tuples of
    them.

    .. note:: All ranks of the group must call it. Whatever goes wrong on one
       rank (bad ``batches``, a leaf on another device, a sparse leaf, memory
       for the result) raises on every rank, naming that rank.

    Returns:
        The collated outputs; None when no rank has any batch.

    Raises:
        RankMismatchError: On every rank, when ranks disagree about the keys,
            trailing shapes, dtypes or devices of the leaves, or hold sample
            counts that EvalSampler cannot produce.
        PdistError: On every rank, when some rank's own ``batches`` are
            malformed or it cannot allocate its buffers: a ``RemoteError``
            whose message names the rank and says what to change (that rank's
            own error is its cause there).
        TypeError: On a one-rank group, when ``batches`` is not a list.
        ValueError: On a one-rank group, when ``batches`` is malformed.
    """
    g = as_group(group)
    try:
        spec, names, local = _local(batches, g.device)
        error: BaseException | None = None
    except Exception as exc:
        spec, names, local, error = None, [], [], exc
    if g.world_size == 1:
        if error is not None:
            raise error
        if spec is None:
            return None
        return _unflatten(spec, iter(torch.cat(c) if len(c) > 1 else c[0] for c in local))
    records = _wire.exchange(g, _record(spec, names, local), error=error, what=_WHAT)
    counts, present = _parse(g, records)
    spec, leaves = _validate(g, counts, present)
    if spec is None:
        return None
    return _unflatten(spec, iter(_gather_leaves(g, local, leaves, counts)))


# --------------------------------------------------------------------------- gathers


def _device(g: Group, spec: _Leaf) -> torch.device:
    """Where a gathered leaf lives: on the CPU if it came from the CPU, else the group's device."""
    return torch.device("cpu") if spec.device_type == "cpu" else g.device


_OWN_GATHER_MIN_BYTES = 256 << 10
_PIPELINE_MIN_BYTES = 1 << 20
_MAX_OWN_GATHERS = 2


class _Call(NamedTuple):
    """What every gather of one ``collate_batches`` call shares."""

    local: list[list[torch.Tensor]]  # this rank's batches, leaf by leaf
    specs: list[_Leaf]
    world: int
    rows: int  # samples per rank and leaf on the wire: the largest count (the rest is padding)
    samples: int  # this rank's samples
    total: int


Finish = Callable[[], list[tuple[int, torch.Tensor]]]
"""Waits for one gather; returns ``(leaf index, gathered leaf)`` pairs."""

Start = Callable[[], Finish]
"""Packs this rank's part of one gather into its (allocated) buffer and starts the gather."""


def _plan(specs: list[_Leaf], leaves: list[int], gathered_rows: int) -> list[list[int]]:
    """Split one transport's leaves into runs of one gather each (at most three).

    Leaves with equal row bytes can be gathered with the interleave fused into
    the gather (:func:`_gather_rows`). The largest such groups (at most
    ``_MAX_OWN_GATHERS``, each at least ``_OWN_GATHER_MIN_BYTES`` gathered) get a
    gather of their own; the other leaves share one packed gather, so the
    number of collectives stays bounded whatever the number of leaves. A lone
    large group is split in two, so that packing the second half overlaps the
    first half's transfer.
    """

    def nbytes(run: list[int]) -> int:
        return len(run) * specs[run[0]].nbytes * gathered_rows

    by_row: dict[int, list[int]] = collections.defaultdict(list)
    for i in leaves:
        by_row[specs[i].nbytes].append(i)
    ranked = sorted(by_row.values(), key=nbytes, reverse=True)
    own = [run for run in ranked[:_MAX_OWN_GATHERS] if nbytes(run) >= _OWN_GATHER_MIN_BYTES]
    rest = sorted(i for run in ranked if run not in own for i in run)
    if len(own) == 1 and len(own[0]) > 1 and nbytes(own[0]) >= _PIPELINE_MIN_BYTES:
        half = len(own[0]) // 2
        own = [own[0][:half], own[0][half:]]
    return own + ([rest] if rest else [])


def _pack(call: _Call, run: list[int], mine: torch.Tensor, offsets: list[int]) -> None:
    """This rank's batches of each leaf of ``run``, concatenated at its byte offset in ``mine``.

    The bytes no leaf fills (padding rows, alignment gaps) are zeroed: what
    goes on the wire never carries leftover process memory to the peers.
    """
    ends = [*offsets[1:], mine.numel()]
    for i, offset, end in zip(run, offsets, ends, strict=True):
        spec = call.specs[i]
        filled = offset + call.samples * spec.nbytes
        if call.samples:
            start = mine[offset:filled].view(spec.dtype)
            torch.cat(call.local[i], out=start.view(call.samples, *spec.shape))  # one copy
        mine[filled:end].zero_()


def _gather_rows(call: _Call, pg: dist.ProcessGroup, run: list[int]) -> Start:
    """Gather leaves of equal row bytes, rows landing straight in dataset order.

    Every rank sends its leaves as ``[leaves, rows, row bytes]``. Rank ``j``'s
    row ``r`` is dataset index ``r * W + j``, so rank ``j``'s output is the
    strided view ``[:, :, j]`` of a ``[leaves, rows, W, row bytes]`` buffer:
    gloo's copy out of its staging buffer interleaves the rows, and each leaf
    is a contiguous slice of the result. Padding rows land past ``total``.
    Allocates now; packs and gathers when started.
    """
    world, rows, row = call.world, call.rows, call.specs[run[0]].nbytes
    cpu = torch.device("cpu")
    mine = allocate(len(run) * rows * row, cpu, what=_WHAT)
    gathered = allocate(len(run) * rows * world * row, cpu, what=_WHAT)

    def start() -> Finish:
        _pack(call, run, mine, [k * rows * row for k in range(len(run))])
        grid = gathered.view(len(run), rows, world, row)
        outs = [grid[:, :, j] for j in range(world)]
        work = dist.all_gather(outs, mine.view(len(run), rows, row), group=pg, async_op=True)

        def finish() -> list[tuple[int, torch.Tensor]]:
            work.wait()
            per_leaf = gathered.view(len(run), rows * world * row)
            result = []
            for k, i in enumerate(run):
                spec = call.specs[i]
                data = per_leaf[k, : call.total * row].view(spec.dtype)
                result.append((i, data.view(call.total, *spec.shape)))
            return result

        return finish

    return start


def _gather_packed(
    call: _Call, pg: dist.ProcessGroup, device: torch.device, run: list[int]
) -> Start:
    """Gather leaves of any row sizes as one rank-major buffer, then interleave (one copy each).

    Allocates now; packs and gathers when started.
    """
    world, rows = call.world, call.rows
    starts, size = offsets([rows * call.specs[i].nbytes for i in run])
    # Padding rows and alignment gaps are never read back (_pack zeroes them).
    mine = allocate(size, device, what=_WHAT)
    gathered = allocate(world * size, device, what=_WHAT)

    def start() -> Finish:
        _pack(call, run, mine, starts)
        work = all_gather_into(gathered, mine, pg, async_op=True)

        def finish() -> list[tuple[int, torch.Tensor]]:
            work.wait()
            per_rank = gathered.view(world, size)
            result = []
            for i, offset in zip(run, starts, strict=True):
                spec = call.specs[i]
                block = per_rank[:, offset : offset + rows * spec.nbytes].view(spec.dtype)
                typed = block.view(world, rows, *spec.shape)  # [W, rows, *trailing]
                # Sample j of rank r is dataset index r + j * W: interleave, then drop the
                # padding rows, which all sit at the end.
                result.append(
                    (i, typed.transpose(0, 1).reshape(rows * world, *spec.shape)[: call.total])
                )
            return result

        return finish

    return start


def _gather_leaves(
    g: Group, local: list[list[torch.Tensor]], specs: list[_Leaf], counts: list[int]
) -> list[torch.Tensor]:
    call = _Call(local, specs, g.world_size, max(counts), counts[g.rank_in_group], sum(counts))
    gathered: dict[int, torch.Tensor] = {}
    by_transport: dict[str, list[int]] = collections.defaultdict(list)
    for i, spec in enumerate(specs):
        if call.total == 0 or spec.nbytes == 0:  # nothing to move, e.g. a [N, 0] leaf
            shape = (call.total, *spec.shape)
            gathered[i] = torch.empty(shape, dtype=spec.dtype, device=_device(g, spec))
        else:
            by_transport["cpu" if _device(g, spec).type == "cpu" else "device"].append(i)
    if not by_transport:
        return [gathered[i] for i in range(len(specs))]
    # Every buffer is allocated before the first gather starts: a rank that cannot
    # (out of memory) says so through one small all-reduce, instead of leaving the
    # others waiting in a gather. Packing validated leaves into them cannot fail.
    starts: list[Start] = []
    try:
        for kind, leaves in by_transport.items():
            pg = g.transport(kind)
            for run in _plan(specs, leaves, call.rows * call.world):
                # Strided outputs rely on gloo copying out of its own staging buffer; a device
                # transport takes the packed gather and interleaves with one device copy.
                if kind == "cpu" and len({specs[i].nbytes for i in run}) == 1:
                    starts.append(_gather_rows(call, pg, run))
                else:
                    device = torch.device("cpu") if kind == "cpu" else g.device
                    starts.append(_gather_packed(call, pg, device, run))
        error = None
    except Exception as exc:
        starts, error = [], exc
    _agree.status(g, error, what=_WHAT)
    # Packing gather k+1 overlaps gather k's transfer.
    finishes = [start() for start in starts]
    for finish in finishes:
        gathered.update(finish())
    return [gathered[i] for i in range(len(specs))]
