"""Expert parallelism: send each token to the ranks of its top-K experts and back.

Experts are spread evenly over the group: expert ``e`` lives on group index
``e // (num_experts // P)``. [`moe_dispatch`][pdist.moe_dispatch] sorts the ``T * K`` (token,
expert) pairs by expert, exchanges the per-expert counts (one small all-to-all
over the CPU group, which also carries any rank's argument error), then moves
the rows with one data all-to-all and regroups them by local expert, the layout
a grouped GEMM wants. [`moe_combine`][pdist.moe_combine] runs the way back with the counts
already known and sums each token's K outputs, weighted. Both are plain
autograd compositions of the differentiable row all-to-all, so tokens, expert
outputs and router weights all get their gradients.
"""

from __future__ import annotations

import attrs
import torch

from . import _check
from ._agree import exchange_counts
from ._errors import RankMismatchError
from ._group import DistContext, Group, as_group
from ._uneven import any_grad, grad_flag, rows

__all__ = ["Counts", "Routed", "moe_combine", "moe_dispatch"]


class Counts(tuple[int, ...]):
    """Rows per local expert: a tuple of ints that also answers ``tolist()``, as a tensor would."""

    __slots__ = ()

    def tolist(self) -> list[int]:
        """The counts as a list."""
        return list(self)


@attrs.frozen(kw_only=True)
class Routed:
    """The rows this rank's experts process, and how to send their outputs back.

    [`moe_dispatch`][pdist.moe_dispatch] returns it and [`moe_combine`][pdist.moe_combine]
    takes it; read ``tokens`` and ``counts``, and hand the rest back unchanged (the type
    is not exported: nothing outside pdist builds one).

    Attributes:
        tokens: ``[N, H]``, grouped by local expert (local expert 0's rows first).
        counts: Rows per local expert, a tuple of ints (``tokens.split(counts)``;
            ``counts.tolist()`` works too).
    """

    tokens: torch.Tensor
    counts: Counts
    group: Group = attrs.field(repr=False)
    order: torch.Tensor = attrs.field(repr=False)  # [T*K]: sorted position -> flat (t, k)
    regroup: torch.Tensor = attrs.field(repr=False)  # [N]: row -> received position
    sent: list[int] = attrs.field(repr=False)  # rows this rank sent each rank
    received: list[int] = attrs.field(repr=False)  # rows each rank sent this rank
    shape: tuple[int, int] = attrs.field(repr=False)  # (T, K)


