"""``Group``, ``DistContext``, ``distributed()`` and the group variants built from a context."""

from __future__ import annotations

import contextlib
import logging
import types
from collections.abc import Iterator, Sequence
from datetime import timedelta
from typing import Any

import attrs
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import HashStore, Store

from . import _env, _layout
from ._errors import PdistError

__all__ = [
    "DistContext",
    "Group",
    "as_group",
    "device_mesh",
    "distributed",
    "new_sp_group",
    "new_tp_group",
    "patch_tp",
]

logger = logging.getLogger("pdist")

ProcessGroup = dist.ProcessGroup


class _Lifetime:
    """The torch process groups of one ``distributed()`` block, and whether it is still open.

    Groups and contexts reach torch's process groups only through this object,
    so that once the block exits nothing pdist handed out keeps a destroyed
    process group alive (torch 2.13 with gloo can abort at interpreter exit
    while one is still referenced).
    """

    __slots__ = ("_created", "_owns_default", "_pgs", "closed")

    def __init__(self) -> None:
        self.closed = False
        self._pgs: list[ProcessGroup] = []
        self._created: list[ProcessGroup] = []
        self._owns_default = False

    def add(self, pg: ProcessGroup, *, created: bool) -> int:
        """Keep ``pg`` and return its key; ``created`` ones are destroyed on close."""
        if created:
            self._created.append(pg)
        self._pgs.append(pg)
        return len(self._pgs) - 1

    def owns_default(self) -> None:
        self._owns_default = True

    def get(self, key: int) -> ProcessGroup:
        if self.closed:
            msg = (
                "this pdist context is closed: its process groups were destroyed when the "
                "`with pdist.distributed()` block exited; use groups only inside the block"
            )
            raise PdistError(msg)
        return self._pgs[key]

    def close(self) -> None:
        """Forget every group and destroy the ones this block created; no collective."""
        if self.closed:
            return
        self.closed = True
        created, self._created, self._pgs = self._created, [], []
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
    _lifetime: _Lifetime = attrs.field(eq=False, repr=False, alias="lifetime")
    _device_key: int = attrs.field(eq=False, repr=False, alias="device_key")
    _cpu_key: int = attrs.field(eq=False, repr=False, alias="cpu_key")
    _mq: Any = attrs.field(default=None, eq=False, repr=False, alias="mq")

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


