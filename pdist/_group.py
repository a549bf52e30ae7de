"""The value types every other module works with: ``Group``, ``DistContext`` and their lifetime.

It imports only the lowest pdist layers, so every other module can depend on it.
"""

from __future__ import annotations

import logging
import threading
from datetime import timedelta
from typing import Protocol

import attrs
import torch
import torch.distributed as dist

from ._compat import Store, before_destroying_groups
from ._errors import PdistError
from ._inflight import InFlight
from ._layout import CONTEXT_GROUPS, Layout

__all__ = [
    "Built",
    "DistContext",
    "Group",
    "HeaderTransport",
    "Lifetime",
    "ProcessGroup",
    "RollCall",
    "as_group",
    "standalone_group",
]

logger = logging.getLogger("pdist")

ProcessGroup = dist.ProcessGroup
Blocks = tuple[tuple[int, ...], ...]


class HeaderTransport(Protocol):
    """What carries a group's object-broadcast headers instead of its CPU group (an mq ring)."""

    def broadcast_bytes(
        self,
        group: Group,
        payload: bytes | None,
        src: int,
        *,
        error: BaseException | None = None,
        what: str,
    ) -> bytes:
        """Broadcast ``payload`` (or the source's ``error``) from group index ``src``."""


@attrs.frozen
class Built:
    """A partition as built: the caller's block, its group keys, whether it is a member at all."""

    ranks: tuple[int, ...]
    device_key: int
    cpu_key: int
    member: bool
    timeout: timedelta

    def group(self, name: str, rank: int, device: torch.device, lifetime: Lifetime) -> Group:
        """The Group of global rank ``rank``, one of ``ranks``, over these keys of ``lifetime``."""
        return Group(
            name=name,
            ranks=self.ranks,
            rank=rank,
            rank_in_group=self.ranks.index(rank),
            device=device,
            timeout=self.timeout,
            lifetime=lifetime,
            device_key=self.device_key,
            cpu_key=self.cpu_key,
        )


@attrs.define(kw_only=True, eq=False)
class RollCall:
    """This rank's roll-call thread of a block (``_departures``), from the moment it is claimed.

    Attributes:
        call: The store key a roll call (or the block's exit) is written to.
        ready: Set once the thread has made its connections, or failed to.
        thread: The thread, once started.
        connection: The store connection the block's short calls share, once made.
    """

    call: str
    ready: threading.Event = attrs.field(factory=threading.Event)
    thread: threading.Thread | None = None
    connection: Store | None = None


