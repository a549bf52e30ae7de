"""Ulysses sequence parallelism on SDPA's [B, H, S, D] layout, checked against one process.

A causal self-attention block, written as transformers writes it (heads before
the sequence), runs with its sequence split over ``ctx.sp``: each rank holds
``S / P`` positions, ``pdist.ulysses_attention`` trades them for ``H / P``
heads over the full sequence around ``scaled_dot_product_attention``, and
``wrap_ddp`` averages the weight gradients over dp x sp. Outputs and gradients
equal those of the same block on the whole sequence in one process.

torchrun --nproc-per-node 2 examples/ulysses_attention.py   (or plain python: one rank)
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional

import pdist

B, S, DIM, HEADS = 2, 16, 32, 4  # batch, sequence, model width, heads (P must divide S and HEADS)


class SelfAttention(nn.Module):
    """Causal self-attention; ``attention`` takes and returns ``[B, H, S, D]``."""

    def __init__(self, attention: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        torch.manual_seed(0)  # the same weights on every rank and in the reference
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.attention = attention

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        b, s, _ = x.shape  # [B, S_local, DIM]
        qkv = self.qkv(x).view(b, s, 3, HEADS, DIM // HEADS)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # 3 x [B, H, S_local, D]
        out = self.attention(q, k, v, is_causal=True)  # [B, H, S_local, D]
        return self.proj(out.transpose(1, 2).reshape(b, s, DIM))


def main() -> None:
    # One sequence-parallel group over the whole job (1 rank under plain python).
    with pdist.distributed(sp=int(os.environ.get("WORLD_SIZE", "1"))) as ctx:
        p, r = ctx.sp.world_size, ctx.sp.rank_in_group
        gen = torch.Generator().manual_seed(1)
        x, target = torch.randn(B, S, DIM, generator=gen), torch.randn(B, S, DIM, generator=gen)
        mine = slice(r * S // p, (r + 1) * S // p)  # this rank's chunk of the sequence

        # The group travels inside the attention function: no module-level global.
        sdpa = pdist.ulysses_attention(ctx.sp, functional.scaled_dot_product_attention)
        model = pdist.wrap_ddp(ctx, SelfAttention(sdpa))  # averages over dp x sp
        out = model(x[:, mine])  # [B, S/P, DIM]
        functional.mse_loss(out, target[:, mine]).backward()

        reference = SelfAttention(functional.scaled_dot_product_attention)
        expected = reference(x)  # [B, S, DIM], the whole sequence in one process
        functional.mse_loss(expected, target).backward()

        torch.testing.assert_close(out, expected[:, mine])
        for got, ref in zip(model.module.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(got.grad, ref.grad)
        error = (out - expected[:, mine]).abs().max()
        worst = pdist.all_reduce(ctx.sp, error.detach().reshape(1), op="max").item()
        if pdist.is_rank0(ctx):
            print(
                f"Ulysses attention over {p} rank(s) matches one process: outputs and "
                f"gradients (max output error {worst:.2e})"
            )
        del model  # release DDP's process group before the context exits


if __name__ == "__main__":
    main()
