"""Building communicators: the world, one partition per axis, arbitrary rank lists, the mesh.

Cost per rank stays O(W). With an accelerator-bound default group a partition's
device groups come from one ``split_group`` over the world; otherwise, and for the
gloo metadata groups (which connect lazily), every rank creates only its own block's
group. A partition already built in the block (``node`` equal to ``tp``) reuses its groups.

torch names the groups of a local-synchronization ``new_group`` and of ``split_group``
by hashing their ranks with the number of groups the process has registered so far,
so members must agree on that count. Every partition build therefore registers the
same number of groups on every rank: a rank in no block of [`new_group`][pdist.new_group] still
builds (and holds until the block exits) a group of its own.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any

import attrs
import torch
import torch.distributed as dist

from . import _agree, _compat
from ._env import Settings
from ._errors import PdistError
from ._group import Blocks, Built, DistContext, Group, Lifetime, ProcessGroup
from ._layout import Layout, consecutive_groups, make_axes_layout

__all__ = [
    "build_axes",
    "build_partition",
    "build_world",
    "device_mesh",
    "flatten",
    "new_group",
    "new_sp_group",
    "new_tp_group",
    "patch_sp",
    "patch_tp",
]

# Backends whose groups can carry pdist's metadata themselves (no separate gloo group).
_SELF_CPU_BACKENDS = ("gloo", "fake")


def _backend_of(pg: ProcessGroup) -> str:
    return str(dist.get_backend(pg)).lower()


def _local_group(
    ranks: list[int] | None, backend: str, timeout: timedelta, desc: str
) -> ProcessGroup:
    """A group made by its members only (``None``: every rank); gloo's connect lazily."""
    lazy = _compat.gloo_lazy_init() if backend == "gloo" else contextlib.nullcontext()
    with lazy:
        pg: ProcessGroup = dist.new_group(
            ranks, timeout=timeout, backend=backend, use_local_synchronization=True, group_desc=desc
        )
    return pg


def build_world(settings: Settings, lifetime: Lifetime) -> Group:
    """The ``world`` Group over the default process group (plus a gloo group when needed)."""
    timeout = settings.timeout
    world_pg = dist.group.WORLD
    if world_pg is None:
        msg = "the default process group is not initialized"
        raise PdistError(msg)
    device_key = lifetime.add(world_pg, created=False)
    cpu_key = device_key
    if _backend_of(world_pg) not in _SELF_CPU_BACKENDS:
        cpu_key = lifetime.add(_local_group(None, "gloo", timeout, "world"), created=True)
    ranks = tuple(range(settings.launch.world_size))
    built = lifetime.partitions[(ranks,)] = Built(ranks, device_key, cpu_key, True, timeout)
    return built.group("world", settings.launch.rank, settings.device, lifetime)


def _complete(blocks: Blocks, world_size: int) -> tuple[Blocks, set[int]]:
    """``blocks`` plus a singleton for every rank in none, and the ranks so added."""
    covered = bytearray(world_size)  # a byte per rank: start-up stays small at any scale
    for r in itertools.chain.from_iterable(blocks):
        covered[r] = 1
    extra = [r for r in range(world_size) if not covered[r]]
    return (*blocks, *((r,) for r in extra)), set(extra)


def _create(
    world: Group, blocks: Blocks, mine: tuple[int, ...], name: str, timeout: timedelta
) -> tuple[ProcessGroup, ProcessGroup]:
    """The device and CPU process groups of the caller's block ``mine``."""
    world_device = world.device_group
    # An accelerator-bound default group splits every block's device group in one call.
    bound = world.device.type != "cpu" and _compat.bound_device(world_device) is not None
    if bound and _compat.FEATURES.split_group:
        device_pg = _compat.split_group(world_device, blocks, timeout=timeout, name=name)
        if device_pg is None:  # every rank is in a block (see _complete)
            msg = f"split_group gave rank {world.rank} no group for partition {name!r}"
            raise PdistError(msg)
    else:
        device_pg = _local_group(list(mine), _backend_of(world_device), timeout, name)
    if world.cpu_group is world_device:
        return device_pg, device_pg
    return device_pg, _local_group(list(mine), "gloo", timeout, f"{name}_cpu")


