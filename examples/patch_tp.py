"""Two models with different tensor-parallel degrees in one job, through patch_tp.

torchrun --nproc-per-node 2 examples/patch_tp.py
"""

from __future__ import annotations

import torch
from torch import nn

import pdist


class ColumnParallelLinear(nn.Module):
    """y = x @ W.T with W's rows split over the context's tp group."""

    def __init__(self, ctx: pdist.DistContext, weight: torch.Tensor) -> None:
        super().__init__()
        self.tp = ctx.tp
        self.weight = nn.Parameter(pdist.shard(self.tp, weight, dim=0, scale_grad=False).detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Local slice of the output columns, then gathered over tp."""
        return pdist.all_gather(self.tp, x @ self.weight.T, dim=-1)  # [N, out]


def main() -> None:
    with pdist.distributed(tp=1) as ctx:
        gen = torch.Generator().manual_seed(0)
        weight = torch.randn(8, 4, generator=gen)
        x = torch.randn(3, 4, generator=gen)
        wide = pdist.new_tp_group(ctx, ctx.world_size)  # every rank holds a shard
        with pdist.patch_tp(ctx, wide) as wide_ctx:
            big = ColumnParallelLinear(wide_ctx, weight)  # TP degree = world size
        small = ColumnParallelLinear(ctx, weight)  # the context's own tp group: degree 1
        assert ctx.tp.world_size == 1  # patch_tp left the original context alone
        for model in (big, small):
            torch.testing.assert_close(model(x), x @ weight.T)
        if pdist.is_rank0(ctx):
            print(
                f"TP degrees {big.tp.world_size} and {small.tp.world_size} give the same output; "
                f"shard sizes {tuple(big.weight.shape)} and {tuple(small.weight.shape)}"
            )
        del big, small


if __name__ == "__main__":
    main()