@attrs.frozen(kw_only=True)
class DistContext:
    """Everything a rank needs, frozen; derive variants with ``attrs.evolve``.

    Attributes:
        rank: Global rank.
        world_size: Number of ranks in the job.
        local_rank: Index of this process on its host (from the launcher).
        device: The device this rank is bound to.
        backend: Backend of the device groups (``"gloo"``, ``"nccl"``).
        world: All ranks.
        node: The ranks on this host.
        tp: Tensor-parallel group (adjacent ranks).
        sp: Sequence-parallel group.
        dp: Data-parallel group.
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


def _resolve_device(
    device: str | torch.device | int | None, backend: str | None, local_rank: int
) -> torch.device:
    if device is None:
        use_cuda = torch.cuda.is_available() and backend != "gloo"
        return torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if isinstance(device, int) and not isinstance(device, bool):
        device = torch.device("cuda", device)
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        msg = f"device={device!r} is not a torch device ({exc})"
        raise ValueError(msg) from None
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            msg = f"device={device!r} needs CUDA, which is not available; use device='cpu'"
            raise ValueError(msg)
        index = local_rank if resolved.index is None else resolved.index
        count = torch.cuda.device_count()
        if index >= count:
            msg = (
                f"device={device!r} (index {index}) is beyond the {count} visible CUDA "
                "device(s); check CUDA_VISIBLE_DEVICES and the processes per node"
            )
            raise ValueError(msg)
        resolved = torch.device("cuda", index)
    return resolved


_KNOWN_BACKENDS = ("gloo", "nccl", "mpi", "ucc", "xccl")


def _resolve_backend(backend: str | None, device: torch.device) -> str:
    if backend is None:
        return "nccl" if device.type == "cuda" else "gloo"
    if not isinstance(backend, str) or backend.lower() not in _KNOWN_BACKENDS:
        msg = f"backend={backend!r} is not one of {_KNOWN_BACKENDS}"
        raise ValueError(msg)
    backend = backend.lower()
    if backend == "nccl" and device.type != "cuda":
        msg = (
            f"backend='nccl' needs a CUDA device, but the device is {str(device)!r}"
            + ("" if torch.cuda.is_available() else " (CUDA is not available)")
            + "; use backend='gloo' on CPU"
        )
        raise ValueError(msg)
    return backend


class _GroupFactory:
    """Builds pdist Groups for one context, sharing torch groups between equal rank sets.

    Every rank must ask for every rank set in the same order: torch's
    ``new_group`` is collective over the whole world.
    """

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        device: torch.device,
        backend: str,
        lifetime: _Lifetime,
        timeout: timedelta,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.backend = backend
        self.lifetime = lifetime
        self.timeout = timeout
        self._keys: dict[tuple[int, ...], tuple[int, int]] = {}

    def adopt_world(
        self,
        device_pg: ProcessGroup,
        cpu_pg: ProcessGroup,
        *,
        cpu_created: bool,
        timeout: timedelta,
    ) -> Group:
        dkey = self.lifetime.add(device_pg, created=False)
        ckey = dkey if cpu_pg is device_pg else self.lifetime.add(cpu_pg, created=cpu_created)
        ranks = tuple(range(self.world_size))
        self._keys[ranks] = (dkey, ckey)
        return Group(
            name="world",
            ranks=ranks,
            rank=self.rank,
            rank_in_group=self.rank,
            device=self.device,
            timeout=timeout,
            lifetime=self.lifetime,
            device_key=dkey,
            cpu_key=ckey,
        )

    def _keys_for(self, ranks: tuple[int, ...]) -> tuple[int, int] | None:
        if ranks in self._keys:
            return self._keys[ranks]
        seconds = self.timeout
        device_pg = dist.new_group(list(ranks), timeout=seconds, backend=self.backend)
        cpu_pg = device_pg
        if self.backend != "gloo":
            cpu_pg = dist.new_group(list(ranks), timeout=seconds, backend="gloo")
        if self.rank not in ranks:
            return None
        dkey = self.lifetime.add(device_pg, created=True)
        ckey = dkey if cpu_pg is device_pg else self.lifetime.add(cpu_pg, created=True)
        self._keys[ranks] = (dkey, ckey)
        return dkey, ckey

    def partition(self, name: str, partition: Sequence[tuple[int, ...]]) -> Group:
        """Create a torch group for every block of ``partition``; return the caller's."""
        mine: Group | None = None
        for ranks in partition:
            keys = self._keys_for(tuple(ranks))
            if keys is not None:
                mine = Group(
                    name=name,
                    ranks=tuple(ranks),
                    rank=self.rank,
                    rank_in_group=ranks.index(self.rank),
                    device=self.device,
                    timeout=self.timeout,
                    lifetime=self.lifetime,
                    device_key=keys[0],
                    cpu_key=keys[1],
                )
        if mine is None:
            msg = f"rank {self.rank} is in no block of the {name!r} partition {list(partition)}"
            raise PdistError(msg)
        return mine


