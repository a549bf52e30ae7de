"""The tensors ``broadcast_weights`` moves: the source's as plain bytes, a receiver's checked.

The source's mapping is checked (``entries_of``) and its bytes are a plain contiguous
tensor whatever it passed (a view, a conjugate, a DTensor); a receiver's ``into`` is
checked against the source's entries and to be one that ``copy_`` fills (not ``meta``).

A sharded trainer's ``state_dict()`` holds DTensors: each rank has a shard, and
``full_tensor()`` is a collective on the trainer's mesh, so every rank of that mesh must
gather each tensor, in the same order. Only the link member sends; the trainer's other
ranks gather with it (``broadcast_weights(None, state_dict)``), in the mapping's order.
A full tensor lives until the next one is gathered, never longer, so the member's extra
memory is one gathered tensor besides its staging.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, cast

import torch
import torch.distributed as dist

from . import _compat
from ._errors import PdistError, RankMismatchError
from ._group import Group

__all__ = [
    "Entry",
    "Gathered",
    "check_into",
    "entries_of",
    "gather_along",
    "plain_wire",
    "sources",
    "unfillable",
]


class Entry(NamedTuple):
    """One tensor as the metadata describes it."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _gathers(tensors: Sequence[torch.Tensor]) -> list[int]:
    """Indices of the DTensors to gather, in order (empty ones are never read)."""
    dtensor = _compat.dtensor_type()  # None: never imported, so no tensor is one
    if dtensor is None:
        return []
    return [i for i, t in enumerate(tensors) if isinstance(t, dtensor) and t.numel() > 0]


def sources(tensors: object) -> Sequence[torch.Tensor]:
    """A mapping's tensors in order, as a ``Gathered`` when it holds DTensors."""
    values = list(tensors.values()) if isinstance(tensors, Mapping) else []
    return Gathered(values) if _gathers(values) else values


def gather_along(tensors: object) -> None:
    """A sharded trainer's rank that is not the link member: gather each DTensor with it."""
    if not isinstance(tensors, Mapping):
        msg = (
            f"tensors={tensors!r:.80} with group=None must be the trainer's mapping of name -> "
            "tensor (the state_dict its link member sends)"
        )
        raise TypeError(msg)
    found = sources(tensors)
    if isinstance(found, Gathered) and found.finish(failed=False):
        msg = (
            "broadcast_weights: the trainer's link member raised (its own error says why); "
            "this rank gathered every tensor with it and sent nothing"
        )
        raise PdistError(msg)


def _full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's full tensor, plain (funcol may hand back a tensor still being gathered)."""
    full = cast("Any", t).full_tensor()
    return cast("torch.Tensor", full.wait() if _compat.is_async_tensor(full) else full)


class Gathered(Sequence[torch.Tensor]):
    """The source's tensors, each DTensor gathered to a full tensor when first read.

    Gathers go in the mapping's order, so that they pair with ``gather_along`` on
    the mesh's other ranks whatever the bucket size. The move reads its large tensors
    in that order, but a packed bucket goes out only once full: reading index ``i``
    first gathers the DTensors before it and hands each to ``ahead`` (the move packs it
    into its bucket's staging at once). The last full tensor is kept for the next read
    of the same index (a large tensor moves in chunks) and dropped before the next
    gather. After a gather failed, reads raise that failure without gathering: the mesh
    is broken, and its other ranks raise in their own gathers.
    """

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self.tensors = list(tensors)
        self.order = _gathers(self.tensors)
        self.position = {i: n for n, i in enumerate(self.order)}
        self.done = 0  # how many of ``order`` were gathered
        self.last: tuple[int, torch.Tensor] | None = None
        self.failed: BaseException | None = None
        self.ahead: Callable[[int, torch.Tensor], None] | None = None

    def __len__(self) -> int:
        return len(self.tensors)

    def __getitem__(self, i: int) -> torch.Tensor:  # type: ignore[override]  # no slices
        position = self.position.get(i)
        if position is None:  # not a DTensor (or an empty one)
            return self.tensors[i]
        if self.last is not None and self.last[0] == i:
            return self.last[1]
        if position < self.done:
            msg = f"tensor {i} was gathered already: read it when it is handed to ahead"
            raise RuntimeError(msg)
        while self.done < position:
            self._hand_ahead(*self._next())
        return self._next()[1]

    def _hand_ahead(self, i: int, full: torch.Tensor) -> None:
        self.last = None  # the caller's reference goes with this frame: nothing kept
        if self.ahead is not None:
            self.ahead(i, full)

    def _next(self) -> tuple[int, torch.Tensor]:
        if self.failed is not None:
            raise self.failed
        i = self.order[self.done]
        self.last = None  # dropped before the next gather: one full tensor at a time
        try:
            full = _full(self.tensors[i])
        except Exception as exc:
            self.failed = exc
            raise
        self.done += 1
        self.last = (i, full)
        return i, full

    def finish(self, *, failed: bool) -> bool:
        """Gather whatever was not read, then tell the mesh whether the member ``failed``.

        Every rank of the mesh ends here: the member once its call is over (``failed``:
        it raised), the others once they gathered along, so no rank waits and the others
        learn that the member raised. Returns whether one did. After a failed gather the
        mesh is broken and no flag travels: the other ranks' own gathers raise.
        """
        self.last = None
        while self.failed is None and self.done < len(self.order):
            self._next()
            self.last = None
        if self.failed is not None or not self.order:
            return failed
        return _any_failed(self.tensors[self.order[0]], failed)


