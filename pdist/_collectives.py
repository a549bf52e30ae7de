"""Tensor collectives on a Group: group-relative, differentiable where useful, async on request.

Eager calls use torch's plain collectives. While ``torch.compile`` traces,
the same functions switch to torch's functional collectives, which trace
without a graph break (functional collectives keep their process groups
alive, so they are used only while tracing). With gradients disabled the
autograd machinery is skipped.

Every eager collective is launched the same way: a result tensor in its final
layout, the torch work handle, and (where the wire layout is not the final
one) a finishing step, run after the work completes. A synchronous call waits
and finishes at once; ``async_op=True`` chains the finishing step onto the
work's future and returns torch's ``AsyncCollectiveTensor`` over the result,
so the wait happens when the tensor is first used, exactly as for torch's own
functional collectives.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from typing import Any, NamedTuple, cast

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from ._errors import PdistError
from ._group import DistContext, Group, as_group, recorded
from ._wire import all_gather_into

__all__ = [
    "all_gather",
    "all_gather_tensor",
    "all_reduce",
    "all_reduce_",
    "all_to_all_4d",
    "broadcast",
    "broadcast_",
    "gather",
    "recv",
    "reduce",
    "reduce_scatter",
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
_DIFFERENTIABLE_OPS = ("sum", "mean")
_FUNCOL_MODULE = "torch.distributed._functional_collectives"

# torch renamed the tensor-in/tensor-out collectives in 2.13 (the old names warn).
_reduce_scatter_single: Any = (
    getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
)
# The pieces torch's functional collectives use to make a tensor that waits on first use.
_c10d: Any = torch._C._distributed_c10d
_register_work: Any = getattr(_c10d, "_register_work", None)
_work_from_future: Any = getattr(_c10d, "_create_work_from_future", None)

# A graph compiled after its distributed() block exited has no process group to
# call; it gets this op instead, which raises pdist's own error when the graph
# runs. Raising while dynamo traces would surface as dynamo's "Observed
# exception" under fullgraph=True, with pdist's message buried in it.
_CLOSED_MESSAGE = (
    "this pdist context is closed: its process groups were destroyed when the "
    "`with pdist.distributed()` block exited, and a function compiled with torch.compile "
    "ran a collective on them afterwards; call compiled functions only inside the block"
)
_library: Any = torch.library  # its Library API is untyped
_LIB = _library.Library("pdist", "FRAGMENT")
_LIB.define("closed_group(Tensor x, SymInt[] shape, str message) -> Tensor")


def _closed_group_kernel(x: torch.Tensor, shape: list[int], message: str) -> torch.Tensor:
    raise PdistError(message)


def _closed_group_fake(x: torch.Tensor, shape: list[int], message: str) -> torch.Tensor:
    return x.new_empty(shape)


_LIB.impl("closed_group", _closed_group_kernel, "CompositeExplicitAutograd")
torch.library.register_fake("pdist::closed_group", _closed_group_fake, lib=_LIB)


def _compiling() -> bool:
    return bool(torch.compiler.is_compiling())


def _funcol() -> Any:
    from torch.distributed import _functional_collectives

    return _functional_collectives


def _check_op(op: str, allowed: tuple[str, ...], name: str = "op") -> str:
    if op not in allowed:
        msg = f"{name}={op!r} is not one of {allowed}"
        raise ValueError(msg)
    return op


def _check_mean_dtype(x: torch.Tensor, op: str) -> None:
    if op == "mean" and not (x.is_floating_point() or x.is_complex()):
        msg = f"op='mean' needs a floating-point tensor, got dtype {x.dtype}; use op='sum'"
        raise TypeError(msg)


def _check_tensor(x: object, name: str = "x") -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        msg = f"{name} must be a torch.Tensor, got {type(x).__name__}"
        raise TypeError(msg)
    return x


def _check_bool(value: object, name: str) -> bool:
    if not isinstance(value, bool):
        msg = f"{name}={value!r} must be True or False"
        raise TypeError(msg)
    return value


def _norm_dim(x: torch.Tensor, dim: int, name: str = "dim") -> int:
    ndim = x.dim()
    if isinstance(dim, bool) or not isinstance(dim, int) or not -ndim <= dim < ndim:
        msg = f"{name}={dim!r} is out of range for a {ndim}-D tensor of shape {tuple(x.shape)}"
        if ndim == 0:
            msg += "; give the tensor a dimension first (x.reshape(1))"
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


def _refuse_grad(group: Group, x: torch.Tensor, name: str, use: str) -> None:
    if _needs_grad(x):
        msg = (
            f"{name} writes x in place and is not differentiable, but x requires grad "
            f"(rank {group.rank}); use pdist.{use}(...) (out of place), or call it "
            "under torch.no_grad()"
        )
        raise ValueError(msg)


def _local(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself, or the waited-for tensor inside torch's ``AsyncCollectiveTensor``.

    Called below autograd (inside a Function's forward, or on a tensor that
    needs no gradient), so unwrapping loses no history.
    """
    funcol = sys.modules.get(_FUNCOL_MODULE)  # not imported: no async tensor can exist
    if funcol is not None and isinstance(x, funcol.AsyncCollectiveTensor):
        return cast("torch.Tensor", x.trigger_wait())
    return x