def build_partition(
    world: Group,
    name: str,
    blocks: Sequence[Sequence[int]],
    *,
    named: bool = False,
) -> Group | None:
    """The caller's Group of a partition of the world into ``blocks``; None if it is in none.

    ``blocks``: disjoint lists of global ranks, the same on every rank (not checked here).
    New groups get the subgroups' timeout (``PDIST_SUBGROUP_TIMEOUT_SEC``), not a reused
    world's. A partition built before is reused, with the timeout it was built with;
    ``named``: only one built under the same ``name`` (a user's group: its traffic never
    shares a communicator with another name's, principle 14).
    """
    lifetime = world.lifetime
    lifetime.check_open()
    canonical: Blocks = tuple(tuple(int(r) for r in b) for b in blocks)
    key = (name, canonical) if named else canonical
    built = lifetime.partitions.get(key)
    if built is None:
        full, extra = _complete(canonical, world.world_size)
        mine = next(block for block in full if world.rank in block)  # _complete covers every rank
        timeout = lifetime.subgroup_timeout or world.timeout
        device_pg, cpu_pg = _create(world, full, mine, name, timeout)
        device_key = lifetime.add(device_pg, created=True)
        cpu_key = device_key if cpu_pg is device_pg else lifetime.add(cpu_pg, created=True)
        built = Built(mine, device_key, cpu_key, world.rank not in extra, timeout)
        lifetime.partitions[key] = built
    return built.group(name, world.rank, world.device, lifetime) if built.member else None


def _require(group: Group | None, name: str) -> Group:
    if group is None:  # a partition covers every rank
        msg = f"rank is in no block of the {name!r} partition"
        raise PdistError(msg)
    return group


def build_axes(world: Group, settings: Settings) -> dict[str, Group]:
    """The caller's group of every name in ``layout.group_names``, once all ranks agree on it.

    Ranks that built different partitions would each get a group the others never join.
    With the layout, every setting that changes what goes on the wire is agreed: check mode
    adds an agreement before each call, the backend and device type make the communicator.
    The axes are built fastest first (then the one-rank groups of absent canonical axes,
    then the derived groups): a partition equal to one built before reuses it.
    """
    s, layout = settings, settings.layout
    agreed = f"{layout.describe()}, check={s.check}, backend={s.backend}, device={s.device.type}"
    _agree.check_same(world, "distributed()", agreed, None)
    order = (*reversed(layout.names), *layout.group_names[len(layout.names) :])
    return {
        axis: _require(build_partition(world, axis, layout.groups(axis)), axis) for axis in order
    }


def _check_ctx(ctx: object) -> DistContext:
    if not isinstance(ctx, DistContext):
        msg = f"ctx={ctx!r} must be a pdist DistContext"
        raise TypeError(msg)
    return ctx


def _patched(ctx: DistContext, group: Group, axis: str) -> DistContext:
    _check_ctx(ctx)
    if not isinstance(group, Group):
        msg = f"group={group!r} must be a pdist Group"
        raise TypeError(msg)
    if ctx.rank not in group.ranks:
        msg = f"group {group.name!r} with ranks {group.ranks} does not contain rank {ctx.rank}"
        raise ValueError(msg)
    changes: dict[str, Any] = {axis: group}
    return attrs.evolve(ctx, **changes)


@contextlib.contextmanager
def patch_tp(ctx: DistContext, group: Group) -> Iterator[DistContext]:
    """Yield a new context whose ``tp`` group is ``group``; ``ctx`` itself is untouched.

    Nests freely; nothing needs undoing when the block raises. Use it to run a model
    with another TP degree, e.g. one built with [`new_tp_group`][pdist.new_tp_group].

    Raises:
        TypeError: ``ctx`` or ``group`` has the wrong type.
        ValueError: The caller's rank is not in ``group``.
    """
    yield _patched(ctx, group, "tp")


