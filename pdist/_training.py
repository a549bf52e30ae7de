"""Training helpers: grad_sync for DDP and FSDP2, DDP's training_step, sync_model_states."""

from __future__ import annotations

import contextlib
import gc
import warnings
import weakref
from collections.abc import Iterable, Iterator
from typing import Any, NoReturn, cast

import torch
import torch.distributed as dist
from torch import nn

from . import _compat, _transfer, _wire
from ._errors import PdistError, RankMismatchError
from ._group import DistContext, Group, as_group
from ._serialize import dtype_name
from ._weights import SYNC_BUCKET_BYTES, WeightsMove, states_of

__all__ = ["DistributedDataParallel", "grad_sync", "sync_model_states", "wrap_ddp"]


_STATIC_WARNED = "_pdist_static_graph_warned"
# Set on every module a DDP wraps: a weak link to the DDP, or a dead one (see _WrapperLink).
_WRAPPER_LINK = "_pdist_ddp_wrapper"
# Set by fully_shard on every module it manages (torch uses it for Dynamo); a private flag,
# so if torch ever drops it the wrong-module warning for FSDP2 goes quiet, nothing breaks.
_FSDP_MANAGED = "_is_fsdp_managed_module"


class _WrapperLink:
    """A weak link from a wrapped module to its DDP; pickles and deep-copies as ``False``."""

    __slots__ = ("_ref",)

    def __init__(self, wrapper: nn.Module | None) -> None:
        self._ref = None if wrapper is None else weakref.ref(wrapper)

    def wrapper(self) -> nn.Module | None:
        return None if self._ref is None else self._ref()

    def __reduce__(self) -> tuple[type[bool], tuple[()]]:
        return (bool, ())


def _link(modules: Iterable[nn.Module], wrapper: nn.Module | None) -> None:
    link = _WrapperLink(wrapper)
    for m in modules:
        # object.__setattr__: a user's __setattr__ override must not see pdist's bookkeeping.
        object.__setattr__(m, _WRAPPER_LINK, link)


def _enclosing_ddp(model: nn.Module) -> nn.Module | None:
    """The DDP that wraps ``model`` (or a module around it), if any; torch's found once, by gc."""
    link = model.__dict__.get(_WRAPPER_LINK)
    if isinstance(link, _WrapperLink):
        return link.wrapper()
    if not (dist.is_available() and dist.is_initialized()):
        return None  # no process group, so no DDP
    found = None
    ddp_type = nn.parallel.DistributedDataParallel
    for obj in gc.get_objects():
        # The MRO, not isinstance: DDP is an ABC (Joinable), and isinstance on arbitrary
        # objects would run their __class__ properties and subclass hooks.
        if ddp_type not in type(obj).__mro__:
            continue
        inner = getattr(obj, "module", None)  # absent from a DDP whose __init__ raised
        if isinstance(inner, nn.Module) and any(m is model for m in inner.modules()):
            found = obj
            break
    _link([model], found)
    return found


def _warn_wrong_module(model: nn.Module) -> None:
    """Warn when ``model`` holds no DDP/FSDP module but sits inside one (grad_sync does nothing)."""
    if getattr(model, _FSDP_MANAGED, False) is True:
        msg = (
            f"grad_sync: {type(model).__name__} holds no FSDP module but sits inside a module "
            "sharded with fully_shard, so gradient synchronization is unchanged; pass the "
            "model you called fully_shard on (its root), not a submodule"
        )
    else:
        wrapper = _enclosing_ddp(model)
        if wrapper is None:
            return
        msg = (
            f"grad_sync: {type(model).__name__} holds no DDP or FSDP module but is wrapped by "
            f"{type(wrapper).__name__}, so gradient synchronization is unchanged; pass that "
            "wrapper (the model wrap_ddp returned), not its .module or a submodule"
        )
    warnings.warn(msg, UserWarning, stacklevel=4)


def _set_ddp(module: nn.parallel.DistributedDataParallel, enabled: bool) -> Any:
    """Set a DDP's flag; returns what puts it back (None: static_graph, left alone)."""
    if getattr(module, "static_graph", False):
        if not getattr(module, _STATIC_WARNED, False):
            object.__setattr__(module, _STATIC_WARNED, True)
            warnings.warn(
                "grad_sync: this DDP model uses static_graph=True, whose gradient "
                "synchronization cannot be skipped; gradients are synced every step",
                UserWarning,
                stacklevel=4,
            )
        return None
    old = module.require_backward_grad_sync
    module.require_backward_grad_sync = enabled
    return lambda: setattr(module, "require_backward_grad_sync", old)


