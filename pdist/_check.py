"""Check mode: a tensor collective first agrees on its arguments across the group.

A collective whose ranks pass different shapes or dtypes does not always fail: on
gloo, one rank may abort ("16 vs 12") while another returns a tensor with a
zero-filled hole and carries on. With check mode on (``distributed(check=True)`` or
``PDIST_CHECK=1``, kept in the block's ``Lifetime``) every
pdist tensor collective first compares a one-line summary of its call (op, shape,
dtype, dim, counts) through one small all-gather on the CPU group
(``pdist._agree.check_same``: the summaries themselves travel only when they
differ), and a difference raises the same [`RankMismatchError`][pdist.RankMismatchError] on every
rank, naming the ranks and what each passed. The price is that round trip per call
(``pdist bench``'s "check mode" cases), which is why it is off by default: on 2 gloo
ranks of a loaded 2-core machine, 0.8-1.7 ms more per call (a 4 KiB all_reduce 1.7 ms
checked against 0.9 ms, 1 MiB 3.2 against 1.8 ms; about 2x for small calls).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from . import _departures
from ._agree import check_same, status
from ._errors import PdistError
from ._group import Group

__all__ = ["HINT", "agree_args", "agree_call", "checked", "describe", "enabled", "explaining"]

_MISMATCH = ("mismatch", "does not match", "doesn't match")  # the backends' words

HINT = (
    "turn on check mode (pdist.distributed(check=True) or PDIST_CHECK=1) and every rank "
    "raises a RankMismatchError naming each rank's shapes and dtypes"
)


def enabled(group: Group) -> bool:
    """Whether ``group``'s block runs in check mode (a group without a block: no)."""
    return bool(getattr(group.lifetime, "check", False))


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


def agree_call(group: Group, name: str, x: torch.Tensor, /, **fields: object) -> None:
    """In check mode, raise on every rank unless all passed alike ``name``, ``x`` and ``fields``.

    Every rank of ``group`` must call it (it is one collective when check mode is on,
    none when off). ``fields`` are the other arguments that must agree (``dim``,
    ``op``, ``src``, counts). Nothing happens on a one-rank group or while tracing.

    Raises:
        RankMismatchError: On every rank, when any rank's summary differs.
    """
    agree_args(group, name, describe(x), None, **fields)


def agree_args(
    group: Group, name: str, tensor: str, error: BaseException | None, /, **fields: object
) -> None:
    """``agree_call`` for a described ``tensor``, carrying this rank's argument ``error``.

    In check mode a rank whose local checks failed (``error``) makes every rank raise
    that error (the first failing rank's, naming it), in the same one small all-gather
    that compares the summaries; off, nothing happens and the caller raises ``error``
    itself. Every rank of ``group`` must call it.

    Raises:
        RankMismatchError: On every rank, when any rank's summary differs.
        ValueError: On every rank (or TypeError, as ``error``), when a rank passed one.
    """
    if group.world_size == 1 or not enabled(group) or torch.compiler.is_compiling():
        return
    summary = ", ".join([f"{name}: {tensor}", *(f"{k}={v!r}" for k, v in fields.items())])
    # A peer gone meanwhile is named as in the collective (which this agreement precedes).
    with explaining(group, f"{name} (check mode)", counted=False):
        if not status(group, error, what=f"{name} (check mode)", summary=summary):
            # The summaries travel, only now.
            check_same(group, f"{name} on group {group.name!r} (check mode)", summary, None)


def checked(
    group: Group, name: str, x: object, *checks: Callable[[], Any], agree: bool = True
) -> list[Any]:
    """This rank's argument ``checks`` of collective ``name``, run: their results, in order.

    In check mode a failing rank joins the agreement its peers wait in (``agree_args``),
    so that they raise its error too, instead of pairing that agreement with its next
    call; ``agree=False``: a local op, which its peers do not agree on. (Callables, not a
    ``with`` block: torch.compile before 2.7 cannot trace one.)
    """
    try:
        return [check() for check in checks]
    except (TypeError, ValueError) as exc:
        if agree:
            agree_args(group, name, describe(x), exc)
        raise


@contextlib.contextmanager
def explaining(group: Group, what: str, *, counted: bool = True) -> Iterator[None]:
    """Turn the backend's failure of collective ``what`` into one naming its cause, if known.

    A peer that left its block is named (``_departures``); a size mismatch the backend
    reports (rather than aborting the process, as gloo mostly does) gets check mode's hint.
    ``counted``: a collective of its own, numbered per group name (``all_reduce #6``), so
    that a survivor's message says which call of the job it was in.
    """
    calls = group.lifetime.calls
    if counted:
        calls[group.name] = number = calls.get(group.name, 0) + 1
        what = f"{what} #{number}"
    try:
        with _departures.naming(group, what):
            yield
    except RuntimeError as exc:  # no one left: a mismatch the backend saw gets the hint
        text = str(exc).strip()
        if isinstance(exc, PdistError) or not any(m in text.lower() for m in _MISMATCH):
            raise
        msg = (
            f"{what} on group {group.name!r} (rank {group.rank}): the ranks' tensors "
            f"do not match ({text.splitlines()[0]}); {HINT}"
        )
        raise PdistError(msg) from exc
