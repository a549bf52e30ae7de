"""all_to_all with counts and uneven all_gather / reduce_scatter, against one-process references."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

import pdist
from pdist.testing import spawn, world_sizes

# COUNTS[i][j]: rows rank i sends rank j (3 ranks; rank 1 sends nothing, rank 2 gets nothing).
COUNTS = [[2, 1, 0], [0, 0, 0], [3, 4, 0]]


def _rows(rank: int, n: int, width: int = 5) -> torch.Tensor:
    """Rank ``rank``'s input: ``n`` rows whose values say where they came from."""
    return torch.arange(n * width, dtype=torch.float32).view(n, width) + 100 * rank


def _reference(p: int, counts, me: int) -> torch.Tensor:
    """What rank ``me`` receives: every rank's block for ``me``, in rank order."""
    blocks = []
    for i in range(p):
        start = sum(counts[i][:me])
        blocks.append(_rows(i, sum(counts[i]))[start : start + counts[i][me]])
    return torch.cat(blocks)


@world_sizes(3)
def test_all_to_all_uneven_and_zero_counts(ctx):
    """Rows reach their ranks with counts given or exchanged; the gradient comes back."""
    r, p = ctx.rank, ctx.world_size
    send, recv = COUNTS[r], [COUNTS[i][r] for i in range(p)]
    expected = _reference(p, COUNTS, r)
    for given in (None, recv):
        x = _rows(r, sum(send)).requires_grad_()
        out = pdist.all_to_all(ctx, x, send, given)
        torch.testing.assert_close(out, expected)
        weight = torch.arange(out.numel(), dtype=torch.float32).view_as(out) + r
        (out * weight).sum().backward()
        # The gradient of my row is the weight its receiver applied to it.
        ref = []
        for j in range(p):
            w_j = torch.arange(sum(COUNTS[i][j] for i in range(p)) * 5.0).view(-1, 5) + j
            start = sum(COUNTS[i][j] for i in range(r))
            ref.append(w_j[start : start + send[j]])
        torch.testing.assert_close(x.grad, torch.cat(ref))
    even = pdist.all_to_all(ctx, _rows(r, 6))  # no counts: N / P rows each
    torch.testing.assert_close(even, _reference(p, [[2, 2, 2]] * p, r))


def _bad_counts(ctx) -> None:
    """Bad counts on one rank: every rank raises, then the group still works."""
    r = ctx.rank
    x = _rows(r, 3)
    bad = [1, 1, 2] if r == 1 else [1, 1, 1]  # sums to 4 on rank 1, which has 3 rows
    with pytest.raises(
        ValueError, match=r"failed on rank 1: ValueError: send_counts=\[1, 1, 2\] sum to 4"
    ):
        pdist.all_to_all(ctx, x, bad)
    wrong_length = [3] if r == 2 else [1, 1, 1]
    with pytest.raises(
        ValueError, match=r"send_counts has 1 entries on rank 2, but the group has 3"
    ):
        pdist.all_to_all(ctx, x, wrong_length)
    with pytest.raises(ValueError, match="recv_counts without send_counts"):
        pdist.all_to_all(ctx, x, None, [1, 1, 1])
    with pytest.raises(ValueError, match=r"x has 4 rows on rank .*does not divide"):
        pdist.all_to_all(ctx, _rows(r, 4))
    with pytest.raises(TypeError, match="must be a list of 3 ints"):
        pdist.all_to_all(ctx, x, [1.0, 1, 1], [1, 1, 1])
    pdist.barrier(ctx)
    out = pdist.all_to_all(ctx, x, [1, 1, 1])  # the group still works
    assert out.shape == (3, 5)


@world_sizes(3)
def test_all_to_all_bad_counts_raise_on_every_rank(ctx):
    """In check mode (the harness's), a rank's bad counts raise on every rank."""
    _bad_counts(ctx)


def _bad_counts_unchecked() -> None:
    os.environ["PDIST_CHECK"] = "0"
    with pdist.distributed() as ctx:
        assert not ctx.world.lifetime.check
        _bad_counts(ctx)