def _is_gloo(group: Group) -> bool:
    return bool(dist.get_backend(group.device_group) == "gloo")


def _closed_result(group: Group, x: torch.Tensor, shape: list[int]) -> torch.Tensor | None:
    """While tracing a closed group's collective: the op that raises when the graph runs."""
    if not group.is_closed:
        return None
    return cast("torch.Tensor", torch.ops.pdist.closed_group(x.detach(), shape, _CLOSED_MESSAGE))


def _split(x: torch.Tensor, dim: int, parts: int) -> torch.Tensor:
    """A view of ``x`` with ``dim`` split into ``(parts, size // parts)``."""
    shape = list(x.shape)
    return x.view(*shape[:dim], parts, shape[dim] // parts, *shape[dim + 1 :])


def _resized(x: torch.Tensor, dim: int, size: int) -> list[int]:
    shape = list(x.shape)
    shape[dim] = size
    return shape


# --------------------------------------------------------------------------- launching


class _Launched(NamedTuple):
    """A collective in flight: its result (final layout), torch's work, the finishing step.

    ``buffers`` are the temporaries the finishing step reads (on an accelerator
    they must outlive the step on the stream it runs on).
    """

    out: torch.Tensor
    work: Any
    finish: Callable[[], None] | None = None
    buffers: tuple[torch.Tensor, ...] = ()


def _result(launched: _Launched, async_op: bool) -> torch.Tensor:
    """The result: now (wait, finish), or as a tensor that waits and finishes on first use."""
    out, work, finish, buffers = launched
    if async_op and _register_work is not None and _work_from_future is not None:
        if finish is not None:

            def then(fut: torch.futures.Future[Any]) -> list[torch.Tensor]:
                fut.wait()  # raises the collective's error; on CUDA, orders the streams
                finish()
                # A CUDA future records the value's memory on the streams the step ran on,
                # so the caching allocator does not hand the buffers out while it runs.
                return [out, *buffers]

            work = _work_from_future(work.get_future().then(then))
        _register_work(out, work)
        return cast("torch.Tensor", _funcol().AsyncCollectiveTensor(out))
    work.wait()
    if finish is not None:
        finish()
    return out


def _divider(out: torch.Tensor, n: int) -> Callable[[], None]:
    def divide() -> None:
        out.div_(n)

    return divide


def _launch_all_reduce(group: Group, x: torch.Tensor, op: str) -> _Launched:
    out = _local(x).clone(memory_format=torch.contiguous_format)
    work = dist.all_reduce(out, op=_OPS[op], group=group.device_group, async_op=True)
    return _Launched(out, work, _divider(out, group.world_size) if op == "mean" else None)


def _launch_all_gather(group: Group, x: torch.Tensor, dim: int) -> _Launched:
    x = _local(x).contiguous()
    p, n = group.world_size, x.shape[dim]
    out = x.new_empty(_resized(x, dim, p * n))
    if math.prod(x.shape[:dim]) == 1:
        # Every rank's block is contiguous in the result: gather straight into it.
        work = all_gather_into(out.view(-1), x.view(-1), group.device_group, async_op=True)
        return _Launched(out, work)
    blocks = _split(out, dim, p)  # [..., P, n, ...]: rank r's block at index r of dim
    if _is_gloo(group):
        # gloo gathers into a buffer of its own and then copies each rank's block
        # to its output tensor: handing it strided views of the result makes that
        # copy the permute, so nothing else touches the data.
        views = list(blocks.unbind(dim))
        work = dist.all_gather(views, x, group=group.device_group, async_op=True)
        return _Launched(out, work)
    raw = x.new_empty((p * x.numel(),))  # rank-major
    work = all_gather_into(raw, x.view(-1), group.device_group, async_op=True)

    def finish() -> None:
        blocks.copy_(raw.view(p, *x.shape).movedim(0, dim))  # the one permute

    return _Launched(out, work, finish, (raw,))


def _launch_reduce_scatter(group: Group, x: torch.Tensor, dim: int, op: str) -> _Launched:
    x = _local(x)
    p = group.world_size
    send = _split(x, dim, p).movedim(dim, 0).contiguous()  # [P, *chunk]; dim 0: no copy
    out = x.new_empty(send.shape[1:])
    if _is_gloo(group):
        # gloo's reduce-scatter all-reduces the whole tensor and keeps a chunk;
        # an all-to-all moves (P-1)/P of it once, then each rank reduces the P
        # chunks it received: half the traffic, and the reduction is local.
        recv = torch.empty_like(send)
        work = dist.all_to_all_single(recv, send, group=group.device_group, async_op=True)

        def reduce_chunks() -> None:
            _reduce_dim0(recv, op, out)
            if op == "mean":
                out.div_(p)

        return _Launched(out, work, reduce_chunks, (recv,))
    work = _reduce_scatter_single(
        out.view(-1), send.view(-1), op=_OPS[op], group=group.device_group, async_op=True
    )
    return _Launched(out, work, _divider(out, p) if op == "mean" else None)


def _reduce_dim0(stacked: torch.Tensor, op: str, out: torch.Tensor) -> None:
    """Reduce ``stacked`` ([P, ...]) over dim 0 into ``out``."""
    if stacked.dtype == torch.bool:
        # torch has no bool sum or product that keeps the dtype; gloo's are OR and AND.
        op = {"sum": "max", "product": "min"}.get(op, op)
    if op in ("sum", "mean"):
        torch.sum(stacked, dim=0, dtype=out.dtype, out=out)
    elif op == "max":
        torch.amax(stacked, dim=0, out=out)
    elif op == "min":
        torch.amin(stacked, dim=0, out=out)
    else:
        torch.prod(stacked, dim=0, dtype=out.dtype, out=out)


def _launch_all_to_all(
    group: Group, x: torch.Tensor, scatter_dim: int, gather_dim: int
) -> _Launched:
    x = _local(x)
    p = group.world_size
    send = _split(x, scatter_dim, p).movedim(scatter_dim, 0)
    send = send.contiguous()  # [P, *chunk]: chunk r goes to rank r
    recv = torch.empty_like(send)  # [P, *chunk]: chunk r came from rank r
    work = dist.all_to_all_single(recv, send, group=group.device_group, async_op=True)
    chunk = send.shape[1:]
    shape = list(chunk)
    shape[gather_dim] *= p
    if gather_dim == 0:
        return _Launched(recv.view(shape), work)  # rank-major already
    out = recv.new_empty(shape)

    def finish() -> None:
        _split(out, gather_dim, p).copy_(recv.movedim(0, gather_dim))

    return _Launched(out, work, finish, (recv,))


# --------------------------------------------------------------------------- traced forms


def _traced_all_reduce(group: Group, x: torch.Tensor, op: str) -> torch.Tensor:
    fc = _funcol()
    out = fc.wait_tensor(fc.all_reduce(x, _FUNCOL_OPS[op], group.device_group))
    return cast("torch.Tensor", out / group.world_size if op == "mean" else out)


def _traced_all_gather(group: Group, x: torch.Tensor, dim: int) -> torch.Tensor:
    fc = _funcol()
    gather = getattr(fc, "all_gather_single", None) or fc.all_gather_tensor
    return cast("torch.Tensor", fc.wait_tensor(gather(x.contiguous(), dim, group.device_group)))


def _traced_reduce_scatter(group: Group, x: torch.Tensor, dim: int, op: str) -> torch.Tensor:
    fc = _funcol()
    p = group.world_size
    send = _split(x, dim, p).movedim(dim, 0).contiguous()  # [P, *chunk]
    scatter = getattr(fc, "reduce_scatter_single", None) or fc.reduce_scatter_tensor
    out = fc.wait_tensor(scatter(send, _FUNCOL_OPS[op], 0, group.device_group))  # [1, *chunk]
    out = out.squeeze(0)
    return cast("torch.Tensor", out / p if op == "mean" else out)


def _traced_all_to_all(
    group: Group, x: torch.Tensor, scatter_dim: int, gather_dim: int
) -> torch.Tensor:
    fc = _funcol()
    chunks = torch.stack(x.chunk(group.world_size, dim=scatter_dim))  # [P, *chunk]
    out = fc.wait_tensor(fc.all_to_all_single(chunks, None, None, group.device_group))
    return torch.cat(out.unbind(0), dim=gather_dim)


# --------------------------------------------------------------------------- implementations


@recorded("all_reduce")
def _all_reduce_impl(
    group: Group, x: torch.Tensor, op: str, async_op: bool = False
) -> torch.Tensor:
    if _compiling():
        return _traced_all_reduce(group, x, op)
    return _result(_launch_all_reduce(group, x, op), async_op)


@recorded("all_gather")
def _all_gather_impl(
    group: Group, x: torch.Tensor, dim: int, async_op: bool = False
) -> torch.Tensor:
    if _compiling():
        return _traced_all_gather(group, x, dim)
    return _result(_launch_all_gather(group, x, dim), async_op)


@recorded("reduce_scatter")
def _reduce_scatter_impl(
    group: Group, x: torch.Tensor, dim: int, op: str = "sum", async_op: bool = False
) -> torch.Tensor:
    """This rank's chunk (along ``dim``) of the reduction of ``x`` over the group."""
    if _compiling():
        return _traced_reduce_scatter(group, x, dim, op)
    return _result(_launch_reduce_scatter(group, x, dim, op), async_op)


@recorded("all_to_all")
def _all_to_all_impl(
    group: Group, x: torch.Tensor, scatter_dim: int, gather_dim: int, async_op: bool = False
) -> torch.Tensor:
    if _compiling():
        return _traced_all_to_all(group, x, scatter_dim, gather_dim)
    return _result(_launch_all_to_all(group, x, scatter_dim, gather_dim), async_op)


def _in_place(
    group: Group,
    x: torch.Tensor,
    traced: Callable[[], torch.Tensor],
    run: Callable[[torch.Tensor], None],
) -> torch.Tensor:
    """Run an in-place collective on ``x``; returns ``x``.

    Eager: ``run`` on ``x`` itself, or on a contiguous copy that is then
    written back. While tracing: ``x`` overwritten with ``traced()`` (or with
    the op that raises when the graph runs, on a closed group).
    """
    if _compiling():
        result = _closed_result(group, x, list(x.shape))
        return x.copy_(traced() if result is None else result)
    buf = _local(x)
    target = buf if buf.is_contiguous() else buf.contiguous()
    with torch.no_grad():
        run(target)
        if target is not buf:
            buf.copy_(target)
    return x


# --------------------------------------------------------------------------- autograd


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, group: Group, x: torch.Tensor, op: str, async_op: bool) -> torch.Tensor:
        ctx.group, ctx.op = group, op
        return _all_reduce_impl(group, x, op, async_op)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor, None, None]:
        return None, _all_reduce_impl(ctx.group, grad, ctx.op), None, None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, group: Group, x: torch.Tensor, dim: int, async_op: bool) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _all_gather_impl(group, x, dim, async_op)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor, None, None]:
        return None, _reduce_scatter_impl(ctx.group, grad, ctx.dim), None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, group: Group, x: torch.Tensor, dim: int, op: str, async_op: bool
    ) -> torch.Tensor:
        ctx.group, ctx.dim, ctx.op = group, dim, op
        return _reduce_scatter_impl(group, x, dim, op, async_op)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor, None, None, None]:
        full = _all_gather_impl(ctx.group, grad, ctx.dim)
        if ctx.op == "mean":
            full = full / ctx.group.world_size
        return None, full, None, None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, group: Group, x: torch.Tensor, scatter_dim: int, gather_dim: int, async_op: bool
    ) -> torch.Tensor:
        ctx.group, ctx.dims = group, (scatter_dim, gather_dim)
        return _all_to_all_impl(group, x, scatter_dim, gather_dim, async_op)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor, None, None, None]:
        scatter_dim, gather_dim = ctx.dims
        return None, _all_to_all_impl(ctx.group, grad, gather_dim, scatter_dim), None, None, None


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


