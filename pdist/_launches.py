"""How each tensor collective runs: eagerly, as a ``Launched``, or traced.

An eager launch gives the result, torch's work and maybe a finishing step;
``result`` waits for it now or returns a tensor that waits on first use.
Traced forms call torch's functional ops (they keep their process groups alive,
so they are used only while tracing).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple, cast

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from . import _compat, _rooted
from ._compat import all_gather_into
from ._errors import PdistError
from ._group import Group

__all__ = [
    "GENERIC",
    "OPS",
    "Launched",
    "all_reduce_into",
    "broadcast_into",
    "exchanged",
    "launch_all_gather",
    "launch_all_to_all",
    "launch_reduce_scatter",
    "local",
    "resized",
    "result",
    "traced_all_gather",
    "traced_all_reduce",
    "traced_all_to_all",
    "traced_broadcast",
    "traced_closed",
    "traced_reduce_scatter",
]

OPS: dict[str, Any] = {
    "sum": ReduceOp.SUM,
    "mean": ReduceOp.SUM,  # divided afterwards: gloo has no AVG
    "max": ReduceOp.MAX,
    "min": ReduceOp.MIN,
    "product": ReduceOp.PRODUCT,
}


def local(x: torch.Tensor) -> torch.Tensor:
    """``x``, or the waited-for tensor in an ``AsyncCollectiveTensor`` (called below autograd)."""
    if _compat.is_async_tensor(x):
        return cast("torch.Tensor", cast("Any", x).trigger_wait())
    return x


def _split(x: torch.Tensor, dim: int, parts: int) -> torch.Tensor:
    """A view of ``x`` with ``dim`` split into ``(parts, size // parts)``."""
    shape = list(x.shape)
    return x.view(*shape[:dim], parts, shape[dim] // parts, *shape[dim + 1 :])


def _chunks(x: torch.Tensor, dim: int, parts: int) -> torch.Tensor:
    """``x.chunk(parts, dim)`` stacked and contiguous: ``[P, *chunk]``."""
    return _split(x, dim, parts).movedim(dim, 0).contiguous()


def resized(x: torch.Tensor, dim: int, size: int) -> list[int]:
    shape = list(x.shape)
    shape[dim] = size
    return shape


def exchanged(group: Group, x: torch.Tensor, scatter: int, gather: int) -> list[int]:
    shape = resized(x, scatter, x.shape[scatter] // group.world_size)
    shape[gather] *= group.world_size
    return shape


def _reduce_dim0(stacked: torch.Tensor, op: str, out: torch.Tensor) -> None:
    if stacked.dtype == torch.bool:
        # torch has no bool sum or product that keeps the dtype; gloo's are OR and AND.
        op = {"sum": "max", "product": "min"}.get(op, op)
    if op in ("max", "min"):
        (torch.amax if op == "max" else torch.amin)(stacked, dim=0, out=out)
    else:
        (torch.prod if op == "product" else torch.sum)(stacked, dim=0, dtype=out.dtype, out=out)


class Launched(NamedTuple):
    """A collective in flight: its result (final layout), torch's work, the finishing step."""

    out: torch.Tensor
    work: Any
    finish: Callable[[], object] | None = None
    buffers: tuple[torch.Tensor, ...] = ()  # what finish reads: must outlive it on its stream


def result(launched: Launched, async_op: bool) -> torch.Tensor:
    """The result: now (wait, finish), or as a tensor that waits and finishes on first use."""
    out, work, finish, buffers = launched
    if async_op:
        if finish is not None:

            def then(fut: torch.futures.Future[Any]) -> list[torch.Tensor]:
                fut.wait()  # raises the collective's error; on CUDA, orders the streams
                finish()
                # A CUDA future records the value's memory on the streams the step ran on,
                # so the caching allocator does not hand the buffers out while it runs.
                return [out, *buffers]

            work = _compat.work_from_future(work.get_future().then(then))
        _compat.register_work(out, work)
        return cast("torch.Tensor", _compat.funcol().AsyncCollectiveTensor(out))
    work.wait()
    if finish is not None:
        finish()
    return out


def _permuter(out: torch.Tensor, stacked: torch.Tensor, dim: int) -> Callable[[], object]:
    """The finishing step that moves ``stacked``'s blocks (``[P, ...]``) to ``dim`` of ``out``."""
    return lambda: _split(out, dim, stacked.shape[0]).copy_(stacked.movedim(0, dim))


def _divider(out: torch.Tensor, n: int, op: str) -> Callable[[], object] | None:
    return (lambda: out.div_(n)) if op == "mean" else None


def all_reduce_into(group: Group, out: torch.Tensor, op: str) -> Launched:
    work = dist.all_reduce(out, op=OPS[op], group=group.device_group, async_op=True)
    return Launched(out, work, _divider(out, group.world_size, op))


def broadcast_into(group: Group, out: torch.Tensor, src: int) -> Launched:
    work = _rooted.broadcast_from(out, group.device_group, src, async_op=True)
    return Launched(out, work)


def launch_all_gather(group: Group, x: torch.Tensor, dim: int) -> Launched:
    x, p = x.contiguous(), group.world_size
    direct = math.prod(x.shape[:dim]) == 1
    if not direct and _compat.backend_name(group.device_group) != "gloo":
        return _launch_all_gather_generic(group, x, dim)
    out = x.new_empty(resized(x, dim, p * x.shape[dim]))
    if direct:
        # Every rank's block is contiguous in the result: gather straight into it.
        work = all_gather_into(out.view(-1), x.view(-1), group.device_group, async_op=True)
        return Launched(out, work)
    # gloo gathers into a buffer of its own, then copies each rank's block to its
    # output tensor: given strided views of the result (rank r's block at index r
    # of dim), that copy is the permute, and nothing else touches the data.
    views = list(_split(out, dim, p).unbind(dim))
    return Launched(out, dist.all_gather(views, x, group=group.device_group, async_op=True))


def _launch_all_gather_generic(group: Group, x: torch.Tensor, dim: int) -> Launched:
    """Gather rank-major into a buffer, then the one permute into the result."""
    x, p = x.contiguous(), group.world_size
    out = x.new_empty(resized(x, dim, p * x.shape[dim]))
    raw = x.new_empty((p, *x.shape))  # rank-major
    work = all_gather_into(raw.view(-1), x.view(-1), group.device_group, async_op=True)
    return Launched(out, work, _permuter(out, raw, dim), (raw,))


def launch_reduce_scatter(group: Group, x: torch.Tensor, op: str, dim: int) -> Launched:
    if _compat.backend_name(group.device_group) != "gloo":
        return _launch_reduce_scatter_generic(group, x, op, dim)
    # gloo's reduce-scatter all-reduces the whole tensor and keeps a chunk; an
    # all-to-all moves (P-1)/P of it once, then each rank reduces the P chunks
    # it received: half the traffic, and the reduction is local.
    send = _chunks(x, dim, group.world_size)  # [P, *chunk]: chunk r goes to rank r
    recv, out = torch.empty_like(send), x.new_empty(send.shape[1:])
    work = dist.all_to_all_single(recv, send, group=group.device_group, async_op=True)

    def reduce_chunks() -> None:
        _reduce_dim0(recv, op, out)
        if op == "mean":
            out.div_(group.world_size)

    return Launched(out, work, reduce_chunks, (recv,))


def _launch_reduce_scatter_generic(group: Group, x: torch.Tensor, op: str, dim: int) -> Launched:
    send = _chunks(x, dim, group.world_size)  # [P, *chunk]
    out, pg = x.new_empty(send.shape[1:]), group.device_group
    work = _compat.reduce_scatter_into(out.view(-1), send.view(-1), OPS[op], pg, async_op=True)
    return Launched(out, work, _divider(out, group.world_size, op))


# What other backends take where gloo has its own path (tests: generic_path).
GENERIC: dict[str, Callable[..., Launched]] = {
    "all_gather": _launch_all_gather_generic,
    "reduce_scatter": _launch_reduce_scatter_generic,
}


def launch_all_to_all(group: Group, x: torch.Tensor, scatter: int, gather: int) -> Launched:
    p = group.world_size
    send = _chunks(x, scatter, p)  # [P, *chunk]: chunk r goes to rank r
    recv = torch.empty_like(send)  # [P, *chunk]: chunk r came from rank r
    work = dist.all_to_all_single(recv, send, group=group.device_group, async_op=True)
    shape = exchanged(group, x, scatter, gather)
    if gather == 0:
        return Launched(recv.view(shape), work)  # rank-major already
    out = recv.new_empty(shape)
    return Launched(out, work, _permuter(out, recv, gather), (recv,))


# --------------------------------------------------------------------------- traced forms


def traced_all_reduce(group: Group, x: torch.Tensor, op: str) -> torch.Tensor:
    ops, name = _compat.functional_ops(), group.device_group.group_name
    out = ops.wait_tensor(ops.all_reduce(x, "sum" if op == "mean" else op, name))
    return cast("torch.Tensor", out / group.world_size if op == "mean" else out)


def traced_broadcast(group: Group, x: torch.Tensor, src: int) -> torch.Tensor:
    ops, name = _compat.functional_ops(), group.device_group.group_name
    # The functional broadcast takes the pg's rank: pdist's group index.
    return cast("torch.Tensor", ops.wait_tensor(ops.broadcast(x, src, name)))


def traced_all_gather(group: Group, x: torch.Tensor, dim: int) -> torch.Tensor:
    ops, name, p = _compat.functional_ops(), group.device_group.group_name, group.world_size
    raw = ops.wait_tensor(ops.all_gather_into_tensor(x.contiguous(), p, name))  # [P * n, ...]
    return raw if dim == 0 else torch.cat(raw.chunk(p), dim=dim)


def traced_reduce_scatter(group: Group, x: torch.Tensor, op: str, dim: int) -> torch.Tensor:
    ops, name, p = _compat.functional_ops(), group.device_group.group_name, group.world_size
    wire_op = "sum" if op == "mean" else op
    out = ops.wait_tensor(ops.reduce_scatter_tensor(_chunks(x, dim, p), wire_op, p, name))
    return cast("torch.Tensor", (out / p if op == "mean" else out).squeeze(0))  # [1, *chunk]


def traced_all_to_all(group: Group, x: torch.Tensor, scatter: int, gather: int) -> torch.Tensor:
    ops, name, p = _compat.functional_ops(), group.device_group.group_name, group.world_size
    out = ops.wait_tensor(ops.all_to_all_single(_chunks(x, scatter, p), [1] * p, [1] * p, name))
    out = out.movedim(0, gather).flatten(gather, gather + 1)  # a view for gather 0, as eagerly
    return cast("torch.Tensor", out)


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


def traced_closed(x: torch.Tensor, shape: list[int]) -> torch.Tensor:
    """The op a graph traced after its block exited calls instead of a collective (it raises)."""
    return cast("torch.Tensor", torch.ops.pdist.closed_group(x.detach(), shape, _CLOSED_MESSAGE))