def _any_failed(dtensor: torch.Tensor, failed: bool) -> bool:
    """Max-reduce ``failed`` over the mesh dimensions a DTensor's gather spans."""
    t = cast("Any", dtensor)
    flag = torch.tensor([int(failed)], device=t.device)
    for dim, placement in enumerate(t.placements):
        if not placement.is_replicate():  # the ranks along it gathered together
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=t.device_mesh.get_group(dim))
    return bool(flag.item())


def plain_wire(wire: torch.Tensor, n: int, device: torch.device) -> torch.Tensor:
    """``wire`` if it is a plain contiguous tensor of ``n`` bytes on ``device``, else raise.

    A tensor of its own dispatch (a DTensor, say) would make the broadcast itself raise on
    this member alone while the others wait in theirs: caught here, it is a local failure
    that the closing status raises on every member.
    """
    if type(wire) is not torch.Tensor or wire.dtype != torch.uint8 or wire.numel() != n:
        msg = (
            f"a tensor's bytes came out as a {type(wire).__name__} of {wire.dtype}, not a "
            f"plain tensor of {n} bytes: broadcast_weights moves plain tensors and DTensors"
        )
        raise TypeError(msg)
    if wire.device != device or not wire.is_contiguous():
        msg = f"a tensor's bytes came out on {wire.device}, not contiguous on {device}"
        raise TypeError(msg)
    return wire


def unfillable(t: torch.Tensor) -> str:
    """Why ``copy_`` into ``t`` would not fill it (``""``: it would), said before any byte moves.

    A ``meta`` tensor takes a copy without a word and holds nothing after it.
    """
    if t.device.type == "meta":
        return (
            "is on the meta device and has no memory to fill; materialize the model first "
            "(model.to_empty(device=...))"
        )
    if type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
        return f"is a {type(t).__name__}; pass plain tensors (a DTensor's: its to_local())"
    if t.is_inference() and not torch.is_inference_mode_enabled():
        return "is an inference tensor; call broadcast_weights inside torch.inference_mode()"
    if any(stride == 0 and size > 1 for stride, size in zip(t.stride(), t.shape, strict=True)):
        return "is an expanded view (one element stands for several); pass a tensor of its own"
    return ""


def entries_of(tensors: object) -> list[Entry]:
    """The source's entries, or a TypeError naming what is wrong."""
    if not isinstance(tensors, Mapping):
        msg = f"tensors={tensors!r:.80} on the source must be a mapping of name -> tensor"
        raise TypeError(msg)
    out = []
    for name, t in tensors.items():
        if not isinstance(name, str) or not isinstance(t, torch.Tensor):
            msg = f"tensors[{name!r}] must map a str name to a torch.Tensor, not {type(t)!r}"
            raise TypeError(msg)
        if t.layout != torch.strided:
            msg = f"tensors[{name!r}] is a {t.layout} tensor; broadcast_weights moves dense ones"
            raise TypeError(msg)
        out.append(Entry(name, tuple(t.shape), t.dtype))
    return out


def check_into(into: object, entries: list[Entry], g: Group, src: int) -> None:
    """Raise (on this member) what differs between ``into`` and the source's tensors."""
    if not isinstance(into, Mapping) or not all(isinstance(t, torch.Tensor) for t in into.values()):
        msg = f"into={into!r:.80} must be a mapping of name -> tensor (or None)"
        raise TypeError(msg)
    where = f"into on rank {g.rank}"
    names = {e.name for e in entries}
    for e in entries:
        if e.name not in into:
            msg = (
                f"tensor {e.name!r} (shape {list(e.shape)} on the source, rank "
                f"{g.ranks[src]}) is missing from {where} (shape: none)"
            )
            raise RankMismatchError(msg)
        got = tuple(into[e.name].shape)
        if got != e.shape:
            msg = (
                f"tensor {e.name!r} has shape {list(e.shape)} on the source (rank "
                f"{g.ranks[src]}) but {list(got)} in {where}; shapes must be equal"
            )
            raise RankMismatchError(msg)
        if why := unfillable(into[e.name]):
            msg = f"into[{e.name!r}] on rank {g.rank} {why}"
            raise ValueError(msg)
    extra = [n for n in into if n not in names]
    if extra:
        name = extra[0]
        msg = (
            f"tensor {name!r} (shape {list(into[name].shape)} in {where}) is not sent by the "
            f"source (rank {g.ranks[src]}, shape: none); {len(extra)} name(s) only in into"
        )
        raise RankMismatchError(msg)
