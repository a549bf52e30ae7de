"""Ulysses sequence parallelism: wrap an attention function so it runs over a group.

Any shape: each rank may hold a sequence chunk of its own length, and the heads
need not divide among the ranks (rank ``r`` takes ``ceil(H/P)`` or
``floor(H/P)`` of them, the first ``H % P`` ranks one more). With grouped-query
k/v each rank receives the k/v heads its q heads use, also when there are fewer
k/v heads than ranks. Per call, one small exchange (over the CPU group) tells
every rank the others' chunk lengths and checks that the head counts agree; it
carries any rank's argument error, so all raise together. Then q, k, v travel in
one row all-to-all, and the output in another, with the counts already known
(the backward reuses them).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple, cast

import torch

from ._agree import exchange_counts
from ._errors import RankMismatchError
from ._group import DistContext, Group, as_group
from ._serialize import DTYPES, dtype_name
from ._uneven import rows

__all__ = ["ulysses_attention"]


def _layout_dims(layout: object) -> tuple[int, int, int, int]:
    if not isinstance(layout, str) or sorted(layout) != sorted("bshd"):
        msg = (
            f"layout={layout!r} must name the 4 dims of q, k and v with the letters b (batch), "
            "s (sequence), h (heads), d (head size), such as 'bhsd' (SDPA, transformers) "
            "or 'bshd' (flash-attn)"
        )
        raise ValueError(msg)
    return layout.index("h"), layout.index("s"), layout.index("b"), layout.index("d")


def _split_heads(total: int, parts: int) -> list[int]:
    """``total`` as ``parts`` near-equal ints, the larger first."""
    return [total // parts + (r < total % parts) for r in range(parts)]


def _kv_heads(first: int, count: int, group_size: int) -> list[int]:
    """The k/v heads q heads ``first .. first + count - 1`` read, in the layout attention wants.

    The distinct heads when local q head ``i`` reads local k/v head ``i // (count / n)``
    as grouped-query attention maps them; otherwise one k/v head per q head.
    """
    wanted = [(first + i) // group_size for i in range(count)]
    distinct = sorted(set(wanted))
    per = count // len(distinct) if distinct and count % len(distinct) == 0 else 0
    if per and wanted == [distinct[i // per] for i in range(count)]:
        return distinct
    return wanted


class _HeadPlan(NamedTuple):
    """Who holds what, agreed in the call's one exchange."""

    seqs: list[int]  # every rank's chunk length
    heads: list[int]  # q heads per rank
    kv: list[list[int]]  # the k/v heads each rank receives
    shape: tuple[int, int, int, int]  # (q heads, k/v heads, batch, head size) on every rank


def _check(
    layout: str, dims: tuple[int, int, int, int], q: object, k: object, v: object
) -> tuple[int, ...]:
    """This rank's record (chunk length, heads, k/v heads, batch, q/k and v head sizes, dtype)."""
    h, s, b, d = dims
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            got = f"shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
            msg = f"ulysses_attention: {name} must be a 4-D tensor in layout {layout!r}, got {got}"
            raise ValueError(msg)
    q, k, v = cast("tuple[torch.Tensor, torch.Tensor, torch.Tensor]", (q, k, v))
    if not q.dtype == k.dtype == v.dtype:
        msg = (
            f"ulysses_attention: q, k, v have dtypes {q.dtype}, {k.dtype}, {v.dtype}; "
            "cast them to one"
        )
        raise ValueError(msg)
    same = k.shape[h] == v.shape[h] and k.shape[d] == q.shape[d]
    if (
        not same
        or not q.shape[s] == k.shape[s] == v.shape[s]
        or not q.shape[b] == k.shape[b] == v.shape[b]
    ):
        msg = (
            f"ulysses_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} "
            f"(layout {layout!r}) must share batch and sequence, k and v their heads, "
            "q and k their head size"
        )
        raise ValueError(msg)
    if q.shape[h] % k.shape[h]:
        msg = (
            f"ulysses_attention: q has {q.shape[h]} heads, which its {k.shape[h]} k/v heads "
            "do not divide (grouped-query attention)"
        )
        raise ValueError(msg)
    dtype = DTYPES.index(q.dtype)
    return (q.shape[s], q.shape[h], k.shape[h], q.shape[b], q.shape[d], v.shape[d], dtype)


