"""Tensor collectives against single-process references, on real gloo processes."""

from __future__ import annotations

import re

import pytest
import torch

import pdist
from pdist._collectives import generic_path  # the documented seam: NCCL's paths, on gloo
from pdist._env import env_flag
from pdist.testing import spawn, world_sizes

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
    """Non-contiguous inputs are made contiguous, not refused; gathers work along every dim."""
    xs = [x.t() for x in _inputs(ctx.world_size, (4, 3), torch.float32, seed=4)]
    assert not xs[ctx.rank].is_contiguous()
    for dim in (0, 1, -1):
        got = pdist.all_gather(ctx, xs[ctx.rank], dim=dim)
        assert got.is_contiguous()
        assert torch.equal(got, torch.cat(xs, dim=dim))
    torch.testing.assert_close(pdist.all_reduce(ctx, xs[ctx.rank]), torch.stack(xs).sum(0))
    # A leading dim of size 1 makes every rank's block contiguous in the result.
    ys = _inputs(ctx.world_size, (1, 3, 5), torch.float32, seed=5)
    for dim in (0, 1, 2):
        assert torch.equal(pdist.all_gather(ctx, ys[ctx.rank], dim=dim), torch.cat(ys, dim=dim))
    sliced = [y[:, :, 1:4] for y in _inputs(ctx.world_size, (2, 3, 5), torch.int64, seed=6)]
    assert torch.equal(pdist.all_gather(ctx, sliced[ctx.rank], dim=1), torch.cat(sliced, dim=1))


def _reference(op, stacked, dtype):
    wide = stacked.to(torch.float64 if dtype.is_floating_point else dtype)
    return REFERENCE[op](wide).to(dtype)


def _assert_matches(got, expected, what):
    if expected.dtype.is_floating_point:
        tol = 2e-2 if expected.dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(got, expected, atol=tol, rtol=tol, msg=lambda m: f"{what}: {m}")
    else:
        assert torch.equal(got, expected), what


@world_sizes(2, 3)
def test_in_place_variants_match_reference(ctx):
    """all_reduce_ and broadcast_ write the reference into x itself, contiguous or not."""
    w, r = ctx.world_size, ctx.rank
    for dtype in [*DTYPES, torch.bool]:
        for op in REFERENCE:
            if (op == "mean" and not dtype.is_floating_point) or (
                dtype == torch.bool and op not in ("max", "min")
            ):
                continue
            for transpose in (False, True):
                xs = _inputs(w, (3, 5), dtype, seed=20)
                if transpose:
                    xs = [x.t() for x in xs]
                x = xs[r].clone() if not transpose else xs[r].t().clone().t()
                assert x.is_contiguous() != transpose
                assert pdist.all_reduce_(ctx, x, op=op) is x
                _assert_matches(x, _reference(op, torch.stack(xs), dtype), (op, dtype, transpose))
        ys = _inputs(w, (5, 3), dtype, seed=21)
        y = ys[r].t().clone().t()  # non-contiguous
        assert pdist.broadcast_(ctx, y, src=w - 1) is y
        assert torch.equal(y, ys[w - 1])
        z = ys[r].clone()
        assert pdist.broadcast_(ctx, z) is z
        assert torch.equal(z, ys[0])


@world_sizes(2)
def test_in_place_variants_refuse_tensors_that_require_grad(ctx):
    """With grad mode on, all_reduce_/broadcast_ refuse x.requires_grad and name the fix."""
    x = torch.ones(3, requires_grad=True)
    with pytest.raises(
        ValueError, match=r"all_reduce_ writes x in place .* \(rank \d+\); use pdist\.all_reduce"
    ):
        pdist.all_reduce_(ctx, x)
    with pytest.raises(ValueError, match=r"broadcast_ writes x in place .* pdist\.broadcast"):
        pdist.broadcast_(ctx, x)
    with torch.no_grad():
        assert pdist.all_reduce_(ctx, x).tolist() == [2.0, 2.0, 2.0]
        pdist.broadcast_(ctx, x, src=1)
    assert torch.equal(pdist.all_reduce_(ctx, torch.ones(2)), torch.full((2,), 2.0))


