"""Rank helpers: ``is_rank0``, ``is_local_rank0``, ``rank0_only``, ``rank0_first``, ``barrier``.

``rank0_only`` and ``rank0_first`` come in two forms, told apart by their one
argument: a callable is decorated directly (the wrapped function takes the
context first, ``@rank0_only``), while a ``DistContext`` or ``Group`` makes a
decorator for any callable (``@rank0_only(ctx)``): methods, zero-argument
callbacks, functions that never see the context. Neither a context nor a
group is callable, so the two forms cannot be confused.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Concatenate, ParamSpec, Protocol, TypeVar, overload

import torch.distributed as dist

from . import _wire
from ._errors import RemoteError
from ._group import DistContext, Group, as_group

__all__ = ["barrier", "is_local_rank0", "is_rank0", "rank0_first", "rank0_only"]

P = ParamSpec("P")
R = TypeVar("R")
# The factory form's decorator is generic on its own: it is made inside a function
# that binds P and R already.
Q = ParamSpec("Q")
T = TypeVar("T")


class Rank0OnlyDecorator(Protocol):
    """What ``rank0_only(ctx_or_group)`` returns: a decorator for any callable."""

    def __call__(self, fn: Callable[P, R], /) -> Callable[P, R | None]:
        """Wrap ``fn`` so that it runs on the group's first rank only."""
        ...


class Rank0FirstDecorator(Protocol):
    """What ``rank0_first(ctx_or_group)`` returns: a decorator for any callable."""

    def __call__(self, fn: Callable[P, R], /) -> Callable[P, R]:
        """Wrap ``fn`` so that it runs on the group's first rank, then on the others."""
        ...


def is_rank0(ctx: DistContext | Group) -> bool:
    """Whether the caller is rank 0: of the job for a context, of the group for a group.

    Given a group, it answers for the group's first rank, the rank
    ``@rank0_only(group)`` runs on (``is_rank0(ctx.tp)`` is true on every tp
    group's first rank). No collective.
    """
    if isinstance(ctx, Group):
        return ctx.rank_in_group == 0
    return as_group(ctx, name="ctx").rank == 0


def is_local_rank0(ctx: DistContext) -> bool:
    """Whether the caller is the first rank of its host (no collective).

    The host's ranks are ``ctx.node``, found through shared memory when the
    context was built; under torchrun and SLURM its first rank is the one with
    ``LOCAL_RANK`` 0. Use it for work done once per machine (a download to
    local disk, a cache fill).

    Raises:
        TypeError: ``ctx`` is not a :class:`~pdist.DistContext`.
    """
    if not isinstance(ctx, DistContext):
        msg = f"ctx={ctx!r} must be a pdist DistContext (a Group does not know its host)"
        raise TypeError(msg)
    return ctx.node.rank_in_group == 0


def barrier(group: Group | DistContext) -> None:
    """Block until every rank of ``group`` has called it (on the CPU group).

    .. note:: All ranks of the group must call it. A no-op on a one-rank group.
    """
    g = as_group(group)
    if g.world_size > 1:
        dist.barrier(group=g.cpu_group)


def _name(fn: object) -> str:
    return str(getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn))


def _neither(decorator: str, arg: object) -> TypeError:
    msg = (
        f"{decorator}({arg!r}): pass a DistContext or Group (@pdist.{decorator}(ctx), for any "
        f"callable) or decorate a function that takes the ctx first (@pdist.{decorator})"
    )
    return TypeError(msg)


def _ctx_arg(decorator: str, fn: object, ctx: object) -> Group:
    """The group of the direct form's first argument, with a message that says what to do."""
    if isinstance(ctx, (DistContext, Group)):
        return as_group(ctx)
    msg = (
        f"{_name(fn)} is decorated with @pdist.{decorator}, so its first argument must be a "
        f"DistContext or Group, got {ctx!r}; for a method or a function without a ctx "
        f"argument use the factory form @pdist.{decorator}(ctx)"
    )
    raise TypeError(msg)


def _first_then_others(group: Group, what: str, call: Callable[[], R]) -> R:
    """Run ``call`` on the group's first rank, then on the others; fail together."""
    if group.world_size == 1:
        return call()
    if group.rank_in_group == 0:
        try:
            result = call()
        except BaseException as exc:
            # Tell the others, then raise rank 0's own error rather than the wrapper's.
            with contextlib.suppress(RemoteError):
                _wire.broadcast_bytes(group, None, 0, error=exc, what=what)
            raise
        _wire.broadcast_bytes(group, b"", 0, what=what)
        return result
    _wire.broadcast_bytes(group, None, 0, what=what)
    return call()