@contextlib.contextmanager
def patch_sp(ctx: DistContext, group: Group) -> Iterator[DistContext]:
    """Yield a new context whose ``sp`` group is ``group``; ``ctx`` itself is untouched.

    The counterpart of [`patch_tp`][pdist.patch_tp], e.g. for a group from
    [`new_sp_group`][pdist.new_sp_group].

    Raises:
        TypeError: ``ctx`` or ``group`` has the wrong type.
        ValueError: The caller's rank is not in ``group``.
    """
    yield _patched(ctx, group, "sp")


def _validated(
    ctx: object, what: str, check: Callable[[], Any], summary: Callable[[Any], str] = repr
) -> Any:
    """``check()``'s value once every rank's ``summary`` of it is the same; its error on every rank.

    A rank raising alone would leave the others waiting in the group build.
    """
    world = _check_ctx(ctx).world
    world.lifetime.check_open()
    try:
        value, error = check(), None
    except (TypeError, ValueError) as exc:
        value, error = None, exc
    _agree.check_same(world, what, "" if error else summary(value), error)  # raises after an error
    return value


def _consecutive(ctx: DistContext, size: int, name: str | None, axis: str) -> Group:
    """``axis`` groups of ``size`` consecutive ranks (``new_tp_group``, ``new_sp_group``)."""

    def check() -> Blocks:
        if name is not None and (not isinstance(name, str) or not name):
            msg = f"name={name!r} must be None or a non-empty str"
            raise TypeError(msg)
        return consecutive_groups(ctx.world_size, size, name="size")

    label = name if isinstance(name, str) and name else f"{axis}{size}"
    summary = f"size={size!r}, name={name!r}"
    blocks = _validated(ctx, f"new group {label!r}", check, lambda _: summary)
    return _require(build_partition(ctx.world, label, blocks, named=True), label)


def new_tp_group(ctx: DistContext, size: int, *, name: str | None = None) -> Group:
    """Build tensor-parallel groups of ``size`` consecutive ranks over the whole world.

    For a second model with another TP degree (use it with [`patch_tp`][pdist.patch_tp]). Asking
    twice for one size and name reuses the communicators; another name gets its own
    (traffic on two names never interleaves). They live until the block exits.

    Note:
        Every rank of the world must call it, in the same order as other
        group creations.

    Returns:
        The group holding the caller (ranks ``size * (rank // size)`` onwards).

    Raises:
        TypeError: ``name`` is not None or a non-empty str (on every rank).
        ValueError: ``size`` does not divide the world size (on every rank).
        RankMismatchError: Ranks passed different sizes (on every rank).
        PdistError: The context is closed.
    """
    return _consecutive(ctx, size, name, "tp")


def new_sp_group(ctx: DistContext, size: int, *, name: str | None = None) -> Group:
    """Build sequence-parallel groups of ``size`` consecutive ranks over the whole world.

    As [`new_tp_group`][pdist.new_tp_group], for a sequence-parallel group (use it with
    [`patch_sp`][pdist.patch_sp]).
    """
    return _consecutive(ctx, size, name, "sp")


