"""CUDA/NCCL paths: the same code as on CPU, with a device. Skipped without GPUs."""

from __future__ import annotations

import pytest
import torch

import pdist
from pdist.testing import spawn

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _one_rank() -> tuple[str, str, bool]:
    with pdist.distributed() as ctx:
        x = pdist.all_reduce(ctx, torch.ones(2, device=ctx.device))
        return ctx.backend, str(ctx.device), bool(x.is_cuda)


def test_nccl_one_rank_world():
    """On a GPU, distributed() binds cuda:<local_rank> and picks NCCL."""
    assert spawn(_one_rank, 1) == [("nccl", "cuda:0", True)]


def _multi_rank() -> list[object]:
    with pdist.distributed() as ctx:
        out: list[object] = []
        x = torch.full((4,), float(ctx.rank + 1), device=ctx.device)
        out.append(pdist.all_reduce(ctx, x).tolist())
        out.append(pdist.all_gather(ctx, x[:1], dim=0).tolist())
        # A CUDA tensor from the source lands on the receiver's own device.
        obj = pdist.broadcast_object(
            ctx, {"t": torch.ones(3, device=ctx.device)} if ctx.rank == 0 else None
        )
        out.append(str(obj["t"].device))
        items = (
            [{"w": torch.arange(5000.0, device=ctx.device), "c": torch.ones(2)}]
            if ctx.rank == 0
            else [None]
        )
        pdist.broadcast_object_list(ctx, items)
        out.append(
            (str(items[0]["w"].device), str(items[0]["c"].device), items[0]["w"].sum().item())
        )
        td = pdist.broadcast_tensor_dict(
            ctx, {"a": torch.ones(8, device=ctx.device)} if ctx.rank == 0 else None
        )
        out.append(str(td["a"].device))
        batches = [torch.tensor([ctx.rank], device=ctx.device)]
        out.append(pdist.collate_batches(ctx, batches).tolist())
        with pdist.world_comm_guard(ctx, timeout=120):
            pass
        with pdist.graph_capture(ctx) as capture:
            out.append(capture.stream is not None)
        # Two blocks of one rank each: a real split_group of the bound world communicator.
        solo = pdist.new_group(ctx, [[0], [1]], name="solo")
        out.append(pdist.all_reduce(solo, torch.ones(1, device=ctx.device)).tolist())
        return out


@pytest.mark.skipif(_gpus() < 2, reason="needs 2 GPUs (NCCL refuses two ranks on one GPU)")
def test_nccl_collectives_and_objects():
    """Collectives, objects and collate over NCCL; tensors land on the receiver's GPU."""
    results = spawn(_multi_rank, 2, timeout=300)
    for rank, out in enumerate(results):
        assert out[0] == [3.0] * 4
        assert out[1] == [1.0, 2.0]
        assert out[2] == f"cuda:{rank}"
        assert out[3] == (f"cuda:{rank}", "cpu", sum(range(5000)))
        assert out[4] == f"cuda:{rank}"
        assert out[5] == [0, 1]
        assert out[6] is True
        assert out[7] == [1.0]


def _tp_dp_axes() -> list[list[float]]:
    # Bound to cuda:<local rank>: eager NCCL bring-up (device_id=) under the start-up
    # deadline, the world probe, then one split_group per axis.
    with pdist.distributed(tp=2) as ctx:
        one = torch.ones(1, device=ctx.device)
        return [pdist.all_reduce(g, one * (ctx.rank + 1)).tolist() for g in (ctx.tp, ctx.dp)]


@pytest.mark.skipif(_gpus() < 4, reason="needs 4 GPUs (tp=2 x dp=2)")
def test_nccl_tp_and_dp_axes_by_split_group():
    """On 4 GPUs, tp=2: each axis group sums over exactly its ranks (tp: 0-1, 2-3; dp: 0,2)."""
    results = spawn(_tp_dp_axes, 4, timeout=300)
    assert results == [[[3.0], [4.0]], [[3.0], [6.0]], [[7.0], [4.0]], [[7.0], [6.0]]]


def _cuda_l2_limit() -> int:
    """The current device's cudaLimitMaxL2FetchGranularity, read through the CUDA runtime."""
    import ctypes

    with open("/proc/self/maps") as maps:
        paths = [line.split()[-1] for line in maps if "/libcudart.so" in line]
    lib = ctypes.CDLL(paths[0] if paths else "libcudart.so")
    value = ctypes.c_size_t()
    assert lib.cudaDeviceGetLimit(ctypes.byref(value), 0x05) == 0
    return int(value.value)


def _l2_granularity() -> tuple[int, int, int]:
    torch.cuda.init()
    before = _cuda_l2_limit()
    with pdist.distributed(l2_fetch_granularity=128):
        inside = _cuda_l2_limit()
    return before, inside, _cuda_l2_limit()


def test_l2_fetch_granularity_is_set_and_restored():
    """distributed(l2_fetch_granularity=128) sets the limit (read back) and restores it on exit."""
    [(before, inside, after)] = spawn(_l2_granularity, 1)
    assert inside == 128
    assert after == before


