"""EvalSampler and collate_batches: dataset order restored, mismatches fail together."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from fail_together import Case, assert_failed_together, out_of_memory, run_case
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
    with pytest.raises(
        pdist.PdistError, match=r"failed on rank 1: ValueError: .* different sample counts \[2, 3\]"
    ):
        pdist.collate_batches(ctx, malformed)
    # Still in step.
    assert pdist.all_reduce(ctx, torch.ones(1)).item() == ctx.world_size


def _nested() -> torch.Tensor:
    with warnings.catch_warnings():  # torch warns that nested tensors are a prototype
        warnings.simplefilter("ignore", UserWarning)
        return torch.nested.nested_tensor([torch.zeros(1, 2), torch.zeros(2, 2)])


MALFORMED = {
    "keys": (
        [{"a": torch.zeros(1)}, {"b": torch.zeros(1)}],
        r"failed on rank 1: ValueError: batch 1 has another structure than batch 0",
    ),
    "leaf type": (
        [{"a": torch.zeros(1)}, {"a": [1.0]}],
        r"batch 1 has another structure than batch 0",
    ),
    "0-d": ([torch.zeros(2), torch.tensor(1.0)], r"batch 1 has a 0-d tensor"),
    "dtype": (
        [{"a": torch.zeros(1)}, {"a": torch.zeros(1, dtype=torch.int64)}],
        r"leaf \['a'\] is torch.int64 \(\) in batch 1 but torch.float32 \(\) in batch 0",
    ),
    "not a tensor": ([{"a": "text"}], r"\['a'\] is a str; batches hold tensors"),
    "key": ([{object: torch.zeros(1)}], r"has the key <class 'object'> \(type\); keys travel"),
    "sparse": (
        [{"a": torch.zeros(1, 2).to_sparse()}],
        r"leaf \['a'\] of batch 0 is a torch.sparse_coo tensor; .* pass .to_dense\(\)",
    ),
    "nested": ([{"a": _nested()}], r"leaf \['a'\] of batch 0 is a nested tensor; pad it"),
    "nested later": (
        [{"a": torch.zeros(1, 2)}, {"a": _nested()}],
        r"leaf \['a'\] of batch 1 is a nested tensor; pad it",
    ),
    "sparse later": (
        [{"a": torch.zeros(1, 2)}, {"a": torch.zeros(1, 2).to_sparse()}],
        r"leaf \['a'\] of batch 1 is a torch.sparse_coo tensor",
    ),
    "meta": (
        [{"a": torch.zeros(1, device="meta")}],
        r"leaf \['a'\] of batch 0 is on meta; collate_batches gathers CPU tensors and tensors "
        r"on the group's device cpu: move it with .cpu\(\)",
    ),
    "devices": (
        [{"a": torch.zeros(1)}, {"a": torch.zeros(1, device="meta")}],
        r"leaf \['a'\] of batch 1 is on meta",
    ),
}


@world_sizes(2)
def test_malformed_batches_raise_on_every_rank(ctx):
    """A rank's own malformed batches raise PdistError on every rank, naming that rank."""
    for bad, match in MALFORMED.values():
        batches = bad if ctx.rank == 1 else [{"a": torch.zeros(1)}]
        with pytest.raises(pdist.PdistError, match=match):
            pdist.collate_batches(ctx, batches)
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
    assert counts[0] <= 1 + 3  # the metadata (and the allocation verdict), at most three gathers


@world_sizes(1, 2)
def test_one_batch_comes_back_in_fresh_memory(ctx):
    """One batch per rank (a non-contiguous leaf too): each leaf comes back in fresh memory.

    Contiguous, and out of reach of later writes to the caller's batch, on one rank as on several.
    """
    n, w = 4, ctx.world_size
    rows = torch.arange(float(ctx.rank), n * w, w)  # this rank's dataset indices
    batch = {"x": rows.clone(), "y": torch.stack([rows, -rows]).t()}  # y: a transposed view
    result = pdist.collate_batches(ctx, [batch])
    batch["x"].fill_(-7.0)
    batch["y"].fill_(-7.0)
    everything = torch.arange(float(n * w))
    assert torch.equal(result["x"], everything)
    assert torch.equal(result["y"], torch.stack([everything, -everything]).t())
    assert result["y"].is_contiguous()


