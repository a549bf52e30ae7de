"""Training helpers: grad_sync for DDP and FSDP2, DDP's training_step, sync_model_states."""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from . import _wire
from ._broadcast import DEFAULT_BUCKET_BYTES
from ._errors import RankMismatchError
from ._group import DistContext, Group, as_group
from ._payload import Fill, place, process_group, staging
from ._serialize import dtype_name

__all__ = ["DistributedDataParallel", "grad_sync", "sync_model_states", "wrap_ddp"]


def _fsdp_module_type() -> type | None:
    # torch >= 2.6 exports FSDPModule from fsdp; older versions keep it under _composable.
    for name in ("torch.distributed.fsdp", "torch.distributed._composable.fsdp"):
        try:
            found = getattr(importlib.import_module(name), "FSDPModule", None)
        except ImportError:
            continue
        if isinstance(found, type):
            return found
    return None


def _fsdp_param_groups(module: nn.Module) -> list[Any]:
    state = module._get_fsdp_state()  # type: ignore[operator]
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # torch < 2.7 has at most one group per module
        group = getattr(state, "_fsdp_param_group", None)
        groups = [] if group is None else [group]
    return list(groups)


_STATIC_WARNED = "_pdist_static_graph_warned"


def _static_graph(ddp: nn.parallel.DistributedDataParallel) -> bool:
    return bool(getattr(ddp, "static_graph", False))


