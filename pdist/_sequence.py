"""Ulysses sequence parallelism: wrap an attention function so it runs over a group."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from ._collectives import all_to_all_4d
from ._group import DistContext, Group, as_group

__all__ = ["ulysses_attention"]


def _layout_dims(layout: object) -> tuple[int, int, int]:
    if not isinstance(layout, str) or sorted(layout) != sorted("bshd"):
        msg = (
            f"layout={layout!r} must name the 4 dims of q, k and v with the letters b (batch), "
            "s (sequence), h (heads), d (head size), such as 'bhsd' (SDPA, transformers) "
            "or 'bshd' (flash-attn)"
        )
        raise ValueError(msg)
    return layout.index("b"), layout.index("s"), layout.index("h")


def ulysses_attention(
    group: Group | DistContext, attention: Callable[..., torch.Tensor], *, layout: str = "bhsd"
) -> Callable[..., torch.Tensor]:
    """Wrap ``attention(q, k, v, ...)`` for Ulysses sequence parallelism over ``group``.

    Rank ``i`` holds the ``i``-th of equal chunks of the sequence; ``attention`` runs
    on the full sequence and ``1/P`` of the heads (the arguments after ``q, k, v``
    reach it unchanged); each rank gets the output for its chunk and all heads.
    Differentiable.

    Example (on 2 ranks, ``[B, H, S/2, D]`` per rank)::

        sdpa = pdist.ulysses_attention(ctx.sp, F.scaled_dot_product_attention)
        out = sdpa(q, k, v, is_causal=True)  # [B, H, S/2, D]

    Note:
        All ranks of the group must call the returned function, with
        tensors of the same shapes and dtype.

    Args:
        group: The sequence-parallel group (a context means its world).
        attention: ``attention(q, k, v, *args, **kwargs) -> out``, all in ``layout``.
        layout: The dims of q, k, v and the output: ``"bhsd"`` (SDPA, the
            default), ``"bshd"`` (flash-attn), ``"sbhd"``... Mind that
            :func:`all_to_all_4d`'s defaults assume ``"bshd"`` instead.

    Returns:
        ``wrapped(q, k, v, *args, **kwargs)``, same signature as ``attention``.

    Raises:
        ValueError: ``layout`` is not a permutation of ``"bshd"``; when called,
            the group size does not divide the heads, or a tensor is not 4-D.
        TypeError: When called, ``attention`` returned something other than a tensor.
    """
    batch_dim, seq_dim, heads_dim = _layout_dims(layout)
    g = as_group(group)

    def check(name: str, x: object) -> None:
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            got = f"shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
            msg = f"ulysses_attention: {name} must be a 4-D tensor in layout {layout!r}, got {got}"
            raise ValueError(msg)
        if x.shape[heads_dim] % g.world_size:
            msg = (
                f"ulysses_attention on rank {g.rank}: {name} has {x.shape[heads_dim]} heads "
                f"(dim {heads_dim} of layout {layout!r}), which the group's {g.world_size} "
                f"ranks do not divide; use a group size that divides the number of heads"
            )
            raise ValueError(msg)

    def to_heads(xs: list[torch.Tensor]) -> list[torch.Tensor]:
        # Same shapes travel together: one exchange for q, k, v stacked along the batch dim.
        x = torch.cat(xs, dim=batch_dim) if len(xs) > 1 else xs[0]
        out = all_to_all_4d(g, x, scatter_dim=heads_dim, gather_dim=seq_dim)  # S/P, H -> S, H/P
        return list(out.chunk(len(xs), dim=batch_dim)) if len(xs) > 1 else [out]

    @functools.wraps(attention)
    def wrapped(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        for name, x in (("q", q), ("k", k), ("v", v)):
            check(name, x)
        if g.world_size == 1:
            return attention(q, k, v, *args, **kwargs)
        if q.shape == k.shape == v.shape and q.dtype == k.dtype == v.dtype:
            q, k, v = to_heads([q, k, v])
        elif k.shape == v.shape and k.dtype == v.dtype:  # grouped-query attention
            (q,) = to_heads([q])
            k, v = to_heads([k, v])
        else:
            q, k, v = (to_heads([x])[0] for x in (q, k, v))
        out = attention(q, k, v, *args, **kwargs)
        if not isinstance(out, torch.Tensor):
            msg = (
                f"ulysses_attention: attention returned {type(out).__name__}, expected one "
                f"tensor in layout {layout!r}; wrap it to return only the output"
            )
            raise TypeError(msg)
        # [.., S, .., H/P, ..] -> [.., S/P, .., H, ..]
        return all_to_all_4d(g, out, scatter_dim=seq_dim, gather_dim=heads_dim)

    return wrapped