def _set_fsdp(module: Any, enabled: bool, defer_reduce_scatter: bool) -> Any:
    """Set one FSDP2 module's flags (not its children's); returns what puts them back."""
    # torch before 2.7 cannot run FSDP2 on CPU: its backward would crash half-way.
    on_cpu = (p.device.type == "cpu" for p in module.parameters(recurse=False))
    if not _compat.FEATURES.fsdp2_on_cpu and any(on_cpu):
        raise _compat.unsupported("FSDP2 (fully_shard) on CPU tensors", (2, 7))
    groups = _compat.fsdp_param_groups(module)
    if not groups:
        return None
    olds = [(g.reduce_grads, g.all_reduce_grads) for g in groups]

    def put_back() -> None:
        for g, (reduce, all_reduce) in zip(groups, olds, strict=True):
            g.reduce_grads, g.all_reduce_grads = reduce, all_reduce

    if enabled or defer_reduce_scatter:  # on: both steps, whatever an outer block turned off
        module.set_requires_gradient_sync(enabled, recurse=False)
    else:
        module.set_requires_all_reduce(enabled, recurse=False)
    return put_back


@contextlib.contextmanager
def grad_sync(
    model: nn.Module, enabled: bool, *, defer_reduce_scatter: bool = False
) -> Iterator[None]:
    """Turn cross-replica gradient synchronization on or off inside the block.

    DDP with ``static_graph=True`` cannot skip it (a warning, once per model).
    FSDP2 defers only HSDP's cross-replica all-reduce, so gradients stay sharded,
    unless ``defer_reduce_scatter=True``. ``enabled=False`` on the wrong module
    (a DDP's ``.module``, an FSDP submodule) warns. On exit every module gets
    back exactly its own flags, also when the block raises. Blocks nest: an inner
    ``enabled=True`` turns the whole synchronization on again.

    Note:
        Every rank must pass the same ``enabled`` for the same backward: a rank that
        syncs while another skips pairs its all-reduce with that rank's next one.

    Example:
        ```python
        with pdist.grad_sync(model, enabled=(i == len(micro_batches) - 1)):
            model(batch).sum().backward()
        ```

    Args:
        model: The DDP model, the ``fully_shard`` model (its root), or a plain module.
        enabled: Whether gradients are synchronized in the block's backward passes.
        defer_reduce_scatter: FSDP2 only: also defer the reduce-scatter.

    Raises:
        TypeError: ``model`` is not an ``nn.Module`` (when the block is entered).
        PdistError: FSDP2 on CPU tensors, on a torch that cannot run it (before 2.7).
    """
    if not isinstance(model, nn.Module):
        msg = (
            f"grad_sync: model must be an nn.Module (the model wrap_ddp returned, the "
            f"module you called fully_shard on, or a plain module), got a {type(model).__name__}"
        )
        raise TypeError(msg)
    fsdp_type = _compat.fsdp_module_type()
    restore: list[Any] = []  # one entry per DDP or FSDP module found
    try:
        for module in model.modules():
            if isinstance(module, nn.parallel.DistributedDataParallel):
                restore.append(_set_ddp(module, bool(enabled)))
            elif fsdp_type is not None and isinstance(module, fsdp_type):
                restore.append(_set_fsdp(module, bool(enabled), defer_reduce_scatter))
        if not restore and not enabled:
            _warn_wrong_module(model)
        yield
    finally:
        for put_back in reversed(restore):
            if put_back is not None:
                put_back()


