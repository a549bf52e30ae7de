"""moe_dispatch / moe_combine: expert parallelism equals one process running every expert."""

from __future__ import annotations

import os
import time

import pytest
import torch

import pdist
from pdist.testing import spawn, world_sizes

E, K, H, OUT = 6, 2, 4, 3
TOKENS = [5, 0, 7]  # rank 1 routes nothing


def _rank_inputs(rank: int):
    """Rank ``rank``'s tokens, top-K expert ids and router weights (computable anywhere)."""
    gen = torch.Generator().manual_seed(rank)
    t = TOKENS[rank]
    tokens = torch.randn(t, H, generator=gen)
    ids = torch.stack(
        [torch.randperm(E, generator=gen)[:K] for _ in range(t)]
        or [torch.zeros(0, K, dtype=torch.int64)]
    ).view(t, K)
    weights = torch.rand(t, K, generator=gen)
    return tokens, ids, weights


def _experts():
    """One linear layer per expert, the same on every rank."""
    return [torch.randn(H, OUT, generator=torch.Generator().manual_seed(100 + e)) for e in range(E)]


def _reference(tokens, ids, weights, experts):
    """Every token through its K experts, weighted, on one process."""
    out = torch.zeros(tokens.shape[0], OUT)
    for t in range(tokens.shape[0]):
        for k in range(K):
            out[t] += weights[t, k] * (tokens[t] @ experts[int(ids[t, k])])
    return out


@world_sizes(1, 3)
def test_moe_layer_matches_one_process(ctx):
    """Outputs and the gradients of tokens, router weights and every expert equal one process."""
    r, p = ctx.rank, ctx.world_size
    local = E // p
    mine = [w.clone().requires_grad_() for w in _experts()[r * local : (r + 1) * local]]
    tokens, ids, weights = (t.clone() for t in _rank_inputs(r))
    tokens.requires_grad_()
    weights.requires_grad_()

    routed = pdist.moe_dispatch(ctx, tokens, ids, E)
    assert len(routed.counts) == local
    assert sum(routed.counts) == routed.tokens.shape[0]
    outs = [rows @ w for rows, w in zip(routed.tokens.split(routed.counts), mine, strict=True)]
    y = pdist.moe_combine(routed, torch.cat(outs), weights)
    target = torch.randn(y.shape, generator=torch.Generator().manual_seed(50 + r))
    (y * target).sum().backward()

    experts = [w.clone().requires_grad_() for w in _experts()]
    inputs = [
        [t.clone().requires_grad_(t.is_floating_point()) for t in _rank_inputs(i)] for i in range(p)
    ]
    total = 0
    for i, (tok, ide, wei) in enumerate(inputs):
        ref = _reference(tok, ide, wei, experts)
        if i == r:
            torch.testing.assert_close(y, ref)
        total = (
            total
            + (ref * torch.randn(ref.shape, generator=torch.Generator().manual_seed(50 + i))).sum()
        )
    total.backward()
    for got, ref in ((tokens, inputs[r][0]), (weights, inputs[r][2])):
        # No tokens: the loop above never touches the reference's, whose grad stays None.
        torch.testing.assert_close(
            got.grad, torch.zeros_like(ref) if ref.grad is None else ref.grad
        )
    for e, w in enumerate(mine):
        torch.testing.assert_close(w.grad, experts[r * local + e].grad)
    # Routed.tokens holds, per local expert, every rank's rows for it in rank and token order.
    first = torch.cat(
        [_rank_inputs(i)[0][(_rank_inputs(i)[1] == r * local).any(1)] for i in range(p)]
    )
    torch.testing.assert_close(routed.tokens[: routed.counts[0]], first)
    assert routed.counts.tolist() == list(routed.counts)
    plain = pdist.moe_combine(routed, torch.cat(outs).detach())  # no weights: a plain sum
    assert plain.shape == (TOKENS[r], OUT)


@world_sizes(3)
def test_moe_bad_expert_id_raises_on_every_rank(ctx):
    """An out-of-range id on one rank makes every rank raise the same error, then all go on."""
    tokens, ids, _ = _rank_inputs(ctx.rank)
    out_of_range = ids.clone()
    if ctx.rank == 2:
        out_of_range[3, 1] = 9
    start = time.monotonic()
    with pytest.raises(
        ValueError, match=r"failed on rank 2: ValueError: expert_ids\[3, 1\] = 9 is out of range"
    ):
        pdist.moe_dispatch(ctx, tokens, out_of_range, E)
    assert time.monotonic() - start < 15
    with pytest.raises(ValueError, match="num_experts=7 is not a multiple of the group size 3"):
        pdist.moe_dispatch(ctx, tokens, ids, 7)
    bad_dtype = ids.float() if ctx.rank == 0 else ids
    with pytest.raises(
        TypeError, match="failed on rank 0: TypeError: expert_ids must be an integer"
    ):
        pdist.moe_dispatch(ctx, tokens, bad_dtype, E)
    pdist.barrier(ctx)


