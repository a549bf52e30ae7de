"""EvalSampler and collate_batches: dataset order restored, mismatches fail together."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

import pdist
from pdist.testing import count_collectives, world_sizes


class Dataset:
    """Sample i is (i, i * 10 + [0, 1, 2]) so order is checkable."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int):
        return {"index": torch.tensor(i), "feat": torch.arange(3.0) + 10 * i}


def _expected(size: int):
    return {
        "index": torch.arange(size),
        "feat": torch.arange(3.0).repeat(size, 1) + 10 * torch.arange(size).unsqueeze(1),
    }


@world_sizes(1, 2, 3, 4)
def test_order_restored_for_every_size(ctx):
    """Sizes 0..20, smaller than the world included, come back in dataset order on every rank."""
    for size in range(21):
        for batch_size in (1, 3):
            sampler = pdist.EvalSampler(Dataset(size), ctx)
            loader = DataLoader(Dataset(size), batch_size=batch_size, sampler=sampler)
            assert len(sampler) == len(range(ctx.rank, size, ctx.world_size))
            # Every index exactly once across ranks, no padding.
            seen = [i for part in pdist.all_gather_object(ctx, list(sampler)) for i in part]
            assert sorted(seen) == list(range(size))
            batches = [{"out": b["feat"] * 2, "meta": [b["index"]]} for b in loader]
            result = pdist.collate_batches(ctx, batches)
            if size == 0:
                assert result is None
                continue
            expected = _expected(size)
            assert torch.equal(result["out"], expected["feat"] * 2), (size, batch_size)
            assert torch.equal(result["meta"][0], expected["index"])
            # A plain tensor per batch comes back as one tensor.
            plain = pdist.collate_batches(ctx, [b["index"] for b in loader])
            assert torch.equal(plain, expected["index"])


@world_sizes(3)
def test_rank_with_no_batches_still_gets_everything(ctx):
    """A rank passing [] receives the full, ordered result."""
    size = 2  # rank 2 gets no index
    sampler = pdist.EvalSampler(Dataset(size), ctx)
    batches = [Dataset(size)[i]["feat"].unsqueeze(0) for i in sampler]
    assert (batches == []) == (ctx.rank == 2)
    result = pdist.collate_batches(ctx, batches)
    assert torch.equal(result, _expected(size)["feat"])


def _batches(ctx, size=7):
    sampler = pdist.EvalSampler(Dataset(size), ctx)
    return [Dataset(size)[i] for i in sampler]


def _stack(items):
    return [{k: v.unsqueeze(0) for k, v in item.items()} for item in items]


@world_sizes(2, 3)
def test_mismatches_raise_on_every_rank(ctx):
    """Different keys, trailing shapes, dtypes or impossible counts raise RankMismatchError."""
    odd = ctx.rank == 1
    base = _stack(_batches(ctx))

    keys = [{("other" if odd and k == "feat" else k): v for k, v in b.items()} for b in base]
    with pytest.raises(pdist.RankMismatchError, match=r"structure \(leaves\) differs.*rank 1"):
        pdist.collate_batches(ctx, keys)

    shapes = [{**b, "feat": torch.zeros(1, 4) if odd else b["feat"]} for b in base]
    with pytest.raises(
        pdist.RankMismatchError,
        match=r"trailing shape of leaf \['feat'\] differs.*\(4,\) on rank 1",
    ):
        pdist.collate_batches(ctx, shapes)

    dtypes = [{**b, "index": b["index"].int() if odd else b["index"]} for b in base]
    with pytest.raises(
        pdist.RankMismatchError, match=r"dtype of leaf \['index'\] differs.*int32 on rank 1"
    ):
        pdist.collate_batches(ctx, dtypes)

    counts = base + (base[:2] if odd else [])
    with pytest.raises(pdist.RankMismatchError, match="not what EvalSampler gives"):
        pdist.collate_batches(ctx, counts)

    malformed = [{"a": torch.zeros(2), "b": torch.zeros(3)}] if odd else [{"a": torch.zeros(1)}]
    with pytest.raises(pdist.PdistError, match=r"different sample counts \[2, 3\] \(on rank 1\)"):
        pdist.collate_batches(ctx, malformed)
    # Still in step.
    assert pdist.all_reduce(ctx, torch.ones(1)).item() == ctx.world_size


@world_sizes(2)
def test_collectives_independent_of_the_number_of_leaves(ctx):
    """One metadata exchange plus one gather per transport, for 1 or 64 leaves."""
    counts = []
    for leaves in (1, 64):
        batch = {f"k{i}": torch.full((3, 2), float(i)) for i in range(leaves)}
        batch["mask"] = torch.ones(3, dtype=torch.bool)
        with count_collectives() as calls:
            out = pdist.collate_batches(ctx, [batch])
        assert out["k0"].shape == (6, 2)
        counts.append(sum(calls.values()))
    assert counts[0] == counts[1]
    assert counts[0] <= 3 + 2  # at most 3 + the number of dtypes


@world_sizes(2)
def test_bad_batches_argument(ctx):
    """batches must be a list."""
    with pytest.raises(TypeError, match="batches must be a list"):
        pdist.collate_batches(ctx, torch.zeros(3))


@world_sizes(2, 3)
def test_large_outputs_take_the_pipelined_path(ctx):
    """Leaves above 1 MiB in all travel in two overlapped gathers; order is still restored."""
    size = 3001
    sampler = pdist.EvalSampler(range(size), ctx)
    indices = torch.tensor(list(sampler))
    batches = [
        {f"leaf{k}": (chunk.float().unsqueeze(1) + k).repeat(1, 64) for k in range(6)}
        | {"index": chunk}
        for chunk in indices.split(400)
    ]
    with count_collectives() as calls:
        out = pdist.collate_batches(ctx, batches)
    assert sum(calls.values()) == 3  # metadata + two pipelined gathers
    assert torch.equal(out["index"], torch.arange(size))
    for k in range(6):
        assert torch.equal(
            out[f"leaf{k}"], (torch.arange(size).float().unsqueeze(1) + k).repeat(1, 64)
        )
