"""Load a checkpoint on rank 0 only, then give every rank the same weights with sync_model_states.

torchrun --nproc-per-node 2 examples/checkpoint_sync.py
"""

from __future__ import annotations

import os
import tempfile

import torch
from torch import nn

import pdist


def build() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))


@pdist.rank0_first
def write_checkpoint(ctx: pdist.DistContext, path: str) -> None:
    # Rank 0 produces the file; the other ranks wait, then find it there.
    if ctx.rank == 0 and not os.path.exists(path):
        torch.manual_seed(1234)
        torch.save(build().state_dict(), path)


@pdist.rank0_only
def load_checkpoint(ctx: pdist.DistContext, model: nn.Module, path: str) -> None:
    model.load_state_dict(torch.load(path, weights_only=True))


def main() -> None:
    with pdist.distributed() as ctx:
        path = os.path.join(tempfile.gettempdir(), f"pdist-example-{os.getppid()}.pt")
        write_checkpoint(ctx, path)
        torch.manual_seed(ctx.rank)  # every rank starts from different weights
        model = build()
        load_checkpoint(ctx, model, path)  # only rank 0 reads the file
        pdist.sync_model_states(ctx, model, src=0)
        checksum = sum(
            t.double().sum().item() for t in model.state_dict().values() if t.is_floating_point()
        )
        checksums = pdist.all_gather_object(ctx, checksum)
        assert len(set(checksums)) == 1, checksums
        pdist.barrier(ctx)
        if pdist.is_rank0(ctx):
            os.unlink(path)
            print(f"all {ctx.world_size} ranks hold rank 0's checkpoint (checksum {checksum:.4f})")


if __name__ == "__main__":
    main()
