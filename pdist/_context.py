"""``distributed()``: settings, then store, deadline, world, groups, hosts; and exact teardown.

One deadline (``startup_timeout``) is armed before the rendezvous and disarmed when
``__enter__`` returns: a stalled bring-up ends every waiting rank (exit code 93, naming
the stage and the ranks that never checked in) instead of hanging. It never covers the
user's block.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from . import _compat, _departures, _env, _stall, _subgroups, _topology
from ._compat import HashStore, PrefixStore, Store, TCPStore
from ._env import DEFAULT_ON_STALL
from ._errors import PdistError, trim_traceback
from ._group import DistContext, Lifetime
from ._guard import Deadline, probe_world
from ._layout import CONTEXT_GROUPS, KEYWORDS

__all__ = ["distributed", "probe_accelerator"]

logger = logging.getLogger("pdist")

# The stores this process hosts, one per address, kept for the process's life (as torchrun's
# agent keeps its own): closing one with its block would fail a rank that reaches the next
# block first. Each block's keys live under a prefix.
_HOSTED: dict[tuple[str, int], Store] = {}


def probe_accelerator() -> _env.Accelerator | None:
    """The machine's accelerator through ``torch.accelerator`` (cuda, xpu, npu, mps, ...)."""
    found = _compat.accelerator()
    if found is None:
        return None
    kind, count = found
    backend = _env.DEFAULT_BACKENDS.get(kind, "gloo")
    with contextlib.suppress(Exception):  # a device type torch names no backend for
        backend = str(dist.get_default_backend_for_device(kind))
    return _env.Accelerator(type=kind, count=count, backend=backend)