@attrs.define(kw_only=True, eq=False)
class Lifetime:
    """The torch process groups of one ``distributed()`` block, and whether it is still open.

    Groups reach torch's process groups only through it, so that once the block
    exits nothing pdist handed out keeps a destroyed group alive (torch 2.13 with
    gloo can abort at exit while one is referenced). ``distributed()`` makes one per
    block; a link or a quorum gets its own through ``standalone_group``.

    Attributes:
        check: Check mode (``distributed(check=True)``): tensor collectives agree on
            their arguments first.
        subgroup_timeout: The timeout of the groups built after the world (None: the world's).
        exit_records: Where a rank leaving the block records why (``_departures``): the
            store and the block's prefix; dropped when the block closes.
        in_flight: The collectives in flight, for the stall watch.
        partitions: The partitions built so far, by their blocks (asking twice builds
            once), and by name and blocks for the groups a user names (one name, one
            communicator).
        calls: pdist's tensor collectives so far, per group name (a survivor's
            "all_reduce #6").
        roll_call: This rank's roll-call thread of the block, once claimed.
        store_gone: A survivor found the store gone with its host: teardown skips the
            store calls that would each wait out their bound (a frozen host accepts and
            never answers).
        closed: Whether the block has exited.
    """

    check: bool = False
    subgroup_timeout: timedelta | None = None
    exit_records: tuple[Store, str] | None = None
    in_flight: InFlight = attrs.field(factory=InFlight, init=False)
    partitions: dict[Blocks | tuple[str, Blocks], Built] = attrs.field(factory=dict, init=False)
    calls: dict[str, int] = attrs.field(factory=dict, init=False)
    roll_call: RollCall | None = attrs.field(default=None, init=False)
    store_gone: bool = attrs.field(default=False, init=False)
    closed: bool = attrs.field(default=False, init=False)
    _pgs: list[ProcessGroup] = attrs.field(factory=list, init=False)
    _created: list[ProcessGroup] = attrs.field(factory=list, init=False)
    _owns_default: bool = attrs.field(default=False, init=False)
    _lock: threading.Lock = attrs.field(factory=threading.Lock, init=False)

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

    def claim_roll_call(self, roll_call: RollCall) -> bool:
        """Whether ``roll_call`` is the block's (the first claim wins); safe from any thread."""
        with self._lock:
            if self.roll_call is not None:
                return False
            self.roll_call = roll_call
            return True

    def check_open(self) -> None:
        """Raise [`PdistError`][pdist.PdistError] when the block has exited."""
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
            self.partitions.clear()
            self.exit_records = None  # a link's member 0 frees its store's port with it
        if self._owns_default or created:
            before_destroying_groups()
        # Destroying the default group destroys every group torch knows of.
        for pg in [None] if self._owns_default else reversed(created):
            try:
                if pg is not None or dist.is_initialized():
                    dist.destroy_process_group(pg)
            except Exception:  # teardown must go on; the block's own error matters more
                logger.warning("pdist: destroying a process group failed", exc_info=True)


