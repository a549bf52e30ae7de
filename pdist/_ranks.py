"""Rank helpers: ``is_rank0``, ``is_local_rank0``, ``rank0_only``, ``rank0_first``, ``barrier``.

``rank0_only`` and ``rank0_first`` take a callable (decorated directly; it takes the
context first) or a ``DistContext`` or ``Group`` (never callable: a decorator for any callable).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar, overload

import torch.distributed as dist

from . import _check, _wire
from ._departures import naming
from ._errors import RemoteError
from ._group import DistContext, Group, as_group

__all__ = ["barrier", "is_local_rank0", "is_rank0", "rank0_first", "rank0_only"]

P = ParamSpec("P")
R = TypeVar("R")


class Rank0OnlyDecorator(Protocol):
    """What ``rank0_only(ctx_or_group)`` returns: a decorator for any callable."""

    def __call__(self, fn: Callable[P, R], /) -> Callable[P, R | None]:
        """Wrap ``fn`` so that it runs on the group's first rank only."""


class Rank0FirstDecorator(Protocol):
    """What ``rank0_first(ctx_or_group)`` returns: a decorator for any callable."""

    def __call__(self, fn: Callable[P, R], /) -> Callable[P, R]:
        """Wrap ``fn`` so that it runs on the group's first rank, then on the others."""


def is_rank0(ctx: DistContext | Group) -> bool:
    """Whether the caller is rank 0: of the job for a context, of the group for a group.

    ``is_rank0(ctx.tp)`` is true on every tp group's first rank. No collective.
    """
    if isinstance(ctx, Group):
        return ctx.rank_in_group == 0
    return as_group(ctx, name="ctx").rank == 0


def is_local_rank0(ctx: DistContext) -> bool:
    """Whether the caller is the first rank of its host, in ``ctx.node`` (no collective).

    Raises:
        TypeError: ``ctx`` is not a [`DistContext`][pdist.DistContext].
    """
    if not isinstance(ctx, DistContext):
        msg = f"ctx={ctx!r} must be a pdist DistContext (a Group does not know its host)"
        raise TypeError(msg)
    return ctx.node.rank_in_group == 0


def barrier(group: Group | DistContext) -> None:
    """Block until every rank of ``group`` has called it (on the CPU group).

    Note:
        All ranks of the group must call it. A no-op on a one-rank group.
    """
    g = as_group(group)
    _check.agree_name(g, "barrier")
    if g.world_size > 1:
        with naming(g, "barrier"):
            dist.barrier(group=g.cpu_group)


def _name(fn: object) -> str:
    return str(getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn))


def _first_then_others(group: Group, what: str, call: Callable[[], R]) -> R:
    """Run ``call`` on the group's first rank, then on the others; fail together."""
    if group.world_size == 1:
        return call()
    if group.rank_in_group == 0:
        try:
            result = call()
        except BaseException as exc:
            with contextlib.suppress(RemoteError):  # rank 0 raises its own error, not the wrapper's
                _wire.broadcast_bytes(group, None, 0, error=exc, what=what)
            raise
        _wire.broadcast_bytes(group, b"", 0, what=what)
        return result
    _wire.broadcast_bytes(group, None, 0, what=what)
    return call()


def _first_only(group: Group, what: str, call: Callable[[], R]) -> R | None:
    return call() if group.rank_in_group == 0 else None


def _decorator(
    name: str, fn_or_ctx: object, run: Callable[[Group, str, Callable[[], Any]], Any]
) -> Any:
    """Both forms of the decorator ``name``; ``run(group, what, call)`` makes each call."""
    if isinstance(fn_or_ctx, (DistContext, Group)):
        bound = as_group(fn_or_ctx)

        def decorate(fn: Callable[..., Any], /) -> Callable[..., Any]:
            what = f"{name}({_name(fn)})"

            @functools.wraps(fn)
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                return run(bound, what, lambda: fn(*args, **kwargs))

            return wrapper

        return decorate
    if not callable(fn_or_ctx):
        msg = (
            f"{name}({fn_or_ctx!r}): pass a DistContext or Group (@pdist.{name}(ctx), for any "
            f"callable) or decorate a function that takes the ctx first (@pdist.{name})"
        )
        raise TypeError(msg)
    fn = fn_or_ctx
    what = f"{name}({_name(fn)})"

    @functools.wraps(fn)
    def direct(ctx: object, /, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(ctx, (DistContext, Group)):
            msg = (
                f"{_name(fn)} is decorated with @pdist.{name}, so its first argument must be a "
                f"DistContext or Group, got {ctx!r}; for a method or a function without a ctx "
                f"argument use the factory form @pdist.{name}(ctx)"
            )
            raise TypeError(msg)
        return run(as_group(ctx), what, lambda: fn(ctx, *args, **kwargs))

    return direct


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

    ``@rank0_only`` on a function whose first argument is the context (or a group) runs
    it on that group's first rank; ``@rank0_only(ctx_or_group)`` does the same for any
    callable (a method, a callback). No collective: the other ranks do not wait.

    Example:
        ```python
        @pdist.rank0_only(ctx)
        def log_metrics():
            print(metrics)
        ```

    Raises:
        TypeError: The argument is neither a callable nor a context or group,
            or (direct form) the wrapped function's first argument is not one.
    """
    return _decorator("rank0_only", fn_or_ctx, _first_only)  # type: ignore[no-any-return]


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

    For work one rank must do before the others can (a download), in the two forms of
    [`rank0_only`][pdist.rank0_only]. If the first rank raises, every other rank raises
    [`PdistError`][pdist.PdistError] naming its error instead of waiting.

    Note:
        Every rank of the group (the world, for a context) must call the
        wrapped function.

    Raises:
        TypeError: The argument is neither a callable nor a context or group,
            or (direct form) the wrapped function's first argument is not one.
        PdistError: On the other ranks, when the first rank's call raised.
    """
    return _decorator("rank0_first", fn_or_ctx, _first_then_others)  # type: ignore[no-any-return]