def _check_rank_lists(rank_lists: object, world_size: int, name: object) -> Blocks:
    if not isinstance(name, str) or not name:
        msg = f"name={name!r} must be a non-empty str"
        raise TypeError(msg)
    if isinstance(rank_lists, (str, bytes)) or not isinstance(rank_lists, Sequence):
        msg = f"rank_lists={rank_lists!r} must be a list of lists of global ranks"
        raise TypeError(msg)
    blocks: list[tuple[int, ...]] = []
    owner: dict[int, int] = {}
    for i, ranks in enumerate(rank_lists):
        if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Sequence) or not ranks:
            msg = f"rank_lists[{i}]={ranks!r} must be a non-empty list of global ranks"
            raise TypeError(msg)
        for r in ranks:
            if isinstance(r, bool) or not isinstance(r, int):
                msg = f"rank_lists[{i}] holds {r!r}, which is not an int rank"
                raise TypeError(msg)
            if not 0 <= r < world_size:
                msg = (
                    f"rank_lists[{i}] holds rank {r}, outside the world of size {world_size}; "
                    f"use global ranks 0..{world_size - 1}"
                )
                raise ValueError(msg)
            if r in owner:
                where = "twice" if owner[r] == i else f"in rank_lists[{owner[r]}] and [{i}]"
                msg = f"rank {r} appears {where}; the lists must be disjoint"
                raise ValueError(msg)
            owner[r] = i
        if list(ranks) != sorted(ranks):
            msg = (
                f"rank_lists[{i}]={list(ranks)!r} is not in increasing order; torch's process "
                f"groups order their members by global rank (and group-relative src/dst, "
                f"gathers and Group.ranks follow that order): pass {sorted(ranks)!r}"
            )
            raise ValueError(msg)
        blocks.append(tuple(ranks))
    if not blocks:
        msg = "rank_lists is empty; pass at least one list of global ranks"
        raise ValueError(msg)
    return tuple(blocks)


def new_group(ctx: DistContext, rank_lists: Sequence[Sequence[int]], *, name: str) -> Group | None:
    """Build one group per list of global ranks; return the caller's, or None if it is in none.

    For pipeline stages, classifier-free-guidance pairs, strided groups. Lists must be
    disjoint and increasing (torch orders a group's members by global rank), and may
    leave ranks out. One name is one communicator: a name gets its own process groups
    even over ranks another group holds (so two threads can use them at once), and the
    same name and lists again return the cached group.

    Note:
        Every rank of the world must call it with the same lists, in the
        same order as other group creations.

    Example:
        ```python
        stage = pdist.new_group(ctx, [[0, 2], [1, 3]], name="pp")  # rank 2: ranks (0, 2)
        ```

    Args:
        ctx: The context.
        rank_lists: Disjoint lists of global ranks.
        name: What the groups are for (``Group.name``).

    Returns:
        The group holding the caller, or None.

    Raises:
        TypeError: ``rank_lists`` is not a list of lists of ints, or ``name`` is not a
            non-empty str (on every rank).
        ValueError: The lists overlap, are empty, are not increasing or hold ranks
            outside the world (on every rank).
        RankMismatchError: Ranks passed different lists, or only some passed bad ones.
        PdistError: The context is closed.
    """
    check = functools.partial(_check_rank_lists, rank_lists, ctx.world_size, name)
    blocks = _validated(ctx, f"new_group(name={name!r})", check, lambda b: f"{b!r}, name={name!r}")
    return build_partition(ctx.world, name, blocks, named=True)


def flatten(ctx: DistContext, *axes: str) -> Group:
    """The ranks sharing every coordinate of the caller except those of ``axes``, as one Group.

    For any combination the context does not hold: ``flatten(ctx, "dp", "cp")`` (FSDP over
    data and context parallelism), ``flatten(ctx, "dp_replicate", "dp_shard")``, ... With
    ``pp=2, tp=2`` on 8 ranks, ``flatten(ctx, "dp", "tp")`` on rank 5 holds ``(4, 5, 6, 7)``.
    The communicators are built once per block: asking again, or for a partition the
    context holds already, builds nothing.

    Note:
        Every rank of the world must call it with the same axes, in the same order
        as other group creations.

    Args:
        ctx: The context.
        axes: Axis names of the layout (``ctx.axes``), in any order.

    Returns:
        The caller's group, named after the axes joined by ``_`` in layout order.

    Raises:
        TypeError: An axis is not a str (on every rank).
        ValueError: No axis, an unknown or repeated one (on every rank).
        RankMismatchError: Ranks passed different axes (on every rank).
        PdistError: The context is closed.
    """
    names = _validated(ctx, "flatten()", lambda: ctx.layout.flatten_names(axes))
    label = "_".join(names)
    return _require(build_partition(ctx.world, label, ctx.layout.flatten(names)), label)