def _head_plan(g: Group, layout: str, dims: tuple[int, int, int, int], *qkv: object) -> _HeadPlan:
    """Exchange every rank's record once; raise on every rank if any failed or they differ."""
    if torch.compiler.is_compiling():
        # Nothing to exchange while tracing: a compiled call assumes every rank's chunk
        # is as long as this one's (the even case; the heads may still be any number).
        got = [list(_check(layout, dims, *qkv))] * g.world_size
        return _plan_from(g, got)
    error: BaseException | None = None
    try:
        record = _check(layout, dims, *qkv)
    except ValueError as e:
        error = e
    got = exchange_counts(
        g, None if error else [record] * g.world_size, error, width=7, what="ulysses_attention"
    )
    shapes = {tuple(r[1:]) for r in got}
    if len(shapes) > 1:
        listed = "; ".join(
            f"rank {g.ranks[j]}: {tuple(r[1:6])} {_dtype_name(r[6])}" for j, r in enumerate(got)
        )
        msg = (
            "ulysses_attention: ranks passed different (heads, k/v heads, batch, q/k head "
            f"size, v head size) or dtypes: {listed}"
        )
        raise RankMismatchError(msg)
    return _plan_from(g, got)


def _dtype_name(code: int) -> str:
    return dtype_name(DTYPES[code]) if 0 <= code < len(DTYPES) else "?"