class _Distributed:
    """The single-use context manager returned by :func:`distributed`."""

    def __init__(
        self,
        *,
        tp: int,
        sp: int,
        backend: str | None,
        device: str | torch.device | int | None,
        timeout: float | timedelta | None,
        store: Store | None,
        rank: int | None,
        world_size: int | None,
        local_rank: int | None,
        cpu_affinity: bool,
    ) -> None:
        self._state = "new"
        self._lifetime: _Lifetime | None = None
        self._adopt = dist.is_available() and dist.is_initialized()
        launch = _env.detect_launch()
        if self._adopt:
            launch = attrs.evolve(launch, rank=dist.get_rank(), world_size=dist.get_world_size())
        for name, value in (("rank", rank), ("world_size", world_size), ("local_rank", local_rank)):
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 0
            ):
                msg = f"{name}={value!r} must be a non-negative int"
                raise ValueError(msg)
        launch = attrs.evolve(
            launch,
            rank=launch.rank if rank is None else rank,
            world_size=launch.world_size if world_size is None else world_size,
            local_rank=launch.local_rank if local_rank is None else local_rank,
        )
        if launch.rank >= launch.world_size:
            msg = f"rank={launch.rank} must be below world_size={launch.world_size}"
            raise ValueError(msg)
        if (
            not self._adopt
            and store is None
            and launch.world_size > 1
            and launch.launcher == "none"
        ):
            msg = (
                f"world_size={launch.world_size} without a launcher needs a rendezvous: "
                "pass store= or run under torchrun/SLURM"
            )
            raise ValueError(msg)
        self._launch = launch
        self._layout = _layout.make_layout(launch.world_size, tp=tp, sp=sp)
        requested_backend = backend if backend is not None else _env.env_backend()
        self._device = _resolve_device(device, requested_backend, launch.local_rank)
        self._backend = _resolve_backend(requested_backend, self._device)
        if self._adopt:
            self._backend = str(dist.get_backend())
        if timeout is None:
            seconds = _env.env_seconds("PDIST_TIMEOUT_SEC", _env.DEFAULT_TIMEOUT_SEC)
        else:
            seconds = _env.to_seconds(timeout, "timeout")
        assert seconds is not None  # zero_means_forever is off
        sub_seconds = _env.env_seconds("PDIST_SUBGROUP_TIMEOUT_SEC", seconds)
        assert sub_seconds is not None
        self._timeout = timedelta(seconds=seconds)
        self._sub_timeout = timedelta(seconds=sub_seconds)
        self._store = store
        self._cpu_affinity = cpu_affinity

    def __enter__(self) -> DistContext:
        if self._state != "new":
            msg = (
                "this distributed() was already entered; a distributed() is single-use: "
                "call pdist.distributed(...) again for a new block"
            )
            raise PdistError(msg)
        self._state = "entered"
        lifetime = self._lifetime = _Lifetime()
        try:
            return self._setup(lifetime)
        except BaseException:
            self._state = "closed"
            lifetime.close()
            raise

    def _init_default(self, lifetime: _Lifetime) -> None:
        launch, device = self._launch, self._device
        kwargs: dict[str, Any] = {
            "backend": self._backend,
            "rank": launch.rank,
            "world_size": launch.world_size,
            "timeout": self._timeout,
        }
        if device.type == "cuda":
            # Eager communicator creation bound to our device (principle 4).
            kwargs["device_id"] = device
        if self._store is not None:
            kwargs["store"] = self._store
        elif launch.launcher == "torchrun":
            kwargs["init_method"] = "env://"
        elif launch.launcher == "slurm":
            kwargs["init_method"] = f"tcp://{launch.master_addr}:{launch.master_port}"
        else:
            kwargs["store"] = HashStore()
        dist.init_process_group(**kwargs)
        lifetime.owns_default()

    def _setup(self, lifetime: _Lifetime) -> DistContext:
        from . import _topology

        device = self._device
        if device.type == "cuda":
            torch.cuda.set_device(device)
        if not self._adopt:
            self._init_default(lifetime)
        world_pg = dist.group.WORLD
        assert world_pg is not None
        cpu_world = world_pg
        cpu_created = False
        if dist.get_backend(world_pg) != "gloo":
            cpu_world = dist.new_group(backend="gloo", timeout=self._timeout)
            cpu_created = True
        factory = _GroupFactory(
            rank=self._launch.rank,
            world_size=self._launch.world_size,
            device=device,
            backend=self._backend,
            lifetime=lifetime,
            timeout=self._sub_timeout,
        )
        world = factory.adopt_world(
            world_pg, cpu_world, cpu_created=cpu_created, timeout=self._timeout
        )
        nodes = _topology.node_partition(world)
        layout = self._layout
        groups = {axis: factory.partition(axis, layout.groups(axis)) for axis in _layout.AXES}
        node = factory.partition("node", nodes)
        if self._cpu_affinity and device.type == "cuda":
            _topology.apply_gpu_affinity(device)
        return DistContext(
            rank=self._launch.rank,
            world_size=self._launch.world_size,
            local_rank=self._launch.local_rank,
            device=device,
            backend=self._backend,
            world=world,
            node=node,
            tp=groups["tp"],
            sp=groups["sp"],
            dp=groups["dp"],
        )

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: types.TracebackType | None,
    ) -> None:
        self._state = "closed"
        if self._lifetime is not None:
            self._lifetime.close()


def distributed(
    *,
    tp: int = 1,
    sp: int = 1,
    backend: str | None = None,
    device: str | torch.device | int | None = None,
    timeout: float | timedelta | None = None,
    store: Store | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    local_rank: int | None = None,
    cpu_affinity: bool = True,
) -> contextlib.AbstractContextManager[DistContext]:
    """Set up torch.distributed and the parallel groups; yield a frozen :class:`DistContext`.

    Works under torchrun, under SLURM's ``srun`` and as plain ``python
    script.py`` (a one-rank world). Arguments are validated when this is
    called, before any collective, identically on every rank. On entry it binds
    the device, initializes the default group (or adopts one that is already
    initialized and leaves it alone), creates the ``node``, ``tp``, ``sp`` and
    ``dp`` groups, and on CUDA pins the CPU affinity of the GPU. On exit it
    destroys exactly the process groups it created, with no collective, also
    when the block raises. The returned object can be entered once.

    .. note:: Every rank of the job must enter it.

    Args:
        tp: Tensor-parallel size (adjacent ranks).
        sp: Sequence-parallel size.
        backend: ``"nccl"``/``"gloo"``; default ``PDIST_BACKEND``, else nccl on CUDA, gloo on CPU.
        device: The rank's device; default ``cuda:<local_rank>`` when CUDA is available, else CPU.
        timeout: Collective timeout (seconds or ``timedelta``); default ``PDIST_TIMEOUT_SEC``
            or 1800 s. ``PDIST_SUBGROUP_TIMEOUT_SEC`` overrides it for subgroups.
        store: A ``torch.distributed.Store`` to rendezvous through instead of the launcher's.
        rank: Overrides the launcher's rank.
        world_size: Overrides the launcher's world size.
        local_rank: Overrides the launcher's local rank.
        cpu_affinity: On CUDA, pin this process to the CPUs near its GPU (NVML).

    Returns:
        A single-use context manager yielding the :class:`DistContext`.

    Raises:
        ValueError: Bad sizes, backend or device (see the message for the fix).
        PdistError: Entered twice, or the hosts hold different numbers of ranks.
    """
    return _Distributed(
        tp=tp,
        sp=sp,
        backend=backend,
        device=device,
        timeout=timeout,
        store=store,
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        cpu_affinity=cpu_affinity,
    )


