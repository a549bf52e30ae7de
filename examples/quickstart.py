"""Quickstart: print each rank's groups, then run two collectives (an all-reduce, a barrier).

Run it with ``torchrun --nproc-per-node 2 examples/quickstart.py`` or as plain
``python examples/quickstart.py`` (a one-rank world).
"""

from __future__ import annotations

import torch

import pdist


def main() -> None:
    with pdist.distributed() as ctx:
        groups = ", ".join(
            f"{name}={getattr(ctx, name).ranks}" for name in ("world", "node", "tp", "sp", "dp")
        )
        print(f"rank {ctx.rank}/{ctx.world_size} on {ctx.device} ({ctx.backend}): {groups}")
        total = pdist.all_reduce(ctx, torch.ones(1, device=ctx.device))  # every rank: [W]
        pdist.barrier(ctx)
        if pdist.is_rank0(ctx):
            hosts = len(ctx.world.ranks) // ctx.node.world_size
            print(f"all_reduce of ones: {total.item():g} (world {ctx.world_size}); hosts: {hosts}")


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