@world_sizes(1, 2)
def test_bad_batches_argument(ctx):
    """batches must be a list: TypeError on one rank, the same RemoteError on every rank of more."""
    expected = TypeError if ctx.world_size == 1 else pdist.PdistError
    with pytest.raises(expected, match="batches must be a list of this rank's per-batch outputs"):
        pdist.collate_batches(ctx, torch.zeros(3))


def _indexed(ctx, size, leaves):
    """This rank's batches of ``{name: (width, dtype)}`` leaves; sample i holds i + k in leaf k."""
    indices = torch.tensor(list(pdist.EvalSampler(range(size), ctx)))
    return [
        {
            name: (chunk.unsqueeze(1) + k).repeat(1, width).to(dtype)
            for k, (name, (width, dtype)) in enumerate(leaves.items())
        }
        for chunk in indices.split(400)
    ]


def _check_indexed(out, size, leaves):
    for k, (name, (width, dtype)) in enumerate(leaves.items()):
        expected = (torch.arange(size).unsqueeze(1) + k).repeat(1, width).to(dtype)
        assert out[name].is_contiguous(), name
        assert torch.equal(out[name], expected), name


@world_sizes(2, 3)
def test_large_outputs_gather_rows_in_dataset_order(ctx):
    """Large leaves of equal row size go in two pipelined gathers; others share one more."""
    size = 3001  # uneven on 2 and 3 ranks
    one_group = {f"leaf{k}": (64, torch.float32) for k in range(6)}
    with count_collectives() as calls:
        out = pdist.collate_batches(ctx, _indexed(ctx, size, one_group))
    assert sum(calls.values()) == 3  # metadata (and the allocation verdict), the two halves
    _check_indexed(out, size, one_group)

    # Two large row sizes (the first mixing dtypes) and small leaves of two more: two own
    # gathers plus one shared.
    mixed = one_group | {"doubles": (32, torch.float64), "wide": (100, torch.float64)}
    mixed |= {"index": (1, torch.int64), "flag": (3, torch.bool)}
    with count_collectives() as calls:
        out = pdist.collate_batches(ctx, _indexed(ctx, size, mixed))
    assert sum(calls.values()) == 4
    _check_indexed(out, size, mixed)


@world_sizes(2, 3)
def test_calls_in_a_row_whose_counts_change(ctx):
    """Calls whose counts differ from the last call's come back right, results kept or not."""
    leaves = {f"leaf{k}": (64, torch.float32) for k in range(6)} | {"index": (1, torch.int64)}
    kept = []
    for n, size in enumerate((3001, 3000, 3002, 3002, 2999, 7, 3001, 3003)):
        out = pdist.collate_batches(ctx, _indexed(ctx, size, leaves))
        _check_indexed(out, size, leaves)
        if n % 2:
            kept.append((size, out))
    for size, out in kept:
        _check_indexed(out, size, leaves)


@world_sizes(3)
def test_zero_width_leaves(ctx):
    """A leaf with no bytes per sample ([N, 0]) comes back with the right shape."""
    size = 8
    batches = [
        {"empty": torch.zeros(len(chunk), 0), "index": chunk}
        for chunk in torch.tensor(list(pdist.EvalSampler(range(size), ctx))).split(2)
    ]
    out = pdist.collate_batches(ctx, batches)
    assert out["empty"].shape == (size, 0)
    assert torch.equal(out["index"], torch.arange(size))


class _OwnDispatch(torch.Tensor):
    """A tensor subclass with its own dispatch, as DTensor is: it refuses every operator."""

    @staticmethod
    def __new__(cls, data):
        return torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=data.dtype)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"{func} is not supported on this subclass")


def _one_bad_rank(case: str, ctx):
    """collate_batches with one rank's input broken as ``case`` says."""
    size = 7 if case in ("None", "meta", "sparse") else 2  # 2 on 3 ranks: rank 2 has none
    batches = [{"x": torch.tensor([[float(i)]])} for i in pdist.EvalSampler(range(size), ctx)]
    if case == "None" and ctx.rank == 1:
        batches = None
    elif case == "meta" and ctx.rank == 1:
        batches = [{"x": torch.zeros(1, 1, device="meta")} for _ in batches]
    elif case == "sparse" and ctx.rank == 1:
        batches = [{"x": b["x"].to_sparse()} for b in batches]
    elif case == "zero samples, others on meta" and batches:
        batches = [{"x": torch.zeros(1, 1, device="meta")} for _ in batches]
    elif case == "zero samples, others hold subclasses" and batches:
        batches = [{"x": _OwnDispatch(b["x"])} for b in batches]
    if case == "zero samples, allocation fails" and ctx.rank == 0:
        with pdist.testing.inject(allocate=out_of_memory(1)):
            pdist.collate_batches(ctx, batches)
    else:
        pdist.collate_batches(ctx, batches)