def _mesh_layout(ctx: DistContext, names: tuple[str, ...]) -> Layout:
    """The layout of ``ctx``'s groups, checked to hold its groups on the ``names`` axes.

    A context from [`patch_tp`][pdist.patch_tp] may hold groups that are no axes of one mesh; a mesh
    built from them would pair each dim with the wrong group.
    """
    layout = ctx.layout
    fix = (
        f"the context's groups do not form one ({', '.join(layout.names)}) mesh (is ctx.tp a "
        "group from patch_tp?); build multi-axis meshes from the context distributed() "
        "yielded, or ask for one axis"
    )
    sizes = {a: -1 if a == layout.inferred else ctx.group(a).world_size for a in layout.names}
    try:
        rebuilt = make_axes_layout(ctx.world_size, sizes, ep=ctx.ep.world_size)
    except ValueError as exc:
        msg = f"device_mesh(axes={names!r}) on rank {ctx.rank}: {exc}; {fix}"
        raise ValueError(msg) from None
    for axis in names:
        ranks, expected = ctx.group(axis).ranks, rebuilt.group_of(axis, ctx.rank)
        if ranks != expected:
            shown = ", ".join(f"{a}={s}" for a, s in rebuilt.axes)
            msg = (
                f"device_mesh(axes={names!r}) on rank {ctx.rank}: ctx.{axis} holds ranks "
                f"{ranks}, but the mesh of {shown} puts ranks {expected} on that axis; {fix}"
            )
            raise ValueError(msg)
    return rebuilt


def device_mesh(ctx: DistContext, axes: tuple[str, ...] | None = None) -> Any:
    """A ``DeviceMesh`` over the context's own groups: the whole dense mesh or a sub-mesh.

    ``axes=None`` gives the mesh of every axis of the layout, named after them
    (``("dp", "sp", "tp")`` in the keyword form with ``pp = cp = 1``). Axis names give
    the caller's sub-mesh, ready for FSDP2: ``("dp",)``, ``("dp_sp",)``, ``("dp", "sp")``
    (HSDP), ``("tp",)``, any user-named axis, and the expert mesh ``("edp", "ep")`` for
    expert weights (``("pp", "edp", "ep")`` with the stages). On 4 ranks with ``tp=2``,
    rank 1 gets for ``("dp_sp",)`` the mesh ``[1, 3]``. No new communicator; release the
    mesh before the block exits.

    Args:
        ctx: The context.
        axes: None, or group names (axes of the layout, ``dp_sp``, ``ep``, ``edp``),
            slowest first.

    Raises:
        TypeError: ``axes`` is not None or a tuple.
        ValueError: An unknown or repeated name, ``dp_sp`` with an axis it holds, an
            expert group with a dense axis, names out of order, or (several names)
            groups that form no such mesh.
        PdistError: The context is closed.
    """
    _check_ctx(ctx)
    names = ctx.layout.mesh_names(axes)
    if len(names) == 1:  # one axis: its group is the mesh, whatever the other groups are
        group = ctx.group(names[0])
        ranks = torch.tensor(group.ranks, dtype=torch.int)
        return _compat.device_mesh_from_group(group.device_group, ctx.device.type, ranks, names)
    shape, members = _mesh_layout(ctx, names).mesh(names, ctx.rank)
    mesh = torch.tensor(members, dtype=torch.int).view(shape)
    groups = [ctx.group(axis).device_group for axis in names]  # two or more
    return _compat.device_mesh_from_group(groups, ctx.device.type, mesh, names)
