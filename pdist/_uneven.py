"""Collectives with per-rank counts: ``all_to_all`` by rows, uneven gathers on it.

One differentiable primitive, ``_AllToAll`` (rows along dim 0, the
gradient is the all-to-all with the counts swapped), runs eagerly straight on
``dist.all_to_all_single`` and, while tracing, on torch's functional op. The
uneven ``all_gather`` / ``reduce_scatter`` are compositions of it whose
gradients autograd derives (a gather's is the scatter and back).

The counts travel in ``_agree.exchange_counts``, which carries failures: a rank
whose arguments are bad sends a marker instead of counts, and every rank raises
the same error, so a caller's mistake on one rank never leaves the others waiting
in the data exchange that follows. ``_moe`` and ``_sequence`` ride their own
checks on it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch
import torch.distributed as dist

from . import _check, _departures
from ._agree import check_same, exchange_counts
from ._compat import functional_ops
from ._errors import RankMismatchError
from ._group import DistContext, Group, as_group
from ._inflight import recorded
from ._launches import local

__all__ = [
    "all_gather_sizes",
    "all_to_all",
    "any_grad",
    "grad_flag",
    "reduce_scatter_sizes",
    "rows",
]


def _count_list(group: Group, value: object, name: str) -> list[int]:
    p = group.world_size
    if isinstance(value, torch.Tensor) and value.dim() == 1 and not value.is_floating_point():
        value = value.tolist()
    if not isinstance(value, (list, tuple)) or not all(
        type(n) is int or isinstance(n, torch.SymInt) for n in value
    ):
        msg = f"{name}={value!r} must be a list of {p} ints, one per rank of the group"
        raise TypeError(msg)
    if len(value) != p:
        msg = (
            f"{name} has {len(value)} entries on rank {group.rank}, but the group has {p} "
            f"ranks; give one count per rank"
        )
        raise ValueError(msg)
    if any(isinstance(n, int) and n < 0 for n in value):
        msg = f"{name}={list(value)!r} on rank {group.rank} holds a negative count"
        raise ValueError(msg)
    return list(value)


def _check_send(group: Group, x: object, send_counts: object) -> tuple[torch.Tensor, list[int]]:
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        got = "a 0-D tensor" if isinstance(x, torch.Tensor) else type(x).__name__
        msg = f"all_to_all: x must be a tensor with rows along dim 0, got {got}"
        raise TypeError(msg)
    p, n = group.world_size, x.shape[0]
    if send_counts is None:
        if n % p:
            msg = (
                f"all_to_all: x has {n} rows on rank {group.rank}, which the group size {p} "
                "does not divide; pass send_counts for uneven rows"
            )
            raise ValueError(msg)
        return x, [n // p] * p
    counts = _count_list(group, send_counts, "send_counts")
    # Symbolic counts (while tracing) are the compiler's to check.
    if all(isinstance(c, int) for c in [n, *counts]) and sum(counts) != n:
        msg = (
            f"send_counts={counts!r} sum to {sum(counts)} on rank {group.rank}, but x has "
            f"{n} rows (x.shape[0]); the counts must cover every row"
        )
        raise ValueError(msg)
    return x, counts


def all_to_all(
    group: Group | DistContext,
    x: torch.Tensor,
    send_counts: Sequence[int] | None = None,
    recv_counts: Sequence[int] | None = None,
) -> torch.Tensor:
    """Exchange rows: the first ``send_counts[j]`` rows after the earlier ranks' go to rank ``j``.

    Rank ``i`` gets, in group order, the block of rows every rank sent it:
    ``recv_counts[j]`` rows from rank ``j``. Differentiable (the gradient is the
    all-to-all with the counts swapped); under ``torch.compile`` it traces to one
    functional all-to-all and one wait, given both counts as Python ints.

    Note:
        All ranks of the group must call it, with rows of one shape and dtype and
        the counts given the same way (both, ``send_counts`` alone, or none).

    Note:
        With both counts given, pdist adds no exchange: the caller vouches that
        ``recv_counts[j]`` on rank ``i`` is ``send_counts[i]`` on rank ``j``. A count
        above what rank ``j`` sends leaves zeros in the rows it does not fill; one
        below it fails in the backend (gloo aborts the receiving process). Check mode
        (``distributed(check=True)`` or ``PDIST_CHECK=1``) verifies them, with the row
        shape and dtype: every rank raises instead.

    Note:
        The backward is an all-to-all too, so every rank must run it when any
        does. With ``send_counts`` alone, whether any rank's ``x`` requires grad
        travels with the counts, and then every rank records the backward (its
        output requires grad even if its ``x`` does not, say a rank with no rows)
        and must call ``backward()`` on a loss built from it. With both counts
        given, or none, nothing travels: the caller keeps ``x.requires_grad`` (and
        the grad mode) alike on every rank, or a rank that recorded no backward
        leaves the others waiting in theirs; check mode compares it.

    Args:
        group: The group (a ``DistContext`` means its ``world``).
        x: ``[N, ...]``; rows along dim 0.
        send_counts: Rows for each rank, summing to ``N``. None: ``N / P`` each.
        recv_counts: Rows from each rank. None: exchanged (one small all-to-all of
            the counts over the CPU group; a rank whose ``send_counts`` are bad sends
            a marker, so every rank raises). Given, pdist adds no exchange and the
            caller vouches that they match the senders' counts.

    Returns:
        ``[sum(recv_counts), ...]``, a new tensor; on a one-rank group, ``x``.

    Raises:
        ValueError: ``recv_counts`` without ``send_counts``; counts of the wrong
            length, negative, or not summing to ``x.shape[0]`` (on every rank when
            the counts are exchanged, or in check mode).
        TypeError: Counts that are not ints; ``recv_counts`` to be exchanged while
            compiling (pass both).
        RankMismatchError: On every rank: with ``send_counts`` alone, a rank
            called it under ``torch.no_grad()`` while another's ``x`` requires grad;
            in check mode, the ranks' rows differ in shape, dtype or (counts given
            or none) ``requires_grad``, or the given ``recv_counts`` are not what
            the ranks send.
    """
    g = as_group(group)
    exchanged = recv_counts is None and send_counts is not None
    if exchanged and torch.compiler.is_compiling():
        msg = "all_to_all: a compiled call needs both send_counts and recv_counts as ints"
        raise TypeError(msg)
    error: BaseException | None = None
    send: list[int] = []
    recv: list[int] = []
    try:
        x, send, recv = _gather_arguments(g, x, send_counts, recv_counts)
    except (TypeError, ValueError) as e:
        error = e
    how = "exchanged" if exchanged else "even" if send_counts is None else "given"
    fields: dict[str, object] = {"counts": how}
    if not exchanged:  # nothing carries the need for a gradient: the ranks must agree on it
        fields["requires_grad"] = _records_backward(x)
    # Even counts: every rank sends and expects N / P rows of each, so N must agree too.
    seen = _check.describe(x, rows=send_counts is not None)
    _check.agree_args(g, "all_to_all", seen, error, **fields)
    grad = False
    if exchanged:  # the need for a gradient rides with the counts
        records = None if error else [[c, grad_flag(x)] for c in send]
        got = exchange_counts(g, records, error, width=2, what="all_to_all")
        recv = [r[0] for r in got]
        grad = any_grad(g, [r[1] for r in got], "all_to_all")
    elif error is not None:
        raise error
    elif recv_counts is not None and _check.enabled(g) and not torch.compiler.is_compiling():
        _verify(g, send, recv)
    return rows(g, x, send, recv, grad=grad)


def _gather_arguments(
    group: Group, x: object, send_counts: object, recv_counts: object
) -> tuple[torch.Tensor, list[int], list[int]]:
    """This rank's checked ``x`` and counts (receive counts ``[]``: to be exchanged)."""
    if recv_counts is not None and send_counts is None:
        msg = (
            "all_to_all: recv_counts without send_counts; pass send_counts too "
            "(alone, the receive counts are exchanged)"
        )
        raise ValueError(msg)
    x, send = _check_send(group, x, send_counts)
    if send_counts is None:
        return x, send, send
    return x, send, [] if recv_counts is None else _count_list(group, recv_counts, "recv_counts")