def all_reduce(
    group: Group | DistContext, x: torch.Tensor, *, op: str = "sum", async_op: bool = False
) -> torch.Tensor:
    """Reduce ``x`` over the group, out of place; every rank gets the result.

    ``op`` is ``"sum"`` (the default), ``"mean"``, ``"max"``, ``"min"`` or
    ``"product"`` (``"mean"`` sums and divides, so it is right on gloo too).
    ``"sum"`` and ``"mean"`` are differentiable: the backward applies the same
    reduction to the gradient. Note that :func:`reduce`'s default is ``"mean"``.

    The result is new memory (``x`` is cloned, then reduced in place); the
    in-place :func:`all_reduce_` saves the clone where ``x`` may be overwritten.

    .. note:: All ranks of the group must call it with tensors of the same shape and dtype.

    Args:
        group: The group (a ``DistContext`` means its ``world``).
        x: This rank's tensor; left unchanged.
        op: The reduction.
        async_op: Return at once a tensor that waits for the collective when it
            is first used (torch's ``AsyncCollectiveTensor``), so that
            communication overlaps the compute in between. Use it before the
            ``distributed()`` block exits. Under ``torch.compile`` the wait is
            left to the compiler.

    Returns:
        A new tensor; on a one-rank group, ``x``.
    """
    g = as_group(group)
    _check_tensor(x)
    _check_op(op, tuple(_OPS))
    _check_mean_dtype(x, op)
    _check_bool(async_op, "async_op")
    if g.world_size == 1:
        return x
    if _compiling() and (closed := _closed_result(g, x, list(x.shape))) is not None:
        return closed
    if op in _DIFFERENTIABLE_OPS and _needs_grad(x):
        return _AllReduce.apply(g, x, op, async_op)  # type: ignore[no-untyped-call,no-any-return]
    return _all_reduce_impl(g, x.detach() if x.requires_grad else x, op, async_op)


