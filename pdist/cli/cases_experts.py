"""The bench cases of counts-driven exchanges: all_to_all, MoE routing, uneven Ulysses."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.nn import functional

import pdist
from pdist import DistContext

from .bench import Case, Fns

__all__ = ["EXPERT_CASES"]

Stack = contextlib.ExitStack


def _uneven_counts(rows: int, world: int) -> list[list[int]]:
    """``counts[i][j]``: rows rank ``i`` sends rank ``j``, uneven (weights 1..P, rotated)."""
    out = []
    for i in range(world):
        weights = [1 + (i + j) % world for j in range(world)]
        row = [rows * w // sum(weights) for w in weights]
        row[-1] += rows - sum(row)
        out.append(row)
    return out


def _all_to_all(ctx: DistContext, stack: Stack) -> Fns:
    """all_to_all of 4000 x 1024 floats with uneven counts vs dist.all_to_all_single."""
    r, world, pg = ctx.rank, ctx.world_size, ctx.world.device_group
    counts = _uneven_counts(4000, world)
    send, recv = counts[r], [counts[j][r] for j in range(world)]
    x = torch.ones(4000, 1024, device=ctx.device)

    def torch_fresh() -> None:
        out = x.new_empty(sum(recv), 1024)  # a fresh result, as pdist returns
        dist.all_to_all_single(out, x, recv, send, group=pg)

    return {
        "pdist": lambda: pdist.all_to_all(ctx, x, send, recv),
        "pdist_exchanged_counts": lambda: pdist.all_to_all(ctx, x, send),
        "torch_all_to_all_single": torch_fresh,
    }


def _moe(ctx: DistContext, stack: Stack) -> Fns:
    """moe_dispatch + moe_combine (8 experts, top-2, 4096 x 256) vs a plain-torch reference."""
    world, pg, experts, k = ctx.world_size, ctx.world.device_group, 8, 2
    local = experts // world
    gen = torch.Generator().manual_seed(ctx.rank)
    x = torch.randn(4096, 256, generator=gen).to(ctx.device)
    ids = torch.rand(4096, experts, generator=gen).topk(k, dim=1).indices.to(ctx.device)
    w = torch.rand(4096, k, generator=gen).to(ctx.device)

    def ours() -> torch.Tensor:
        routed = pdist.moe_dispatch(ctx, x, ids, experts)
        return pdist.moe_combine(routed, routed.tokens, w)  # the identity as the experts

    def reference() -> torch.Tensor:
        # argsort, counts all-to-all, two data all-to-alls, regroup by local expert, index back.
        flat = ids.view(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=experts)
        got_counts = torch.empty_like(counts)
        dist.all_to_all_single(got_counts, counts, group=pg)
        send = counts.view(world, local).sum(1).tolist()
        recv = got_counts.view(world, local).sum(1).tolist()
        got = x.new_empty(sum(recv), x.shape[1])
        dist.all_to_all_single(got, x[order // k], recv, send, group=pg)
        blocks = torch.arange(world * local, device=x.device).repeat_interleave(got_counts)
        perm = torch.argsort((blocks % local) * world + blocks // local, stable=True)
        grouped = got[perm]
        back = torch.empty_like(got)
        back[perm] = grouped
        home = x.new_empty(flat.numel(), x.shape[1])
        dist.all_to_all_single(home, back, send, recv, group=pg)
        out = torch.empty_like(home)
        out[order] = home
        return (out.view(-1, k, x.shape[1]) * w.unsqueeze(-1)).sum(1)

    return {"pdist": ours, "torch_reference": reference}


def _ulysses(ctx: DistContext, stack: Stack) -> Fns:
    """ulysses_attention on uneven chunks vs the same call on even chunks of the same total."""
    world, total, heads = ctx.world_size, 1024, 8
    even = [total // world] * world
    even[-1] += total - sum(even)
    uneven = [n + (40 if j % 2 == 0 else -40) for j, n in enumerate(even)]
    uneven[-1] += total - sum(uneven)
    sdpa = pdist.ulysses_attention(ctx, functional.scaled_dot_product_attention)

    def qkv(n: int) -> list[torch.Tensor]:
        return [torch.randn(1, heads, n, 64, device=ctx.device) for _ in range(3)]

    ours, theirs = qkv(uneven[ctx.rank]), qkv(even[ctx.rank])
    return {
        "pdist": lambda: sdpa(*ours, is_causal=True),
        "even_chunks": lambda: sdpa(*theirs, is_causal=True),
    }


EXPERT_CASES = [
    Case("all_to_all 4000 x 1024 uneven", 4000 * 1024 * 4, _all_to_all, 3),
    Case("moe_dispatch+combine 8 experts top-2 4096 x 256", 4096 * 2 * 256 * 4, _moe, 3),
    Case("ulysses_attention uneven 1024 x 8 heads", 3 * 1024 * 8 * 64 * 4, _ulysses, 3),
]