@contextlib.contextmanager
def patch_tp(ctx: DistContext, group: Group) -> Iterator[DistContext]:
    """Yield a new context whose ``tp`` group is ``group``; ``ctx`` itself is untouched.

    Nests freely (each level is a separate value), and nothing needs undoing
    when the block raises. Use it to run a model with another TP degree, e.g.
    one built with :func:`new_tp_group`.

    Raises:
        TypeError: ``ctx`` or ``group`` has the wrong type.
        ValueError: The caller's rank is not in ``group``.
    """
    if not isinstance(ctx, DistContext):
        msg = f"ctx={ctx!r} must be a pdist DistContext"
        raise TypeError(msg)
    if not isinstance(group, Group):
        msg = f"group={group!r} must be a pdist Group"
        raise TypeError(msg)
    if ctx.rank not in group.ranks:
        msg = f"group {group.name!r} with ranks {group.ranks} does not contain rank {ctx.rank}"
        raise ValueError(msg)
    yield attrs.evolve(ctx, tp=group)


def _new_consecutive_group(ctx: DistContext, size: int, name: str) -> Group:
    if not isinstance(ctx, DistContext):
        msg = f"ctx={ctx!r} must be a pdist DistContext"
        raise TypeError(msg)
    partition = _layout.consecutive_groups(ctx.world_size, size, name="size")
    lifetime = ctx.world._lifetime
    lifetime.get(ctx.world._device_key)  # raises when the context is closed
    factory = _GroupFactory(
        rank=ctx.rank,
        world_size=ctx.world_size,
        device=ctx.device,
        backend=ctx.backend,
        lifetime=lifetime,
        timeout=ctx.tp.timeout,
    )
    if len(partition) == 1:
        return attrs.evolve(ctx.world, name=name, timeout=ctx.tp.timeout)
    return factory.partition(name, partition)


def new_tp_group(ctx: DistContext, size: int, *, name: str | None = None) -> Group:
    """Build tensor-parallel groups of ``size`` consecutive ranks over the whole world.

    For a second model with another TP degree; use it with :func:`patch_tp`.
    The groups live until the context's ``distributed()`` block exits.

    .. note:: Every rank of the world must call it, in the same order as other
       group creations.

    Returns:
        The group holding the caller (ranks ``size * (rank // size)`` onwards).

    Raises:
        ValueError: ``size`` does not divide the world size.
        PdistError: The context is closed.
    """
    return _new_consecutive_group(ctx, size, name or f"tp{size}")


def new_sp_group(ctx: DistContext, size: int, *, name: str | None = None) -> Group:
    """Build sequence-parallel groups of ``size`` consecutive ranks over the whole world.

    .. note:: Every rank of the world must call it, in the same order as other
       group creations.

    Returns:
        The group holding the caller.

    Raises:
        ValueError: ``size`` does not divide the world size.
        PdistError: The context is closed.
    """
    return _new_consecutive_group(ctx, size, name or f"sp{size}")


def device_mesh(ctx: DistContext) -> Any:
    """A ``torch.distributed.device_mesh.DeviceMesh`` over the context's ``dp, sp, tp`` groups.

    ``mesh_dim_names == ("dp", "sp", "tp")``; the mesh reuses the context's
    process groups (no new communicator), so FSDP2/DTensor code runs inside a
    pdist context. Release the mesh (and whatever holds it) before the
    ``distributed()`` block exits.

    Raises:
        PdistError: The context is closed.
    """
    from torch.distributed.device_mesh import DeviceMesh

    layout = _layout.make_layout(ctx.world_size, tp=ctx.tp.world_size, sp=ctx.sp.world_size)
    mesh = torch.arange(ctx.world_size, dtype=torch.int).view(layout.dp, layout.sp, layout.tp)
    groups = [ctx.dp.device_group, ctx.sp.device_group, ctx.tp.device_group]
    return DeviceMesh.from_group(
        groups, ctx.device.type, mesh=mesh, mesh_dim_names=("dp", "sp", "tp")
    )