def _record_width(num_experts: object, p: int) -> int:
    """The counts exchange's record: ``num_experts``, the grad flag, ``E/P`` counts, padded.

    Every rank must send records of one width, and the width follows ``E/P``: ranks
    that disagree on ``num_experts`` would send different sizes, and the exchange
    itself would hang or abort rather than fail together. Rounded up to a power of
    two of at least 16 counts, the width is the same for every ``num_experts`` that
    gives at most 16 experts per rank (and for any two whose experts per rank round
    up to the same power of two above that: 33-64, 65-128, ...), so ``num_experts``
    travels in the record and a difference is seen by every rank.
    """
    local = 0
    if isinstance(num_experts, int) and not isinstance(num_experts, bool) and num_experts > 0:
        local = -(-num_experts // p)  # a bad one (not a multiple) still sends a marker as wide
    return 2 + max(16, 1 << max(local - 1, 0).bit_length())


def _same_num_experts(group: Group, seen: list[int]) -> None:
    """Every rank got every rank's ``num_experts``: raise alike on all if they differ."""
    if len(set(seen)) > 1:
        listed = "; ".join(f"rank {group.ranks[j]}: {e}" for j, e in enumerate(seen))
        msg = (
            f"moe_dispatch on group {group.name!r}: ranks passed different num_experts "
            f"({listed}); pass the same number on every rank"
        )
        raise RankMismatchError(msg)


def _arguments(tokens: object, expert_ids: object, num_experts: object, p: int) -> None:
    """This rank's argument errors (the ones its peers cannot see)."""
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        msg = f"num_experts={num_experts!r} must be a positive int"
        raise TypeError(msg)
    if num_experts % p:
        msg = (
            f"num_experts={num_experts} is not a multiple of the group size {p}; "
            f"experts are spread evenly over the group's ranks"
        )
        raise ValueError(msg)
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2:
        got = f"shape {tuple(tokens.shape)}" if isinstance(tokens, torch.Tensor) else type(tokens)
        msg = f"tokens must be a [T, H] tensor, got {got}"
        raise ValueError(msg)
    if not isinstance(expert_ids, torch.Tensor) or expert_ids.is_floating_point():
        kind = expert_ids.dtype if isinstance(expert_ids, torch.Tensor) else type(expert_ids)
        msg = f"expert_ids must be an integer tensor, got {kind}"
        raise TypeError(msg)
    if expert_ids.is_complex() or expert_ids.dtype == torch.bool:
        msg = f"expert_ids must be an integer tensor, got {expert_ids.dtype}"
        raise TypeError(msg)
    if expert_ids.dim() != 2 or expert_ids.shape[0] != tokens.shape[0]:
        msg = (
            f"expert_ids has shape {tuple(expert_ids.shape)}, but tokens has "
            f"{tokens.shape[0]} rows; expert_ids must be [T, K] for tokens [T, H]"
        )
        raise ValueError(msg)
    bad = (expert_ids < 0) | (expert_ids >= num_experts)
    if expert_ids.numel() and bool(bad.any()):
        row, k = (int(i) for i in bad.nonzero()[0])
        msg = (
            f"expert_ids[{row}, {k}] = {int(expert_ids[row, k])} is out of range for "
            f"num_experts={num_experts}; expert ids must be in [0, {num_experts})"
        )
        raise ValueError(msg)


def moe_dispatch(
    group: Group | DistContext, tokens: torch.Tensor, expert_ids: torch.Tensor, num_experts: int
) -> Routed:
    """Send each token to the ranks holding its experts; return what this rank's experts get.

    Expert ``e`` lives on group index ``e // (num_experts // P)``. A token with
    ``K`` experts travels ``K`` times (once to each; twice to a rank holding two).
    Differentiable in ``tokens``. A rank may have no tokens (``T = 0``), and its
    ``tokens`` need not require grad: whether any rank's tokens need a gradient
    travels with the counts, and then every rank records the backward (its
    ``routed.tokens`` requires grad), so every rank's backward runs its all-to-all.

    Example:
        Experts as one linear layer each:

        ```python
        routed = pdist.moe_dispatch(ctx.ep, x, topk_ids, num_experts=8)
        outs = [experts[i](rows) for i, rows in enumerate(routed.tokens.split(routed.counts))]
        y = pdist.moe_combine(routed, torch.cat(outs), topk_weights)  # [T, H']
        ```

    Note:
        All ranks of the group must call it, with the same ``num_experts``
        and hidden size. One counts exchange and one data all-to-all. The checks
        ride on the counts exchange: an argument error on any rank (ids out of
        range, wrong shapes, ``num_experts`` not a multiple of the group size)
        makes every rank raise it, naming the rank, and so does a different
        ``num_experts`` (it travels in the counts record; its width is the same
        for every ``num_experts`` with at most 16 experts per rank, or whose
        experts per rank round up to the same power of two). The hidden size is
        the caller's to keep equal: check mode (``distributed(check=True)`` or
        ``PDIST_CHECK=1``) compares it, the dtype and ``num_experts`` first, on
        every rank. Every rank calls it in the same grad mode (a rank in
        ``torch.no_grad()`` while another's tokens need a gradient raises on every
        rank), and, when one does, runs the backward (``loss.backward()``) with
        a loss built from ``moe_combine``'s output: on a rank without tokens
        too (``y.sum()`` over its zero rows), since its experts' rows came from
        the others.

    Args:
        group: The expert-parallel group (a context means its world).
        tokens: ``[T, H]``, this rank's tokens.
        expert_ids: ``[T, K]`` integers in ``[0, num_experts)``: each token's experts.
        num_experts: The number of experts, a multiple of the group size.

    Returns:
        What this rank's ``num_experts // P`` experts process, a
        [`Routed`][pdist._moe.Routed]: its ``tokens``, ``[N, H]``, grouped by local
        expert (in each expert's block the rows of rank 0's tokens first, in token
        order), and its ``counts``, the rows per local expert.

    Raises:
        ValueError: ``num_experts`` is not a multiple of the group size, ids out of
            range or wrong shapes, on any rank (on every rank).
        TypeError: ``num_experts`` is not a positive int or ``expert_ids`` not an
            integer tensor, on any rank (on every rank).
        RankMismatchError: The ranks passed different ``num_experts``, or a rank
            called it under ``torch.no_grad()`` while another's tokens require grad
            (or, in check mode, tokens of different widths or dtypes), on every rank.
    """
    g = as_group(group)
    p = g.world_size
    error: BaseException | None = None
    try:
        _arguments(tokens, expert_ids, num_experts, p)
    except (TypeError, ValueError) as e:
        error = e
    rows_of = _check.describe(tokens, rows=True)
    _check.agree_args(g, "moe_dispatch", rows_of, error, num_experts=num_experts)
    width = _record_width(num_experts, p)
    if error is not None:
        exchange_counts(g, None, error, width=width, what="moe_dispatch")  # raises on every rank
    local = num_experts // p
    t, k = expert_ids.shape
    flat = expert_ids.reshape(-1).long()  # [T*K]
    order = torch.argsort(flat, stable=True)  # sorted by expert: by rank, then local expert
    per_expert = torch.bincount(flat, minlength=num_experts).view(p, local).tolist()
    flag = grad_flag(tokens)  # a peer's need for a gradient rides with the counts
    records = [[num_experts, flag, *c, *[0] * (width - 2 - local)] for c in per_expert]
    got = exchange_counts(g, records, None, width=width, what="moe_dispatch")  # [P, width]
    _same_num_experts(g, [r[0] for r in got])
    grad = any_grad(g, [r[1] for r in got], "moe_dispatch")
    got = [r[2 : 2 + local] for r in got]  # [P, local]
    sent, received = [sum(c) for c in per_expert], [sum(c) for c in got]
    # Any rank's tokens need a gradient: every rank records, so every backward runs.
    out = rows(g, tokens[order // k], sent, received, grad=grad)  # [N, H], by rank, expert
    # Regroup the blocks (source j, local expert e) into expert-major order.
    sizes = torch.tensor(got, dtype=torch.int64, device=out.device).view(-1)  # source-major
    blocks = torch.arange(p * local, device=out.device).repeat_interleave(sizes)  # [N]
    regroup = torch.argsort((blocks % local) * p + blocks // local, stable=True)
    counts = Counts(sum(got[j][e] for j in range(p)) for e in range(local))
    return Routed(
        tokens=out[regroup],
        counts=counts,
        group=g,
        order=order,
        regroup=regroup,
        sent=sent,
        received=received,
        shape=(t, k),
    )


def _outputs(routed: Routed, expert_out: object, weights: object) -> None:
    """This rank's errors in ``moe_combine``'s arguments."""
    n, (t, k) = routed.tokens.shape[0], routed.shape
    if not isinstance(expert_out, torch.Tensor) or expert_out.dim() != 2:
        msg = f"expert_out must be an [N, H'] tensor, got {expert_out!r:.80}"
        raise ValueError(msg)
    if expert_out.shape[0] != n:
        msg = (
            f"expert_out has {expert_out.shape[0]} rows on rank {routed.group.rank}, but "
            f"routed.tokens has {n} (sum(routed.counts)); give one output row per routed "
            "row, in its order"
        )
        raise ValueError(msg)
    if weights is not None and (
        not isinstance(weights, torch.Tensor) or tuple(weights.shape) != (t, k)
    ):
        got = tuple(weights.shape) if isinstance(weights, torch.Tensor) else type(weights)
        msg = f"weights has shape {got} on rank {routed.group.rank}, expected [T, K] = {[t, k]}"
        raise ValueError(msg)


def moe_combine(
    routed: Routed, expert_out: torch.Tensor, weights: torch.Tensor | None = None
) -> torch.Tensor:
    """Send the experts' outputs back; each token gets the sum over its K experts.

    Differentiable in ``expert_out`` and ``weights``. One data all-to-all (the
    counts are the dispatch's).

    Note:
        All ranks of the group must call it with the [`Routed`][pdist._moe.Routed] their
        [`moe_dispatch`][pdist.moe_dispatch] returned, and outputs of one width and dtype.

    Note:
        Its backward reaches ``moe_dispatch``'s on every rank whenever the
        dispatch recorded one (any rank's tokens needed a gradient), even where
        ``expert_out`` does not depend on ``routed.tokens``: an expert that got
        no rows may be skipped, and ``expert_out`` built without it (even
        ``torch.zeros(0, H')``, without grad). When no rank's tokens need a
        gradient but the experts train, nothing carries that need: then every
        rank's ``expert_out`` must require grad alike (compute a skipped expert
        on its zero rows instead); check mode compares it.

    Note:
        No counts travel here, so nothing carries a wrong shape to the other
        ranks: the caller vouches for ``expert_out`` (one row per routed row) and
        ``weights``, and a wrong one raises only on its rank while the others wait
        in the data all-to-all. Check mode (``distributed(check=True)`` or
        ``PDIST_CHECK=1``) verifies them first and raises on every rank.

    Args:
        routed: What [`moe_dispatch`][pdist.moe_dispatch] returned on this rank.
        expert_out: ``[N, H']``, one output row per row of ``routed.tokens``, same order.
        weights: ``[T, K]``, each (token, expert) pair's weight (router
            probabilities); None: a plain sum.

    Returns:
        ``[T, H']``: for token ``t``, ``sum_k weights[t, k] * out(expert_ids[t, k])``.

    Raises:
        ValueError: ``expert_out`` or ``weights`` has the wrong shape (on this rank;
            in check mode, on every rank).
        RankMismatchError: In check mode, on every rank: the ranks' ``expert_out``
            differ in width or dtype, or in whether they need the backward.
    """
    n, (t, k) = routed.tokens.shape[0], routed.shape
    error: BaseException | None = None
    try:
        _outputs(routed, expert_out, weights)
    except ValueError as e:
        error = e
    out_rows = _check.describe(expert_out, rows=True)
    needs = torch.is_grad_enabled() and (
        routed.tokens.requires_grad or getattr(expert_out, "requires_grad", False)
    )  # whether this rank records the backward: the ranks must agree (see the Note)
    _check.agree_args(routed.group, "moe_combine", out_rows, error, requires_grad=needs)
    if error is not None:
        raise error
    back = torch.empty_like(routed.regroup)
    back[routed.regroup] = torch.arange(n, device=back.device)
    unsent = expert_out[back]  # by source rank, local expert: as received
    # routed.tokens as the anchor: the backward reaches the dispatch's even where
    # expert_out does not depend on it (an expert skipped for want of rows).
    home = rows(
        routed.group, unsent, routed.received, routed.sent, anchor=routed.tokens
    )  # [T*K, H']
    place = torch.empty_like(routed.order)
    place[routed.order] = torch.arange(t * k, device=place.device)
    per_pair = home[place].view(t, k, *home.shape[1:])  # [T, K, H']
    if weights is None:
        return per_pair.sum(1)
    return (per_pair * weights.unsqueeze(-1).to(per_pair.dtype)).sum(1)