def _verify(group: Group, send: list[int], recv: list[int]) -> None:
    """Check mode: the vouched ``recv`` are what the ranks send here, or every rank raises."""
    got = [
        r[0] for r in exchange_counts(group, [[c] for c in send], None, width=1, what="all_to_all")
    ]
    me = group.rank_in_group
    summary = "recv_counts match the senders' send_counts"
    if got != recv:
        j = next(j for j in range(len(got)) if got[j] != recv[j])
        summary = (
            f"recv_counts={recv!r} on rank {group.rank}, but rank {group.ranks[j]} sends it "
            f"{got[j]} rows (its send_counts[{me}]), not {recv[j]}; the ranks send {got!r}"
        )
    check_same(group, f"all_to_all on group {group.name!r} (check mode)", summary, None)


def rows(
    group: Group,
    x: torch.Tensor,
    send: list[int],
    recv: list[int],
    *,
    grad: bool = False,
    anchor: torch.Tensor | None = None,
) -> torch.Tensor:
    """The all-to-all of checked counts (``_moe`` and ``_sequence`` call it directly).

    Recorded for autograd (grad mode on) when ``x`` or ``anchor`` requires grad, or
    ``grad``: a peer's input needs its gradient, so this rank's backward must run the
    swapped all-to-all too, or that peer waits in it. Every rank of the group must
    come to the same answer. ``anchor``: a tensor whose graph the backward must reach
    even when ``x`` does not depend on it; its gradient is zeros.
    """
    if group.world_size == 1:
        return x
    if torch.is_grad_enabled() and (grad or x.requires_grad or _needs(anchor)):
        if not _needs(anchor) and not x.requires_grad:
            anchor = x.new_empty(0).requires_grad_()  # records the backward; dropped after
        return cast("torch.Tensor", _AllToAll.apply(group, x, anchor, send, recv))  # type: ignore[no-untyped-call]
    return _rows_forward(group, x, send, recv)


