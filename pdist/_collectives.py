"""Tensor collectives on a Group: out-of-place, group-relative, differentiable where useful.

Eager calls use torch's plain collectives. While ``torch.compile`` traces,
the same functions switch to torch's functional collectives, which trace
without a graph break (functional collectives keep their process groups
alive, so they are used only while tracing). With gradients disabled the
autograd machinery is skipped.
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from ._group import DistContext, Group, as_group
from ._wire import all_gather_into

__all__ = [
    "all_gather",
    "all_gather_tensor",
    "all_reduce",
    "all_to_all_4d",
    "broadcast",
    "gather",
    "recv",
    "reduce",
    "send",
    "shard",
]

_OPS: dict[str, Any] = {
    "sum": ReduceOp.SUM,
    "mean": ReduceOp.SUM,  # divided afterwards: gloo has no AVG
    "max": ReduceOp.MAX,
    "min": ReduceOp.MIN,
    "product": ReduceOp.PRODUCT,
}
_FUNCOL_OPS = {"sum": "sum", "mean": "sum", "max": "max", "min": "min", "product": "product"}


def _compiling() -> bool:
    return bool(torch.compiler.is_compiling())


def _funcol() -> Any:
    from torch.distributed import _functional_collectives

    return _functional_collectives


def _check_op(op: str, allowed: tuple[str, ...]) -> str:
    if op not in allowed:
        msg = f"op={op!r} is not one of {allowed}"
        raise ValueError(msg)
    return op


def _check_tensor(x: object, name: str = "x") -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        msg = f"{name} must be a torch.Tensor, got {type(x).__name__}"
        raise TypeError(msg)
    return x


def _norm_dim(x: torch.Tensor, dim: int, name: str = "dim") -> int:
    ndim = max(x.dim(), 1)
    if isinstance(dim, bool) or not isinstance(dim, int) or not -ndim <= dim < ndim:
        msg = f"{name}={dim!r} is out of range for a {x.dim()}-D tensor of shape {tuple(x.shape)}"
        raise ValueError(msg)
    return dim % ndim


def _check_divisible(x: torch.Tensor, dim: int, group: Group, name: str) -> None:
    if x.shape[dim] % group.world_size:
        msg = (
            f"{name}: dimension {dim} of shape {tuple(x.shape)} has size {x.shape[dim]}, "
            f"which the group size {group.world_size} does not divide"
        )
        raise ValueError(msg)


def _needs_grad(x: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and x.requires_grad


# --------------------------------------------------------------------------- raw implementations


def _all_reduce_impl(group: Group, x: torch.Tensor, op: str) -> torch.Tensor:
    if _compiling():
        fc = _funcol()
        out = cast(
            "torch.Tensor", fc.wait_tensor(fc.all_reduce(x, _FUNCOL_OPS[op], group.device_group))
        )
    else:
        out = x.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, op=_OPS[op], group=group.device_group)
    if op == "mean":
        out = out / group.world_size
    return out


def _all_gather_impl(group: Group, x: torch.Tensor, dim: int) -> torch.Tensor:
    x = x.contiguous()
    if _compiling():
        fc = _funcol()
        out = fc.all_gather_tensor(x, dim, group.device_group)
        return cast("torch.Tensor", fc.wait_tensor(out))
    flat = x.new_empty(group.world_size * x.numel())
    all_gather_into(flat, x.view(-1), group.device_group)
    if dim == 0:
        return flat.view(group.world_size * x.shape[0], *x.shape[1:])  # rank-major: no copy
    return torch.cat(flat.view(group.world_size, *x.shape).unbind(0), dim=dim)


def _reduce_scatter_impl(group: Group, x: torch.Tensor, dim: int) -> torch.Tensor:
    """This rank's chunk (along ``dim``) of the sum of ``x`` over the group."""
    if _compiling():
        fc = _funcol()
        return cast(
            "torch.Tensor",
            fc.wait_tensor(
                fc.reduce_scatter_tensor(x.contiguous(), "sum", dim, group.device_group)
            ),
        )
    if dist.get_backend(group.device_group) == "gloo":
        # gloo has no reduce-scatter: all-reduce, then keep our chunk.
        total = x.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(total, group=group.device_group)
        return total.chunk(group.world_size, dim=dim)[group.rank_in_group].contiguous()
    moved = x.movedim(dim, 0).contiguous()  # [P * n, ...]
    out = moved.new_empty((moved.shape[0] // group.world_size, *moved.shape[1:]))
    dist.reduce_scatter_tensor(out, moved, group=group.device_group)
    return out.movedim(0, dim)


def _all_to_all_impl(
    group: Group, x: torch.Tensor, scatter_dim: int, gather_dim: int
) -> torch.Tensor:
    chunks = torch.stack(x.chunk(group.world_size, dim=scatter_dim))  # [P, *chunk]
    if _compiling():
        fc = _funcol()
        out = fc.wait_tensor(fc.all_to_all_single(chunks, None, None, group.device_group))
    else:
        out = torch.empty_like(chunks)
        dist.all_to_all_single(out, chunks, group=group.device_group)
    return torch.cat(out.unbind(0), dim=gather_dim)


# --------------------------------------------------------------------------- autograd


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, group: Group, x: torch.Tensor, op: str) -> torch.Tensor:
        ctx.group, ctx.op = group, op
        return _all_reduce_impl(group, x, op)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor, None]:
        return None, _all_reduce_impl(ctx.group, grad, ctx.op), None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, group: Group, x: torch.Tensor, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _all_gather_impl(group, x, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor, None]:
        return None, _reduce_scatter_impl(ctx.group, grad, ctx.dim), None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, group: Group, x: torch.Tensor, scatter_dim: int, gather_dim: int
    ) -> torch.Tensor:
        ctx.group, ctx.dims = group, (scatter_dim, gather_dim)
        return _all_to_all_impl(group, x, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor, None, None]:
        scatter_dim, gather_dim = ctx.dims
        return None, _all_to_all_impl(ctx.group, grad, gather_dim, scatter_dim), None, None