@recorded("all_reduce_")
def all_reduce_(group: Group | DistContext, x: torch.Tensor, *, op: str = "sum") -> torch.Tensor:
    """Reduce ``x`` over the group in place; every rank's ``x`` holds the result.

    The in-place form of :func:`all_reduce` (same ``op`` values, same default
    ``"sum"``), for hot loops that may overwrite ``x``: no clone, no new memory.
    A non-contiguous ``x`` is reduced through a contiguous copy, then written back.

    Not differentiable: with gradients enabled it refuses a tensor that
    requires grad (use :func:`all_reduce`).

    .. note:: All ranks of the group must call it with tensors of the same shape and dtype.

    Returns:
        ``x`` (untouched on a one-rank group).

    Raises:
        ValueError: ``x`` requires grad while gradients are enabled.
    """
    g = as_group(group)
    _check_tensor(x)
    _check_op(op, tuple(_OPS))
    _check_mean_dtype(x, op)
    _refuse_grad(g, x, "all_reduce_", "all_reduce")
    if g.world_size == 1:
        return x

    def reduce(target: torch.Tensor) -> None:
        dist.all_reduce(target, op=_OPS[op], group=g.device_group)
        if op == "mean":
            target.div_(g.world_size)

    return _in_place(g, x, lambda: _traced_all_reduce(g, x, op), reduce)