@overload
def rank0_only(fn_or_ctx: DistContext | Group, /) -> Rank0OnlyDecorator: ...


@overload
def rank0_only(
    fn_or_ctx: Callable[Concatenate[DistContext, P], R], /
) -> Callable[Concatenate[DistContext, P], R | None]: ...


def rank0_only(
    fn_or_ctx: DistContext | Group | Callable[Concatenate[DistContext, P], R], /
) -> Rank0OnlyDecorator | Callable[Concatenate[DistContext, P], R | None]:
    """Decorator: run a function on one rank only; the other ranks get None.

    Two forms:

    - ``@rank0_only`` on a function whose first argument is the context (or a
      group): it runs on that group's first rank, global rank 0 for a context.
    - ``@rank0_only(ctx_or_group)`` on any callable (a method, a callback with
      no arguments): it runs on the first rank of the given group, global rank
      0 for a context.

    No collective is involved, so the other ranks do not wait for it.

    Example::

        @pdist.rank0_only(ctx)
        def log_metrics():
            print(metrics)

    Raises:
        TypeError: The argument is neither a callable nor a context or group,
            or (direct form) the wrapped function's first argument is not one.
    """
    if isinstance(fn_or_ctx, (DistContext, Group)):
        first = as_group(fn_or_ctx).rank_in_group == 0

        def decorate(fn: Callable[Q, T], /) -> Callable[Q, T | None]:
            @functools.wraps(fn)
            def wrapper(*args: Q.args, **kwargs: Q.kwargs) -> T | None:
                return fn(*args, **kwargs) if first else None

            return wrapper

        return decorate
    if not callable(fn_or_ctx):
        raise _neither("rank0_only", fn_or_ctx)
    fn = fn_or_ctx

    @functools.wraps(fn)
    def direct(ctx: DistContext, /, *args: P.args, **kwargs: P.kwargs) -> R | None:
        if _ctx_arg("rank0_only", fn, ctx).rank_in_group != 0:
            return None
        return fn(ctx, *args, **kwargs)

    return direct


@overload
def rank0_first(fn_or_ctx: DistContext | Group, /) -> Rank0FirstDecorator: ...


@overload
def rank0_first(
    fn_or_ctx: Callable[Concatenate[DistContext, P], R], /
) -> Callable[Concatenate[DistContext, P], R]: ...


def rank0_first(
    fn_or_ctx: DistContext | Group | Callable[Concatenate[DistContext, P], R], /
) -> Rank0FirstDecorator | Callable[Concatenate[DistContext, P], R]:
    """Decorator: run a function on the first rank, then on every other rank.

    For work that one rank must do before the others can (a download, a cache
    fill). Two forms, as for :func:`rank0_only`:

    - ``@rank0_first`` on a function whose first argument is the context (or a
      group): the first rank of that group goes first.
    - ``@rank0_first(ctx_or_group)`` on any callable (a method, a callback with
      no arguments): the first rank of the given group goes first.

    If the first rank raises, every other rank raises
    :class:`~pdist.PdistError` naming its error instead of waiting.

    .. note:: Every rank of the group (the world, for a context) must call the
       wrapped function.

    Example::

        @pdist.rank0_first(ctx)
        def fetch_weights():
            return download(url, cache_dir)

    Raises:
        TypeError: The argument is neither a callable nor a context or group,
            or (direct form) the wrapped function's first argument is not one.
        PdistError: On the other ranks, when the first rank's call raised.
    """
    if isinstance(fn_or_ctx, (DistContext, Group)):
        bound = as_group(fn_or_ctx)

        def decorate(fn: Callable[Q, T], /) -> Callable[Q, T]:
            what = f"rank0_first({_name(fn)})"

            @functools.wraps(fn)
            def wrapper(*args: Q.args, **kwargs: Q.kwargs) -> T:
                return _first_then_others(bound, what, lambda: fn(*args, **kwargs))

            return wrapper

        return decorate
    if not callable(fn_or_ctx):
        raise _neither("rank0_first", fn_or_ctx)
    fn = fn_or_ctx
    what = f"rank0_first({_name(fn)})"

    @functools.wraps(fn)
    def direct(ctx: DistContext, /, *args: P.args, **kwargs: P.kwargs) -> R:
        world = _ctx_arg("rank0_first", fn, ctx)
        return _first_then_others(world, what, lambda: fn(ctx, *args, **kwargs))

    return direct