def _different_num_experts(check: str) -> float:
    os.environ["PDIST_CHECK"] = check
    with pdist.distributed() as ctx:
        tokens, ids, _ = _rank_inputs(ctx.rank)
        start = time.monotonic()
        with pytest.raises(pdist.RankMismatchError, match="num_experts"):
            pdist.moe_dispatch(ctx, tokens, ids, 9 if ctx.rank == 1 else E)
        seconds = time.monotonic() - start
        pdist.barrier(ctx)
        return seconds


@pytest.mark.parametrize("check", ["0", "1"])
def test_different_num_experts_raise_on_every_rank(check):
    """num_experts travels in the counts record: a rank's other number raises on all, no wait."""
    for seconds in spawn(_different_num_experts, 3, check, timeout=90):
        assert seconds < 15


def _sparse_inputs(rank: int, p: int):
    """Rank 0 has no tokens (no grad); no token picks the last rank's experts."""
    gen = torch.Generator().manual_seed(rank)
    t = 0 if rank == 0 else 3 + rank
    ids = torch.zeros(t, K, dtype=torch.int64)
    for row in ids:
        row.copy_(torch.randperm(2 * p - 2, generator=gen)[:K])
    return torch.randn(t, H, generator=gen), ids.view(t, K), torch.rand(t, K, generator=gen)


def _skipping_layer(ctx, tokens, ids, weights, mine):
    """Mixtral's way: an expert that got no rows is skipped (its rank may compute nothing)."""
    routed = pdist.moe_dispatch(ctx, tokens, ids, 2 * ctx.world_size)
    parts = routed.tokens.split(routed.counts)
    outs = [rows @ w for rows, w in zip(parts, mine, strict=True) if rows.shape[0]]
    expert_out = torch.cat(outs) if outs else torch.zeros(0, OUT)  # no grad, no routed.tokens
    return pdist.moe_combine(routed, expert_out, weights)


def _zero_tokens_and_skipped_experts(ctx) -> None:
    r, p = ctx.rank, ctx.world_size
    experts = [
        torch.randn(H, OUT, generator=torch.Generator().manual_seed(100 + e)) for e in range(2 * p)
    ]
    mine = [w.clone().requires_grad_() for w in experts[2 * r : 2 * r + 2]]
    tokens, ids, weights = _sparse_inputs(r, p)
    if r:  # rank 0's zeros(0, H) needs no gradient, as a data loader's empty batch
        tokens.requires_grad_()
        weights.requires_grad_()
    start = time.monotonic()
    y = _skipping_layer(ctx, tokens, ids, weights, mine)
    target = torch.randn(y.shape, generator=torch.Generator().manual_seed(50 + r))
    (y * target).sum().backward()  # on rank 0, a sum over zero rows: still from y
    assert time.monotonic() - start < 20

    refs = [w.clone().requires_grad_() for w in experts]
    inputs = [
        [t.clone().requires_grad_(t.is_floating_point()) for t in _sparse_inputs(i, p)]
        for i in range(p)
    ]
    total = sum(
        (
            _reference(tok, ide, wei, refs)
            * torch.randn(tok.shape[0], OUT, generator=torch.Generator().manual_seed(50 + i))
        ).sum()
        for i, (tok, ide, wei) in enumerate(inputs)
    )
    torch.testing.assert_close(y, _reference(*inputs[r], refs).detach())
    total.backward()
    if r:
        torch.testing.assert_close(tokens.grad, inputs[r][0].grad)
        torch.testing.assert_close(weights.grad, inputs[r][2].grad)
    for w, ref in zip(mine, refs[2 * r : 2 * r + 2], strict=True):
        zero = torch.zeros(H, OUT)  # a skipped expert: no gradient on either side
        torch.testing.assert_close(
            w.grad if w.grad is not None else zero, ref.grad if ref.grad is not None else zero
        )


@world_sizes(2, 3, timeout=60)
def test_zero_token_rank_and_skipped_experts_backward_on_every_rank(ctx):
    """A rank without tokens and a rank whose experts got no rows: every backward runs."""
    _zero_tokens_and_skipped_experts(ctx)


def _unchecked(fn) -> None:
    os.environ["PDIST_CHECK"] = "0"
    with pdist.distributed() as ctx:
        fn(ctx)


def test_zero_token_rank_backward_without_check_mode():
    """Check mode off, the need for a gradient still rides on the counts exchange."""
    spawn(_unchecked, 3, _zero_tokens_and_skipped_experts, timeout=60)


@world_sizes(3, timeout=60)
def test_frozen_tokens_with_a_skipped_expert_raise_in_check_mode(ctx):
    """No rank's tokens need a gradient: a skipped expert's rank differs, check mode says so."""
    r, p = ctx.rank, ctx.world_size
    mine = [torch.randn(H, OUT).requires_grad_() for _ in range(2)]
    tokens, ids, weights = _sparse_inputs(r, p)  # none requires grad; rank 2 gets no rows
    with pytest.raises(pdist.RankMismatchError, match="requires_grad=False"):
        _skipping_layer(ctx, tokens, ids, weights, mine)
    pdist.barrier(ctx)
