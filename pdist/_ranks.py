"""Rank helpers: ``is_rank0``, ``rank0_only``, ``rank0_first``, ``barrier``."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Concatenate, ParamSpec, TypeVar

import torch.distributed as dist

from . import _wire
from ._group import DistContext, Group, as_group

__all__ = ["barrier", "is_rank0", "rank0_first", "rank0_only"]

P = ParamSpec("P")
R = TypeVar("R")


def is_rank0(ctx: DistContext | Group) -> bool:
    """Whether the caller is global rank 0."""
    return as_group(ctx, name="ctx").rank == 0


def barrier(group: Group | DistContext) -> None:
    """Block until every rank of ``group`` has called it (on the CPU group).

    .. note:: All ranks of the group must call it. A no-op on a one-rank group.
    """
    g = as_group(group)
    if g.world_size > 1:
        dist.barrier(group=g.cpu_group)


def rank0_only(
    fn: Callable[Concatenate[DistContext, P], R],
) -> Callable[Concatenate[DistContext, P], R | None]:
    """Decorator: run ``fn(ctx, ...)`` on global rank 0 only; other ranks get None.

    No collective is involved, so other ranks do not wait for rank 0.
    """

    @functools.wraps(fn)
    def wrapper(ctx: DistContext, /, *args: P.args, **kwargs: P.kwargs) -> R | None:
        return fn(ctx, *args, **kwargs) if is_rank0(ctx) else None

    return wrapper


def rank0_first(
    fn: Callable[Concatenate[DistContext, P], R],
) -> Callable[Concatenate[DistContext, P], R]:
    """Decorator: run ``fn(ctx, ...)`` on global rank 0, then on the other ranks.

    For work that rank 0 must do before the others can (a download, a cache
    fill). If rank 0 raises, every other rank raises
    :class:`~pdist.PdistError` naming rank 0's error instead of waiting.

    .. note:: Every rank of the world must call the wrapped function.
    """

    @functools.wraps(fn)
    def wrapper(ctx: DistContext, /, *args: P.args, **kwargs: P.kwargs) -> R:
        world = as_group(ctx, name="ctx")
        what = f"rank0_first({fn.__name__})"
        if world.world_size == 1:
            return fn(ctx, *args, **kwargs)
        if world.rank_in_group == 0:
            try:
                result = fn(ctx, *args, **kwargs)
            except BaseException as exc:
                # Tell the others, then raise rank 0's own error rather than the wrapper.
                with contextlib.suppress(_wire.RemoteError):
                    _wire.broadcast_bytes(world, None, 0, error=exc, what=what)
                raise
            _wire.broadcast_bytes(world, b"", 0, what=what)
            return result
        _wire.broadcast_bytes(world, None, 0, what=what)
        return fn(ctx, *args, **kwargs)

    return wrapper
