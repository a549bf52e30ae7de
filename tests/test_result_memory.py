"""Received results own their memory: a small tensor does not keep its whole receive slab alive."""

from __future__ import annotations

import torch

import pdist
from pdist.testing import world_sizes

BIG = 1 << 20  # elements: 4 MiB of fp32, in the same bucket as the small tensor
SMALL = 300


def _keeps(t: torch.Tensor) -> int:
    """How many bytes ``t`` keeps alive: its storage's."""
    return t.untyped_storage().nbytes()


@world_sizes(2, 3)
def test_a_small_received_tensor_keeps_only_its_own_memory(ctx):
    """broadcast_object_list / broadcast_object: the small tensor's storage is about its size."""
    src = ctx.world_size - 1
    big, small = torch.arange(float(BIG)), torch.arange(float(SMALL))
    items = [{"big": big, "small": small}] if ctx.rank == src else [None]
    pdist.broadcast_object_list(ctx, items, src=src)
    got = pdist.broadcast_object(
        ctx, {"big": big, "small": small} if ctx.rank == src else None, src=src
    )
    for received in (items[0], got):
        assert torch.equal(received["big"], big)
        assert torch.equal(received["small"], small)
        if ctx.rank != src:
            assert _keeps(received["small"]) <= 4 * SMALL * 4, _keeps(received["small"])
            assert _keeps(received["big"]) <= 2 * BIG * 4  # a large one stays a view: no copy