def test_all_to_all_bad_counts_ride_on_the_exchange_without_check_mode():
    """Check mode off: bad exchanged counts still raise on every rank (the counts exchange)."""
    spawn(_bad_counts_unchecked, 3, timeout=90)


@world_sizes(2, 3)
def test_uneven_all_gather_and_reduce_scatter(ctx):
    """Shards of different sizes gather and scatter along dim 0 and -1, gradients included."""
    r, p = ctx.rank, ctx.world_size
    sizes = [3, 0, 2][:p] if p == 3 else [3, 1]
    for dim in (0, -1):
        shards = [
            torch.randn(4, 2, sizes[i], generator=torch.Generator().manual_seed(i)).movedim(-1, dim)
            for i in range(p)
        ]
        x = shards[r].clone().requires_grad_()
        out = pdist.all_gather(ctx, x, dim=dim, sizes=sizes)
        full = torch.cat(shards, dim=dim)
        torch.testing.assert_close(out, full)
        (out * (full + 1)).sum().backward()  # every rank's loss: the total gradient is P times
        torch.testing.assert_close(x.grad, p * (shards[r] + 1))

        inputs = [
            torch.randn(full.shape, generator=torch.Generator().manual_seed(10 + i))
            for i in range(p)
        ]
        y = inputs[r].clone().requires_grad_()
        got = pdist.reduce_scatter(ctx, y, dim=dim, sizes=sizes)
        total = torch.stack(inputs).sum(0)
        torch.testing.assert_close(got, total.split(sizes, dim=dim)[r])
        weights = [
            torch.full(s.shape, float(i + 1)) for i, s in enumerate(total.split(sizes, dim=dim))
        ]
        (got * weights[r]).sum().backward()
        torch.testing.assert_close(y.grad, torch.cat(weights, dim=dim))
        mean = pdist.reduce_scatter(ctx, inputs[r], dim=dim, op="mean", sizes=sizes)
        torch.testing.assert_close(mean, total.split(sizes, dim=dim)[r] / p)
    with pytest.raises(ValueError, match=r"sizes=\[1, 1.*\] sum to"):
        pdist.reduce_scatter(ctx, torch.ones(5, 2), dim=0, sizes=[1] * p)
    with pytest.raises(ValueError, match="sizes has 1 entries"):
        pdist.all_gather(ctx, torch.ones(5, 2), dim=0, sizes=[5])


@world_sizes(3)
def test_uneven_reduce_scatter_keeps_the_dtype_and_refuses_complex_order(ctx):
    """product, max and min of int8 and bool keep their dtype, as the even path; complex: none."""
    r, sizes = ctx.rank, [2, 0, 3]
    for dtype in (torch.int8, torch.bool):
        inputs = [torch.tensor([1, 2, 1, 0, 3]).add(i % 2).to(dtype) for i in range(3)]
        stacked = torch.stack(inputs)
        references = {
            "product": stacked.all(0) if dtype == torch.bool else stacked.prod(0, dtype=dtype),
            "max": stacked.amax(0),
            "min": stacked.amin(0),
        }
        for op, full in references.items():
            got = pdist.reduce_scatter(ctx, inputs[r], dim=0, op=op, sizes=sizes)
            assert got.dtype == dtype
            assert torch.equal(got, full.split(sizes)[r]), (dtype, op)
    z = torch.ones(5, dtype=torch.complex64)
    for op in ("max", "min"):
        with pytest.raises(TypeError, match="needs a real tensor"):
            pdist.reduce_scatter(ctx, z, dim=0, op=op, sizes=sizes)
        with pytest.raises(TypeError, match="needs a real tensor"):
            pdist.all_reduce(ctx, z, op=op)
    assert pdist.all_reduce(ctx, torch.ones(1)).item() == 3.0