def _needs(anchor: torch.Tensor | None) -> bool:
    return anchor is not None and anchor.requires_grad


def _records_backward(x: object) -> bool:
    """Whether this rank records the backward of a call whose ranks must agree on it."""
    return grad_flag(x) == 2


def grad_flag(x: object) -> int:
    """This rank's word on autograd, for a counts exchange: 0 grad mode off, 1 on, 2 needs one."""
    if not torch.is_grad_enabled():
        return 0
    return 2 if isinstance(x, torch.Tensor) and x.requires_grad else 1


def any_grad(group: Group, flags: Sequence[int], what: str) -> bool:
    """Whether any rank's input needs a gradient (every rank's ``grad_flag``, exchanged).

    Then every rank records the backward. Every rank sees the same ``flags``, so a rank
    in ``torch.no_grad()`` while another's input needs a gradient (that one would wait
    in the backward for good) raises the same error on every rank.
    """
    if 2 not in flags:
        return False
    off = [group.ranks[j] for j, f in enumerate(flags) if f == 0]
    if off:
        needs = [group.ranks[j] for j, f in enumerate(flags) if f == 2]
        msg = (
            f"{what} on group {group.name!r}: rank(s) {off} called it with grad mode off "
            f"(torch.no_grad), while the input of rank(s) {needs} requires grad, so their "
            "backward would wait for the others; call it in the same grad mode on every rank"
        )
        raise RankMismatchError(msg)
    return True


def _rows_forward(group: Group, x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
    if torch.compiler.is_compiling():
        ops = functional_ops()
        out = ops.all_to_all_single(x.contiguous(), recv, send, group.device_group.group_name)
        return cast("torch.Tensor", ops.wait_tensor(out))
    return _rows_eager(group, local(x).detach(), send, recv, what="all_to_all")


@recorded("collective")  # what the stall watch reads where torch's flight recorder is blind
def _rows_eager(
    group: Group, x: torch.Tensor, send: list[int], recv: list[int], *, what: str
) -> torch.Tensor:
    # Written, never left: rows a peer does not send (a vouched count too high) stay zero.
    out = x.new_zeros((sum(recv), *x.shape[1:]))
    with _departures.naming(group, what, counted=True):  # as every eager collective
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group.device_group)
    return out


class _AllToAll(torch.autograd.Function):
    """Rows to ranks by counts; the gradient goes back with the counts swapped.

    The backward runs the swapped all-to-all even where neither input needs its
    result: the peers' gradients travel through it.
    """

    @staticmethod
    def forward(
        ctx: Any,
        group: Group,
        x: torch.Tensor,
        anchor: torch.Tensor | None,
        send: list[int],
        recv: list[int],
    ) -> torch.Tensor:
        ctx.group, ctx.send, ctx.recv = group, send, recv
        if anchor is not None:
            ctx.anchor = anchor.shape, anchor.dtype, anchor.device
        return _rows_forward(group, x, send, recv)

    @staticmethod
    def backward(
        ctx: Any, grad: torch.Tensor
    ) -> tuple[None, torch.Tensor | None, torch.Tensor | None, None, None]:
        back = _rows_forward(ctx.group, grad, ctx.recv, ctx.send)
        zeros = None
        if ctx.needs_input_grad[2]:  # stride 0: no memory for the anchor's zeros
            shape, dtype, device = ctx.anchor
            zeros = torch.zeros((), dtype=dtype, device=device).expand(shape)
        return None, back if ctx.needs_input_grad[1] else None, zeros, None, None


