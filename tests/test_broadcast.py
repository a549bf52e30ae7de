"""Structured broadcast (broadcast_object_list): round trips, errors, constant collectives."""

from __future__ import annotations

import collections
import itertools

import pytest
import torch
from launcher import run_ranks

import pdist
from pdist._env import env_flag
from pdist.testing import count_collectives, world_sizes

Pair = collections.namedtuple("Pair", "first second")

ALL_DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.complex64,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
]


def _tensor(dtype: torch.dtype, shape, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype.is_complex:
        return torch.randn(shape, generator=gen, dtype=dtype)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype)
    return torch.randint(0, 100, shape, generator=gen).to(dtype)


def _payload():
    shared = torch.arange(1000.0)
    big = {f"{d}".removeprefix("torch."): _tensor(d, (40, 30), i) for i, d in enumerate(ALL_DTYPES)}
    small = {
        f"{d}".removeprefix("torch."): _tensor(d, (3,), 50 + i) for i, d in enumerate(ALL_DTYPES)
    }
    return [
        {"big": big, "small": small},
        Pair(shared, [shared, {"again": shared}]),
        (torch.empty(0, 5), torch.tensor(2.5), torch.tensor(7, dtype=torch.int64)),
        torch.arange(2000.0).reshape(40, 50).t(),  # non-contiguous
        "a string leaf",
        {"cfg": {"lr": 0.1, "betas": (0.9, 0.95)}},
        None,
    ]


def _check(out) -> None:
    expected = _payload()
    for group in ("big", "small"):
        for name, t in expected[0][group].items():
            got = out[0][group][name]
            assert got.dtype == t.dtype, name
            assert torch.equal(got, t), name
    pair = out[1]
    assert isinstance(pair, Pair)
    assert pair.second[0] is pair.first
    assert pair.second[1]["again"] is pair.first
    assert torch.equal(pair.first, expected[1].first)
    empty, zero_dim, integer = out[2]
    assert empty.shape == (0, 5)
    assert zero_dim.shape == ()
    assert zero_dim.item() == 2.5
    assert integer.item() == 7
    assert torch.equal(out[3], expected[3])
    assert out[4:] == expected[4:]


@world_sizes(2, 3)
def test_round_trip_from_every_src(ctx):
    """Every dtype, empty/zero-dim/non-contiguous tensors, namedtuples and shared tensors."""
    for src in range(ctx.world_size):
        objs = _payload() if ctx.rank == src else [None]
        pdist.broadcast_object_list(ctx, objs, src=src)
        _check(objs)
        # Everything inline, and everything bucketed, give the same result.
        for min_bytes in (0, 1 << 30):
            objs = _payload() if ctx.rank == src else []
            pdist.broadcast_object_list(ctx, objs, src=src, min_tensor_bytes=min_bytes)
            _check(objs)


@world_sizes(2, 3)
def test_buckets_of_one_dtype_round_trip(ctx):
    """Buckets of one dtype whose tensors end on 64 bytes pack in one copy: values, grads kept."""
    shapes = [(16, 8), (64,), (4, 4, 4), (0,)]
    for i, dtype in enumerate(ALL_DTYPES):
        sent = [_tensor(dtype, shape, 10 * i + j) for j, shape in enumerate(shapes)]
        objs = [sent] if ctx.rank == 0 else [None]
        pdist.broadcast_object_list(ctx, objs, min_tensor_bytes=0)
        assert [t.shape for t in objs[0]] == [t.shape for t in sent]
        for got, t in zip(objs[0], sent, strict=True):
            assert got.dtype == dtype
            assert torch.equal(got, t)
    weight = torch.nn.Parameter(torch.arange(64.0).reshape(8, 8))
    grown = torch.arange(32.0, requires_grad=True) * 2  # not a leaf
    objs = [[weight, grown]] if ctx.rank == 0 else [None]
    pdist.broadcast_object_list(ctx, objs, min_tensor_bytes=0)
    got_weight, got_grown = objs[0]
    assert type(got_weight) is torch.nn.Parameter
    assert got_weight.requires_grad
    assert torch.equal(got_weight.detach(), weight.detach())
    assert got_grown.requires_grad
    assert torch.equal(got_grown.detach(), grown.detach())