def _plan_from(g: Group, got: list[list[int]]) -> _HeadPlan:
    hq, hkv = got[0][1], got[0][2]
    heads = _split_heads(hq, g.world_size)
    firsts = [sum(heads[:j]) for j in range(g.world_size)]
    kv = [_kv_heads(firsts[j], heads[j], hq // hkv) for j in range(g.world_size)]
    return _HeadPlan([r[0] for r in got], heads, kv, tuple(got[0][1:5]))  # type: ignore[arg-type]


def _inverse(order: tuple[int, ...]) -> list[int]:
    back = [0] * len(order)
    for i, o in enumerate(order):
        back[o] = i
    return back


def _to_heads(
    g: Group, plan: _HeadPlan, canon: tuple[int, int, int, int], qkv: tuple[torch.Tensor, ...]
) -> list[torch.Tensor]:
    """``[.., s_r, .., H, ..]`` -> ``[.., S, .., h_r, ..]`` for q, k, v in one all-to-all."""
    p, me = g.world_size, g.rank_in_group
    q, k, v = (x.permute(canon) for x in qkv)  # [H, s, B, D]: rows by head
    pieces, send = [], []
    for j in range(p):
        first = sum(plan.heads[:j])
        kv = torch.tensor(plan.kv[j], dtype=torch.int64, device=q.device)
        parts = [q[first : first + plan.heads[j]], k.index_select(0, kv), v.index_select(0, kv)]
        pieces += [x.reshape(-1) for x in parts]
        send.append(sum(x.numel() for x in parts))
    _, _, batch, dq = plan.shape
    dv = v.shape[3]
    hq, hkv = plan.heads[me], len(plan.kv[me])
    sizes = [[hq * s * batch * dq, hkv * s * batch * dq, hkv * s * batch * dv] for s in plan.seqs]
    got = rows(g, torch.cat(pieces), send, [sum(n) for n in sizes])
    blocks: list[list[torch.Tensor]] = [[], [], []]
    for s, n, part in zip(
        plan.seqs, sizes, got.split_with_sizes([sum(n) for n in sizes]), strict=True
    ):
        for i, (x, heads, d) in enumerate(
            zip(part.split_with_sizes(n), (hq, hkv, hkv), (dq, dq, dv), strict=True)
        ):
            blocks[i].append(x.view(heads, s, batch, d))
    back = _inverse(canon)
    return [torch.cat(b, dim=1).permute(back) for b in blocks]  # [h_r, S, B, D] -> layout


def _to_sequence(
    g: Group, plan: _HeadPlan, canon: tuple[int, int, int, int], out: torch.Tensor
) -> torch.Tensor:
    """``[.., S, .., h_r, ..]`` -> ``[.., s_r, .., H, ..]``: the output's way back."""
    me, (h, s, b, d) = g.rank_in_group, canon
    order = (s, h, b, d)
    o = out.permute(order)  # [S, h_r, B, D]: rows by position, rank j's block j
    _, _, batch, dim = o.shape
    mine = plan.seqs[me]
    send = [n * plan.heads[me] * batch * dim for n in plan.seqs]
    recv = [mine * n * batch * dim for n in plan.heads]
    got = rows(g, o.reshape(-1), send, recv)
    blocks = [
        x.view(mine, n, batch, dim)
        for x, n in zip(got.split_with_sizes(recv), plan.heads, strict=True)
    ]
    return torch.cat(blocks, dim=1).permute(_inverse(order))


def ulysses_attention(
    group: Group | DistContext, attention: Callable[..., torch.Tensor], *, layout: str = "bhsd"
) -> Callable[..., torch.Tensor]:
    """Wrap ``attention(q, k, v, ...)`` for Ulysses sequence parallelism over ``group``.

    Rank ``i`` holds the ``i``-th chunk of the sequence, of any length (the
    sequence is the chunks in group order); ``attention`` runs on the full
    sequence and rank ``r``'s share of the heads (``ceil(H/P)`` or
    ``floor(H/P)``, the first ``H % P`` ranks one more), with the k/v heads
    those q heads read under grouped-query attention (also with fewer k/v heads
    than ranks); the arguments after ``q, k, v`` reach it unchanged. Each rank
    gets the output for its chunk and all heads. Differentiable.

    Example:
        On 2 ranks, ``[B, H, S_r, D]`` per rank:

        ```python
        sdpa = pdist.ulysses_attention(ctx.sp, F.scaled_dot_product_attention)
        out = sdpa(q, k, v, is_causal=True)  # [B, H, S_r, D]
        ```

    Note:
        All ranks of the group must call the returned function, with
        tensors of the same heads, batch, head sizes and dtype; only the sequence
        length may differ. Each call exchanges the chunk lengths once (a small
        all-to-all over the CPU group, which makes every rank raise when one
        passed bad tensors), then moves q, k, v in one all-to-all and the output
        in another. A compiled call (``torch.compile``) exchanges nothing while
        tracing and assumes every rank's chunk is as long as its own.

    Args:
        group: The sequence-parallel group (a context means its world).
        attention: ``attention(q, k, v, *args, **kwargs) -> out``, all in ``layout``.
        layout: The dims of q, k, v and the output: ``"bhsd"`` (SDPA, the
            default), ``"bshd"`` (flash-attn), ``"sbhd"``... Mind that
            [`all_to_all_4d`][pdist.all_to_all_4d]'s defaults assume ``"bshd"`` instead.

    Returns:
        ``wrapped(q, k, v, *args, **kwargs)``, same signature as ``attention``.

    Raises:
        ValueError: ``layout`` is not a permutation of ``"bshd"``; when called (on
            every rank), a tensor is not 4-D, or q, k, v do not fit together.
        RankMismatchError: When called, the ranks' heads, batch or head sizes differ.
        TypeError: When called, ``attention`` returned something other than a tensor.
    """
    dims = _layout_dims(layout)
    g = as_group(group)

    @functools.wraps(attention)
    def wrapped(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        if g.world_size == 1:
            _check(layout, dims, q, k, v)
            return attention(q, k, v, *args, **kwargs)
        plan = _head_plan(g, layout, dims, q, k, v)
        out = attention(*_to_heads(g, plan, dims, (q, k, v)), *args, **kwargs)
        if not isinstance(out, torch.Tensor):
            msg = (
                f"ulysses_attention: attention returned {type(out).__name__}, expected one "
                f"tensor in layout {layout!r}; wrap it to return only the output"
            )
            raise TypeError(msg)
        return _to_sequence(g, plan, dims, out)

    return wrapped