@world_sizes(2, 3)
def test_reduce_scatter_matches_reference(ctx):
    """Rank r gets chunk r of the reduction, for every dim, op and dtype, contiguous or not."""
    w, r = ctx.world_size, ctx.rank
    for dtype in [*DTYPES, torch.bool]:
        for op in REFERENCE:
            if (op == "mean" and not dtype.is_floating_point) or (
                dtype == torch.bool and op not in ("max", "min")
            ):
                continue
            xs = _inputs(w, (3 * w, 5, 2 * w), dtype, seed=30)
            full = _reference(op, torch.stack(xs), dtype)
            for dim in (0, 2, -1):
                got = pdist.reduce_scatter(ctx, xs[r], dim=dim, op=op)
                assert got.is_contiguous()
                _assert_matches(got, full.chunk(w, dim=dim)[r], (op, dtype, dim))
    xs = [x.transpose(0, 2) for x in _inputs(w, (2 * w, 5, 3 * w), torch.float32, seed=31)]
    assert not xs[r].is_contiguous()
    for dim in (0, 2):
        got = pdist.reduce_scatter(ctx, xs[r], dim=dim)
        torch.testing.assert_close(got, torch.stack(xs).sum(0).chunk(w, dim=dim)[r])
    with pytest.raises(ValueError, match=rf"size 5, which the group size {w} does not divide"):
        pdist.reduce_scatter(ctx, xs[r], dim=1)


@world_sizes(2, 3)
def test_reduce_scatter_gradients(ctx):
    """For the loss sum_r <out_r, W_r>, d/dx on every rank is the concatenation of the W_r."""
    p, r = ctx.world_size, ctx.rank
    xs = _inputs(p, (2 * p, 3), torch.float32, seed=40)
    ws = _inputs(p, (2, 3), torch.float32, seed=41)
    for op, scale in (("sum", 1.0), ("mean", 1.0 / p)):
        x = xs[r].clone().requires_grad_(True)
        out = pdist.reduce_scatter(ctx, x, dim=0, op=op)
        torch.testing.assert_close(out.detach(), torch.stack(xs).sum(0)[2 * r : 2 * r + 2] * scale)
        (out * ws[r]).sum().backward()
        torch.testing.assert_close(x.grad, torch.cat(ws, dim=0) * scale)
    # Along the last dim, with a non-contiguous input.
    x = xs[r].t().clone().requires_grad_(True)  # [3, 2P]
    (pdist.reduce_scatter(ctx, x.t().t(), dim=-1) * ws[r].t()).sum().backward()
    torch.testing.assert_close(x.grad, torch.cat([w_.t() for w_ in ws], dim=-1))


@world_sizes(2, 3)
def test_generic_paths_match_reference(ctx):
    """The all-gather and reduce-scatter that NCCL takes equal their references on gloo too."""
    w, r = ctx.world_size, ctx.rank
    for dtype in DTYPES:
        xs = _inputs(w, (2 * w, 5, 2 * w), dtype, seed=60)
        for transpose in (False, True):
            mine = xs[r].transpose(0, 2) if transpose else xs[r]
            every = [x.transpose(0, 2) for x in xs] if transpose else xs
            for dim in (0, 1, -1):
                got = generic_path("all_gather", ctx, mine, dim)
                assert torch.equal(got, torch.cat(every, dim=dim)), (dtype, transpose, dim)
            # The op is torch's (gloo's reduce-scatter ignores it on torch 2.6); the layout
            # of the chunks and the mean's division are pdist's.
            for op in ("sum", "mean") if dtype.is_floating_point else ("sum",):
                full = _reference(op, torch.stack(every), dtype)
                for dim in (0, -1):
                    got = generic_path("reduce_scatter", ctx, mine, op, dim)
                    _assert_matches(got, full.chunk(w, dim=dim)[r], (op, dtype, transpose, dim))
    with pytest.raises(ValueError, match=rf"size 5, which the group size {w} does not divide"):
        generic_path("reduce_scatter", ctx, xs[r], "sum", 1)


ASYNC_CASES = {
    "all_reduce": lambda g, x, x4, a: pdist.all_reduce(g, x, op="mean", async_op=a),
    "all_gather 0": lambda g, x, x4, a: pdist.all_gather(g, x, dim=0, async_op=a),
    "all_gather -1": lambda g, x, x4, a: pdist.all_gather(g, x, dim=-1, async_op=a),
    "reduce_scatter 0": lambda g, x, x4, a: pdist.reduce_scatter(g, x, dim=0, async_op=a),
    "reduce_scatter 1": lambda g, x, x4, a: pdist.reduce_scatter(
        g, x.transpose(0, 1), dim=1, async_op=a
    ),
    "all_to_all_4d": lambda g, x, x4, a: pdist.all_to_all_4d(g, x4, async_op=a),
    "all_to_all_4d to 0": lambda g, x, x4, a: pdist.all_to_all_4d(
        g, x4, scatter_dim=2, gather_dim=0, async_op=a
    ),
}


