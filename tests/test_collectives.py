"""Tensor collectives against single-process references, on real gloo processes."""

from __future__ import annotations

import pytest
import torch

import pdist
from pdist.testing import world_sizes

DTYPES = [torch.float32, torch.bfloat16, torch.int64]


def _inputs(world_size: int, shape, dtype, seed: int = 0) -> list[torch.Tensor]:
    """Every rank's input, computable on every rank (the single-process reference)."""
    out = []
    for r in range(world_size):
        gen = torch.Generator().manual_seed(seed * 1000 + r)
        if dtype == torch.bool:
            out.append(torch.randint(0, 2, shape, generator=gen).bool())
        elif dtype.is_floating_point:
            out.append(torch.randn(shape, generator=gen).to(dtype))
        else:
            out.append(torch.randint(-50, 50, shape, generator=gen, dtype=dtype))
    return out


REFERENCE = {
    "sum": lambda s: s.sum(0),
    "mean": lambda s: s.sum(0) / s.shape[0],
    "max": lambda s: s.max(0).values,
    "min": lambda s: s.min(0).values,
    "product": lambda s: s.prod(0),
}


@world_sizes(2, 3)
def test_all_reduce_matches_reference(ctx):
    """Every op and dtype equals the local reduction of all ranks' inputs; x is unchanged."""
    for dtype in [*DTYPES, torch.bool]:
        for op, ref in REFERENCE.items():
            if op == "mean" and not dtype.is_floating_point:
                continue
            if dtype == torch.bool and op not in ("max", "min"):
                continue
            xs = _inputs(ctx.world_size, (3, 5), dtype, seed=1)
            x = xs[ctx.rank].clone()
            out = pdist.all_reduce(ctx, x, op=op)
            stacked = torch.stack(xs).to(torch.float64 if dtype.is_floating_point else dtype)
            expected = ref(stacked).to(dtype)
            assert torch.equal(x, xs[ctx.rank]), (op, dtype)
            tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
            if dtype.is_floating_point:
                torch.testing.assert_close(out, expected, atol=tol, rtol=tol)
            else:
                assert torch.equal(out, expected), (op, dtype)


@world_sizes(2, 3)
def test_all_gather_gather_reduce_broadcast(ctx):
    """all_gather/gather/reduce/broadcast equal their references for every dim and dtype."""
    w, r = ctx.world_size, ctx.rank
    last = w - 1
    for dtype in [*DTYPES, torch.bool]:
        xs = _inputs(w, (2, 3, 4), dtype, seed=2)
        for dim in (0, 1, -1):
            assert torch.equal(pdist.all_gather(ctx, xs[r], dim=dim), torch.cat(xs, dim=dim))
            got = pdist.gather(ctx, xs[r], dst=last, dim=dim)
            assert (got is None) == (r != last)
            if got is not None:
                assert torch.equal(got, torch.cat(xs, dim=dim))
        listed = pdist.all_gather_tensor(ctx, xs[r])
        assert len(listed) == w
        assert all(torch.equal(a, b) for a, b in zip(listed, xs, strict=True))
        y = xs[r].clone()
        assert pdist.broadcast(ctx, y, src=last) is y
        assert torch.equal(y, xs[last])
        if dtype != torch.bool:
            total = pdist.reduce(ctx, xs[r], dst=1, op="sum")
            assert (total is None) == (r != 1)
            if total is not None:
                expected = torch.stack(xs).double().sum(0).to(dtype)
                torch.testing.assert_close(total, expected, atol=5e-2, rtol=1e-2)
    xs = _inputs(w, (4,), torch.float32, seed=3)
    mean = pdist.reduce(ctx, xs[r], dst=0)
    if r == 0:
        torch.testing.assert_close(mean, torch.stack(xs).mean(0))