class _Distributed:
    """The single-use context manager returned by [`distributed`][pdist.distributed]."""

    def __init__(self, settings: _env.Settings, store: Store | None) -> None:
        self._settings, self._store, self._state = settings, store, "new"
        self._lifetime: Lifetime | None = None
        self._restore: list[Any] = []
        self._watch: _stall.Watch | None = None
        self._block: tuple[Store, str] | None = None  # the rendezvous store, the block's prefix
        self._hosts_store = False

    def __enter__(self) -> DistContext:
        if self._state != "new":
            msg = (
                "this distributed() was already entered; a distributed() is single-use: "
                "call pdist.distributed(...) again for a new block"
            )
            raise PdistError(msg)
        self._state = "entered"
        try:
            return self._start()
        except BaseException:
            self._close()
            raise

    def _rendezvous(self) -> str | None:
        launch = self._settings.launch
        if launch.master_addr is None or launch.master_port is None:
            return None
        return f"{launch.master_addr}:{launch.master_port}"

    def _start(self) -> DistContext:
        settings = self._settings
        launch = settings.launch
        deadline = Deadline(
            settings.startup_timeout,
            rank=launch.rank,
            world_size=launch.world_size,
            what="distributed() start-up",
            hint="Raise the deadline with distributed(startup_timeout=...) or "
            "PDIST_WORLD_COMM_TIMEOUT_SEC (0 waits forever)",
            rendezvous=self._rendezvous(),
        )
        deadline.arm()
        try:
            ctx = self._build(deadline)
        except Exception as exc:
            # Past the deadline, a failure is most likely a peer that gave up at its own
            # deadline (rank 0 taking the store with it): end as the watchdog would.
            deadline.abort_if_expired(exc)
            raise
        finally:
            took = deadline.disarm()
        axes = ", ".join(f"{name}={size}" for name, size in settings.layout.axes)
        msg = "pdist: start-up of %d ranks (%s, ep=%d) took %.2fs"
        logger.info(msg, launch.world_size, axes, settings.layout.ep, took)
        if settings.cpu_affinity and ctx.device.type == "cuda":
            before = _topology.apply_gpu_affinity(ctx.device)
            if before is not None:
                self._restore.append(lambda: os.sched_setaffinity(0, before))
        self._start_watch(ctx)
        return ctx

    def _watched(self) -> bool:
        s = self._settings
        return s.stall_timeout is not None and s.launch.world_size > 1

    def _start_watch(self, ctx: DistContext) -> None:
        if not self._watched() or self._block is None:
            return
        store, prefix = self._block
        lifetime = ctx.world.lifetime
        self._watch = _stall.Watch(self._settings, lifetime, store, prefix, self._hosts_store)
        self._watch.start([ctx.group(name) for name in ctx.layout.context_groups])

    def _bind_device(self) -> None:
        device = self._settings.device
        module = getattr(torch, device.type, None) if device.type != "cpu" else None
        if module is None or not hasattr(module, "set_device"):
            return
        previous = module.current_device() if hasattr(module, "current_device") else None
        module.set_device(device)
        if previous is not None:
            self._restore.append(lambda: module.set_device(previous))

    def _set_l2_fetch_granularity(self, device: torch.device, nbytes: int) -> None:
        """Cosmos' ``cudaDeviceSetLimit(cudaLimitMaxL2FetchGranularity, n)``, undone on exit."""
        before = _compat.l2_fetch_granularity() if device.type == "cuda" else None
        why = "it applies to CUDA devices only" if device.type != "cuda" else None
        why = why or _compat.set_l2_fetch_granularity(nbytes)
        if why is not None:
            msg = "pdist: not setting the L2 fetch granularity of %s to %d bytes: %s"
            logger.warning(msg, device, nbytes, why)
        elif before is not None and before != nbytes:
            self._restore.append(lambda: _compat.set_l2_fetch_granularity(before))

    def _open_store(self, deadline: Deadline) -> Store:
        settings = self._settings
        launch = settings.launch
        if settings.adopt:
            # An adopted group without a store has no one to check in with but this process.
            return _compat.default_store() or HashStore()
        if self._store is not None:
            return self._store
        if launch.launcher == "none":
            return HashStore()
        deadline.stage = f"connecting to the rendezvous store at {self._rendezvous()}"
        addr, port = launch.master_addr, launch.master_port
        if addr is None or port is None:
            unset = "MASTER_ADDR" if addr is None else "MASTER_PORT"
            msg = (
                f"rank {launch.rank}: {unset} is not set, so the {launch.launcher} launch of "
                f"{launch.world_size} ranks has no rendezvous store; set MASTER_ADDR and "
                "MASTER_PORT, or pass store="
            )
            raise ValueError(msg)
        # Rank 0 hosts the store unless torchrun's agent does (as torch's env:// decides).
        # It must not wait for every rank to connect, TCPStore's default: a late rank would
        # keep it from checking in, and it alone would report the store as unreachable.
        hosts = launch.rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
        options: dict[str, Any] = {"timeout": settings.timeout, "wait_for_workers": False}
        if not hosts:
            return TCPStore(addr, port, launch.world_size, **options)
        deadline.hosts_store()
        self._hosts_store = True
        if (addr, port) not in _HOSTED:
            _HOSTED[(addr, port)] = TCPStore(
                addr, port, launch.world_size, is_master=True, multi_tenant=True, **options
            )
        return _HOSTED[(addr, port)]

    def _init_world(self, lifetime: Lifetime, store: Store, deadline: Deadline) -> None:
        settings = self._settings
        deadline.stage = "initializing the default process group (the world communicator)"
        dist.init_process_group(
            backend=settings.backend,
            rank=settings.launch.rank,
            world_size=settings.launch.world_size,
            timeout=settings.timeout,
            store=store,
            # Eager communicator creation bound to our device (principle 4); it also lets
            # every subgroup be split from it in one call per axis.
            device_id=settings.device if settings.device.type != "cpu" else None,
        )
        lifetime.owns_default()

    def _build(self, deadline: Deadline) -> DistContext:
        settings = self._settings
        launch = settings.launch
        if self._watched() and not settings.adopt:  # before the first group: torch reads it once
            undo = _stall.arm_flight_recorder()
            if undo is not None:
                self._restore.append(undo)
        self._bind_device()
        if settings.l2_fetch_granularity is not None:
            self._set_l2_fetch_granularity(settings.device, settings.l2_fetch_granularity)
        store = self._open_store(deadline)
        deadline.stage = "checking in with the rendezvous store"
        generation = deadline.check_in(store, "startup")
        # A second block in the same job must never read the first one's (closed) addresses.
        self._block = (store, f"pdist/block/{generation}")
        lifetime = self._lifetime = Lifetime(
            check=settings.check,
            subgroup_timeout=settings.subgroup_timeout,
            exit_records=self._block,
        )
        store = PrefixStore(f"pdist/block/{generation}", store)
        if not settings.adopt:
            self._init_world(lifetime, store, deadline)
        deadline.stage = "building the world groups"
        world = _subgroups.build_world(settings, lifetime)
        layout = settings.layout
        deadline.stage = f"building the groups {', '.join(layout.group_names)}"
        groups = _subgroups.build_axes(world, settings)
        deadline.stage = "detecting which ranks share a host"
        nodes = _topology.node_partition(world)
        deadline.stage = "building the node groups"
        node = _subgroups.build_partition(world, "node", nodes)
        assert node is not None  # the hosts cover the world
        groups.update(world=world, node=node)
        ctx = DistContext(
            rank=launch.rank,
            world_size=launch.world_size,
            local_rank=launch.local_rank,
            device=settings.device,
            backend=settings.backend,
            layout=layout,
            **{name: groups[name] for name in CONTEXT_GROUPS},
            named_axes=tuple((n, groups[n]) for n in layout.names if n not in CONTEXT_GROUPS),
        )
        if world.device_group is not world.cpu_group:
            # Host detection ran on the gloo groups: the accelerator's world communicator
            # proves itself while the deadline still holds.
            deadline.stage = "probing the world communicator"
            probe_world(ctx)
        return ctx

    def _close(self) -> None:
        self._state = "closed"
        watch, self._watch = self._watch, None
        if watch is not None:  # its threads read the groups: joined before any is destroyed
            watch.stop()
        # Dropped modules, meshes and compiled functions may sit in cycles that hold process
        # groups: torch 2.13 with gloo can abort at exit when such a cycle outlives its group.
        gc.collect()
        if self._lifetime is not None:
            _departures.stop_listening(self._lifetime)
            self._lifetime.close()
        restore, self._restore = self._restore, []
        for undo in reversed(restore):
            try:
                undo()
            except Exception:  # teardown goes on; report and keep restoring
                logger.warning("pdist: restoring process state failed", exc_info=True)

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if isinstance(exc, PdistError):  # the user's traceback starts at the user's call
            trim_traceback(exc)
        if exc is not None and self._lifetime is not None:
            # Before the communicators go: the peers' failing collectives read it.
            launch = self._settings.launch
            _departures.left_block(self._lifetime, launch.rank, launch.world_size, exc)
        self._close()