class MyList(list):
    """A list subclass: it travels as itself."""


def _cycle():
    a = [1]
    a.append({"back": a})
    return [a]


def _shared():
    inner = {"x": 1}
    return [{"a": inner, "b": inner}]


@world_sizes(2, 3)
def test_cycles_shared_containers_and_subclasses_travel(ctx):
    """What torch's broadcast_object_list carries, pdist's carries too, structure intact."""
    src = ctx.world_size - 1
    objs = _cycle() if ctx.rank == src else [None]
    pdist.broadcast_object_list(ctx, objs, src=src)
    assert objs[0][1]["back"] is objs[0]
    objs = _shared() if ctx.rank == src else [None]
    pdist.broadcast_object_list(ctx, objs, src=src)
    assert objs[0]["a"] is objs[0]["b"]
    objs = [MyList([1, torch.arange(600.0)])] if ctx.rank == src else [None]
    pdist.broadcast_object_list(ctx, objs, src=src)
    assert type(objs[0]) is MyList
    assert torch.equal(objs[0][1], torch.arange(600.0))


@world_sizes(2)
def test_tiny_payload_takes_one_collective(ctx):
    """A payload whose header fits the first message costs a single collective."""
    with count_collectives() as calls:
        objs = [{"step": 3, "lr": 0.1, "t": torch.ones(4)}] if ctx.rank == 0 else [None]
        pdist.broadcast_object_list(ctx, objs)
    # In check mode (the harness's unless PDIST_CHECK=0), one all-gather more: the agreement.
    checked = {"gloo:all_gather": 1} if env_flag("PDIST_CHECK", False) else {}
    assert dict(calls) == {"gloo:broadcast": 1, **checked}
    assert objs[0]["step"] == 3


@world_sizes(2)
def test_collectives_do_not_grow_with_the_number_of_tensors(ctx):
    """The collective count is the header, the status and one per bucket, whatever the tensors."""
    counts = []
    for n in (10, 100, 1000):
        objs = [[torch.full((1024,), float(i)) for i in range(n)]] if ctx.rank == 0 else [None]
        with count_collectives() as calls:
            pdist.broadcast_object_list(ctx, objs)
        assert [t[0].item() for t in objs[0]] == [float(i) for i in range(n)]
        counts.append(sum(calls.values()) - env_flag("PDIST_CHECK", False))  # less the agreement
    # Header (first chunk, plus the rest when the specs outgrow it), the status and one bucket.
    assert counts[0] <= 4
    assert counts[-1] <= 4
    assert counts[-1] - counts[0] <= 1


@world_sizes(2, 3)
def test_calls_in_a_row_keep_their_own_results(ctx):
    """Each call's received tensors stay its own through the calls after it."""

    def sent(k: int) -> list[torch.Tensor]:  # 40 MiB: three buckets
        return [torch.full((1 << 18,), float(100 * k + i)) for i in range(40)]

    got = []
    for k in range(3):
        objs = [sent(k)] if ctx.rank == 0 else [None]
        pdist.broadcast_object_list(ctx, objs)
        got.append(objs[0])
    for k, out in enumerate(got):
        assert all(torch.equal(a, b) for a, b in zip(out, sent(k), strict=True))


