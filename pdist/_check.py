"""Check mode: a tensor collective first agrees on its arguments across the group.

A collective whose ranks pass different shapes or dtypes does not always fail: on
gloo, one rank may abort ("16 vs 12") while another returns a tensor with a
zero-filled hole and carries on. With check mode on (``distributed(check=True)`` or
``PDIST_CHECK=1``, kept in the block's :class:`~pdist._group.Lifetime`) every
pdist tensor collective first compares a one-line summary of its call (op, shape,
dtype, dim, counts) through one small all-reduce on the CPU group
(:func:`pdist._agree.check_same`: the summaries themselves travel only when they
differ), and a difference raises the same :class:`~pdist.RankMismatchError` on every
rank, naming the ranks and what each passed. The price is that round trip per call
(``pdist bench``'s "check mode" cases), which is why it is off by default: on 2 gloo
ranks of a loaded 2-core machine, 0.8-1.7 ms more per call (a 4 KiB all_reduce 1.7 ms
checked against 0.9 ms, 1 MiB 3.2 against 1.8 ms; about 2x for small calls).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from . import _departures
from ._agree import check_same
from ._errors import PdistError
from ._group import Group

__all__ = ["HINT", "agree_call", "enabled", "explaining"]

_MISMATCH = ("mismatch", "does not match", "doesn't match")  # the backends' words

HINT = (
    "turn on check mode (pdist.distributed(check=True) or PDIST_CHECK=1) and every rank "
    "raises a RankMismatchError naming each rank's shapes and dtypes"
)


def enabled(group: Group) -> bool:
    """Whether ``group``'s block runs in check mode (a group without a block: no)."""
    return bool(getattr(group.lifetime, "check", False))


def _describe(x: torch.Tensor) -> str:
    dtype = str(x.dtype).replace("torch.", "")
    return f"shape {tuple(x.shape)} {dtype} on {x.device.type}"


def agree_call(group: Group, name: str, x: torch.Tensor, /, **fields: object) -> None:
    """In check mode, raise on every rank unless all passed alike ``name``, ``x`` and ``fields``.

    Every rank of ``group`` must call it (it is one collective when check mode is on,
    none when off). ``fields`` are the other arguments that must agree (``dim``,
    ``op``, ``src``, counts). Nothing happens on a one-rank group or while tracing.

    Raises:
        RankMismatchError: On every rank, when any rank's summary differs.
    """
    if group.world_size == 1 or not enabled(group) or torch.compiler.is_compiling():
        return
    summary = ", ".join([f"{name}: {_describe(x)}", *(f"{k}={v!r}" for k, v in fields.items())])
    with explaining(group, name):  # a peer gone meanwhile is named as in the collective
        check_same(group, f"{name} on group {group.name!r} (check mode)", summary, None)


@contextlib.contextmanager
def explaining(group: Group, what: str) -> Iterator[None]:
    """Turn the backend's failure of collective ``what`` into one naming its cause, if known.

    A peer that left its block is named (``_departures``); a size mismatch the backend
    reports (rather than aborting the process, as gloo mostly does) gets check mode's hint.
    """
    try:
        yield
    except RuntimeError as exc:
        better = _departures.explained(group, what, exc)
        text = str(exc).strip()
        mismatch = any(m in text.lower() for m in _MISMATCH)
        if better is None and mismatch and not isinstance(exc, PdistError):
            msg = (
                f"{what} on group {group.name!r} (rank {group.rank}): the ranks' tensors "
                f"do not match ({text.splitlines()[0]}); {HINT}"
            )
            better = PdistError(msg)
        if better is None:
            raise
        raise better from exc