def all_gather(
    group: Group | DistContext, x: torch.Tensor, *, dim: int = -1, async_op: bool = False
) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` in group order; every rank gets it.

    Differentiable: the backward reduce-scatters the gradient. Along ``dim=0``
    the ranks' data lands in place; along any other dim, the one permute that
    layout needs is the only pass over the data (on gloo it is fused into
    gloo's own copy out of its receive buffer).

    .. note:: All ranks of the group must call it with tensors of the same shape and dtype.

    Args:
        group: The group (a ``DistContext`` means its ``world``).
        x: This rank's part.
        dim: The dimension to concatenate along.
        async_op: Return at once a tensor that waits when first used (see
            :func:`all_reduce`).

    Returns:
        A tensor whose ``dim`` is ``group.world_size`` times ``x``'s; on a
        one-rank group, ``x``.
    """
    g = as_group(group)
    _check_tensor(x)
    d = _norm_dim(x, dim)
    _check_bool(async_op, "async_op")
    if g.world_size == 1:
        return x
    shape = _resized(x, d, x.shape[d] * g.world_size)
    if _compiling() and (closed := _closed_result(g, x, shape)) is not None:
        return closed
    if _needs_grad(x):
        return _AllGather.apply(g, x, d, async_op)  # type: ignore[no-untyped-call,no-any-return]
    return _all_gather_impl(g, x.detach() if x.requires_grad else x, d, async_op)


def all_gather_tensor(group: Group | DistContext, x: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's ``x`` as a list in group order (not differentiable).

    Returns a *list*, one tensor per rank; :func:`all_gather` returns their
    concatenation instead.

    .. note:: All ranks of the group must call it with tensors of the same shape and dtype.
    """
    g = as_group(group)
    _check_tensor(x)
    if g.world_size == 1:
        return [x]
    x = _local(x).detach().contiguous()
    outs = [torch.empty_like(x) for _ in g.ranks]
    dist.all_gather(outs, x, group=g.device_group)
    return outs


def reduce_scatter(
    group: Group | DistContext,
    x: torch.Tensor,
    *,
    dim: int = -1,
    op: str = "sum",
    async_op: bool = False,
) -> torch.Tensor:
    """Reduce ``x`` over the group and give each rank its chunk along ``dim``.

    Rank ``r`` (in group order) gets chunk ``r`` of ``x.chunk(world_size,
    dim)`` reduced over the ranks: the inverse of :func:`all_gather`, as in
    Megatron-style sequence parallelism. ``op`` takes the values of
    :func:`all_reduce`; ``"sum"`` and ``"mean"`` are differentiable (the
    backward all-gathers the gradient, divided by the group size for ``"mean"``).

    On NCCL it is torch's reduce-scatter. gloo's reduce-scatter all-reduces the
    whole tensor; pdist sends each rank its chunks with one all-to-all instead
    and reduces them locally, which moves half the bytes.

    .. note:: All ranks of the group must call it with tensors of the same shape and dtype.

    Args:
        group: The group (a ``DistContext`` means its ``world``).
        x: This rank's full-size tensor; left unchanged.
        dim: The dimension to scatter along; the group size must divide it.
        op: The reduction.
        async_op: Return at once a tensor that waits when first used (see
            :func:`all_reduce`).

    Returns:
        A new tensor whose ``dim`` is ``x``'s divided by the group size; on a
        one-rank group, ``x``.

    Raises:
        ValueError: ``dim`` is out of range, the group size does not divide
            it, or ``op`` is unknown.
    """
    g = as_group(group)
    _check_tensor(x)
    _check_op(op, tuple(_OPS))
    _check_mean_dtype(x, op)
    d = _norm_dim(x, dim)
    _check_divisible(x, d, g, "reduce_scatter")
    _check_bool(async_op, "async_op")
    if g.world_size == 1:
        return x
    shape = _resized(x, d, x.shape[d] // g.world_size)
    if _compiling() and (closed := _closed_result(g, x, shape)) is not None:
        return closed
    if op in _DIFFERENTIABLE_OPS and _needs_grad(x):
        return _ReduceScatter.apply(g, x, d, op, async_op)  # type: ignore[no-untyped-call,no-any-return]
    return _reduce_scatter_impl(g, x.detach() if x.requires_grad else x, d, op, async_op)


def gather(
    group: Group | DistContext, x: torch.Tensor, dst: int = 0, *, dim: int = -1
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
    x = _local(x).detach().contiguous()
    if g.rank_in_group != dst:
        dist.gather(x, None, dst=dst_global, group=g.device_group)
        return None
    outs = [torch.empty_like(x) for _ in g.ranks]
    dist.gather(x, outs, dst=dst_global, group=g.device_group)
    return torch.cat(outs, dim=d)


def reduce(
    group: Group | DistContext, x: torch.Tensor, dst: int = 0, *, op: str = "mean"
) -> torch.Tensor | None:
    """Reduce ``x`` (``"sum"`` or ``"mean"``) onto group index ``dst``, out of place.

    Mind the default: ``op="mean"`` here, while :func:`all_reduce` and
    :func:`reduce_scatter` default to ``"sum"``. Pass ``op`` explicitly when
    porting code that reduces with torch's default (a sum).

    .. note:: All ranks of the group must call it with tensors of the same shape and dtype.

    Returns:
        The reduction on ``dst``, None on the other ranks.
    """
    g = as_group(group)
    _check_tensor(x)
    _check_op(op, ("sum", "mean"))
    dst_global = g.global_rank(dst, name="dst")
    _check_mean_dtype(x, op)
    if g.world_size == 1:
        return x
    out = _local(x).detach().clone(memory_format=torch.contiguous_format)
    dist.reduce(out, dst=dst_global, group=g.device_group)
    if g.rank_in_group != dst:
        return None
    return out.div_(g.world_size) if op == "mean" else out


@recorded("broadcast")
def _broadcast_into(group: Group, x: torch.Tensor, src: int) -> torch.Tensor:
    src_global = group.global_rank(src)
    if group.world_size == 1:
        return x

    def traced() -> torch.Tensor:
        fc = _funcol()
        pg = group.device_group
        root = dist.get_group_rank(pg, src_global)  # functional collectives take the pg's rank
        return cast("torch.Tensor", fc.wait_tensor(fc.broadcast(x, root, pg)))

    def run(target: torch.Tensor) -> None:
        dist.broadcast(target, src=src_global, group=group.device_group)

    return _in_place(group, x, traced, run)


def broadcast(group: Group | DistContext, x: torch.Tensor, src: int = 0) -> torch.Tensor:
    """Broadcast ``x`` from group index ``src`` into every rank's ``x``, in place.

    ``x`` must be contiguous on the receivers (it is written in place).
    :func:`broadcast_` is the same collective, spelled in torch's in-place
    convention: it also accepts non-contiguous tensors and refuses ones that
    require grad.

    .. note:: All ranks of the group must call it with tensors of the same shape and dtype.

    Returns:
        ``x``.
    """
    g = as_group(group)
    _check_tensor(x)
    g.global_rank(src)
    if g.world_size > 1 and not x.is_contiguous():
        msg = "broadcast writes x in place, so x must be contiguous; pass x.contiguous()"
        raise ValueError(msg)
    return _broadcast_into(g, x, src)


def broadcast_(group: Group | DistContext, x: torch.Tensor, *, src: int = 0) -> torch.Tensor:
    """Overwrite every rank's ``x`` with group index ``src``'s, in place.

    A non-contiguous ``x`` is received through a contiguous copy, then
    written back. Not differentiable: with gradients enabled it refuses a
    tensor that requires grad (broadcast a detached tensor instead).

    .. note:: All ranks of the group must call it with tensors of the same shape and dtype.

    Returns:
        ``x`` (untouched on a one-rank group).

    Raises:
        ValueError: ``x`` requires grad while gradients are enabled.
    """
    g = as_group(group)
    _check_tensor(x)
    g.global_rank(src)
    _refuse_grad(g, x, "broadcast_", "broadcast")
    return _broadcast_into(g, x, src)


def all_to_all_4d(
    group: Group | DistContext,
    x: torch.Tensor,
    *,
    scatter_dim: int = 2,
    gather_dim: int = 1,
    async_op: bool = False,
) -> torch.Tensor:
    """The sequence-parallel (Ulysses) exchange of a 4-D tensor.

    With the defaults, ``[B, S/P, H, D] -> [B, S, H/P, D]``: each rank gives
    away head chunks and receives sequence chunks; ``scatter_dim=1,
    gather_dim=2`` is the way back. Differentiable: the backward is the
    inverse exchange.

    .. note:: All ranks of the group must call it with tensors of the same shape and dtype.

    Args:
        group: The group (a ``DistContext`` means its ``world``).
        x: This rank's 4-D tensor.
        scatter_dim: The dimension split among the ranks.
        gather_dim: The dimension the received chunks are concatenated along.
        async_op: Return at once a tensor that waits when first used (see
            :func:`all_reduce`); the final re-layout runs when the data arrives.

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
    _check_bool(async_op, "async_op")
    if g.world_size == 1:
        return x
    shape = _resized(x, s, x.shape[s] // g.world_size)
    shape[d] *= g.world_size
    if _compiling() and (closed := _closed_result(g, x, shape)) is not None:
        return closed
    if _needs_grad(x):
        return _AllToAll.apply(g, x, s, d, async_op)  # type: ignore[no-untyped-call,no-any-return]
    return _all_to_all_impl(g, x.detach() if x.requires_grad else x, s, d, async_op)


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


@recorded("send", p2p=True)
def send(group: Group | DistContext, x: torch.Tensor, dst: int | None = None) -> None:
    """Send ``x`` to group index ``dst`` (default: the next rank) on the device group.

    .. note:: The destination must call :func:`recv` with the same shape and dtype.
    """
    g = as_group(group)
    _check_tensor(x)
    peer = g.ranks[g.peer_index(dst, g.next_rank, "dst")]
    dist.send(_local(x).detach().contiguous(), dst=peer, group=g.device_group)


@recorded("recv", p2p=True)
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
