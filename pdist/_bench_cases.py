"""The cases of ``python -m pdist bench``."""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ._bench import Case, environment, run_cases
from ._collate import collate_batches
from ._collectives import all_gather, all_reduce, all_reduce_, broadcast, reduce_scatter
from ._compat import all_gather_into
from ._context import distributed
from ._gathers import all_gather_object
from ._group import DistContext
from ._mq import message_queue
from ._objects import broadcast_object, broadcast_object_list
from ._p2p import recv_object, send_object

__all__ = ["all_cases", "bench_rank"]

Fns = dict[str, Callable[[], object]]

_SIZES = [(4 << 10, True), (64 << 10, False), (1 << 20, True), (16 << 20, False)]


def _label(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def _sweep_setup(op: str, numel: int) -> Callable[[DistContext, contextlib.ExitStack], Fns]:
    """Time pdist's ``op`` against torch's on the same tensors (``numel`` elements in all)."""

    def setup(ctx: DistContext, stack: contextlib.ExitStack) -> Fns:
        pg = ctx.world.device_group
        dev = ctx.device
        if op == "all_gather":
            x = torch.ones(numel // ctx.world_size, device=dev)  # every rank's part of the output
            flat = torch.empty(numel, device=dev)  # the same layout as pdist's result
            outs = [torch.empty_like(x) for _ in range(ctx.world_size)]
            return {
                "pdist": lambda: all_gather(ctx, x, dim=0),
                "torch": lambda: all_gather_into(flat, x, pg),
                # What an out-of-place result pays too: a fresh output every call.
                "torch_into_fresh": lambda: all_gather_into(torch.empty_like(flat), x, pg),
                "torch_list": lambda: dist.all_gather(outs, x, group=pg),
            }
        x, buf = torch.ones(numel, device=dev), torch.ones(numel, device=dev)
        if op == "all_reduce":

            def clone_then_reduce() -> None:
                dist.all_reduce(x.clone(), group=pg)

            return {
                "pdist": lambda: all_reduce(ctx, x),
                "torch": lambda: dist.all_reduce(buf, group=pg),
                "torch_clone_then_all_reduce": clone_then_reduce,  # the out-of-place floor
            }
        return {
            "pdist": lambda: broadcast(ctx, x),
            "torch": lambda: dist.broadcast(buf, 0, group=pg),
        }

    return setup


# nccl-tests' bus bandwidth factors: the bytes each link carries relative to the message.
_BUSBW: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
}


def _sweep_cases() -> list[Case]:
    return [
        Case(
            f"{op} {_label(nbytes)}",
            nbytes,
            _sweep_setup(op, nbytes // 4),
            inner=20 if nbytes <= 64 << 10 else 3,
            busbw_factor=factor,
            quick=quick,
        )
        for nbytes, quick in _SIZES
        for op, factor in _BUSBW.items()
    ]


def _first_use(t: torch.Tensor) -> object:
    """Touch ``t`` the cheapest way that still waits for an async result."""
    return t[:1].sum()


def _in_place_all_reduce(numel: int) -> Callable[[DistContext, contextlib.ExitStack], Fns]:
    """all_reduce_ against torch's in-place all_reduce (zeros: repeated sums stay finite)."""

    def setup(ctx: DistContext, stack: contextlib.ExitStack) -> Fns:
        ours, theirs = (torch.zeros(numel, device=ctx.device) for _ in range(2))
        pg = ctx.world.device_group
        return {
            "pdist": lambda: all_reduce_(ctx, ours),
            "torch": lambda: dist.all_reduce(theirs, group=pg),
        }

    return setup


def _async_all_reduce(numel: int) -> Callable[[DistContext, contextlib.ExitStack], Fns]:
    """all_reduce(async_op=True), then first use, against torch's async forms."""

    def setup(ctx: DistContext, stack: contextlib.ExitStack) -> Fns:
        from torch.distributed import _functional_collectives as funcol

        x, buf = torch.ones(numel, device=ctx.device), torch.ones(numel, device=ctx.device)
        pg = ctx.world.device_group
        return {
            "pdist": lambda: _first_use(all_reduce(ctx, x, async_op=True)),
            # Out of place, waits on first use: the like-for-like baseline.
            "torch_functional": lambda: _first_use(funcol.all_reduce(x, "sum", pg)),
            "torch_in_place_async": lambda: dist.all_reduce(buf, group=pg, async_op=True).wait(),
        }

    return setup


def _reduce_scatter(numel: int) -> Callable[[DistContext, contextlib.ExitStack], Fns]:
    """reduce_scatter against torch's reduce-scatter, and on gloo the all-to-all pdist uses."""

    def setup(ctx: DistContext, stack: contextlib.ExitStack) -> Fns:
        world, pg = ctx.world_size, ctx.world.device_group
        x = torch.ones(numel, device=ctx.device)
        out = torch.empty(numel // world, device=ctx.device)
        fns: Fns = {"pdist": lambda: reduce_scatter(ctx, x, dim=0)}
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        if _probe(lambda: scatter(out, x, group=pg)):
            fns["torch"] = lambda: scatter(out, x, group=pg)
        if ctx.backend == "gloo":
            received = torch.empty(numel, device=ctx.device)

            def all_to_all_then_sum() -> None:
                dist.all_to_all_single(received, x, group=pg)
                torch.sum(received.view(world, -1), dim=0, out=out)

            fns["torch_all_to_all_then_sum"] = all_to_all_then_sum
        return fns

    return setup


def _all_gather_last_dim(numel: int) -> Callable[[DistContext, contextlib.ExitStack], Fns]:
    """all_gather along the last dim against all_gather_into_tensor plus the one permute."""

    def setup(ctx: DistContext, stack: contextlib.ExitStack) -> Fns:
        world, pg = ctx.world_size, ctx.world.device_group
        rows = 64
        x = torch.ones(rows, numel // world // rows, device=ctx.device)
        raw = torch.empty(world * x.numel(), device=ctx.device)
        out = torch.empty(rows, world, x.shape[1], device=ctx.device)

        def gather_then_permute() -> None:
            all_gather_into(raw, x.view(-1), pg)
            out.copy_(raw.view(world, *x.shape).movedim(0, 1))

        return {"pdist": lambda: all_gather(ctx, x, dim=-1), "torch": gather_then_permute}

    return setup


def _probe(call: Callable[[], object]) -> bool:
    """Whether the backend implements ``call`` (every rank fails alike, before any traffic)."""
    try:
        call()
    except (RuntimeError, NotImplementedError):
        return False
    return True


def _tensor_cases() -> list[Case]:
    """The in-place, async, reduce-scatter and last-dim gather cases, at 1 and 16 MiB."""
    cases = []
    for nbytes, quick in ((1 << 20, True), (16 << 20, False)):
        numel = nbytes // 4
        label = _label(nbytes)
        cases += [
            Case(
                f"all_reduce_ {label}",
                nbytes,
                _in_place_all_reduce(numel),
                3,
                _BUSBW["all_reduce"],
                quick,
            ),
            Case(
                f"all_reduce async {label}",
                nbytes,
                _async_all_reduce(numel),
                3,
                _BUSBW["all_reduce"],
                quick,
            ),
            Case(
                f"reduce_scatter {label}",
                nbytes,
                _reduce_scatter(numel),
                3,
                _BUSBW["all_gather"],
                quick,
            ),
            Case(
                f"all_gather dim=-1 {label}",
                nbytes,
                _all_gather_last_dim(numel),
                3,
                _BUSBW["all_gather"],
                quick,
            ),
        ]
    return cases


def _structured_a(ctx: DistContext, stack: contextlib.ExitStack) -> Fns:
    """(a) one 128 MiB tensor with metadata vs a raw broadcast of the same bytes."""
    w = torch.ones(32 << 20)  # 128 MiB of float32
    payload = {"w": w, "meta": {"step": 1000, "name": "layer.0.weight", "shape": tuple(w.shape)}}
    raw = torch.ones(32 << 20)
    pg = ctx.world.device_group

    def ours() -> None:
        broadcast_object_list(ctx, [payload] if ctx.rank == 0 else [None])

    return {"pdist": ours, "raw_broadcast": lambda: dist.broadcast(raw, 0, group=pg)}


def _structured_b(ctx: DistContext, stack: contextlib.ExitStack) -> Fns:
    """(b) 1000 tensors of 64 KiB (a state-dict shape) vs one flat broadcast of the same bytes."""
    tensors = [torch.full((16 << 10,), float(i)) for i in range(1000)]
    flat = torch.ones(1000 * (16 << 10))
    pg = ctx.world.device_group

    def ours() -> None:
        broadcast_object_list(ctx, [tensors] if ctx.rank == 0 else [None])

    def per_tensor() -> None:
        for t in tensors:
            dist.broadcast(t, 0, group=pg)

    return {
        "pdist": ours,
        "flat_broadcast": lambda: dist.broadcast(flat, 0, group=pg),
        "per_tensor_broadcast": per_tensor,
    }


def _structured_c(ctx: DistContext, stack: contextlib.ExitStack) -> Fns:
    """(c) a tiny dict vs torch.distributed.broadcast_object_list."""
    obj = {"step": 3, "lr": 0.1}
    pg = ctx.world.cpu_group

    def ours() -> None:
        broadcast_object_list(ctx, [obj] if ctx.rank == 0 else [None])

    def theirs() -> None:
        dist.broadcast_object_list([obj] if ctx.rank == 0 else [None], src=0, group=pg)

    return _with_torch_baseline(ours, "torch_broadcast_object_list", theirs)


def _with_torch_baseline(
    ours: Callable[[], object], name: str, theirs: Callable[[], object]
) -> Fns:
    """``ours`` against a torch object collective, when numpy lets torch run it."""
    if not _torch_objects_available():
        return {"pdist": ours}
    return {"pdist": ours, name: theirs}


def _object_gather(ctx: DistContext, stack: contextlib.ExitStack) -> Fns:
    """all_gather_object of a small dict vs torch.distributed.all_gather_object."""
    obj = {"rank": ctx.rank, "loss": 0.25, "tokens": list(range(32))}
    pg = ctx.world.cpu_group
    out: list[object] = [None] * ctx.world_size

    def ours() -> None:
        all_gather_object(ctx, obj)

    return {
        "pdist": ours,
        "torch_all_gather_object": lambda: dist.all_gather_object(out, obj, group=pg),
    }


_OBJECT_WEIGHT = 8 << 20  # float32 elements: a 32 MiB tensor


def _object_gather_big(ctx: DistContext, stack: contextlib.ExitStack) -> Fns:
    """all_gather_object of {"w": 32 MiB, "step": 3} vs raw all-gathers into fresh outputs.

    ``raw_all_gather`` is torch's list form (the issue's baseline); ``raw_all_gather_into``
    gathers into one fresh flat output, as pdist does.
    """
    w = torch.ones(_OBJECT_WEIGHT, device=ctx.device)
    obj = {"w": w, "step": 3}
    pg = ctx.world.device_group

    def raw() -> None:
        outs = [torch.empty_like(w) for _ in range(ctx.world_size)]
        dist.all_gather(outs, w, group=pg)

    def raw_into() -> None:
        all_gather_into(w.new_empty(ctx.world_size * w.numel()), w, pg)

    return {
        "pdist": lambda: all_gather_object(ctx, obj),
        "raw_all_gather": raw,
        "raw_all_gather_into": raw_into,
    }


def _object_send_big(ctx: DistContext, stack: contextlib.ExitStack) -> Fns:
    """send_object/recv_object of {"w": 32 MiB, "step": 3}, rank 0 to 1, vs raw send/recv.

    ``raw_send_recv`` receives into fresh memory, as recv_object must;
    ``raw_send_recv_warm`` into a buffer allocated once.
    """
    w = torch.ones(_OBJECT_WEIGHT, device=ctx.device)
    obj = {"w": w, "step": 3}
    pg = ctx.world.device_group
    warm = torch.empty_like(w)

    def ours() -> None:
        if ctx.rank == 0:
            send_object(ctx, obj, dst=1)
        elif ctx.rank == 1:
            recv_object(ctx, src=0)

    def raw() -> None:
        if ctx.rank == 0:
            dist.send(w, 1, group=pg)
        elif ctx.rank == 1:
            dist.recv(torch.empty_like(w), 0, group=pg)  # into fresh memory, as recv_object

    def raw_warm() -> None:
        if ctx.rank == 0:
            dist.send(w, 1, group=pg)
        elif ctx.rank == 1:
            dist.recv(warm, 0, group=pg)

    return {"pdist": ours, "raw_send_recv": raw, "raw_send_recv_warm": raw_warm}


def _collate(ctx: DistContext, stack: contextlib.ExitStack) -> Fns:
    """32 leaves of [~5000, 8] per rank, uneven by one, vs one raw all_gather of the bytes."""
    world = ctx.world_size
    size = 5000 * world - 1
    count = len(range(ctx.rank, size, world))
    batches = [
        {f"leaf{i}": torch.full((min(500, count - chunk), 8), float(i)) for i in range(32)}
        for chunk in range(0, count, 500)
    ]
    per_rank = 32 * 5000 * 8
    mine = torch.ones(per_rank)
    out = torch.empty(per_rank * world)
    pg = ctx.world.cpu_group
    return {
        "pdist": lambda: collate_batches(ctx, batches),
        "raw_all_gather": lambda: all_gather_into(out, mine, pg),
    }


def _message_queue(ctx: DistContext, stack: contextlib.ExitStack) -> Fns:
    """Back-to-back broadcasts of a small dict through shared memory vs torch's object broadcast."""
    obj = {"step": 3, "lr": 0.1}
    group = stack.enter_context(message_queue(ctx.world))
    pg = ctx.world.cpu_group

    def ours() -> None:
        broadcast_object(group, obj if ctx.rank == 0 else None)

    def theirs() -> None:
        dist.broadcast_object_list([obj] if ctx.rank == 0 else [None], src=0, group=pg)

    return _with_torch_baseline(ours, "torch_broadcast_object_list", theirs)


def _torch_objects_available() -> bool:
    # torch's object collectives (the baselines of the object cases) need numpy; pdist does not.
    return importlib.util.find_spec("numpy") is not None


def all_cases() -> list[Case]:
    """Every case, in the order they run."""
    return [
        *_sweep_cases(),
        *_tensor_cases(),
        Case("structured broadcast (a) 128 MiB + meta", 128 << 20, _structured_a, 1),
        Case("structured broadcast (b) 1000 x 64 KiB", 1000 * (64 << 10), _structured_b, 1),
        Case("structured broadcast (c) tiny dict", 32, _structured_c, 50),
        Case("all_gather_object small dict", 256, _object_gather, 50),
        Case("all_gather_object 32 MiB + meta", 32 << 20, _object_gather_big, 1),
        Case("send_object/recv_object 32 MiB + meta", 32 << 20, _object_send_big, 1),
        Case("collate_batches 32 x [5000, 8]", 32 * 5000 * 8 * 4, _collate, 1),
        Case("message_queue broadcast_object small dict", 32, _message_queue, 1000),
    ]


def bench_rank(quick: bool, progress: bool) -> dict[str, Any]:
    """Run every case on this rank inside ``distributed()``; every rank returns the report.

    The report is the :func:`~pdist._bench.environment` (torch version, backend,
    device, world size), ``quick``, and ``records``: one dict per case.
    """
    with distributed() as ctx:
        show = progress and ctx.rank == 0
        records = [r.as_json() for r in run_cases(ctx, all_cases(), quick=quick, progress=show)]
        return {**environment(ctx), "quick": quick, "records": records}