def all_gather_sizes(group: Group, x: torch.Tensor, dim: int, sizes: object) -> torch.Tensor:
    """``all_gather`` of shards of ``sizes[r]`` along ``dim`` (normalized); differentiable.

    The caller vouches that every rank passes the same ``sizes``: only this rank's
    entry can be checked here (against ``x``). A list that overstates a peer's size
    leaves zeros where that peer sends nothing; one that understates it fails in the
    backend. Check mode compares them (and ``x``'s other dims, dtype and
    ``requires_grad``: a rank that records no backward strands the others in theirs)
    on every rank first.
    """
    error: BaseException | None = None
    counts: list[int] = []
    try:
        counts = _count_list(group, sizes, "sizes")
        mine = counts[group.rank_in_group]
        if mine != x.shape[dim]:
            msg = (
                f"all_gather: sizes[{group.rank_in_group}]={mine} on rank {group.rank}, but x "
                f"has size {x.shape[dim]} along dim {dim} (shape {tuple(x.shape)}); sizes[r] "
                "is rank r's size along dim"
            )
            raise ValueError(msg)
    except (TypeError, ValueError) as e:
        error = e
    fields = {"sizes": counts, "requires_grad": _records_backward(x)}
    _check.agree_args(group, "all_gather", _check.describe(x, dim=dim), error, **fields)
    if error is not None:
        raise error
    if group.world_size == 1:
        return x
    p = group.world_size
    moved = x.movedim(dim, 0)  # [n_r, ...]: the rows this rank sends every rank
    send = moved.unsqueeze(0).expand(p, *moved.shape).flatten(0, 1)  # [P * n_r, ...]
    out = rows(group, send, [mine] * p, counts)  # [sum(sizes), ...]
    return out.movedim(0, dim)


def reduce_scatter_sizes(
    group: Group, x: torch.Tensor, op: str, dim: int, sizes: object
) -> torch.Tensor:
    """``reduce_scatter`` into shards of ``sizes[r]`` along ``dim``; differentiable in sum/mean.

    As in ``all_gather_sizes``, the caller vouches that every rank passes the same
    ``sizes`` (this rank checks their length and sum); check mode compares them.
    """
    error: BaseException | None = None
    counts: list[int] = []
    try:
        counts = _count_list(group, sizes, "sizes")
        if sum(counts) != x.shape[dim]:
            msg = (
                f"reduce_scatter: sizes={counts!r} sum to {sum(counts)} on rank {group.rank}, "
                f"but x has size {x.shape[dim]} along dim {dim} (shape {tuple(x.shape)})"
            )
            raise ValueError(msg)
    except (TypeError, ValueError) as e:
        error = e
    fields = {"op": op, "dim": dim, "sizes": counts, "requires_grad": _records_backward(x)}
    _check.agree_args(group, "reduce_scatter", _check.describe(x), error, **fields)
    if error is not None:
        raise error
    if group.world_size == 1:
        return x
    p, mine = group.world_size, counts[group.rank_in_group]
    moved = x.movedim(dim, 0)  # [sum(sizes), ...]: rank r's rows are block r
    got = rows(group, moved.contiguous(), counts, [mine] * p)  # [P * n_me, ...], rank-major
    stacked = got.view(p, mine, *got.shape[1:])
    if op in ("sum", "mean"):
        out = stacked.any(0) if stacked.dtype == torch.bool else stacked.sum(0, dtype=x.dtype)
        out = out / p if op == "mean" else out
    elif op == "max":
        out = stacked.amax(0)
    elif op == "min":
        out = stacked.amin(0)
    else:  # the product in x's dtype, as the even path's (a bool product is "all")
        out = stacked.all(0) if stacked.dtype == torch.bool else stacked.prod(0, dtype=x.dtype)
    return out.movedim(0, dim)
