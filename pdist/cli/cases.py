"""The cases of ``python -m pdist bench``: pdist's calls and the torch baselines they face."""

from __future__ import annotations

import contextlib
import importlib.util
import mmap
from collections.abc import Callable
from functools import partial
from typing import Any

import attrs
import torch
import torch.distributed as dist

import pdist
from pdist import DistContext
from pdist._compat import all_gather_into, funcol, reduce_scatter_into
from pdist._wire import FIRST_MESSAGE_BYTES

from .bench import Case, Fns, run_cases
from .cases_experts import EXPERT_CASES

__all__ = ["CASES", "bench_rank"]

Stack = contextlib.ExitStack

# nccl-tests' bus bandwidth factors: the bytes each link carries relative to the message.
_BUSBW: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
}
_SIZES = [(4 << 10, True), (64 << 10, False), (1 << 20, True), (16 << 20, False)]
_OBJECT_WEIGHT = 8 << 20  # float32 elements: a 32 MiB tensor


def _label(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def _sweep(op: str, numel: int, ctx: DistContext, stack: Stack) -> Fns:
    """``op``: pdist's against torch's on the same tensors (``numel`` elements in all)."""
    pg, dev = ctx.world.device_group, ctx.device
    if op == "all_gather":
        x = torch.ones(numel // ctx.world_size, device=dev)  # every rank's part of the output
        flat = torch.empty(numel, device=dev)  # the same layout as pdist's result
        outs = [torch.empty_like(x) for _ in range(ctx.world_size)]
        return {
            "pdist": lambda: pdist.all_gather(ctx, x, dim=0),
            "torch": lambda: all_gather_into(flat, x, pg),
            # What an out-of-place result pays too: a fresh output every call.
            "torch_into_fresh": lambda: all_gather_into(torch.empty_like(flat), x, pg),
            "torch_list": lambda: dist.all_gather(outs, x, group=pg),
        }
    x, buf = torch.ones(numel, device=dev), torch.ones(numel, device=dev)
    if op == "broadcast":
        return {
            "pdist": lambda: pdist.broadcast(ctx, x),
            "torch": lambda: dist.broadcast(buf, 0, group=pg),
        }
    return {
        "pdist": lambda: pdist.all_reduce(ctx, x),
        "torch": lambda: dist.all_reduce(buf, group=pg),
        "torch_clone_then_all_reduce": lambda: dist.all_reduce(x.clone(), group=pg),  # the floor
    }


def _in_place_all_reduce(numel: int, ctx: DistContext, stack: Stack) -> Fns:
    """all_reduce_ against torch's in-place all_reduce (zeros: repeated sums stay finite)."""
    ours, theirs = (torch.zeros(numel, device=ctx.device) for _ in range(2))
    pg = ctx.world.device_group
    return {
        "pdist": lambda: pdist.all_reduce_(ctx, ours),
        "torch": lambda: dist.all_reduce(theirs, group=pg),
    }


def _async_all_reduce(numel: int, ctx: DistContext, stack: Stack) -> Fns:
    """all_reduce(async_op=True), then first use, against torch's async forms."""
    x, buf = torch.ones(numel, device=ctx.device), torch.ones(numel, device=ctx.device)
    pg, functional = ctx.world.device_group, funcol()
    # The first use of a result is its cheapest touch that still waits for it: t[:1].sum().
    return {
        "pdist": lambda: pdist.all_reduce(ctx, x, async_op=True)[:1].sum(),
        # Out of place, waits on first use: the like-for-like baseline.
        "torch_functional": lambda: functional.all_reduce(x, "sum", pg)[:1].sum(),
        "torch_in_place_async": lambda: dist.all_reduce(buf, group=pg, async_op=True).wait(),
    }


def _reduce_scatter(numel: int, ctx: DistContext, stack: Stack) -> Fns:
    """reduce_scatter against torch's reduce-scatter, and on gloo the all-to-all pdist uses."""
    world, pg = ctx.world_size, ctx.world.device_group
    x = torch.ones(numel, device=ctx.device)
    out = torch.empty(numel // world, device=ctx.device)
    fns: Fns = {"pdist": lambda: pdist.reduce_scatter(ctx, x, dim=0)}
    scatter = partial(reduce_scatter_into, out, x, dist.ReduceOp.SUM, pg, async_op=False)
    with contextlib.suppress(RuntimeError, NotImplementedError):  # the backend has none
        scatter()  # every rank fails alike, before any traffic
        fns["torch"] = scatter
    if ctx.backend == "gloo":
        received = torch.empty(numel, device=ctx.device)

        def all_to_all_then_sum() -> None:
            dist.all_to_all_single(received, x, group=pg)
            torch.sum(received.view(world, -1), dim=0, out=out)

        fns["torch_all_to_all_then_sum"] = all_to_all_then_sum
    return fns


def _all_gather_last_dim(numel: int, ctx: DistContext, stack: Stack) -> Fns:
    """all_gather along the last dim against all_gather_into_tensor plus the one permute."""
    world, pg = ctx.world_size, ctx.world.device_group
    x = torch.ones(64, numel // world // 64, device=ctx.device)
    raw = torch.empty(world * x.numel(), device=ctx.device)
    out = torch.empty(64, world, x.shape[1], device=ctx.device)

    def gather_then_permute() -> None:
        all_gather_into(raw, x.view(-1), pg)
        out.copy_(raw.view(world, *x.shape).movedim(0, 1))

    return {"pdist": lambda: pdist.all_gather(ctx, x, dim=-1), "torch": gather_then_permute}


def _check_mode(numel: int, ctx: DistContext, stack: Stack) -> Fns:
    """all_reduce in check mode (one more small CPU all-reduce per call) against it unchecked."""
    x, lifetime = torch.ones(numel, device=ctx.device), ctx.world.lifetime
    before = lifetime.check
    stack.callback(setattr, lifetime, "check", before)

    def checked() -> torch.Tensor:
        lifetime.check = True
        try:
            return pdist.all_reduce(ctx, x)
        finally:
            lifetime.check = False

    lifetime.check = False
    return {"pdist": checked, "pdist_unchecked": lambda: pdist.all_reduce(ctx, x)}


def _tensor_cases() -> list[Case]:
    """The size sweep; then the in-place, async, reduce-scatter and last-dim cases at 1, 16 MiB."""
    cases = []
    for n, quick in _SIZES:
        inner = 20 if n <= 64 << 10 else 3  # small messages: enough calls to outgrow the clock
        for op, bw in _BUSBW.items():
            name = f"{op} {_label(n)}"
            cases.append(Case(name, n, partial(_sweep, op, n // 4), inner, bw, quick))
    for n, quick in ((1 << 20, True), (16 << 20, False)):
        for name, setup, bw in (
            ("all_reduce_", _in_place_all_reduce, _BUSBW["all_reduce"]),
            ("all_reduce async", _async_all_reduce, _BUSBW["all_reduce"]),
            ("reduce_scatter", _reduce_scatter, _BUSBW["all_gather"]),
            ("all_gather dim=-1", _all_gather_last_dim, _BUSBW["all_gather"]),
        ):
            cases.append(Case(f"{name} {_label(n)}", n, partial(setup, n // 4), 3, bw, quick))
    for n, quick in ((4 << 10, True), (1 << 20, False)):
        name = f"all_reduce {_label(n)} check mode"
        cases.append(Case(name, n, partial(_check_mode, n // 4), 20, _BUSBW["all_reduce"], quick))
    return cases


def _torch_objects(ctx: DistContext, ours: Callable[[], object], obj: object) -> Fns:
    """``ours`` against torch's broadcast_object_list, which needs numpy (pdist does not)."""
    if importlib.util.find_spec("numpy") is None:
        return {"pdist": ours}
    pg = ctx.world.cpu_group
    theirs = lambda: dist.broadcast_object_list(_from_rank0(ctx, obj), src=0, group=pg)  # noqa: E731
    return {"pdist": ours, "torch_broadcast_object_list": theirs}


def _from_rank0(ctx: DistContext, obj: object) -> list[Any]:
    return [obj] if ctx.rank == 0 else [None]


def _fresh_pages(like: torch.Tensor) -> torch.Tensor:
    """Memory no one wrote, as a result needs: on CPU, transparent huge pages where offered.

    Not ``_buffers.allocate``, though it does the same: a baseline stays independent of
    the code it is measured against, and ``_buffers`` serves the transports only.
    """
    if like.device.type != "cpu" or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty_like(like)
    region = mmap.mmap(-1, like.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(region, dtype=like.dtype)


def _structured_a(ctx: DistContext, stack: Stack) -> Fns:
    """(a) one 128 MiB tensor with metadata vs a raw broadcast of the same bytes.

    ``raw_broadcast`` reuses one warm tensor; a result of its own memory (pdist's, or
    ``raw_broadcast_into_fresh``'s) first pays the kernel's zeroing of fresh pages.
    """
    w, raw, pg = torch.ones(32 << 20), torch.ones(32 << 20), ctx.world.device_group
    payload = {"w": w, "meta": {"step": 1000, "name": "layer.0.weight", "shape": tuple(w.shape)}}
    return {
        "pdist": lambda: pdist.broadcast_object_list(ctx, _from_rank0(ctx, payload)),
        "raw_broadcast": lambda: dist.broadcast(raw, 0, group=pg),
        "raw_broadcast_into_fresh": lambda: dist.broadcast(
            raw if ctx.rank == 0 else _fresh_pages(raw), 0, group=pg
        ),
    }


def _structured_b(ctx: DistContext, stack: Stack) -> Fns:
    """(b) 1000 tensors of 64 KiB (a state-dict shape) vs one flat broadcast of the same bytes."""
    tensors = [torch.full((16 << 10,), float(i)) for i in range(1000)]
    flat, pg = torch.ones(1000 * (16 << 10)), ctx.world.device_group

    def per_tensor() -> None:
        for t in tensors:
            dist.broadcast(t, 0, group=pg)

    def fresh() -> torch.Tensor:  # (pdist's own are huge pages at this size: a floor, not less)
        return torch.empty_like(flat)

    def into_fresh() -> None:
        # What a result in new tensors costs at least: the receivers' fresh memory.
        dist.broadcast(flat if ctx.rank == 0 else fresh(), 0, pg)

    def cat_into_fresh() -> None:
        # The least any one-collective transport does: the source concatenates too.
        dist.broadcast(torch.cat(tensors, out=fresh()) if ctx.rank == 0 else fresh(), 0, pg)

    return {
        "pdist": lambda: pdist.broadcast_object_list(ctx, _from_rank0(ctx, tensors)),
        "flat_broadcast": lambda: dist.broadcast(flat, 0, group=pg),
        "per_tensor_broadcast": per_tensor,
        "flat_into_fresh": into_fresh,
        "cat_into_fresh_then_broadcast": cat_into_fresh,
    }


def _structured_c(ctx: DistContext, stack: Stack) -> Fns:
    """(c) a tiny dict vs torch.distributed.broadcast_object_list."""
    obj = {"step": 3, "lr": 0.1}
    return _torch_objects(ctx, lambda: pdist.broadcast_object_list(ctx, _from_rank0(ctx, obj)), obj)


def _object_gather(ctx: DistContext, stack: Stack) -> Fns:
    """all_gather_object of a small dict vs torch.distributed.all_gather_object."""
    obj = {"rank": ctx.rank, "loss": 0.25, "tokens": list(range(32))}
    out: list[object] = [None] * ctx.world_size
    pg = ctx.world.cpu_group
    return {
        "pdist": lambda: pdist.all_gather_object(ctx, obj),
        "torch_all_gather_object": lambda: dist.all_gather_object(out, obj, group=pg),
    }


def _object_gather_big(ctx: DistContext, stack: Stack) -> Fns:
    """all_gather_object of {"w": 32 MiB, "step": 3} vs raw all-gathers into fresh outputs."""
    w, pg = torch.ones(_OBJECT_WEIGHT, device=ctx.device), ctx.world.device_group
    obj = {"w": w, "step": 3}
    return {
        "pdist": lambda: pdist.all_gather_object(ctx, obj),
        "raw_all_gather": lambda: dist.all_gather(
            [torch.empty_like(w) for _ in range(ctx.world_size)], w, group=pg
        ),
        "raw_all_gather_into": lambda: all_gather_into(
            w.new_empty(ctx.world_size * w.numel()), w, pg
        ),
    }


def _object_send_big(ctx: DistContext, stack: Stack) -> Fns:
    """send_object/recv_object of {"w": 32 MiB, "step": 3}, rank 0 to 1, vs raw send/recv.

    ``raw_send_recv`` receives into fresh memory, as recv_object must; ``_warm`` into one buffer.
    """
    w, pg = torch.ones(_OBJECT_WEIGHT, device=ctx.device), ctx.world.device_group
    obj, warm = {"w": w, "step": 3}, torch.empty_like(w)

    def one_to_two(send: Callable[[], object], recv: Callable[[], object]) -> Callable[[], object]:
        return lambda: send() if ctx.rank == 0 else recv() if ctx.rank == 1 else None

    send = lambda: dist.send(w, 1, group=pg)  # noqa: E731
    return {
        "pdist": one_to_two(
            lambda: pdist.send_object(ctx, obj, dst=1), lambda: pdist.recv_object(ctx, src=0)
        ),
        "raw_send_recv": one_to_two(send, lambda: dist.recv(torch.empty_like(w), 0, group=pg)),
        "raw_send_recv_warm": one_to_two(send, lambda: dist.recv(warm, 0, group=pg)),
    }


def _collate(ctx: DistContext, stack: Stack) -> Fns:
    """32 leaves of [~5000, 8] per rank, uneven by one, vs one raw all_gather of the bytes."""
    world = ctx.world_size
    count = len(range(ctx.rank, 5000 * world - 1, world))
    batches = [
        {f"leaf{i}": torch.full((min(500, count - chunk), 8), float(i)) for i in range(32)}
        for chunk in range(0, count, 500)
    ]
    mine, out = torch.ones(32 * 5000 * 8), torch.empty(32 * 5000 * 8 * world)
    pg = ctx.world.cpu_group
    record = torch.zeros(FIRST_MESSAGE_BYTES, dtype=torch.uint8)  # collate's metadata message
    records = [torch.empty_like(record) for _ in range(world)]

    def in_dataset_order(rows: torch.Tensor) -> None:
        # The same bytes straight into a fresh result in dataset order (rank j's row r is
        # sample r * W + j): the data movement collate's result needs, without metadata.
        grid = torch.empty(32, 5000, world, 8)
        dist.all_gather([grid[:, :, j] for j in range(world)], rows, group=pg)

    def cat_then_in_dataset_order() -> None:
        # As above from the batches: each leaf's batches concatenated into fresh memory first.
        rows = torch.zeros(32, 5000, 8)
        for i, leaf in enumerate(batches[0]):
            torch.cat([batch[leaf] for batch in batches], out=rows[i, :count])
        in_dataset_order(rows)

    def round_trip_then_cat() -> None:
        # As above after one 4 KiB all-gather: the metadata round trip failing together needs.
        dist.all_gather(records, record, group=pg)
        cat_then_in_dataset_order()

    return {
        "pdist": lambda: pdist.collate_batches(ctx, batches),
        "raw_all_gather": lambda: all_gather_into(out, mine, pg),
        "all_gather_in_dataset_order": lambda: in_dataset_order(mine.view(32, 5000, 8)),
        "cat_then_gather_in_dataset_order": cat_then_in_dataset_order,
        "round_trip_cat_gather_in_dataset_order": round_trip_then_cat,
    }


def _weights(count: int, numel: int, ctx: DistContext, stack: Stack) -> Fns:
    """broadcast_weights of ``count`` fp32 tensors into the receivers' own, vs a broadcast loop."""
    ours = {f"layer.{i}.weight": torch.full((numel,), float(i)) for i in range(count)}
    theirs, pg = [t.clone() for t in ours.values()], ctx.world.device_group

    def loop() -> None:  # what weight sync code writes today
        for t in theirs:
            dist.broadcast(t, 0, group=pg)

    source = ctx.rank == 0
    return {
        "pdist": lambda: pdist.broadcast_weights(
            ctx, ours if source else None, into=None if source else ours
        ),
        "broadcast_loop": loop,
    }


def _message_queue(ctx: DistContext, stack: Stack) -> Fns:
    """Back-to-back broadcasts of a small dict through shared memory vs torch's object broadcast."""
    obj, group = {"step": 3, "lr": 0.1}, stack.enter_context(pdist.message_queue(ctx.world))
    return _torch_objects(ctx, lambda: pdist.broadcast_object(group, _from_rank0(ctx, obj)[0]), obj)


CASES = [
    *_tensor_cases(),
    Case("structured broadcast (a) 128 MiB + meta", 128 << 20, _structured_a),
    Case("structured broadcast (b) 1000 x 64 KiB", 1000 * (64 << 10), _structured_b),
    Case("structured broadcast (c) tiny dict", 32, _structured_c, 50),
    Case("all_gather_object small dict", 256, _object_gather, 50),
    Case("all_gather_object 32 MiB + meta", 32 << 20, _object_gather_big),
    Case("send_object/recv_object 32 MiB + meta", 32 << 20, _object_send_big),
    Case("collate_batches 32 x [5000, 8]", 32 * 5000 * 8 * 4, _collate),
    Case("message_queue broadcast_object small dict", 32, _message_queue, 1000),
    *EXPERT_CASES,
    Case("broadcast_weights 1000 x 64 KiB", 1000 * (64 << 10), partial(_weights, 1000, 16 << 10)),
    Case("broadcast_weights 8 x 16 MiB", 8 * (16 << 20), partial(_weights, 8, 4 << 20)),
]


def bench_rank(quick: bool, progress: bool) -> dict[str, Any]:
    """Run every case in ``distributed()`` (every rank must); each returns the same report."""
    with pdist.distributed() as ctx:
        show = progress and ctx.rank == 0
        records = [attrs.asdict(r) for r in run_cases(ctx, CASES, quick=quick, progress=show)]
        return {
            "torch_version": torch.__version__,
            "backend": ctx.backend,
            "device": ctx.device.type,
            "world_size": ctx.world_size,
            "quick": quick,
            "records": records,
        }
