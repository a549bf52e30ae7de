"""Expert parallelism: send each token to the ranks of its top-K experts and back.

Experts are spread evenly over the group: expert ``e`` lives on group index
``e // (num_experts // P)``. :func:`moe_dispatch` sorts the ``T * K`` (token,
expert) pairs by expert, exchanges the per-expert counts (one small all-to-all
over the CPU group, which also carries any rank's argument error), then moves
the rows with one data all-to-all and regroups them by local expert, the layout
a grouped GEMM wants. :func:`moe_combine` runs the way back with the counts
already known and sums each token's K outputs, weighted. Both are plain
autograd compositions of the differentiable row all-to-all, so tokens, expert
outputs and router weights all get their gradients.
"""

from __future__ import annotations

import attrs
import torch

from ._group import DistContext, Group, as_group
from ._uneven import exchange, rows

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


def _check(tokens: object, expert_ids: object, num_experts: int) -> None:
    """This rank's argument errors (the ones its peers cannot see)."""
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
    Differentiable in ``tokens``. A rank may have no tokens (``T = 0``).

    Example (experts as one linear layer each)::

        routed = pdist.moe_dispatch(ctx.ep, x, topk_ids, num_experts=8)
        outs = [experts[i](rows) for i, rows in enumerate(routed.tokens.split(routed.counts))]
        y = pdist.moe_combine(routed, torch.cat(outs), topk_weights)  # [T, H']

    Note:
        All ranks of the group must call it, with the same ``num_experts``
        and hidden size. One counts exchange and one data all-to-all; an argument
        error on any rank (ids out of range, wrong shapes) makes every rank raise
        it, naming the rank.

    Args:
        group: The expert-parallel group (a context means its world).
        tokens: ``[T, H]``, this rank's tokens.
        expert_ids: ``[T, K]`` integers in ``[0, num_experts)``: each token's experts.
        num_experts: The number of experts, a multiple of the group size.

    Returns:
        A :class:`Routed`: ``tokens`` ``[N, H]`` for this rank's
        ``num_experts // P`` experts, grouped by local expert (in each expert's
        block the rows of rank 0's tokens first, in token order), and ``counts``.

    Raises:
        ValueError: ``num_experts`` is not a positive multiple of the group size (at
            once); ids out of range or wrong shapes on any rank (on every rank).
        TypeError: ``expert_ids`` is not an integer tensor (on every rank).
    """
    g = as_group(group)
    p = g.world_size
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        msg = f"num_experts={num_experts!r} must be a positive int"
        raise TypeError(msg)
    if num_experts % p:
        msg = (
            f"num_experts={num_experts} is not a multiple of the group size {p}; "
            f"experts are spread evenly over the group's ranks"
        )
        raise ValueError(msg)
    local = num_experts // p
    error: BaseException | None = None
    try:
        _check(tokens, expert_ids, num_experts)
    except (TypeError, ValueError) as e:
        error = e
    if error is not None:
        exchange(g, None, error, width=local, what="moe_dispatch")  # raises on every rank
    t, k = expert_ids.shape
    flat = expert_ids.reshape(-1).long()  # [T*K]
    order = torch.argsort(flat, stable=True)  # sorted by expert: by rank, then local expert
    per_expert = torch.bincount(flat, minlength=num_experts).view(p, local).tolist()
    got = exchange(g, per_expert, None, width=local, what="moe_dispatch")  # [P, local]
    sent, received = [sum(c) for c in per_expert], [sum(c) for c in got]
    out = rows(g, tokens[order // k], sent, received)  # [N, H], by source rank, local expert
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


def moe_combine(
    routed: Routed, expert_out: torch.Tensor, weights: torch.Tensor | None = None
) -> torch.Tensor:
    """Send the experts' outputs back; each token gets the sum over its K experts.

    Differentiable in ``expert_out`` and ``weights``. One data all-to-all (the
    counts are the dispatch's).

    Note:
        All ranks of the group must call it with the :class:`Routed` their
        :func:`moe_dispatch` returned.

    Args:
        routed: What :func:`moe_dispatch` returned on this rank.
        expert_out: ``[N, H']``, one output row per row of ``routed.tokens``, same order.
        weights: ``[T, K]``, each (token, expert) pair's weight (router
            probabilities); None: a plain sum.

    Returns:
        ``[T, H']``: for token ``t``, ``sum_k weights[t, k] * out(expert_ids[t, k])``.

    Raises:
        ValueError: ``expert_out`` or ``weights`` has the wrong shape (on this rank).
    """
    n, (t, k) = routed.tokens.shape[0], routed.shape
    if not isinstance(expert_out, torch.Tensor) or expert_out.dim() != 2:
        msg = f"expert_out must be an [N, H'] tensor, got {expert_out!r:.80}"
        raise ValueError(msg)
    if expert_out.shape[0] != n:
        msg = (
            f"expert_out has {expert_out.shape[0]} rows on rank {routed.group.rank}, but "
            f"routed.tokens has {n}; give one output row per routed row, in its order"
        )
        raise ValueError(msg)
    if weights is not None and tuple(weights.shape) != (t, k):
        msg = f"weights has shape {tuple(weights.shape)}, expected [T, K] = {[t, k]}"
        raise ValueError(msg)
    back = torch.empty_like(routed.regroup)
    back[routed.regroup] = torch.arange(n, device=back.device)
    unsent = expert_out[back]  # by source rank, local expert: as received
    home = rows(routed.group, unsent, routed.received, routed.sent)  # [T*K, H'], sorted by expert
    place = torch.empty_like(routed.order)
    place[routed.order] = torch.arange(t * k, device=place.device)
    per_pair = home[place].view(t, k, *home.shape[1:])  # [T, K, H']
    if weights is None:
        return per_pair.sum(1)
    return (per_pair * weights.unsqueeze(-1).to(per_pair.dtype)).sum(1)