def _case(
    name: str, bad: int, expected: type[BaseException], pattern: str, *, names_the_rank: bool = True
) -> Case:
    return Case(functools.partial(_one_bad_rank, name), 3, bad, expected, pattern, names_the_rank)


# A bad argument stays a TypeError/ValueError on every rank (a RemoteError subclass).
ONE_BAD_RANK = {
    "None": _case(
        "None",
        1,
        TypeError,
        r"failed on rank 1: TypeError: batches must be a list .*got None; pass \[\] on a rank",
    ),
    "meta": _case(
        "meta",
        1,
        ValueError,
        r"failed on rank 1: ValueError: leaf \['x'\] of batch 0 is on meta; .* \.cpu\(\)",
    ),
    "sparse": _case(
        "sparse",
        1,
        ValueError,
        r"failed on rank 1: ValueError: leaf \['x'\] of batch 0 is a torch.sparse_coo tensor",
    ),
    "zero samples, others on meta": _case(
        "zero samples, others on meta",
        0,
        ValueError,
        r"failed on rank [01]: ValueError: leaf \['x'\] .* on meta",
        names_the_rank=False,  # ranks 0 and 1 both fail: each raises its own error
    ),
    "zero samples, others hold subclasses": _case(
        "zero samples, others hold subclasses",
        0,
        ValueError,
        r"failed on rank [01]: ValueError: leaf \['x'\] of batch 0 is a _OwnDispatch, a tensor "
        r"subclass with its own dispatch; pass plain tensors",
        names_the_rank=False,  # ranks 0 and 1 both fail: each raises its own error
    ),
    "zero samples, allocation fails": _case(
        "zero samples, allocation fails",
        0,
        pdist.PdistError,
        r"failed on rank 0: PdistError: could not allocate .*simulated out of memory",
    ),
}


@pytest.mark.parametrize("case", list(ONE_BAD_RANK))
def test_one_bad_rank_fails_every_rank_within_seconds(case):
    """One rank's bad input (or failed allocation) raises the same error on every rank, quickly."""
    bad = ONE_BAD_RANK[case]
    results = pdist.testing.spawn(run_case, bad.world, bad)
    assert_failed_together(bad, results)
    # One message, except where several ranks failed: each of those raises its own.
    assert len({o.message for o in results}) == (1 if bad.names_the_rank else 2), results


@pytest.mark.parametrize("samples", [0, 3])
@pytest.mark.parametrize("widths", [(3, 3), (3, 2)])  # a block per leaf, or leaves side by side
def test_packing_zeroes_the_bytes_no_sample_fills(samples, widths):
    """Padding rows and gaps between leaves go on the wire as zeros, never as leftover memory."""
    # A unit test of a private piece: no public call shows what a rank sent.
    from pdist._collate import _Call, _layout, _Leaf, _pack

    specs = [_Leaf(torch.float32, (widths[0],), "cpu"), _Leaf(torch.int16, (widths[1],), "cpu")]
    local = [
        [torch.arange(samples * s.shape[0]).view(samples, *s.shape).to(s.dtype) + 1] for s in specs
    ]
    rows = 4  # another rank holds 4 samples: this rank sends 4 - samples padding rows
    call = _Call(local, specs, rank=1, world=2, rows=rows, samples=samples, total=rows + samples)
    blocks, width, places = _layout(specs, [0, 1])
    mine = torch.full((blocks * rows * width,), 0xAB, dtype=torch.uint8)
    _pack(call, [0, 1], mine)
    grid = mine.view(blocks, rows, width)
    expected = torch.zeros_like(grid)
    for spec, (block, offset), tensors in zip(specs, places, local, strict=True):
        data = torch.cat(tensors).view(torch.uint8).view(samples, spec.nbytes)
        expected[block, :samples, offset : offset + spec.nbytes] = data
    assert torch.equal(grid, expected)