def _async_inputs(ctx, requires_grad=False):
    p, r = ctx.world_size, ctx.rank
    x = _inputs(p, (2 * p, 3, 5), torch.float32, seed=50)[r]
    x4 = _inputs(p, (2, 3, 2 * p, 5), torch.float32, seed=51)[r]
    return x.requires_grad_(requires_grad), x4.requires_grad_(requires_grad)


@world_sizes(2, 3)
def test_async_results_equal_sync_results(ctx):
    """async_op=True returns a tensor that waits on first use and equals the sync result."""
    x, x4 = _async_inputs(ctx)
    for name, call in ASYNC_CASES.items():
        expected = call(ctx, x, x4, False)
        pending = call(ctx, x, x4, True)
        assert isinstance(pending, torch.Tensor), name
        assert pending.shape == expected.shape, name
        a = torch.randn(64, 64)
        for _ in range(3):  # unrelated compute while the collective is in flight
            a = a @ a.t() / 64
        assert torch.equal(pending[0], expected[0]), name  # a view first
        assert torch.equal(pending * 1, expected), name
        assert pending.tolist() == expected.tolist(), name
    # A chain: an async result fed to the next collective before anyone used it.
    y = torch.full((2 * ctx.world_size,), float(ctx.rank))
    chained = pdist.all_reduce(ctx, pdist.all_reduce(ctx, y, async_op=True), async_op=True)
    assert torch.equal(chained, pdist.all_reduce(ctx, pdist.all_reduce(ctx, y)))
    z = pdist.all_gather(ctx, y, async_op=True)
    assert pdist.all_reduce_(ctx, z) is z
    assert torch.equal(z, pdist.all_reduce(ctx, pdist.all_gather(ctx, y)))


@world_sizes(2)
def test_async_results_are_differentiable(ctx):
    """Gradients through async results equal those through sync results."""
    for name, call in ASYNC_CASES.items():
        grads = []
        for async_op in (False, True):
            x, x4 = _async_inputs(ctx, requires_grad=True)
            out = call(ctx, x, x4, async_op)
            weight = torch.arange(out.numel(), dtype=torch.float32).reshape(out.shape) + ctx.rank
            (out * weight).sum().backward()
            grads.append(x4.grad if name.startswith("all_to_all") else x.grad)
        torch.testing.assert_close(grads[0], grads[1], msg=lambda m, n=name: f"{n}: {m}")


@world_sizes(1)
def test_one_rank_group_is_identity(ctx):
    """On a one-rank group every collective is the identity, async or not."""
    x = torch.arange(8.0).reshape(1, 2, 2, 2)
    assert pdist.all_reduce(ctx, x) is x
    assert pdist.all_reduce(ctx, x, async_op=True) is x
    assert pdist.all_reduce_(ctx, x, op="mean") is x
    assert pdist.broadcast_(ctx, x) is x
    assert torch.equal(x, torch.arange(8.0).reshape(1, 2, 2, 2))
    assert pdist.all_gather(ctx, x) is x
    assert pdist.all_gather(ctx, x, dim=1, async_op=True) is x
    assert pdist.reduce_scatter(ctx, x) is x
    assert pdist.reduce_scatter(ctx, x, dim=0, op="max", async_op=True) is x
    assert pdist.all_to_all_4d(ctx, x) is x
    assert pdist.all_to_all_4d(ctx, x, async_op=True) is x
    with pytest.raises(ValueError, match="all_reduce_ writes x in place"):
        pdist.all_reduce_(ctx, x.clone().requires_grad_(True))
    assert pdist.shard(ctx, x, scale_grad=True) is x
    assert pdist.broadcast(ctx, x) is x
    assert pdist.gather(ctx, x) is x
    assert pdist.all_gather_tensor(ctx, x) == [x]
    with pytest.raises(ValueError, match="needs a group of at least 2 ranks"):
        pdist.send(ctx, x)