@attrs.frozen(kw_only=True)
class Group:
    """One process group, seen from the calling rank.

    Rank attributes but ``rank_in_group`` are global; ``src``/``dst`` arguments index ``ranks``.

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
        """The torch process group for tensors (NCCL on CUDA, gloo on CPU); raises once closed."""
        return self._lifetime.get(self._device_key)

    @property
    def cpu_group(self) -> ProcessGroup:
        """The gloo process group for metadata, pickled objects and barriers; raises once closed."""
        return self._lifetime.get(self._cpu_key)

    @property
    def is_closed(self) -> bool:
        """Whether the ``distributed()`` block that made this group has exited."""
        return self._lifetime.closed

    @property
    def header_transport(self) -> HeaderTransport | None:
        """What object broadcasts send headers through (a message_queue group's ring)."""
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

    def transport(self, kind: str) -> ProcessGroup:
        """The group that carries a payload's ``kind`` of bytes: ``"cpu"`` or ``"device"``."""
        return self.cpu_group if kind == "cpu" else self.device_group

    def global_rank(self, index: int, *, name: str = "src") -> int:
        """The global rank of group index ``index``.

        Raises:
            TypeError: ``index`` is not an int.
            ValueError: ``index`` is outside ``range(world_size)``.
        """
        if isinstance(index, bool) or not isinstance(index, int):
            msg = f"{name}={index!r} on rank {self.rank} must be an int index into the group"
            raise TypeError(msg)
        if not 0 <= index < self.world_size:
            msg = (
                f"{name}={index!r} is outside group {self.name!r} of size {self.world_size} "
                f"(on rank {self.rank}); {name} is group-relative: use 0..{self.world_size - 1}"
            )
            raise ValueError(msg)
        return self.ranks[index]

    def peer_index(self, index: int | None, default_global: int, name: str) -> int:
        """The group index of a point-to-point peer: ``index``, or ``default_global``'s.

        Raises:
            TypeError | ValueError: The group has one rank, or ``index`` is not in it.
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


def standalone_group(
    *,
    name: str,
    rank: int,
    size: int,
    device: torch.device,
    timeout: timedelta,
    device_group: ProcessGroup,
    cpu_group: ProcessGroup,
    exit_records: tuple[Store, str] | None = None,
) -> Group:
    """A Group of process groups made outside torch's registry (a link, a quorum).

    Its ranks are its own ``0..size-1``, and it gets a ``Lifetime`` of its own: closing
    it forgets the process groups, which the caller shuts down (it made them).
    ``exit_records``: where its members record why they left (see ``Lifetime``).
    """
    lifetime = Lifetime(exit_records=exit_records)
    device_key, cpu_key = (lifetime.add(pg, created=False) for pg in (device_group, cpu_group))
    built = Built(tuple(range(size)), device_key, cpu_key, True, timeout)
    return built.group(name, rank, device, lifetime)


@attrs.frozen(kw_only=True)
class DistContext:
    """Everything a rank needs, frozen; derive variants with ``attrs.evolve``.

    Every axis of the layout has a group ([`axes`][pdist.DistContext.axes]); ``pp``, ``dp``,
    ``cp``, ``sp`` and ``tp`` are also fields, a one-rank group where the layout lacks that axis.

    Attributes:
        rank: Global rank.
        world_size: Number of ranks in the job.
        local_rank: Index of this process on its host (from the launcher).
        device: The device this rank is bound to.
        backend: Backend of the device groups (``"gloo"``, ``"nccl"``, ...).
        layout: The axes of the job, slowest first (pure rank arithmetic, to read):
            ``layout.axes`` the ``(name, size)`` pairs, ``layout.names`` the names,
            ``layout.axis_size(name)`` one size (1 for an axis it lacks).
        world: All ranks.
        node: The ranks on this host (found through shared memory).
        pp: Pipeline-parallel group (the ranks of one pipeline "column", one per stage).
        dp: Data-parallel group.
        cp: Context-parallel (ring attention) group.
        sp: Sequence-parallel (Ulysses) group.
        tp: Tensor-parallel group (adjacent ranks).
        dp_sp: The ranks sharing every coordinate except ``dp``, ``cp`` and ``sp``, over
            which data-parallel gradients are averaged (``dp`` when ``cp == sp == 1``).
        ep: Expert-parallel group: a block of ``ep`` consecutive ranks of a pipeline stage.
        edp: The ranks of this stage at this rank's position in their ``ep`` block, over
            which expert gradients are averaged.
        named_axes: ``(name, group)`` of each user-named axis that is not a field.
    """

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    layout: Layout
    world: Group
    node: Group
    pp: Group
    dp: Group
    cp: Group
    sp: Group
    tp: Group
    dp_sp: Group
    ep: Group
    edp: Group
    named_axes: tuple[tuple[str, Group], ...] = ()

    @property
    def axes(self) -> dict[str, Group]:
        """Every axis of the layout -> its Group, slowest first (a patched tp shows here too)."""
        return {name: self.group(name) for name in self.layout.names}

    def group(self, name: str) -> Group:
        """The group called ``name``: an axis, ``world``, ``node``, ``dp_sp``, ``ep`` or ``edp``.

        Raises:
            ValueError: The context has no group of that name.
        """
        if name in CONTEXT_GROUPS:
            found: Group = getattr(self, name)
            return found
        for axis, group in self.named_axes:
            if axis == name:
                return group
        known = (*CONTEXT_GROUPS, *(axis for axis, _ in self.named_axes))
        msg = f"name={name!r} is no group of this context; choose one of {known}"
        raise ValueError(msg)


def as_group(group: Group | DistContext, *, name: str = "group") -> Group:
    """The group a collective runs on: a ``Group`` itself, or a context's ``world``.

    Raises [`PdistError`][pdist.PdistError] once its block has exited, a one-rank group's too
    (no process group would tell), except while torch.compile traces: a graph compiled
    then gets the op that raises when it runs.
    """
    if isinstance(group, DistContext):
        group = group.world
    elif not isinstance(group, Group):
        msg = f"{name}={group!r} must be a pdist Group or DistContext"
        raise TypeError(msg)
    if group.is_closed and not torch.compiler.is_compiling():
        group.lifetime.check_open()
    return group