@world_sizes(3)
def test_all_to_all_compiles_without_graph_breaks(ctx):
    """Given both counts as ints, all_to_all and uneven gathers compile under fullgraph=True."""
    r, p = ctx.rank, ctx.world_size
    send, recv = COUNTS[r], [COUNTS[i][r] for i in range(p)]
    sizes = [2, 0, 3]

    def step(x, y):
        out = pdist.all_to_all(ctx, x * 2, send, recv)
        g = pdist.all_gather(ctx, y, dim=0, sizes=sizes)
        return out.sum() + pdist.reduce_scatter(ctx, g, dim=0, sizes=sizes).square().sum()

    x, y = _rows(r, sum(send)), torch.randn(sizes[r], 3)
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    try:
        xa, ya = x.clone().requires_grad_(), y.clone().requires_grad_()
        xb, yb = x.clone().requires_grad_(), y.clone().requires_grad_()
        compiled(xa, ya).backward()
        step(xb, yb).backward()
        torch.testing.assert_close(xa.grad, xb.grad)
        torch.testing.assert_close(ya.grad, yb.grad)
        torch.testing.assert_close(compiled(x, y), step(x, y))
    finally:
        del compiled  # compiled code holds the process groups
        torch._dynamo.reset()


def _one_rank_without_grad(ctx) -> None:
    r, p = ctx.rank, ctx.world_size
    counts = [[1, 2, 0][:p], [0] * p, [2, 1, 3][:p]][:p]  # rank 1 sends nothing, no grad
    send = counts[r]
    x = _rows(r, sum(send))
    if r != 1:
        x.requires_grad_()
    out = pdist.all_to_all(ctx, x, send)
    weight = torch.arange(out.numel(), dtype=torch.float32).view_as(out) + r
    (out * weight).sum().backward()  # rank 1 too: its rows came from ranks that need grads
    if r != 1:
        ref = []
        for j in range(p):
            got = sum(counts[i][j] for i in range(p))
            w_j = torch.arange(got * 5, dtype=torch.float32).view(-1, 5) + j
            start = sum(counts[i][j] for i in range(r))
            ref.append(w_j[start : start + send[j]])
        torch.testing.assert_close(x.grad, torch.cat(ref))
    no_grad = torch.no_grad() if r == 0 else contextlib.nullcontext()
    with no_grad, pytest.raises(pdist.RankMismatchError, match=r"rank\(s\) \[0\] called it"):
        pdist.all_to_all(ctx, _rows(r, p).requires_grad_(r == 1), [1] * p)


@world_sizes(2, 3, timeout=60)
def test_all_to_all_backward_runs_where_the_input_needs_no_grad(ctx):
    """send_counts alone: one rank's input needing a gradient makes every rank's backward run."""
    _one_rank_without_grad(ctx)


def test_all_to_all_backward_on_every_rank_without_check_mode():
    """Check mode off, the need for a gradient rides on the counts exchange all the same."""
    spawn(_one_rank_without_grad_unchecked, 3, timeout=60)


def _one_rank_without_grad_unchecked() -> None:
    os.environ["PDIST_CHECK"] = "0"
    with pdist.distributed() as ctx:
        _one_rank_without_grad(ctx)


@world_sizes(3, timeout=60)
def test_given_counts_with_grad_on_one_rank_raise_in_check_mode(ctx):
    """Both counts given (no exchange): check mode compares requires_grad instead of a hang."""
    r = ctx.rank
    x = _rows(r, 3).requires_grad_(r == 2)
    with pytest.raises(pdist.RankMismatchError, match="requires_grad=True"):
        pdist.all_to_all(ctx, x, [1, 1, 1], [1, 1, 1])
    with pytest.raises(pdist.RankMismatchError, match="requires_grad=False"):
        pdist.all_gather(ctx, x, dim=0, sizes=[3, 3, 3])
    with pytest.raises(pdist.RankMismatchError, match="requires_grad"):
        pdist.reduce_scatter(ctx, x, dim=0, sizes=[1, 1, 1])
    out = pdist.all_to_all(ctx, x.detach().requires_grad_(), [1, 1, 1], [1, 1, 1])
    out.sum().backward()  # alike on every rank: the group goes on
