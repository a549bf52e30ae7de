"""Evaluation: a sampler without padding and a collation back into dataset order.

``EvalSampler`` strides a dataset over ranks without padding, and
``collate_batches`` gathers every rank's outputs back into dataset order.

``collate_batches`` issues a constant number of collectives: one metadata
exchange for the whole structure (two collectives on the CPU group), then one
all-gather per transport (CPU group for CPU tensors, device group for device
tensors) carrying every leaf as raw bytes.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator, Sequence, Sized
from typing import Any

import torch
from torch.utils.data import Sampler

from . import _wire
from ._context import DistContext, Group, as_group
from ._errors import PdistError, RankMismatchError
from ._payload import buffer
from ._serialize import TensorSpec, dtype_name
from ._wire import all_gather_into

__all__ = ["EvalSampler", "collate_batches"]

_ALIGN = 64


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


def _flatten(obj: Any, path: str, leaves: list[tuple[str, torch.Tensor]]) -> Spec:
    if isinstance(obj, torch.Tensor):
        leaves.append((path or "<root>", obj))
        return "T"
    if isinstance(obj, dict):
        keys = tuple(obj)
        return ("dict", keys, tuple(_flatten(obj[k], f"{path}[{k!r}]", leaves) for k in keys))
    if isinstance(obj, (list, tuple)):
        kind = "list" if isinstance(obj, list) else "tuple"
        children = tuple(_flatten(v, f"{path}[{i}]", leaves) for i, v in enumerate(obj))
        return (kind, len(obj), children)
    msg = (
        f"collate_batches: {path or 'a batch'} is a {type(obj).__name__}; batches hold "
        "tensors in (nested) dicts, lists and tuples"
    )
    raise TypeError(msg)


def _unflatten(spec: Spec, leaves: Iterator[torch.Tensor]) -> Any:
    if spec == "T":
        return next(leaves)
    kind, keys, children = spec
    values = [_unflatten(c, leaves) for c in children]
    if kind == "dict":
        return dict(zip(keys, values, strict=True))
    return values if kind == "list" else tuple(values)


def _local(batches: Sequence[Any]) -> tuple[Spec, list[str], list[list[torch.Tensor]]]:
    """This rank's batches, leaf by leaf (columns); raises ValueError/TypeError on bad input."""
    spec: Spec = None
    names: list[str] = []
    columns: list[list[torch.Tensor]] = []
    for i, batch in enumerate(batches):
        leaves: list[tuple[str, torch.Tensor]] = []
        batch_spec = _flatten(batch, "", leaves)
        if i == 0:
            spec, names, columns = batch_spec, [n for n, _ in leaves], [[] for _ in leaves]
        elif batch_spec != spec:
            msg = f"collate_batches: batch {i} has another structure than batch 0"
            raise ValueError(msg)
        if any(t.dim() == 0 for _, t in leaves):
            msg = f"collate_batches: batch {i} has a 0-d tensor; the sample dimension comes first"
            raise ValueError(msg)
        sizes = sorted({t.shape[0] for _, t in leaves})
        if len(sizes) > 1:
            msg = f"collate_batches: the leaves of batch {i} hold different sample counts {sizes}"
            raise ValueError(msg)
        for column, (name, t) in zip(columns, leaves, strict=True):
            if column and (column[0].shape[1:] != t.shape[1:] or column[0].dtype != t.dtype):
                msg = (
                    f"collate_batches: leaf {name} is {t.dtype} {tuple(t.shape[1:])} in batch {i} "
                    f"but {column[0].dtype} {tuple(column[0].shape[1:])} in batch 0"
                )
                raise ValueError(msg)
            column.append(t.detach())
    return spec, names, columns