class _Shard(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, group: Group, x: torch.Tensor, dim: int, scale_grad: bool
    ) -> torch.Tensor:
        ctx.group, ctx.dim, ctx.scale = group, dim, scale_grad
        return x.chunk(group.world_size, dim=dim)[group.rank_in_group].contiguous()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor, None, None]:
        full = _all_gather_impl(ctx.group, grad, ctx.dim)
        if ctx.scale:
            full = full / ctx.group.world_size
        return None, full, None, None


# --------------------------------------------------------------------------- public functions


def all_reduce(group: Group | DistContext, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """Reduce ``x`` over the group, out of place; every rank gets the result.

    ``op`` is ``"sum"``, ``"mean"``, ``"max"``, ``"min"`` or ``"product"``
    (``"mean"`` sums and divides, so it is right on gloo too). ``"sum"`` and
    ``"mean"`` are differentiable: the backward applies the same reduction to
    the gradient.

    .. note:: All ranks of the group must call it with tensors of the same shape and dtype.

    Returns:
        A new tensor; ``x`` itself is left unchanged. On a one-rank group, ``x``.
    """
    g = as_group(group)
    _check_tensor(x)
    _check_op(op, tuple(_OPS))
    if op == "mean" and not (x.is_floating_point() or x.is_complex()):
        msg = f"op='mean' needs a floating-point tensor, got dtype {x.dtype}; use op='sum'"
        raise TypeError(msg)
    if g.world_size == 1:
        return x
    if op in ("sum", "mean") and _needs_grad(x):
        return _AllReduce.apply(g, x, op)  # type: ignore[no-untyped-call,no-any-return]
    return _all_reduce_impl(g, x.detach() if x.requires_grad else x, op)


def all_gather(group: Group | DistContext, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` in group order; every rank gets it.

    Differentiable: the backward reduce-scatters the gradient.

    .. note:: All ranks of the group must call it with tensors of the same shape and dtype.
    """
    g = as_group(group)
    _check_tensor(x)
    d = _norm_dim(x, dim)
    if g.world_size == 1:
        return x
    if _needs_grad(x):
        return _AllGather.apply(g, x, d)  # type: ignore[no-untyped-call,no-any-return]
    return _all_gather_impl(g, x, d)


def all_gather_tensor(group: Group | DistContext, x: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's ``x`` as a list in group order (not differentiable).

    .. note:: All ranks of the group must call it with tensors of the same shape and dtype.
    """
    g = as_group(group)
    _check_tensor(x)
    if g.world_size == 1:
        return [x]
    x = x.detach().contiguous()
    outs = [torch.empty_like(x) for _ in g.ranks]
    dist.all_gather(outs, x, group=g.device_group)
    return outs


def gather(
    group: Group | DistContext, x: torch.Tensor, dst: int = 0, dim: int = -1
) -> torch.Tensor | None:
    """Concatenate every rank's ``x`` along ``dim`` on group index ``dst``.

    .. note:: All ranks of the group must call it with tensors of the same shape and dtype.

    Returns:
        The concatenation on ``dst``, None on the other ranks.
    """
    g = as_group(group)
    _check_tensor(x)
    dst_global = g.global_rank(dst, name="dst")
    d = _norm_dim(x, dim)
    if g.world_size == 1:
        return x
    x = x.detach().contiguous()
    if g.rank_in_group != dst:
        dist.gather(x, None, dst=dst_global, group=g.device_group)
        return None
    outs = [torch.empty_like(x) for _ in g.ranks]
    dist.gather(x, outs, dst=dst_global, group=g.device_group)
    return torch.cat(outs, dim=d)


def reduce(
    group: Group | DistContext, x: torch.Tensor, dst: int = 0, op: str = "mean"
) -> torch.Tensor | None:
    """Reduce ``x`` (``"sum"`` or ``"mean"``) onto group index ``dst``, out of place.

    .. note:: All ranks of the group must call it with tensors of the same shape and dtype.

    Returns:
        The reduction on ``dst``, None on the other ranks.
    """
    g = as_group(group)
    _check_tensor(x)
    _check_op(op, ("sum", "mean"))
    dst_global = g.global_rank(dst, name="dst")
    if op == "mean" and not (x.is_floating_point() or x.is_complex()):
        msg = f"op='mean' needs a floating-point tensor, got dtype {x.dtype}; use op='sum'"
        raise TypeError(msg)
    if g.world_size == 1:
        return x
    out = x.detach().clone(memory_format=torch.contiguous_format)
    dist.reduce(out, dst=dst_global, group=g.device_group)
    if g.rank_in_group != dst:
        return None
    return out / g.world_size if op == "mean" else out


def broadcast(group: Group | DistContext, x: torch.Tensor, src: int = 0) -> torch.Tensor:
    """Broadcast ``x`` from group index ``src`` into every rank's ``x``, in place.

    ``x`` must be contiguous on the receivers (it is written in place).

    .. note:: All ranks of the group must call it with tensors of the same shape and dtype.

    Returns:
        ``x``.
    """
    g = as_group(group)
    _check_tensor(x)
    src_global = g.global_rank(src)
    if g.world_size == 1:
        return x
    if not x.is_contiguous():
        msg = "broadcast writes x in place, so x must be contiguous; pass x.contiguous()"
        raise ValueError(msg)
    with torch.no_grad():
        dist.broadcast(x, src=src_global, group=g.device_group)
    return x


def all_to_all_4d(
    group: Group | DistContext, x: torch.Tensor, scatter_dim: int = 2, gather_dim: int = 1
) -> torch.Tensor:
    """The sequence-parallel (Ulysses) exchange of a 4-D tensor.

    With the defaults, ``[B, S/P, H, D] -> [B, S, H/P, D]``: each rank gives
    away head chunks and receives sequence chunks; ``scatter_dim=1,
    gather_dim=2`` is the way back. Differentiable: the backward is the
    inverse exchange.

    .. note:: All ranks of the group must call it with tensors of the same shape and dtype.

    Raises:
        ValueError: ``x`` is not 4-D, the dims are out of range or equal, or
            the group size does not divide ``x.shape[scatter_dim]``.
    """
    g = as_group(group)
    _check_tensor(x)
    if x.dim() != 4:
        msg = f"all_to_all_4d needs a 4-D tensor, got shape {tuple(x.shape)}"
        raise ValueError(msg)
    s = _norm_dim(x, scatter_dim, "scatter_dim")
    d = _norm_dim(x, gather_dim, "gather_dim")
    if s == d:
        msg = f"scatter_dim={scatter_dim} and gather_dim={gather_dim} must differ"
        raise ValueError(msg)
    _check_divisible(x, s, g, "all_to_all_4d scatter_dim")
    if g.world_size == 1:
        return x
    if _needs_grad(x):
        return _AllToAll.apply(g, x, s, d)  # type: ignore[no-untyped-call,no-any-return]
    return _all_to_all_impl(g, x, s, d)


def shard(
    group: Group | DistContext, x: torch.Tensor, dim: int = -1, *, scale_grad: bool
) -> torch.Tensor:
    """This rank's slice of ``x`` along ``dim`` (``x`` is the same on every rank).

    Differentiable: the backward all-gathers the gradient, divided by the
    group size when ``scale_grad`` (for a loss averaged over the group).

    Raises:
        ValueError: ``dim`` is out of range or the group size does not divide it.
    """
    g = as_group(group)
    _check_tensor(x)
    d = _norm_dim(x, dim)
    _check_divisible(x, d, g, "shard")
    if g.world_size == 1:
        return x
    if _needs_grad(x):
        return _Shard.apply(g, x, d, bool(scale_grad))  # type: ignore[no-untyped-call,no-any-return]
    return x.chunk(g.world_size, dim=d)[g.rank_in_group].contiguous()


def send(group: Group | DistContext, x: torch.Tensor, dst: int | None = None) -> None:
    """Send ``x`` to group index ``dst`` (default: the next rank) on the device group.

    .. note:: The destination must call :func:`recv` with the same shape and dtype.
    """
    g = as_group(group)
    _check_tensor(x)
    peer = g.ranks[g.peer_index(dst, g.next_rank, "dst")]
    dist.send(x.detach().contiguous(), dst=peer, group=g.device_group)


def recv(
    group: Group | DistContext,
    shape: tuple[int, ...] | torch.Size,
    dtype: torch.dtype,
    src: int | None = None,
) -> torch.Tensor:
    """Receive a tensor of ``shape``/``dtype`` from group index ``src`` (default: previous rank).

    Returns:
        A new tensor on the group's device.
    """
    g = as_group(group)
    peer = g.ranks[g.peer_index(src, g.prev_rank, "src")]
    out = torch.empty(tuple(shape), dtype=dtype, device=g.device)
    dist.recv(out, src=peer, group=g.device_group)
    return out