def _nccl_paths() -> list[object]:
    """all_gather off dim 0 and reduce_scatter on NCCL (pdist's generic paths), async too."""
    from pdist._collectives import generic_path

    with pdist.distributed() as ctx:
        w, r, dev = ctx.world_size, ctx.rank, ctx.device
        xs = [torch.arange(24.0, device=dev).reshape(2, 3, 4) * (k + 1) for k in range(w)]
        out: list[object] = []
        for dim in (1, -1):  # leading dims > 1: the gather-then-permute path
            want = torch.cat(xs, dim=dim)
            out.append(torch.equal(pdist.all_gather(ctx, xs[r], dim=dim), want))
            out.append(torch.equal(pdist.all_gather(ctx, xs[r], dim=dim, async_op=True), want))
            out.append(torch.equal(generic_path("all_gather", ctx, xs[r], dim), want))
        ys = [torch.arange(8.0 * w * w, device=dev).reshape(2 * w, 4 * w) + k for k in range(w)]
        for op, reduced in (("sum", sum(ys)), ("mean", sum(ys) / w), ("max", ys[-1])):
            for dim in (0, -1):
                want = reduced.chunk(w, dim=dim)[r]
                got = pdist.reduce_scatter(ctx, ys[r], dim=dim, op=op)
                out.append(torch.allclose(got, want))
                got = pdist.reduce_scatter(ctx, ys[r].t().t(), dim=dim, op=op, async_op=True)
                out.append(torch.allclose(got, want))
        # Gradients through both paths: all_gather's backward is reduce_scatter.
        x = xs[r].clone().requires_grad_(True)
        pdist.all_gather(ctx, x, dim=-1).sum().backward()
        out.append(torch.equal(x.grad, torch.full_like(x, float(w))))
        return out


@pytest.mark.skipif(_gpus() < 2, reason="needs 2 GPUs (NCCL refuses two ranks on one GPU)")
def test_nccl_all_gather_off_dim0_and_reduce_scatter():
    """all_gather along dim=-1 and reduce_scatter equal their references on NCCL."""
    for rank, out in enumerate(spawn(_nccl_paths, 2, timeout=300)):
        assert out == [True] * len(out), (rank, out)


def _generic_on_one_gpu() -> list[bool]:
    from pdist._collectives import generic_path

    with pdist.distributed() as ctx:
        x = torch.arange(12.0, device=ctx.device).reshape(3, 4)
        return [
            torch.equal(generic_path("all_gather", ctx, x, -1), x),
            torch.equal(generic_path("reduce_scatter", ctx, x, "mean", 0), x),
        ]


def test_nccl_generic_paths_on_one_rank():
    """The generic paths' NCCL calls run on a one-rank world (the public calls skip them)."""
    assert spawn(_generic_on_one_gpu, 1, timeout=300) == [[True, True]]


NCCL_SOURCE_DIES = """
    import os, time
    import torch
    import pdist
    from pdist.testing import inject

    rank = int(os.environ["RANK"])
    address = "127.0.0.1:" + os.environ["LINK_PORT"]
    with pdist.link(address, rank=rank, world_size=2, device=f"cuda:{rank}", timeout=10) as g:
        assert g.device_group is not g.cpu_group  # tensors travel on NCCL
        pdist.barrier(g)
        weights = {f"w{i}": torch.ones(1 << 18, device=g.device) for i in range(8)}
        into = {f"w{i}": torch.zeros(1 << 18) for i in range(8)}  # on the host: copies block
        # A mismatch raised together leaves the NCCL communicator alone: it goes on.
        try:
            pdist.broadcast_weights(g, weights, src=1, into={} if rank == 0 else None)
        except pdist.PdistError:
            pass
        assert pdist.all_reduce(g, torch.ones(1, device=g.device)).item() == 2.0
        start = time.monotonic()
        try:
            if rank == 1:  # the source goes away after two buckets
                with inject(pack=lambda i: os._exit(3) if i == 2 else None):
                    pdist.broadcast_weights(g, weights, src=1, bucket_bytes=1 << 20)
            else:
                pdist.broadcast_weights(g, src=1, into=into, bucket_bytes=1 << 20)
        except pdist.PdistError as exc:
            print(f"RAISED after {time.monotonic() - start:.1f}s: {exc}")
    print("OK")
"""


@pytest.mark.skipif(_gpus() < 2, reason="needs 2 GPUs (NCCL refuses two ranks on one GPU)")
def test_nccl_link_survivor_raises_when_the_source_dies_mid_broadcast():
    """pdist's watchdog aborts the stuck NCCL communicator: the receiver raises, naming it."""
    from launcher import run_ranks
    from test_links import free_port

    env = {"LINK_PORT": str(free_port())}
    receiver = run_ranks(NCCL_SOURCE_DIES, 2, timeout=120, env=env)[0]
    assert receiver.returncode == 0, receiver.output
    assert "RAISED after" in receiver.output, receiver.output
    assert "rank 1" in receiver.output.split("RAISED after")[1], receiver.output
    assert float(receiver.output.split("RAISED after ")[1].split("s")[0]) < 10 + 15