HANDED_TO_A_CHILD = """
    import torch, pdist

    N = 4096  # elements: 16 KiB, a bucket of its own rather than inline bytes

    def hold(tensors, answers):
        held = tensors.get()
        answers.put("holding")
        tensors.get()
        answers.put(held.unique().tolist())

    def received(ctx, k, how):
        sent = torch.full((N,), float(k))
        if how == "recv_object":
            if ctx.rank == 0:
                pdist.send_object(ctx, sent, dst=1)
                return sent
            return pdist.recv_object(ctx, 0)
        objs = [sent] if ctx.rank == 0 else [None]
        pdist.broadcast_object_list(ctx, objs)
        return objs[0]

    if __name__ == "__main__":
        mp = torch.multiprocessing.get_context("spawn")
        with pdist.distributed(timeout=60) as ctx:
            for how in ("recv_object", "broadcast_object_list"):
                t = received(ctx, 1, how)
                if ctx.rank == 1:
                    tensors, answers = mp.Queue(), mp.Queue()
                    child = mp.Process(target=hold, args=(tensors, answers), daemon=True)
                    child.start()
                    tensors.put(t)  # torch moves the storage to shared memory
                    assert answers.get(timeout=60) == "holding"
                    del t
                for k in (2, 3):
                    assert received(ctx, k, how).unique().tolist() == [float(k)]
                if ctx.rank == 1:
                    tensors.put("go")
                    print(how, "CHILD READS", answers.get(timeout=60), flush=True)
                    child.join(timeout=30)
"""


def test_a_result_handed_to_another_process_stays_intact():
    """A received tensor moved to a child's shared memory keeps its values through later calls."""
    results = run_ranks(HANDED_TO_A_CHILD, 2, timeout=150)
    assert [r.returncode for r in results] == [0, 0], results[0].output + results[1].output
    for how in ("recv_object", "broadcast_object_list"):
        assert f"{how} CHILD READS [1.0]" in results[1].output, results[1].output


@world_sizes(2)
def test_bad_arguments(ctx):
    """object_list must be a list and min_tensor_bytes a non-negative int."""
    with pytest.raises(TypeError, match=r"object_list=\(1,\) on rank 0 must be a list, got tuple"):
        pdist.broadcast_object_list(ctx, (1,))
    with pytest.raises(
        ValueError, match="min_tensor_bytes=-1 on rank 0 must be a non-negative int"
    ):
        pdist.broadcast_object_list(ctx, [1], min_tensor_bytes=-1)
    with pytest.raises(ValueError, match="src=5 is outside group 'world' of size 2"):
        pdist.broadcast_object_list(ctx, [1], src=5)


def test_corrupt_bucket_layouts_are_refused():
    """A header whose places are misaligned, overlapping or out of the bucket raises."""
    from pdist._payload import _slices

    bucket = torch.arange(64, dtype=torch.uint8)
    first, second = _slices(bucket, torch.int32, [(0, 2), (16, 3)])
    assert torch.equal(first, bucket[:8].view(torch.int32))
    assert torch.equal(second, bucket[16:28].view(torch.int32))
    for places, match in (
        ([(2, 1)], "byte offset 2"),
        ([(0, 4), (8, 1)], "byte offset 8"),
        ([(60, 2)], "17 torch.int32 elements in a bucket of 16"),
    ):
        with pytest.raises(pdist.PdistError, match=match):
            _slices(bucket, torch.int32, places)


def test_slab_carves_aligned_buffers_from_one_allocation():
    """The buckets of one transfer share one allocation, each starting ALIGN-ed."""
    from pdist._buffers import ALIGN, slab

    _, parts = slab([100, 0, 4096, 7], torch.device("cpu"), what="a test")
    assert [p.numel() for p in parts] == [100, 0, 4096, 7]
    filled = [p for p in parts if p.numel()]  # an empty view has no address
    base = filled[0].untyped_storage().data_ptr()
    assert all(p.untyped_storage().data_ptr() == base for p in filled)
    assert all((p.data_ptr() - base) % ALIGN == 0 for p in filled)
    for before, after in itertools.pairwise(filled):
        assert before.data_ptr() + before.numel() <= after.data_ptr()