class DistributedDataParallel(nn.parallel.DistributedDataParallel):
    """torch's DDP plus ``training_step``, which runs through DDP's forward and hooks."""

    def __init__(self, module: nn.Module, *args: Any, **kwargs: Any) -> None:
        super().__init__(module, *args, **kwargs)
        # grad_sync(model.module, ...) would change nothing: the links let it say so.
        _link(module.modules(), self)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Call the wrapped module's ``training_step`` as DDP's forward.

        DDP's gradient hooks only arm through ``forward``, so ``forward`` points
        at the step for one call.

        Raises:
            AttributeError: The wrapped module has no ``training_step``.
        """
        inner = self.module
        step = getattr(inner, "training_step", None)
        if step is None:
            msg = f"{type(inner).__name__} has no training_step method"
            raise AttributeError(msg)
        had_own = "forward" in inner.__dict__
        own = inner.__dict__.get("forward")

        def put_back() -> None:
            if had_own:
                inner.__dict__["forward"] = own
            else:
                inner.__dict__.pop("forward", None)

        def run_step(*step_args: Any, **step_kwargs: Any) -> Any:
            put_back()  # the step may call self(batch): forward must be forward again
            return step(*step_args, **step_kwargs)

        inner.__dict__["forward"] = run_step
        try:
            return self(*args, **kwargs)
        finally:
            put_back()


def wrap_ddp(
    ctx: DistContext, model: nn.Module, *, group: Group | None = None, **ddp_options: Any
) -> DistributedDataParallel:
    """Wrap ``model`` in ``DistributedDataParallel`` over the context's ``dp_sp`` group.

    ``ctx.dp_sp`` holds the ranks sharing every coordinate but dp, cp and sp (with
    ``pp`` and ``tp``, the ranks of one stage and one tp index): on 4 ranks with
    ``sp=2`` all 4 average; with ``tp=2`` rank 1 averages with rank 3. The
    model is moved to ``ctx.device`` first.

    Note:
        Every rank of the group must call it (DDP broadcasts the
        parameters of the group's first rank on construction).

    Args:
        ctx: The context.
        model: The module to wrap.
        group: The group to average over; default ``ctx.dp_sp``.
        **ddp_options: Passed to ``DistributedDataParallel`` (``static_graph``,
            ``find_unused_parameters``, ...).

    Raises:
        TypeError: ``process_group`` or ``device_ids`` in ``ddp_options``
            (pass ``group=``; the device comes from the context).
    """
    for name in ("process_group", "device_ids"):
        if name in ddp_options:
            msg = (
                f"wrap_ddp got {name}={ddp_options[name]!r}: it sets process_group and "
                "device_ids from the context; pass group=<a pdist Group> to choose the group"
            )
            raise TypeError(msg)
    g = ctx.dp_sp if group is None else as_group(group)
    model.to(ctx.device)
    device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    return DistributedDataParallel(
        model, process_group=g.device_group, device_ids=device_ids, **ddp_options
    )


def _states(
    model: nn.Module, ignore: tuple[str, ...], buffers: bool
) -> list[tuple[str, torch.Tensor]]:
    named: list[tuple[str, torch.Tensor]] = list(model.named_parameters())  # shared ones once
    if buffers:
        named += [(n, b) for n, b in model.named_buffers() if b is not None]
    return [(n, t) for n, t in named if not any(n == p or n.startswith(f"{p}.") for p in ignore)]


def _check_ignore(ignore: object, rank: int) -> tuple[str, ...]:
    if isinstance(ignore, str):
        return (ignore,)
    fix = "pass a name or an iterable of names, such as ignore=('head',)"
    if not isinstance(ignore, Iterable):
        msg = f"ignore={ignore!r:.80} on rank {rank} is not a name or an iterable of names; {fix}"
        raise TypeError(msg)
    names = tuple(ignore)
    bad = [n for n in names if not isinstance(n, str)]
    if bad:
        msg = f"ignore={names!r:.80} on rank {rank} holds {bad[0]!r:.40}, not a name; {fix}"
        raise TypeError(msg)
    return names


def _local_states(
    g: Group, model: object, src: object, ignore: object, broadcast_buffers: object
) -> list[tuple[str, torch.Tensor]]:
    """Validate this rank's arguments; the states to synchronize (bad arguments raise)."""
    rank = g.rank
    g.global_rank(src)  # type: ignore[arg-type]  # its errors name the rank
    names = _check_ignore(ignore, rank)
    if not isinstance(broadcast_buffers, bool):
        msg = f"broadcast_buffers={broadcast_buffers!r:.40} on rank {rank} must be True or False"
        raise TypeError(msg)
    if not isinstance(model, nn.Module):
        msg = (
            f"model={model!r:.60} on rank {rank} is not an nn.Module; every rank of the group "
            "must pass its own copy of the model"
        )
        raise TypeError(msg)
    states = _states(model, names, broadcast_buffers)
    meta = [n for n, t in states if t.device.type == "meta"]
    if meta:
        msg = (
            f"model on rank {rank} has parameters or buffers on the meta device ({meta[:3]}), "
            "which hold no data to send or receive; materialize them first "
            "(model.to_empty(device=...) and initialize), or list them in ignore="
        )
        raise ValueError(msg)
    dtensor = _compat.dtensor_type()  # None: never imported, so no tensor is one
    sharded = [n for n, t in states if dtensor is not None and isinstance(t, dtensor)]
    if sharded:
        msg = (
            f"model on rank {rank} holds DTensor parameters or buffers ({sharded[:3]}), as "
            "fully_shard or tensor parallelism make them: their shards differ per rank by "
            "design; call sync_model_states before sharding the model, load a full state "
            "dict with torch.distributed.checkpoint, or list them in ignore="
        )
        raise ValueError(msg)
    return states


def _first_state_difference(src: list[list[Any]], other: list[list[Any]]) -> str:
    src_names, other_names = [e[0] for e in src], [e[0] for e in other]
    if src_names != other_names:
        extra = [n for n in other_names if n not in set(src_names)]
        missing = [n for n in src_names if n not in set(other_names)]
        if extra or missing:
            return f"names only there: {extra[:3]}, names missing there: {missing[:3]}"
        return "the same names in another order"
    for a, b in zip(src, other, strict=True):
        if list(a) != list(b):
            return f"{a[0]} {a[2]} {list(a[1])} on {a[3]} vs {b[0]} {b[2]} {list(b[1])} on {b[3]}"
    return "none"


def sync_model_states(
    group: Group | DistContext,
    model: nn.Module,
    src: int = 0,
    *,
    ignore: Iterable[str] = (),
    broadcast_buffers: bool = True,
) -> None:
    """Copy ``model``'s parameters (and buffers) from group index ``src`` to every rank, in place.

    Before any tensor moves the ranks agree on ``src`` and on the (name, shape,
    dtype, device type) of what they hold, so that a mismatch raises on every
    rank instead of deadlocking. A model holding DTensors is refused.

    Note:
        All ranks of the group must call it.

    Args:
        group: The group (a context means its world).
        model: The model to synchronize.
        src: Group index of the rank whose states win.
        ignore: Names (or name prefixes ending a dotted component, such as
            ``"head"`` for ``"head.weight"``) to leave alone.
        broadcast_buffers: Also synchronize buffers (running statistics...).

    Raises:
        PdistError: On every rank, when a rank's arguments are wrong (also a
            ``TypeError`` or ``ValueError``, naming the rank and the fix).
        RankMismatchError: On every rank, when ranks disagree on ``src`` or
            on what they hold.
    """
    g = as_group(group)
    what = "sync_model_states"
    states: list[tuple[str, torch.Tensor]] = []

    def make() -> WeightsMove | None:
        nonlocal states
        states = _local_states(g, model, src, ignore, broadcast_buffers)
        if g.world_size == 1:
            return None
        # Staging first, so that failing to allocate it raises on all.
        tensors = [t for _, t in states]
        return WeightsMove(g, states_of(states), tensors, src, SYNC_BUCKET_BYTES, what=what)

    if g.world_size == 1:
        make()  # a bad argument raises as it is
        return

    def entries() -> list[Any]:
        return [(n, tuple(t.shape), dtype_name(t.dtype), t.device.type) for n, t in states]

    # One status all-gather carries every rank's failure and a digest of (src, entries).
    move, same = _transfer.prepare(g, make, what=what, summary=lambda: repr([src, entries()]))
    if not same:
        _raise_difference(g, src, entries(), what)
    with torch.no_grad():
        cast("WeightsMove", move).run()


def _raise_difference(g: Group, src: int, entries: list[Any], what: str) -> NoReturn:
    """After a digest mismatch: exchange every rank's src and entries, and name what differs."""
    records = _wire.exchange(g, [src, entries], what=what)
    for rank, record in zip(g.ranks, records, strict=True):
        if not (
            isinstance(record, list)
            and len(record) == 2
            and type(record[0]) is int
            and isinstance(record[1], list)
            and all(isinstance(e, list) and len(e) == 4 for e in record[1])
        ):
            msg = (
                f"{what} on group {g.name!r}: rank {rank} sent a malformed record "
                f"{record!r:.80}; do all ranks run the same pdist version?"
            )
            raise PdistError(msg)
    srcs = [r[0] for r in records]
    if len(set(srcs)) > 1:
        by_rank = ", ".join(f"rank {r}: src={s!r}" for r, s in zip(g.ranks, srcs, strict=True))
        msg = f"{what}: the ranks passed different src ({by_rank}); pass the same src on every rank"
        raise RankMismatchError(msg)
    lists = [r[1] for r in records]
    bad = [g.ranks[i] for i, entries_i in enumerate(lists) if entries_i != lists[src]]
    try:
        difference = _first_state_difference(lists[src], lists[g.ranks.index(bad[0])])
    except (TypeError, ValueError, IndexError, KeyError):  # JSON, but not pdist's entries
        difference = "unknown (a rank sent a malformed list of entries)"
    msg = (
        f"{what}: the states of ranks {bad} differ from those of src rank "
        f"{g.ranks[src]}: first difference (src vs rank {bad[0]}): {difference}"
    )
    raise RankMismatchError(msg)
