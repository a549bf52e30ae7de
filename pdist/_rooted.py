"""Rooted and point-to-point operations that name their root or peer by group index.

pdist names a root or a peer by its index into the group. torch's wrappers translate a
global rank through its group registry (torch 2.6 does so even for ``group_src=``), which
a link's groups are never in: those take the process group's own methods, which index
the group as pdist does. Registered groups keep torch's wrappers (and their bookkeeping:
the flight recorder, tests that wrap ``torch.distributed``'s functions).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ._compat import registered as _registered

__all__ = [
    "broadcast_from",
    "gather_to",
    "irecv_from",
    "isend_to",
    "recv_from",
    "reduce_to",
    "send_to",
]


def _real(t: torch.Tensor) -> torch.Tensor:
    return torch.view_as_real(t) if t.is_complex() else t


def _done(work: Any, async_op: bool) -> Any:
    if async_op:
        return work
    work.wait()
    return None


def broadcast_from(
    t: torch.Tensor, pg: dist.ProcessGroup, index: int, *, async_op: bool = False
) -> Any:
    """``dist.broadcast`` of ``t`` from group index ``index`` (its work when ``async_op``)."""
    if _registered(pg):
        src = dist.get_global_rank(pg, index)
        return dist.broadcast(t, src, group=pg, async_op=async_op)
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = index, 0
    return _done(pg.broadcast([_real(t)], opts), async_op)


def isend_to(t: torch.Tensor, pg: dist.ProcessGroup, index: int) -> Any:
    """``dist.isend`` of ``t`` to group index ``index``: its work."""
    if _registered(pg):
        return dist.isend(t, dist.get_global_rank(pg, index), group=pg)
    return pg.send([_real(t)], index, 0)


def irecv_from(t: torch.Tensor, pg: dist.ProcessGroup, index: int) -> Any:
    """``dist.irecv`` into ``t`` from group index ``index``: its work."""
    if _registered(pg):
        return dist.irecv(t, dist.get_global_rank(pg, index), group=pg)
    return pg.recv([_real(t)], index, 0)


def send_to(t: torch.Tensor, pg: dist.ProcessGroup, index: int) -> None:
    """``dist.send`` of ``t`` to group index ``index``."""
    if _registered(pg):
        dist.send(t, dist.get_global_rank(pg, index), group=pg)
        return
    pg.send([_real(t)], index, 0).wait()


def recv_from(t: torch.Tensor, pg: dist.ProcessGroup, index: int) -> None:
    """``dist.recv`` into ``t`` from group index ``index``."""
    if _registered(pg):
        dist.recv(t, dist.get_global_rank(pg, index), group=pg)
        return
    pg.recv([_real(t)], index, 0).wait()


def gather_to(
    t: torch.Tensor,
    outs: list[torch.Tensor] | None,
    pg: dist.ProcessGroup,
    index: int,
    *,
    async_op: bool = False,
) -> Any:
    """``dist.gather`` of ``t`` into the root's ``outs`` at group index ``index``."""
    if _registered(pg):
        dst = dist.get_global_rank(pg, index)
        return dist.gather(t, outs, dst=dst, group=pg, async_op=async_op)
    opts = dist.GatherOptions()
    opts.rootRank = index
    outputs = [[_real(o) for o in outs]] if outs is not None else []
    return _done(pg.gather(outputs, [_real(t)], opts), async_op)


def reduce_to(t: torch.Tensor, pg: dist.ProcessGroup, index: int, op: Any) -> None:
    """``dist.reduce`` of ``t`` (in place) to group index ``index``."""
    if _registered(pg):
        dist.reduce(t, dist.get_global_rank(pg, index), op=op, group=pg)
        return
    opts = dist.ReduceOptions()
    opts.reduceOp, opts.rootRank, opts.rootTensor = op, index, 0
    pg.reduce([_real(t)], opts).wait()