@contextlib.contextmanager
def grad_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Turn cross-replica gradient synchronization on or off inside the block.

    - DDP (torch's or pdist's): sets ``require_backward_grad_sync``. With
      ``static_graph=True`` the flag cannot change: it is left alone, with a
      warning once per model.
    - FSDP2 (``fully_shard``): defers only the cross-replica all-reduce of
      HSDP (``set_requires_all_reduce(enabled, recurse=False)`` on every FSDP
      module with parameters), so reduce-scatter still runs every micro-step
      and gradient memory does not grow.
    - Plain modules and one-rank runs: nothing to do.

    On exit every module gets back exactly its own previous flag, also when
    the block raises or when setting the flags fails half-way. Nests freely.

    Example::

        for i, batch in enumerate(micro_batches):
            with pdist.grad_sync(model, enabled=(i == len(micro_batches) - 1)):
                model(batch).sum().backward()
    """
    fsdp_type = _fsdp_module_type()
    restore: list[Any] = []

    def undo() -> None:
        for action in reversed(restore):
            action()

    try:
        for module in model.modules():
            if isinstance(module, nn.parallel.DistributedDataParallel):
                if _static_graph(module):
                    if not getattr(module, _STATIC_WARNED, False):
                        object.__setattr__(module, _STATIC_WARNED, True)
                        warnings.warn(
                            "grad_sync: this DDP model uses static_graph=True, whose gradient "
                            "synchronization cannot be skipped; gradients are synced every step",
                            UserWarning,
                            stacklevel=3,
                        )
                    continue
                old_flag = module.require_backward_grad_sync
                restore.append(
                    lambda m=module, v=old_flag: setattr(m, "require_backward_grad_sync", v)
                )
                module.require_backward_grad_sync = bool(enabled)
            elif fsdp_type is not None and isinstance(module, fsdp_type):
                groups = _fsdp_param_groups(module)
                if not groups:
                    continue
                olds = [g.all_reduce_grads for g in groups]

                def put_back(gs: list[Any] = groups, vs: list[bool] = olds) -> None:
                    for g, v in zip(gs, vs, strict=True):
                        g.all_reduce_grads = v

                restore.append(put_back)
                module.set_requires_all_reduce(bool(enabled), recurse=False)  # type: ignore[operator]
    except BaseException:
        undo()
        raise
    try:
        yield
    finally:
        undo()


class DistributedDataParallel(nn.parallel.DistributedDataParallel):
    """torch's DDP plus :meth:`training_step`, which runs through DDP's forward and hooks."""

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Call the wrapped module's ``training_step`` as DDP's forward.

        DDP's gradient hooks only arm through ``forward``; this redirects the
        wrapped module's ``forward`` to its ``training_step`` for one call and
        puts it back afterwards, also when the step raises.

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
        inner.forward = step
        try:
            return self(*args, **kwargs)
        finally:
            if had_own:
                inner.forward = own
            else:
                del inner.forward


def wrap_ddp(ctx: DistContext, model: nn.Module, **ddp_options: Any) -> nn.Module:
    """Wrap ``model`` in :class:`DistributedDataParallel` over the context's ``dp`` group.

    The model is moved to ``ctx.device`` first (``Module.to`` works in place).
    When the ``dp`` group has one rank there is nothing to synchronize and the
    model comes back unwrapped.

    .. note:: Every rank of the ``dp`` group must call it (DDP broadcasts rank
       0's parameters on construction).

    Args:
        ctx: The context.
        model: The module to wrap.
        **ddp_options: Passed to ``DistributedDataParallel`` (``static_graph``,
            ``find_unused_parameters``, ...).
    """
    model.to(ctx.device)
    if ctx.dp.world_size == 1:
        return model
    if "process_group" in ddp_options or "device_ids" in ddp_options:
        msg = "wrap_ddp sets process_group and device_ids from the context; do not pass them"
        raise TypeError(msg)
    device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    return DistributedDataParallel(
        model, process_group=ctx.dp.device_group, device_ids=device_ids, **ddp_options
    )


def _ignored(name: str, ignore: Iterable[str]) -> bool:
    return any(name == pattern or name.startswith(pattern + ".") for pattern in ignore)


def _states(
    model: nn.Module, ignore: tuple[str, ...], buffers: bool
) -> list[tuple[str, torch.Tensor]]:
    named: list[tuple[str, torch.Tensor]] = list(model.named_parameters())  # shared ones once
    if buffers:
        named += [(n, b) for n, b in model.named_buffers() if b is not None]
    return [(n, t) for n, t in named if not _ignored(n, ignore)]


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
    try:
        g.global_rank(src)  # type: ignore[arg-type]
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{exc} (on rank {rank})") from None
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
    return states


def _entry(name: str, t: torch.Tensor) -> tuple[str, tuple[int, ...], str, str]:
    return (name, tuple(t.shape), dtype_name(t.dtype), t.device.type)


def _first_difference(src: list[list[Any]], other: list[list[Any]]) -> str:
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

    Before any tensor moves, every rank exchanges one record: its ``src``, a
    fingerprint of the (name, shape, dtype, device type) of what it will send
    or receive, or the error its own arguments raised. A bad argument on one
    rank (``model=None``, a model on ``meta``, ``ignore=5``...) then raises
    on every rank, naming that rank; ranks passing different ``src`` raise
    :class:`~pdist.RankMismatchError`, and so does any fingerprint difference,
    naming the first differing entries and the ranks (such a mismatch would
    otherwise deadlock NCCL). Shared parameters are sent once; tensors travel
    in coalesced buckets, not one collective each, after an 8-byte status
    all-reduce that makes a failure while staging them raise everywhere too.
    Tensors that do not live on the group's transport device (such as a CPU
    group's model on another device) are sent from a copy and received into
    a buffer, then written back into the model's own tensors.

    .. note:: All ranks of the group must call it.

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
    error: BaseException | None = None
    states: list[tuple[str, torch.Tensor]] = []
    try:
        states = _local_states(g, model, src, ignore, broadcast_buffers)
    except (TypeError, ValueError) as exc:
        error = exc
    if g.world_size == 1:
        if error is not None:
            raise error
        return
    entries = [_entry(n, t) for n, t in states]
    digest = hashlib.sha256(repr(entries).encode()).hexdigest()
    records = _wire.exchange(g, [src, digest], error=error, what=what)
    srcs = [r[0] for r in records]
    if len(set(map(repr, srcs))) > 1:
        by_rank = ", ".join(f"rank {r}: src={s!r}" for r, s in zip(g.ranks, srcs, strict=True))
        msg = f"{what}: the ranks passed different src ({by_rank}); pass the same src on every rank"
        raise RankMismatchError(msg)
    digests = [r[1] for r in records]
    if len(set(digests)) > 1:
        # Only now the full lists: the common path exchanges 64 bytes.
        lists = _wire.exchange(g, entries, what=what)
        bad = [g.ranks[i] for i, d in enumerate(digests) if d != digests[src]]
        first_bad = g.ranks.index(bad[0])
        msg = (
            f"{what}: the states of ranks {bad} differ from those of src rank "
            f"{g.ranks[src]}: first difference (src vs rank {bad[0]}): "
            f"{_first_difference(lists[src], lists[first_bad])}"
        )
        raise RankMismatchError(msg)
    with torch.no_grad():
        broadcast_tensors(g, [t for _, t in states], src, what=what)


def broadcast_tensors(
    group: Group,
    tensors: list[torch.Tensor],
    src: int,
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    what: str = "broadcast_tensors",
) -> None:
    """Broadcast ``tensors`` (same shapes and dtypes on every rank) from ``src``, in place.

    Both sides know the layout, so no header travels: the source packs the
    tensors into byte buckets per transport, receivers unpack them into their
    own tensors. A tensor of a bucket of its own that lives on its
    transport's device is received in place; any other is received into a
    staging buffer and copied into the tensor itself (never into a copy).
    Staging and packing happen before one 8-byte status all-reduce, so a
    failure there raises on every rank instead of leaving the others waiting.

    .. note:: All ranks of the group must call it.
    """
    src_global = group.global_rank(src)
    is_src = group.rank_in_group == src
    fills: list[Fill] = []
    buffers: list[torch.Tensor] = []
    flats: list[torch.Tensor | None] = []
    failure: BaseException | None = None
    try:
        for t in tensors:
            place(fills, t, group.device, bucket_bytes)
        flats = staging(fills, [f.size for f in fills], receiving=not is_src)
        buffers = [
            fill.pack(flat) if is_src else fill.receive_buffer(flat)
            for fill, flat in zip(fills, flats, strict=True)
        ]
    except Exception as exc:
        failure = exc
    if fills or failure is not None:
        _wire.settle(group, failure, what=what)
    works = [
        dist.broadcast(buffer, src=src_global, group=process_group(group, fill.kind), async_op=True)
        for fill, buffer in zip(fills, buffers, strict=True)
    ]
    for work, fill, flat, buffer in zip(works, fills, flats, buffers, strict=True):
        if work is not None:
            work.wait()
        # A lone tensor (no staging buffer) was received in place; the others are unpacked.
        if flat is not None and not is_src:
            fill.unpack(buffer)