@world_sizes(2)
def test_compiles_without_graph_breaks(ctx):
    """The traceable collectives, async ones included, compile under fullgraph=True."""

    def step(x, async_op):
        y = pdist.all_reduce(ctx.world, x, async_op=async_op) * 2
        z = pdist.all_gather(ctx.world, y, dim=0, async_op=async_op)  # [4, 12]
        u = pdist.all_to_all_4d(ctx.world, z.reshape(2, 2, 4, 3), async_op=async_op)
        v = pdist.reduce_scatter(ctx.world, u.reshape(8, 6), dim=-1, async_op=async_op)  # [8, 3]
        w = pdist.all_gather(ctx.world, y, dim=-1, async_op=async_op)  # [2, 24]
        return v + w.reshape(8, 6)[:, 1:4]

    def in_place(x):
        x = x * 1
        pdist.all_reduce_(ctx.world, x, op="mean")
        return pdist.broadcast_(ctx.world, x, src=1) + 1

    x = torch.arange(24.0).reshape(2, 12) + ctx.rank
    expected = step(x, False)
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    compiled_in_place = torch.compile(in_place, backend="aot_eager", fullgraph=True)
    try:
        for async_op in (False, True):
            assert torch.equal(compiled(x, async_op), expected)
            xa = x.clone().requires_grad_(True)
            xb = x.clone().requires_grad_(True)
            compiled(xa, async_op).square().sum().backward()
            step(xb, async_op).square().sum().backward()
            torch.testing.assert_close(xa.grad, xb.grad)
        explained = torch._dynamo.explain(step)(x, True)
        assert explained.graph_break_count == 0, explained.break_reasons
        assert torch.equal(compiled_in_place(x), in_place(x))
    finally:
        # Compiled code holds the process groups; release it before the group is destroyed.
        del compiled, compiled_in_place, explained
        torch._dynamo.reset()


@world_sizes(2, timeout=300)  # importing inductor alone takes a minute on a loaded machine
def test_inductor_waits_once_per_collective(ctx):
    """In inductor's generated code, each traced collective is followed by exactly one wait."""
    from torch._inductor.utils import run_and_get_code

    def step(x):
        a = pdist.all_to_all_4d(ctx.world, x, scatter_dim=2, gather_dim=0)  # [2, 1, 1, 4]
        b = pdist.all_reduce(ctx.world, a)
        c = pdist.all_gather(ctx.world, b, dim=0)  # [4, 1, 1, 4]
        return pdist.reduce_scatter(ctx.world, c, dim=0)  # [2, 1, 1, 4]

    x = torch.arange(8.0).reshape(1, 1, 2, 4) + ctx.rank
    compiled = torch.compile(step, backend="inductor", fullgraph=True)
    # Along these dims every re-layout is a view: no C++ kernel to compile, which would
    # take most of the time; no cache, so that the code is generated afresh.
    options = {"fx_graph_cache": False, "compile_threads": 1}
    try:
        with torch._inductor.config.patch(options):
            out, codes = run_and_get_code(compiled, x)
        assert torch.equal(out, step(x))
    finally:
        del compiled
        torch._dynamo.reset()
    lines = [line for code in codes for line in code.splitlines() if "#" not in line]
    calls = re.findall(r"torch\.ops\._c10d_functional\.(\w+)\.default\(", "\n".join(lines))
    print(calls)
    assert calls[1::2] == ["wait_tensor"] * 4, calls
    expected = [
        "all_to_all_single",
        "all_reduce",
        "all_gather_into_tensor",
        "reduce_scatter_tensor",
    ]
    assert [c.rstrip("_") for c in calls[0::2]] == expected, calls


@world_sizes(3)
def test_compiled_in_place_collectives_on_a_subgroup(ctx):
    """Compiled broadcast_/all_reduce_ on ranks (1, 2) use group-relative src like eager ones."""
    group = pdist.new_group(ctx, [[1, 2]], name="pair")
    if group is None:
        return

    def step(x):
        y = pdist.broadcast_(group, x * 1, src=1)  # global rank 2's
        return pdist.all_reduce_(group, y + group.rank_in_group)

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    try:
        x = torch.full((3,), float(ctx.rank))
        assert torch.equal(compiled(x), step(x))
        assert torch.equal(step(x), torch.full((3,), 5.0))  # (2 + 0) + (2 + 1)
    finally:
        del compiled
        torch._dynamo.reset()