def _adopted() -> _env.Adopted | None:
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return _env.Adopted(
        rank=dist.get_rank(), world_size=dist.get_world_size(), backend=str(dist.get_backend())
    )


def distributed(
    *,
    tp: int = 1,
    sp: int = 1,
    cp: int = 1,
    pp: int = 1,
    ep: int = 1,
    axes: Mapping[str, int] | None = None,
    backend: str | None = None,
    device: str | torch.device | int | None = None,
    timeout: float | timedelta | None = None,
    startup_timeout: float | timedelta | None = None,
    l2_fetch_granularity: int | None = None,
    stall_timeout: float | timedelta | None = None,
    on_stall: str = DEFAULT_ON_STALL,
    check: bool = False,
    store: Store | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    local_rank: int | None = None,
    cpu_affinity: bool = True,
) -> contextlib.AbstractContextManager[DistContext]:
    """Set up torch.distributed and the parallel groups; yield a frozen ``DistContext``.

    Works under torchrun, SLURM's ``srun`` and plain ``python script.py`` (one
    rank); arguments are validated at the call, identically on every rank. The
    start-up runs under ``startup_timeout`` (a stalled one ends every waiting rank
    with [`WORLD_COMM_TIMEOUT_EXIT_CODE`][pdist.WORLD_COMM_TIMEOUT_EXIT_CODE], naming the ranks
    that never checked in); inside the block the stall watch reports a collective that waits
    too long. An initialized default group is adopted and left alone. On exit it
    destroys exactly the groups it created (no collective) and restores the device,
    CPU affinity, L2 fetch granularity and environment it changed. Single-use;
    blocks may follow each other in one job. A rank leaving the block through an
    exception (``sys.exit`` included) first records a one-line summary of it in the
    rendezvous store, so that the ranks it leaves waiting in a collective name it
    (a [`PdistError`][pdist.PdistError] from a pdist collective; a line on stderr when their
    own exception leaves the block).

    What it changes in the process, and what turns each off:

    - On CUDA, the CPU affinity: pinned to the CPUs near the rank's GPU (NVML);
      ``cpu_affinity=False`` leaves it alone.
    - The stall watch: two daemon threads (``pdist-stall``, ``pdist-stall-answer``;
      bounded waits, never holding the process) and ``TORCH_FR_BUFFER_SIZE`` (the
      flight recorder's size, where unset) for the block; ``stall_timeout=0`` starts none.
    - ``gc.collect()`` on exit, before the groups are destroyed (cycles holding a
      process group abort torch 2.13 with gloo at exit); always.
    - While a [`message_queue`][pdist.message_queue] is open, a SIGTERM handler that removes its
      shared-memory segment, then ends the process as the default action would; only
      where SIGTERM has its default action: install your own handler to keep it off.

    Note:
        Every rank of the job must enter it.

    Args:
        tp: Tensor-parallel size (adjacent ranks: the fastest axis).
        sp: Sequence-parallel (Ulysses) size.
        cp: Context-parallel (ring attention) size; an axis of the layout when > 1.
        pp: Pipeline-parallel size (the slowest axis); an axis of the layout when > 1.
            The keyword form's axes are ``pp, dp, cp, sp, tp``, slowest first, with
            ``dp`` the rest of the world.
        ep: Expert-parallel size: ``ctx.ep`` holds blocks of ``ep`` consecutive ranks of a
            pipeline stage and ``ctx.edp`` the ranks at one place in them; it must divide
            ``world_size // pp``. Works with ``axes=`` too.
        axes: User-named axes instead of the keywords, slowest first, e.g.
            ``{"dp": -1, "cfg": 2, "sp": 2}`` (one size may be -1: the rest of the
            world). ``ctx.axes`` then maps each name to its group; the canonical names
            (``pp``, ``dp``, ``cp``, ``sp``, ``tp``) also fill those fields.
        backend: ``"nccl"``, ``"gloo"``, ``"xccl"``, ...; default ``PDIST_BACKEND``,
            else the device's default.
        device: The rank's device; default the accelerator at ``local_rank`` (through
            ``torch.accelerator``), else the CPU.
        timeout: Collective timeout (seconds or ``timedelta``); default ``PDIST_TIMEOUT_SEC``
            or 1800 s. ``PDIST_SUBGROUP_TIMEOUT_SEC`` overrides it for subgroups.
        startup_timeout: Deadline of the whole start-up (seconds or ``timedelta``);
            None reads ``PDIST_WORLD_COMM_TIMEOUT_SEC`` (default 600 s); 0 waits forever.
        l2_fetch_granularity: On CUDA, the L2 fetch granularity to set, in bytes; None
            leaves the device alone. A warning says why when it cannot be set.
        stall_timeout: How long a collective may wait before the stall report (seconds or
            ``timedelta``); None reads ``PDIST_STALL_TIMEOUT_SEC`` (default 300 s); 0 turns
            the watch off.
        on_stall: ``"report"``: log the report (``pdist`` logger, ERROR) and keep waiting;
            ``"exit"``: log it, then every answering rank exits with
            [`STALL_EXIT_CODE`][pdist.STALL_EXIT_CODE]. Default ``"report"``, or ``PDIST_ON_STALL``.
        check: Check mode: every pdist call that communicates first agrees on its name, op,
            shapes, dtypes and dims through one small all-gather on the CPU group (the two
            ends of a send/recv swap theirs), and a difference raises
            [`RankMismatchError`][pdist.RankMismatchError] on every rank naming each rank's call,
            instead of a backend error on one rank and a wrong tensor on another. All ranks
            must agree on it (checked at entry, with the layout). It costs that round trip
            per call (``pdist bench``'s "check mode" cases: about 2x a small gloo
            all_reduce): on in tests and while debugging, off in production.
            ``PDIST_CHECK=1`` turns it on too. For raw ``torch.distributed`` calls, torch's
            own check is ``TORCH_DISTRIBUTED_DEBUG=DETAIL``, read when the groups are made:
            set it in ``os.environ`` before entering ``distributed()``.
        store: A ``torch.distributed.Store`` to rendezvous through instead of the launcher's.
        rank: Overrides the launcher's rank.
        world_size: Overrides the launcher's world size.
        local_rank: Overrides the launcher's local rank.
        cpu_affinity: On CUDA, pin this process to the CPUs near its GPU (NVML).

    Returns:
        A single-use context manager yielding the [`DistContext`][pdist.DistContext].

    Raises:
        TypeError: A size that is no int (or a bool), ``axes`` that is no mapping.
        ValueError: Bad sizes (not dividing the world, 0, two -1 in ``axes``), ``axes=``
            beside a tp/sp/cp/pp keyword, an ``axes`` name that is a derived group's
            (``world``, ``node``, ``dp_sp``, ``ep``, ``edp``), a bad backend, device,
            duration or ``on_stall``; all before any communicator exists.
        RankMismatchError: On entry, on every rank, when ranks passed different layouts, or
            differ in check mode (``check``, ``PDIST_CHECK``), backend or device type.
        PdistError: Entered twice, or the hosts hold different numbers of ranks (on every
            rank).
    """
    # The signature above is the one place the arguments are written: they travel as one value.
    given = dict(locals())
    store = given.pop("store")
    sizes = {name: given.pop(name) for name in KEYWORDS}
    request = _env.Request(sizes=sizes, store_given=store is not None, **given)
    settings = _env.resolve_settings(request, accelerator=probe_accelerator(), adopted=_adopted())
    return _Distributed(settings, store)