def _describe(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {ranks if len(ranks) > 1 else ranks[0]}"


def _disagreement(what: str, values: dict[int, Any]) -> str:
    by_value: dict[Any, list[int]] = collections.defaultdict(list)
    for rank, value in values.items():
        by_value[value].append(rank)
    parts = [f"{value} on {_describe(ranks)}" for value, ranks in by_value.items()]
    return f"collate_batches: {what} differs across ranks: " + "; ".join(parts)


def _validate(
    group: Group, records: list[Any]
) -> tuple[Spec, list[str], list[TensorSpec], list[int]]:
    """Check the exchanged records agree; the same verdict on every rank."""
    errors = [(r, rec[0]) for r, rec in enumerate(records) if rec[0] is not None]
    if errors:
        rank, text = errors[0]
        msg = f"{text} (on rank {group.ranks[rank]})"
        raise PdistError(msg)
    present = {group.ranks[r]: rec for r, rec in enumerate(records) if rec[1] is not None}
    counts = [rec[4] for rec in records]
    if not present:
        return None, [], [], counts
    specs = {r: rec[1] for r, rec in present.items()}
    if len({repr(s) for s in specs.values()}) > 1:
        names = {r: tuple(rec[2]) for r, rec in present.items()}
        raise RankMismatchError(_disagreement("the structure (leaves)", names))
    first = next(iter(present.values()))
    spec, names = first[1], first[2]
    leaf_specs: list[TensorSpec] = []
    for i, name in enumerate(names):
        for field, label in ((0, "dtype"), (1, "trailing shape"), (2, "device type")):
            values = {r: rec[3][i][field] for r, rec in present.items()}
            if len(set(values.values())) > 1:
                raise RankMismatchError(_disagreement(f"the {label} of leaf {name}", values))
        dtype, shape, device_type = first[3][i]
        leaf_specs.append(TensorSpec(dtype, tuple(shape), device_type, False, False))
    total, world = sum(counts), group.world_size
    expected = [len(range(r, total, world)) for r in range(world)]
    if counts != expected:
        msg = (
            f"collate_batches: samples per rank {counts} are not what EvalSampler gives for "
            f"{total} samples over {world} ranks ({expected}); shard the dataset with EvalSampler"
        )
        raise RankMismatchError(msg)
    return spec, names, leaf_specs, counts


def collate_batches(group: Group | DistContext, batches: Sequence[Any]) -> Any:
    """Gather every rank's evaluation outputs, in dataset order, on every rank.

    ``batches`` is this rank's list of per-batch outputs (a tensor, or nested
    dicts/lists/tuples of tensors, with the sample dimension first), produced
    from an :class:`EvalSampler` over ``group``. Every rank gets the outputs of
    the whole dataset in the original index order, as one tensor or the same
    nested structure. A rank with no samples passes an empty list and still
    gets the full result.

    .. note:: All ranks of the group must call it.

    Returns:
        The collated outputs; None when no rank has any batch.

    Raises:
        RankMismatchError: On every rank, when ranks disagree about the keys,
            trailing shapes, dtypes or devices of the leaves, or hold sample
            counts that EvalSampler cannot produce.
        PdistError: On every rank, when some rank's own batches are malformed
            (the message names the rank).
    """
    g = as_group(group)
    if not isinstance(batches, Sequence):
        msg = f"batches must be a list of per-batch outputs, got {type(batches).__name__}"
        raise TypeError(msg)
    try:
        spec, names, local = _local(batches) if len(batches) else (None, [], [])
        error = None
    except (TypeError, ValueError) as exc:
        spec, names, local, error = None, [], [], str(exc)
    leaves = [(dtype_name(c[0].dtype), tuple(c[0].shape[1:]), c[0].device.type) for c in local]
    count = sum(t.shape[0] for t in local[0]) if local else 0
    record = (error, spec, names, leaves, count)
    records = [record] if g.world_size == 1 else _wire.exchange(g, record, what="collate_batches")
    spec, names, leaf_specs, counts = _validate(g, records)
    if spec is None:
        return None
    if g.world_size == 1:
        return _unflatten(spec, iter(torch.cat(c) if len(c) > 1 else c[0] for c in local))
    return _unflatten(spec, iter(_gather_leaves(g, local, leaf_specs, counts)))


def _device(g: Group, spec: TensorSpec) -> torch.device:
    """Where a gathered leaf lives: on the CPU if it came from the CPU, else the group's device."""
    return torch.device("cpu") if spec.device_type == "cpu" else g.device


_PIPELINE_MIN_BYTES = 1 << 20


def _split_in_two(entries: list[tuple[int, int, int]]) -> list[list[tuple[int, int, int]]]:
    """Two runs of leaves of about equal bytes (one run when small).

    The second run's transfer then overlaps the first run's unpacking.
    """
    total = sum(e[2] for e in entries)
    if total < _PIPELINE_MIN_BYTES or len(entries) < 2:
        return [entries]
    running, cut = 0, len(entries)
    for index, entry in enumerate(entries, 1):
        running += entry[2]
        if running * 2 >= total:
            cut = index
            break
    return [entries[:cut], entries[cut:]] if cut < len(entries) else [entries]


def _gather_leaves(
    g: Group, local: list[list[torch.Tensor]], leaf_specs: list[TensorSpec], counts: list[int]
) -> list[torch.Tensor]:
    world, total = g.world_size, sum(counts)
    if total == 0:
        return [
            torch.empty(0, *s.shape, dtype=s.torch_dtype, device=_device(g, s)) for s in leaf_specs
        ]
    rows = max(counts)  # every rank sends `rows` samples per leaf, padded
    count = counts[g.rank_in_group]
    by_kind: dict[str, list[tuple[int, int, int]]] = collections.defaultdict(list)
    for i, spec in enumerate(leaf_specs):
        kind = "cpu" if _device(g, spec).type == "cpu" else "device"
        by_kind[kind].append((i, 0, rows * spec.nbytes))  # leaf, offset (set below), bytes
    out: list[torch.Tensor | None] = [None] * len(leaf_specs)
    pending = []
    for kind, kind_entries in by_kind.items():
        device = torch.device("cpu") if kind == "cpu" else g.device
        pg = g.cpu_group if kind == "cpu" else g.device_group
        for run in _split_in_two(kind_entries):
            placed, size = [], 0
            for i, _, nbytes in run:
                placed.append((i, size, nbytes))
                size += (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
            # Padding rows and alignment gaps are never read back: left uninitialized.
            mine = torch.empty(size, dtype=torch.uint8, device=device)
            for i, offset, _ in placed:
                if count:
                    spec = leaf_specs[i]
                    start = mine[offset : offset + count * spec.nbytes].view(spec.torch_dtype)
                    # All of this rank's batches straight into place: one copy.
                    torch.cat(local[i], out=start.view(count, *spec.shape))
            gathered = buffer(world * size, device)
            work = all_gather_into(gathered, mine, pg, async_op=True)
            pending.append((work, gathered, size, placed))
    for work, gathered, size, placed in pending:
        work.wait()
        per_rank = gathered.view(world, size)
        for i, offset, nbytes in placed:
            spec = leaf_specs[i]
            block = per_rank[:, offset : offset + nbytes].view(spec.torch_dtype)  # [W, rows * row]
            typed = block.view(world, rows, *spec.shape)  # [W, rows, *trailing]
            # Sample j of rank r is dataset index r + j * W: interleave (the one copy on this
            # side), then drop the padding rows, which all sit at the end.
            out[i] = typed.transpose(0, 1).reshape(rows * world, *spec.shape)[:total]
    return [t for t in out if t is not None]
