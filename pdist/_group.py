"""The value types every other module works with: ``Group``, ``DistContext`` and their lifetime.

It imports nothing else from pdist except the errors and ``_compat`` (both
leaves), so that every other module can depend on it and nothing imports back up.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Hashable
from datetime import timedelta
from typing import Any, Protocol, TypeVar, cast

import attrs
import torch
import torch.distributed as dist

from ._compat import recorder_sees_gloo
from ._errors import PdistError

__all__ = [
    "DistContext",
    "Group",
    "HeaderTransport",
    "InFlight",
    "Lifetime",
    "ProcessGroup",
    "as_group",
    "recorded",
]

F = TypeVar("F", bound=Callable[..., Any])

logger = logging.getLogger("pdist")

ProcessGroup = dist.ProcessGroup


class HeaderTransport(Protocol):
    """What a group's message queue must do: carry a framed header from the group's first rank.

    :func:`~pdist.message_queue` attaches one to the group it yields; the object
    broadcasts send their header through it instead of the CPU group.
    """

    def broadcast_bytes(
        self,
        group: Group,
        payload: bytes | None,
        src: int,
        *,
        error: BaseException | None = None,
        what: str = "broadcast",
    ) -> bytes:
        """Broadcast ``payload`` (or the source's ``error``) from group index ``src``."""
        ...


class InFlight:
    """pdist's own record of the collectives the block is in: where the flight recorder is blind.

    torch's flight recorder records every collective, but not gloo's on torch
    2.6 and never gloo's point-to-point ones; the stall watch then reads this
    instead. :func:`recorded` keeps it: one call per decorated pdist function,
    and only while :attr:`active` (the watch is on). ``current`` is the
    innermost call in flight, ``(group key, op, seq, sizes, dtype, start ns)``;
    ``entered`` counts the calls per group key (pdist's own sequence numbers),
    ``finished`` keeps each group's last finished call. One thread (the one
    running the block) writes; the watch only reads.
    """

    __slots__ = ("active", "current", "entered", "finished")

    def __init__(self) -> None:
        self.active = False
        self.current: tuple[Any, ...] | None = None
        self.entered: dict[str, int] = {}
        self.finished: dict[str, tuple[Any, ...]] = {}

    @staticmethod
    def key(group: Group) -> str:
        """The group's key in the record: its name, first rank and size (equal on its members)."""
        return f"{group.name}@{group.ranks[0]}+{group.world_size}"

    def track(self, groups: list[Group]) -> None:
        """Start counting ``groups`` at zero, so that a rank that never called on one shows."""
        for group in groups:
            self.entered.setdefault(self.key(group), 0)

    def enter(self, group: Group, op: str, first: object) -> tuple[Any, ...] | None:
        """Record that ``op`` started on ``group``; returns what :meth:`leave` restores."""
        key = self.key(group)
        seq = self.entered.get(key, 0) + 1
        self.entered[key] = seq
        if isinstance(first, torch.Tensor):
            sizes, dtype = [list(first.shape)], str(first.dtype).replace("torch.", "")
        elif isinstance(first, (bytes, bytearray, memoryview)):
            sizes, dtype = [[len(first)]], "bytes"
        else:
            sizes, dtype = [], ""
        outer, self.current = self.current, (key, op, seq, sizes, dtype, time.time_ns())
        return outer

    def leave(self, outer: tuple[Any, ...] | None) -> None:
        """Record that the innermost call ended; ``outer`` is what :meth:`enter` returned."""
        if self.current is not None:
            self.finished[self.current[0]] = self.current
        self.current = outer


def recorded(op: str, *, p2p: bool = False) -> Callable[[F], F]:
    """Decorate a pdist function taking a group first: its calls go into :class:`InFlight`.

    Returns the function itself where torch's flight recorder sees the call
    (gloo collectives from torch 2.7): nothing is added to its path there.
    Elsewhere, one check of the block's record per call, and the record only
    while the stall watch is on. ``op`` names the call, unless the call passes
    ``what=``; ``p2p`` marks a point-to-point call (never in gloo's recorder).
    """

    def decorate(fn: F) -> F:
        if recorder_sees_gloo() and not p2p:
            return fn

        @functools.wraps(fn)
        def recorded_call(group: Group | DistContext, *args: Any, **kwargs: Any) -> Any:
            g = group.world if isinstance(group, DistContext) else group
            # A bad group is the function's own error to raise; a traced call has no time.
            if not isinstance(g, Group) or torch.compiler.is_compiling():
                return fn(group, *args, **kwargs)
            record = g.lifetime.in_flight
            if not record.active:
                return fn(group, *args, **kwargs)
            outer = record.enter(g, kwargs.get("what", op), args[0] if args else None)
            try:
                return fn(group, *args, **kwargs)
            finally:
                record.leave(outer)

        return cast("F", recorded_call)

    return decorate


class Lifetime:
    """The torch process groups of one ``distributed()`` block, and whether it is still open.

    Groups and contexts reach torch's process groups only through this object,
    so that once the block exits nothing pdist handed out keeps a destroyed
    process group alive (torch 2.13 with gloo can abort at interpreter exit
    while one is still referenced). It also holds the block's cache of built
    partitions, so that asking twice for the same groups builds them once,
    and pdist's own record of the collectives in flight (:class:`InFlight`).
    """

    __slots__ = ("_created", "_lock", "_owns_default", "_pgs", "cache", "closed", "in_flight")

    def __init__(self) -> None:
        self.closed = False
        self.in_flight = InFlight()
        self._pgs: list[ProcessGroup] = []
        self._created: list[ProcessGroup] = []
        self._owns_default = False
        self._lock = threading.Lock()
        self.cache: dict[Hashable, object] = {}

    def add(self, pg: ProcessGroup, *, created: bool) -> int:
        """Keep ``pg`` and return its key; ``created`` ones are destroyed on close."""
        with self._lock:
            self.check_open()
            if created:
                self._created.append(pg)
            self._pgs.append(pg)
            return len(self._pgs) - 1

    def owns_default(self) -> None:
        """Mark the default group as this block's: closing destroys it (and every group)."""
        self._owns_default = True

    def check_open(self) -> None:
        """Raise :class:`~pdist.PdistError` when the block has exited."""
        if self.closed:
            msg = (
                "this pdist context is closed: its process groups were destroyed when the "
                "`with pdist.distributed()` block exited; use groups only inside the block"
            )
            raise PdistError(msg)

    def get(self, key: int) -> ProcessGroup:
        """The process group of ``key``; raises once the block has exited."""
        self.check_open()
        return self._pgs[key]

    def process_groups(self) -> list[ProcessGroup]:
        """Every process group of the block (none once it has exited); safe from any thread."""
        with self._lock:
            return list(self._pgs)

    def close(self) -> None:
        """Forget every group and destroy the ones this block created; no collective."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            created, self._created, self._pgs = self._created, [], []
            self.cache.clear()
        if self._owns_default:
            # Destroying the default group destroys every group torch knows of.
            _destroy(None)
        else:
            for pg in reversed(created):
                _destroy(pg)


def _destroy(pg: ProcessGroup | None) -> None:
    try:
        if pg is None:
            if dist.is_initialized():
                dist.destroy_process_group()
        else:
            dist.destroy_process_group(pg)
    except Exception:  # teardown must go on; the block's own error matters more
        logger.warning("pdist: destroying a process group failed", exc_info=True)


@attrs.frozen(kw_only=True)
class Group:
    """One process group, seen from the calling rank.

    All rank attributes except ``rank_in_group`` are global ranks; ``src`` and
    ``dst`` arguments of pdist's collectives index into ``ranks``.

    Attributes:
        name: What the group is for (``"world"``, ``"tp"``, ...).
        ranks: Global ranks of the members, in group order.
        rank: The caller's global rank.
        rank_in_group: The caller's index into ``ranks``.
        device: The device tensors of this group live on.
        timeout: Collective timeout of the group.
    """

    name: str
    ranks: tuple[int, ...]
    rank: int
    rank_in_group: int
    device: torch.device
    timeout: timedelta
    _lifetime: Lifetime = attrs.field(eq=False, repr=False, alias="lifetime")
    _device_key: int = attrs.field(eq=False, repr=False, alias="device_key")
    _cpu_key: int = attrs.field(eq=False, repr=False, alias="cpu_key")
    _mq: HeaderTransport | None = attrs.field(default=None, eq=False, repr=False, alias="mq")

    @property
    def world_size(self) -> int:
        """Number of ranks in the group."""
        return len(self.ranks)

    @property
    def device_group(self) -> ProcessGroup:
        """The torch process group for tensor traffic (NCCL on CUDA, gloo on CPU).

        Raises:
            PdistError: The ``distributed()`` block that made the group has exited.
        """
        return self._lifetime.get(self._device_key)

    @property
    def cpu_group(self) -> ProcessGroup:
        """The gloo process group for metadata, pickled objects and barriers.

        Raises:
            PdistError: The ``distributed()`` block that made the group has exited.
        """
        return self._lifetime.get(self._cpu_key)

    @property
    def is_closed(self) -> bool:
        """Whether the ``distributed()`` block that made this group has exited."""
        return self._lifetime.closed

    @property
    def header_transport(self) -> HeaderTransport | None:
        """The queue object broadcasts send headers through (on a message_queue group)."""
        return self._mq

    @property
    def lifetime(self) -> Lifetime:
        """The ``distributed()`` block this group belongs to (for building related groups)."""
        return self._lifetime

    @property
    def first_rank(self) -> int:
        """Global rank of the group's first member."""
        return self.ranks[0]

    @property
    def last_rank(self) -> int:
        """Global rank of the group's last member."""
        return self.ranks[-1]

    @property
    def is_first_rank(self) -> bool:
        """Whether the caller is the group's first member."""
        return self.rank_in_group == 0

    @property
    def is_last_rank(self) -> bool:
        """Whether the caller is the group's last member."""
        return self.rank_in_group == self.world_size - 1

    @property
    def next_rank(self) -> int:
        """Global rank of the next member (wraps around)."""
        return self.ranks[(self.rank_in_group + 1) % self.world_size]

    @property
    def prev_rank(self) -> int:
        """Global rank of the previous member (wraps around)."""
        return self.ranks[(self.rank_in_group - 1) % self.world_size]

    def global_rank(self, index: int, *, name: str = "src") -> int:
        """The global rank of group index ``index``.

        Raises:
            TypeError: ``index`` is not an int.
            ValueError: ``index`` is outside ``range(world_size)``.
        """
        if isinstance(index, bool) or not isinstance(index, int):
            msg = f"{name}={index!r} must be an int index into the group's ranks"
            raise TypeError(msg)
        if not 0 <= index < self.world_size:
            msg = (
                f"{name}={index!r} is outside group {self.name!r} of size {self.world_size}; "
                f"{name} is group-relative: use 0..{self.world_size - 1}"
            )
            raise ValueError(msg)
        return self.ranks[index]

    def peer_index(self, index: int | None, default_global: int, name: str) -> int:
        """The group index of a point-to-point peer: ``index``, or ``default_global``'s.

        Raises:
            ValueError: The group has one rank, or ``index`` is outside it.
        """
        if self.world_size == 1:
            msg = (
                f"point-to-point {name} needs a group of at least 2 ranks; "
                f"group {self.name!r} has 1"
            )
            raise ValueError(msg)
        if index is None:
            return self.ranks.index(default_global)
        self.global_rank(index, name=name)
        return index


@attrs.frozen(kw_only=True)
class DistContext:
    """Everything a rank needs, frozen; derive variants with ``attrs.evolve``.

    Attributes:
        rank: Global rank.
        world_size: Number of ranks in the job.
        local_rank: Index of this process on its host (from the launcher).
        device: The device this rank is bound to.
        backend: Backend of the device groups (``"gloo"``, ``"nccl"``, ...).
        world: All ranks.
        node: The ranks on this host (found through shared memory).
        tp: Tensor-parallel group (adjacent ranks).
        sp: Sequence-parallel group.
        dp: Data-parallel group.
        dp_sp: The ranks sharing this rank's tp index: the group gradients are
            averaged over (data and sequence parallel together); ``dp`` when
            ``sp == 1``.
    """

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    world: Group
    node: Group
    tp: Group
    sp: Group
    dp: Group
    dp_sp: Group


def as_group(group: Group | DistContext, *, name: str = "group") -> Group:
    """The group a collective runs on: a ``Group`` itself, or a context's ``world``.

    Raises:
        TypeError: ``group`` is neither.
    """
    if isinstance(group, Group):
        return group
    if isinstance(group, DistContext):
        return group.world
    msg = f"{name}={group!r} must be a pdist Group or DistContext"
    raise TypeError(msg)
