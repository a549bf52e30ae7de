"""Sequence-parallel (Ulysses) attention with all_to_all_4d, checked against one-rank attention.

torchrun --nproc-per-node 2 examples/sequence_parallel.py
"""

from __future__ import annotations

import torch
from torch.nn import functional

import pdist

B, S, H, D = 2, 16, 4, 8  # batch, sequence, heads, head dim


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    # [B, S, H, D] in and out; SDPA wants heads before the sequence.
    out = functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    )
    return out.transpose(1, 2)


def main() -> None:
    with pdist.distributed() as ctx:
        sp = ctx.world  # the whole world is one sequence-parallel group here
        p, r = sp.world_size, sp.rank_in_group
        gen = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(B, S, H, D, generator=gen) for _ in range(3))  # same on every rank
        chunk = S // p
        local = [t[:, r * chunk : (r + 1) * chunk] for t in (q, k, v)]  # [B, S/P, H, D]
        # Trade sequence chunks for head chunks: [B, S/P, H, D] -> [B, S, H/P, D].
        heads = [pdist.all_to_all_4d(sp, t, scatter_dim=2, gather_dim=1) for t in local]
        out = attention(*heads)  # full sequence, this rank's heads
        out = pdist.all_to_all_4d(sp, out, scatter_dim=1, gather_dim=2)  # back to [B, S/P, H, D]
        reference = attention(q, k, v)[:, r * chunk : (r + 1) * chunk]
        error = (out - reference).abs().max().item()
        assert error < 1e-5, error
        worst = pdist.all_reduce(sp, torch.tensor([error]), op="max").item()
        if pdist.is_rank0(ctx):
            print(
                f"sequence-parallel attention over {p} ranks matches one rank "
                f"(max error {worst:.2e})"
            )


if __name__ == "__main__":
    main()