@world_sizes(2, 3)
def test_non_contiguous_inputs_are_accepted(ctx):
    """Non-contiguous inputs are made contiguous, not refused."""
    xs = [x.t() for x in _inputs(ctx.world_size, (4, 3), torch.float32, seed=4)]
    assert not xs[ctx.rank].is_contiguous()
    assert torch.equal(pdist.all_gather(ctx, xs[ctx.rank], dim=0), torch.cat(xs, dim=0))
    torch.testing.assert_close(pdist.all_reduce(ctx, xs[ctx.rank]), torch.stack(xs).sum(0))


def _full_attention_input(world_size: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    return torch.randn(2, 4 * world_size, 3 * world_size, 5, generator=gen)  # [B, S, H, D]


@world_sizes(2, 3)
def test_all_to_all_4d_forward_backward_and_inverse(ctx):
    """[B, S/P, H, D] -> [B, S, H/P, D]; the way back restores the input; gradients match."""
    p, r = ctx.world_size, ctx.rank
    full = _full_attention_input(p)
    s, h = full.shape[1] // p, full.shape[2] // p
    local = full[:, r * s : (r + 1) * s].clone().requires_grad_(True)
    out = pdist.all_to_all_4d(ctx, local)
    assert torch.equal(out, full[:, :, r * h : (r + 1) * h])
    back = pdist.all_to_all_4d(ctx, out, scatter_dim=1, gather_dim=2)
    assert torch.equal(back, local)
    # Global loss sum_r <out_r, W_r>: d/d full is W_r placed at head slice r.
    weights = _inputs(p, tuple(out.shape), torch.float32, seed=8)
    (out * weights[r]).sum().backward()
    expected = torch.cat(weights, dim=2)[:, r * s : (r + 1) * s]
    torch.testing.assert_close(local.grad, expected)
    for dtype in (torch.bfloat16, torch.int64):
        x = full.to(dtype)[:, r * s : (r + 1) * s]
        assert torch.equal(pdist.all_to_all_4d(ctx, x), full.to(dtype)[:, :, r * h : (r + 1) * h])


@world_sizes(2, 3)
def test_differentiable_collectives_gradients(ctx):
    """Gradients of all_reduce, all_gather and shard follow the sum-over-ranks loss."""
    p, r = ctx.world_size, ctx.rank
    xs = _inputs(p, (2, 6), torch.float32, seed=9)
    ws = _inputs(p, (2, 6), torch.float32, seed=10)
    x = xs[r].clone().requires_grad_(True)
    (pdist.all_reduce(ctx, x) * ws[r]).sum().backward()
    torch.testing.assert_close(x.grad, torch.stack(ws).sum(0))

    x = xs[r].clone().requires_grad_(True)
    wg = _inputs(p, (2, 6 * p), torch.float32, seed=11)
    (pdist.all_gather(ctx, x, dim=-1) * wg[r]).sum().backward()
    torch.testing.assert_close(x.grad, torch.stack(wg).sum(0)[:, r * 6 : (r + 1) * 6])

    for scale in (False, True):
        full = xs[0].repeat(1, p).clone().requires_grad_(True)  # the same on every rank
        part = pdist.shard(ctx, full, dim=1, scale_grad=scale)
        assert torch.equal(part, full.detach()[:, r * 6 : (r + 1) * 6])
        (part * ws[r]).sum().backward()
        expected = torch.cat(ws, dim=1) / (p if scale else 1)
        torch.testing.assert_close(full.grad, expected)


@world_sizes(2)
def test_no_autograd_when_gradients_are_off(ctx):
    """With gradients disabled, outputs carry no autograd history."""
    x = torch.ones(2, 4, requires_grad=True)
    with torch.no_grad():
        assert pdist.all_reduce(ctx, x).grad_fn is None
        assert pdist.all_gather(ctx, x).grad_fn is None
    assert pdist.all_reduce(ctx, x).grad_fn is not None


@world_sizes(3)
def test_send_recv_pipeline_order(ctx):
    """send/recv default to the next and previous rank of the group."""
    for dtype in DTYPES:
        x = torch.full((2, 2), ctx.rank, dtype=dtype)
        # A ring: 0 -> 1 -> 2 -> 0.
        if ctx.rank == 0:
            pdist.send(ctx, x)
            got = pdist.recv(ctx, (2, 2), dtype)
        else:
            got = pdist.recv(ctx, (2, 2), dtype)
            pdist.send(ctx, x)
        assert torch.equal(got, torch.full((2, 2), ctx.world.prev_rank, dtype=dtype))
    if ctx.rank == 0:
        pdist.send(ctx, torch.ones(1), dst=2)
    elif ctx.rank == 2:
        assert pdist.recv(ctx, (1,), torch.float32, src=0).item() == 1.0


@world_sizes(2, 3)
def test_bad_arguments_raise_on_every_rank_before_any_collective(ctx):
    """Out-of-range src/dst/dim and bad all_to_all_4d shapes raise ValueError everywhere."""
    w = ctx.world_size
    x = torch.ones(2, w + 1, 4, 4)
    with pytest.raises(ValueError, match=rf"src={w} is outside group 'world' of size {w}"):
        pdist.broadcast(ctx, x.contiguous(), src=w)
    with pytest.raises(ValueError, match=rf"dst=-1 is outside group 'world' of size {w}"):
        pdist.gather(ctx, x, dst=-1)
    with pytest.raises(ValueError, match=r"dim=4 is out of range for a 4-D tensor"):
        pdist.all_gather(ctx, x, dim=4)
    with pytest.raises(ValueError, match=r"needs a 4-D tensor, got shape \(2, 3\)"):
        pdist.all_to_all_4d(ctx, torch.ones(2, 3))
    with pytest.raises(
        ValueError, match=rf"size {w + 1}, which the group size {w} does not divide"
    ):
        pdist.all_to_all_4d(ctx, x, scatter_dim=1, gather_dim=2)
    with pytest.raises(ValueError, match=r"op='avg' is not one of"):
        pdist.all_reduce(ctx, x, op="avg")
    with pytest.raises(TypeError, match=r"op='mean' needs a floating-point tensor"):
        pdist.all_reduce(ctx, torch.ones(2, dtype=torch.int64), op="mean")
    with pytest.raises(TypeError, match=r"x must be a torch\.Tensor"):
        pdist.all_reduce(ctx, [1.0])
    # Nothing was left half-done: a collective still lines up.
    assert pdist.all_reduce(ctx, torch.ones(1)).item() == w


@world_sizes(1)
def test_one_rank_group_is_identity(ctx):
    """On a one-rank group every collective is the identity."""
    x = torch.arange(8.0).reshape(1, 2, 2, 2)
    assert pdist.all_reduce(ctx, x) is x
    assert pdist.all_gather(ctx, x) is x
    assert pdist.all_to_all_4d(ctx, x) is x
    assert pdist.shard(ctx, x, scale_grad=True) is x
    assert pdist.broadcast(ctx, x) is x
    assert pdist.gather(ctx, x) is x
    assert pdist.all_gather_tensor(ctx, x) == [x]
    with pytest.raises(ValueError, match="needs a group of at least 2 ranks"):
        pdist.send(ctx, x)


@world_sizes(2)
def test_compiles_without_graph_breaks(ctx):
    """all_reduce, all_gather and all_to_all_4d trace under fullgraph=True and match eager."""

    def step(x):
        y = pdist.all_reduce(ctx.world, x) * 2
        z = pdist.all_gather(ctx.world, y, dim=0)  # [4, 12]
        return pdist.all_to_all_4d(ctx.world, z.reshape(2, 2, 4, 3))

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    x = torch.arange(24.0).reshape(2, 12) + ctx.rank
    try:
        assert torch.equal(compiled(x), step(x))
        xa = x.clone().requires_grad_(True)
        xb = x.clone().requires_grad_(True)
        compiled(xa).square().sum().backward()
        step(xb).square().sum().backward()
        torch.testing.assert_close(xa.grad, xb.grad)
    finally:
        # Compiled code holds the process groups; release it before the group is destroyed.
        del compiled
        torch._dynamo.reset()