def _compiled_call_after_exit():
    with pdist.distributed() as ctx:
        group = ctx.world
        compiled = torch.compile(
            lambda x: pdist.all_gather(group, x, dim=-1) * 2, backend="aot_eager", fullgraph=True
        )
        compiled(torch.ones(2))
    try:
        compiled(torch.ones(2))
    except pdist.PdistError as error:
        return str(error)
    finally:
        del compiled
        torch._dynamo.reset()
    return "no error"


def test_compiled_function_after_exit_raises_pdist_error():
    """A compiled function called after its block exited raises PdistError, not dynamo's error."""
    for message in spawn(_compiled_call_after_exit, 2, timeout=120):
        assert message.startswith("this pdist context is closed"), message
        assert "torch.compile" in message


@world_sizes(2, 3)
def test_send_recv_take_a_shape_or_an_int_size(ctx):
    """recv takes a shape or an int size (as vLLM's GroupCoordinator.recv does), around a ring."""
    prev = (ctx.rank - 1) % ctx.world_size
    for shape, expected in ((6, (6,)), ((2, 3), (2, 3)), ([3, 2], (3, 2)), (torch.Size([6]), (6,))):
        mine = torch.arange(6.0).reshape(expected) + 10 * ctx.rank
        if ctx.rank == 0:  # rank 0 starts the ring; the others pass it on
            pdist.send(ctx, mine)
        got = pdist.recv(ctx, shape, dtype=torch.float32)
        if ctx.rank != 0:
            pdist.send(ctx, mine)
        assert torch.equal(got, torch.arange(6.0).reshape(expected) + 10 * prev), shape


@world_sizes(2)
def test_recv_checks_every_argument_before_receiving(ctx):
    """A bad shape or dtype raises before anything is received; a bad src on its rank alone.

    In check mode (the harness's) the sender hears the receiver's error and raises it too.
    """
    cases = (
        ("64", torch.float32, r"shape='64' must be an int or a sequence of non-negative ints"),
        ((2, 2.0), torch.float32, r"shape=\(2, 2.0\) must be an int"),
        ((2, -1), torch.float32, r"shape=\(2, -1\)"),
        (True, torch.float32, r"shape=True"),
        (None, torch.float32, r"shape=None"),
        (4, "float32", r"dtype='float32' must be a torch.dtype"),
    )
    for shape, dtype, match in cases:
        if ctx.rank == 0:
            with pytest.raises(TypeError, match=match):
                pdist.recv(ctx, shape, dtype, src=1)
        elif env_flag("PDIST_CHECK", False):
            with pytest.raises(TypeError, match="send .*failed on rank 0: TypeError: " + match):
                pdist.send(ctx, torch.ones(4), dst=0)
    if ctx.rank == 0:
        with pytest.raises(ValueError, match=r"src=2 is outside group 'world' of size 2"):
            pdist.recv(ctx, 4, torch.float32, src=2)
        # Checked in order, and none of them waited for a peer.
        with pytest.raises(TypeError, match="shape="):
            pdist.recv(ctx, "64", "float32", src=7)


def test_options_after_the_tensor_are_keyword_only():
    """op, dim, scatter_dim and gather_dim cannot be passed by position; src/dst can."""
    x = torch.ones(2)
    calls = [
        lambda: pdist.all_reduce(None, x, "sum"),
        lambda: pdist.all_reduce_(None, x, "sum"),
        lambda: pdist.all_gather(None, x, 0),
        lambda: pdist.reduce_scatter(None, x, 0),
        lambda: pdist.gather(None, x, 0, 1),
        lambda: pdist.reduce(None, x, 0, "sum"),
        lambda: pdist.broadcast_(None, x, 0),
        lambda: pdist.all_to_all_4d(None, x, 2, 1),
        lambda: pdist.shard(None, x, -1, True),
    ]
    for call in calls:
        with pytest.raises(TypeError, match="positional argument"):
            call()
    for call in (
        lambda: pdist.gather(None, x, 0),
        lambda: pdist.reduce(None, x, 0),
        lambda: pdist.broadcast(None, x, 0),
        lambda: pdist.shard(None, x, -1, scale_grad=True),
        lambda: pdist.send(None, x, 0),
        lambda: pdist.recv(None, (2,), torch.float32, 0),
    ):
        with pytest.raises(TypeError, match="must be a pdist Group or DistContext"):
            call()
