"""Check mode: every pdist call that communicates first agrees on its arguments.

A collective whose ranks pass different shapes or dtypes does not always fail: on
gloo, one rank may abort ("16 vs 12") while another returns a tensor with a
zero-filled hole and carries on. With check mode on (``distributed(check=True)`` or
``PDIST_CHECK=1``, agreed by every rank at start-up and kept in the block's
``Lifetime``) every pdist collective, object function, ``barrier``
and ``broadcast_weights`` first compares a one-line summary of its call (name, op,
shape, dtype, dim, counts, ``requires_grad`` where a backward would communicate)
through one small all-gather on the CPU group (``pdist._agree.status``: the
summaries themselves travel only when they differ), and a difference raises the same
[`RankMismatchError`][pdist.RankMismatchError] on every rank, naming the ranks and what each
passed. The two ends of a point-to-point call swap theirs instead
(``agree_ends``). The price is that round trip per call, which is why it is off by
default (the collectives guide's "What it costs": on 2 gloo ranks of a loaded 2-core
machine, a 4 KiB all_reduce 1.5-3.2 ms checked against 0.9-2.0 ms).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from . import _departures
from ._agree import check_same, status
from ._errors import RankMismatchError
from ._group import Group

__all__ = [
    "agree_args",
    "agree_call",
    "agree_ends",
    "agree_name",
    "checked",
    "describe",
    "enabled",
    "tensor_of",
]


def enabled(group: Group) -> bool:
    """Whether ``group``'s block runs in check mode (kept in its typed ``Lifetime``)."""
    return group.lifetime.check


def describe(x: object, *, dim: int | None = None, rows: bool = False) -> str:
    """``shape (2, 3) float32 on cpu``; ``dim``: that size shown as ``*``; ``rows``: dims 1 on."""
    if not isinstance(x, torch.Tensor):
        return type(x).__name__
    shape: list[object] = list(x.shape)
    if dim is not None and -len(shape) <= dim < len(shape):
        shape[dim] = "*"  # the dim whose size may differ between ranks
    dtype = str(x.dtype).replace("torch.", "")
    if rows:
        return f"rows of shape {tuple(shape[1:])} {dtype} on {x.device.type}"
    return f"shape {tuple(shape)} {dtype} on {x.device.type}"


def tensor_of(shape: object, dtype: object) -> str:
    """``a tensor of shape (2, 3) float32``; a TypeError unless ``shape`` and ``dtype`` are."""
    dims = (shape,) if isinstance(shape, int) else shape
    if not isinstance(dims, (tuple, list, torch.Size)) or not all(
        type(n) is int and n >= 0 for n in dims
    ):
        msg = f"shape={shape!r} must be an int or a sequence of non-negative ints"
        raise TypeError(msg)
    if not isinstance(dtype, torch.dtype):
        msg = f"dtype={dtype!r} must be a torch.dtype, such as torch.float32"
        raise TypeError(msg)
    return f"a tensor of shape {tuple(dims)} {str(dtype).replace('torch.', '')}"


def agree_call(group: Group, name: str, x: torch.Tensor, /, **fields: object) -> None:
    """In check mode, raise on every rank unless all passed alike ``name``, ``x`` and ``fields``.

    Every rank of ``group`` must call it (it is one collective when check mode is on,
    none when off). ``fields`` are the other arguments that must agree (``dim``,
    ``op``, ``src``, counts). Nothing happens on a one-rank group or while tracing.

    Raises:
        RankMismatchError: On every rank, when any rank's summary differs.
    """
    agree_args(group, name, describe(x), None, **fields)


def agree_name(group: Group, name: str, /, **fields: object) -> None:
    """In check mode, a call that is no tensor collective joins the agreement under its ``name``.

    The object functions, ``barrier`` and ``broadcast_weights`` call it first, so that a
    rank in another pdist call (a tensor collective, say) raises on every rank instead of
    pairing its transfer with theirs (an abort, or a hang). Every rank of ``group`` must
    call it; ``fields`` as in ``agree_call``.
    """
    agree_args(group, name, "", None, **fields)


