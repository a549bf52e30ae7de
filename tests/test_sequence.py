"""ulysses_attention: sequence-parallel attention equals full attention, gradients included."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional

import pdist
from pdist.testing import world_sizes

B, H, S, D = 2, 12, 12, 4  # 12 heads and 12 positions divide among 1, 2, 3 (and 4, 6) ranks


def _bshd_sdpa(q, k, v, **kwargs):
    """SDPA on [B, S, H, D] tensors (the flash-attn layout)."""
    out = functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), **kwargs
    )
    return out.transpose(1, 2)


# (layout, sequence dim, heads of k and v, attention, keyword arguments)
CASES = [
    ("bhsd", 2, H, functional.scaled_dot_product_attention, {"is_causal": True}),
    ("bhsd", 2, H // 2, functional.scaled_dot_product_attention, {"enable_gqa": True}),
    ("bshd", 1, H, _bshd_sdpa, {"is_causal": True}),
]


@world_sizes(1, 2, 3)
def test_ulysses_attention_matches_full_attention(ctx):
    """Each rank's output and q/k/v gradients equal its slice of one-process attention."""
    p, r = ctx.world_size, ctx.rank
    for layout, seq_dim, kv_heads, attention, kwargs in CASES:
        gen = torch.Generator().manual_seed(0)

        def make(heads, layout=layout, gen=gen):
            shape = {"b": B, "h": heads, "s": S, "d": D}
            return torch.randn(*(shape[c] for c in layout), generator=gen)

        q, k, v, weight = make(H), make(kv_heads), make(kv_heads), make(H)
        mine = [slice(None)] * 4
        mine[seq_dim] = slice(r * S // p, (r + 1) * S // p)  # this rank's sequence chunk
        mine = tuple(mine)

        local = [t[mine].clone().requires_grad_() for t in (q, k, v)]
        out = pdist.ulysses_attention(ctx, attention, layout=layout)(*local, **kwargs)
        (out * weight[mine]).sum().backward()  # the total loss is the sum of the ranks' losses

        full = [t.clone().requires_grad_() for t in (q, k, v)]
        reference = attention(*full, **kwargs)
        (reference * weight).sum().backward()

        torch.testing.assert_close(out, reference[mine], msg=layout)
        for got, ref in zip(local, full, strict=True):
            torch.testing.assert_close(got.grad, ref.grad[mine], msg=layout)


UNEVEN = [5, 4, 3]  # each rank's sequence chunk on 3 ranks


def _uneven_case(ctx, heads, kv_heads, causal, layout="bhsd"):
    """One rank's output and grads against its slice of full attention on chunks of 5, 4, 3."""
    r, total, d = ctx.rank, sum(UNEVEN), 4
    seq_dim = layout.index("s")
    gen = torch.Generator().manual_seed(heads * 10 + kv_heads)

    def make(h):
        shape = {"b": 2, "h": h, "s": total, "d": d}
        return torch.randn(*(shape[c] for c in layout), generator=gen)

    q, k, v, weight = make(heads), make(kv_heads), make(kv_heads), make(heads)
    start = sum(UNEVEN[:r])
    mine = [slice(None)] * 4
    mine[seq_dim] = slice(start, start + UNEVEN[r])
    mine = tuple(mine)
    attention = _bshd_sdpa if layout == "bshd" else functional.scaled_dot_product_attention
    kwargs = {"is_causal": causal, "enable_gqa": kv_heads != heads}

    local = [t[mine].clone().requires_grad_() for t in (q, k, v)]
    out = pdist.ulysses_attention(ctx, attention, layout=layout)(*local, **kwargs)
    (out * weight[mine]).sum().backward()
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    reference = attention(*full, **kwargs)
    (reference * weight).sum().backward()
    what = f"heads={heads} kv={kv_heads} causal={causal} {layout}"
    torch.testing.assert_close(out, reference[mine], msg=what)
    for got, ref in zip(local, full, strict=True):
        torch.testing.assert_close(got.grad, ref.grad[mine], msg=what)


@world_sizes(3)
def test_ulysses_attention_on_uneven_chunks_and_heads(ctx):
    """Chunks of 5, 4, 3 tokens, 5 heads, GQA (also fewer k/v heads than ranks), causal or not."""
    for heads, kv_heads in ((5, 5), (4, 2), (6, 2), (6, 1), (2, 2)):
        for causal in (False, True):
            _uneven_case(ctx, heads, kv_heads, causal)
    _uneven_case(ctx, 5, 5, True, layout="bshd")


@world_sizes(3)
def test_ulysses_attention_mismatch_raises_on_every_rank(ctx):
    """Different head counts or one rank's bad tensor raise on every rank; the group goes on."""
    sdpa = pdist.ulysses_attention(ctx, functional.scaled_dot_product_attention)
    heads = 4 if ctx.rank == 1 else 3
    x = torch.randn(1, heads, 2, 2)
    with pytest.raises(pdist.RankMismatchError, match=r"rank 1: \(4, 4, 1, 2, 2\)"):
        sdpa(x, x, x)
    y = torch.randn(1, 3, 2, 2)
    k = torch.randn(1, 2, 2, 2) if ctx.rank == 2 else y
    with pytest.raises(
        ValueError, match=r"failed on rank 2: .*q has 3 heads, which its 2 k/v heads"
    ):
        sdpa(y, k, k)
    z = y.double() if ctx.rank == 0 else y  # a dtype the exchange compares too
    with pytest.raises(pdist.RankMismatchError, match=r"rank 0: \(3, 3, 1, 2, 2\) float64"):
        sdpa(z, z, z)
    pdist.barrier(ctx)


@world_sizes(2)
def test_ulysses_attention_bad_input_raises_before_any_exchange(ctx):
    """Non-4-D inputs and tuple outputs raise clearly."""
    sdpa = pdist.ulysses_attention(ctx, functional.scaled_dot_product_attention)
    with pytest.raises(ValueError, match=r"k must be a 4-D tensor in layout 'bhsd', got shape"):
        sdpa(torch.randn(1, 2, 4, 2), torch.randn(4, 2), torch.randn(1, 2, 4, 2))

    def with_weights(q, k, v):
        return functional.scaled_dot_product_attention(q, k, v), None

    x = torch.randn(1, 2, 4, 2)
    with pytest.raises(TypeError, match="attention returned tuple, expected one tensor"):
        pdist.ulysses_attention(ctx, with_weights)(x, x, x)
    pdist.barrier(ctx)


@pytest.mark.parametrize("layout", ["bhs", "bhsx", "bbsd", 4])
def test_ulysses_attention_bad_layout(layout):
    """A layout that is not a permutation of 'bshd' is a ValueError naming it."""
    with pytest.raises(ValueError, match=rf"layout={layout!r} must name the 4 dims"):
        pdist.ulysses_attention(None, functional.scaled_dot_product_attention, layout=layout)


@world_sizes(2)
def test_ulysses_attention_compiles_on_even_chunks(ctx):
    """Compiled (fullgraph=True) on equal chunks, with 3 heads and 1 k/v head, it equals eager."""
    sdpa = pdist.ulysses_attention(ctx, functional.scaled_dot_product_attention)

    def step(q, k, v):
        return sdpa(q, k, v, is_causal=True, enable_gqa=True)

    gen = torch.Generator().manual_seed(ctx.rank)
    q, k, v = (torch.randn(1, h, 4, 2, generator=gen) for h in (3, 1, 1))
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    try:
        ours = [t.clone().requires_grad_() for t in (q, k, v)]
        theirs = [t.clone().requires_grad_() for t in (q, k, v)]
        compiled(*ours).square().sum().backward()
        step(*theirs).square().sum().backward()
        torch.testing.assert_close(compiled(q, k, v), step(q, k, v))
        for a, b in zip(ours, theirs, strict=True):
            torch.testing.assert_close(a.grad, b.grad)
    finally:
        del compiled  # compiled code holds the process groups
        torch._dynamo.reset()