def agree_args(
    group: Group, name: str, tensor: str, error: BaseException | None, /, **fields: object
) -> None:
    """``agree_call`` for a described ``tensor``, carrying this rank's argument ``error``.

    In check mode a rank whose local checks failed (``error``) makes every rank raise
    that error (the first failing rank's, naming it), in the same one small all-gather
    that compares the summaries; off, nothing happens and the caller raises ``error``
    itself. Every rank of ``group`` must call it. A field of None is left out of the summary
    (``requires_grad=True or None``: shown where a gradient is wanted).

    Raises:
        RankMismatchError: On every rank, when any rank's summary differs.
        ValueError: On every rank (or TypeError, as ``error``), when a rank passed one.
    """
    if group.world_size == 1 or not enabled(group) or torch.compiler.is_compiling():
        return
    head = f"{name}: {tensor}" if tensor else name
    summary = ", ".join([head, *(f"{k}={v!r}" for k, v in fields.items() if v is not None)])
    # A peer gone meanwhile is named as in the collective (which this agreement precedes).
    with _departures.naming(group, f"{name} (check mode)"):
        if not status(group, error, what=f"{name} (check mode)", summary=summary):
            # The summaries travel, only now.
            check_same(group, f"{name} on group {group.name!r} (check mode)", summary, None)


def agree_ends(
    group: Group,
    name: str,
    travels: Callable[[], str],
    /,
    *,
    peer: int,
    send: Callable[..., object],
    recv: Callable[[], bytes],
) -> None:
    """Check this end of point-to-point call ``name``; in check mode, first swap it with the other.

    ``travels()`` checks this end's arguments (TypeError, ValueError) and says what it sends
    or expects (``a tensor of shape (4,) float32``, ``an object``). In check mode the
    sender's (``name`` starts with ``send``) goes to group index ``peer`` and the
    receiver's comes back, through ``send(payload, error=...)`` and ``recv()`` (``_wire``'s
    framed messages), so that a difference raises the same
    [`RankMismatchError`][pdist.RankMismatchError] on both ends before any data moves, and a failed
    check raises on both. Off (or while tracing), nothing travels.
    """
    error: BaseException | None = None
    try:
        mine = f"{name}: {travels()}"
    except (TypeError, ValueError) as exc:
        error, mine = exc, f"{name}: bad arguments"
    if enabled(group) and not torch.compiler.is_compiling():
        if name.startswith("send"):
            send(mine.encode(), error=error)  # raises this end's error, after sending it
            theirs = recv().decode(errors="replace")  # raises the receiver's
        else:
            theirs = recv().decode(errors="replace")
            send(mine.encode(), error=error)
        if theirs.partition(": ")[2] != mine.partition(": ")[2]:
            ends = [(group.rank, mine), (group.ranks[peer], theirs)]
            (src, sender), (dst, receiver) = ends if name.startswith("send") else ends[::-1]
            msg = (
                f"{sender.partition(':')[0]} on group {group.name!r} (check mode): the two "
                f"ends do not match: rank {src} calls {sender}, but rank {dst} calls "
                f"{receiver}; pass the same shape and dtype (and matching calls) on both ends"
            )
            raise RankMismatchError(msg)
    if error is not None:
        raise error


def checked(group: Group, name: str, x: object, *checks: Callable[[], Any]) -> list[Any]:
    """This rank's argument ``checks`` of collective ``name``, run: their results, in order.

    In check mode a failing rank joins the agreement its peers wait in (``agree_args``),
    so that they raise its error too, instead of pairing that agreement with its next
    call. (Callables, not a ``with`` block: torch.compile before 2.7 cannot trace one.)
    """
    try:
        return [check() for check in checks]
    except (TypeError, ValueError) as exc:
        agree_args(group, name, describe(x), exc)
        raise
