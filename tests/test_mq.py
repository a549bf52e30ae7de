"""The shared-memory message queue and graph_capture."""

from __future__ import annotations

import collections
import os

import pytest
import torch
from launcher import raised_after, run_ranks

import pdist
from pdist.testing import count_collectives, world_sizes

Msg = collections.namedtuple("Msg", "step tokens")


def _objects(i: int):
    return [
        {"step": i, "lr": 0.1},
        [i, "text", (1.5, None)],
        {"tensor": torch.arange(4.0) + i, "nested": {"mask": torch.ones(2, dtype=torch.bool)}},
        Msg(i, list(range(i))),
        "x" * i,
    ]


def _shm_entries() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("pdist-")}


@world_sizes(2, 3)
def test_round_trips_without_collectives(ctx):
    """Objects (tensors inside too) arrive through shared memory: no collective per broadcast."""
    with pdist.message_queue(ctx) as group:
        assert group.ranks == ctx.world.ranks
        assert ctx.world._mq is None  # the original is untouched
        for i in range(20):  # more messages than slots: the ring wraps
            for obj in _objects(i):
                with count_collectives() as calls:
                    got = pdist.broadcast_object(group, obj if ctx.rank == 0 else None)
                assert sum(calls.values()) == 0
                if isinstance(obj, dict) and "tensor" in obj:
                    assert torch.equal(got["tensor"], obj["tensor"])
                    assert got["nested"]["mask"].dtype == torch.bool
                else:
                    assert got == obj
        tensors = {"a": torch.arange(10.0), "b": {"c": torch.ones(3, dtype=torch.int64)}, "n": 4}
        got = pdist.broadcast_tensor_dict(group, tensors if ctx.rank == 0 else None)
        assert torch.equal(got["a"], tensors["a"])
        assert got["n"] == 4


@world_sizes(2, 3)
def test_large_object_falls_back_to_the_cpu_group(ctx):
    """An object larger than a slot still arrives, over the CPU group."""
    with pdist.message_queue(ctx, chunk_bytes=1024, chunks=2) as group:
        big = {"blob": "y" * 10_000, "t": torch.arange(1000.0)}
        for _ in range(3):
            got = pdist.broadcast_object(group, big if ctx.rank == 0 else None)
            assert got["blob"] == big["blob"]
            assert torch.equal(got["t"], big["t"])
            assert pdist.broadcast_object(group, 7 if ctx.rank == 0 else None) == 7


@world_sizes(3)
def test_only_the_first_rank_writes(ctx):
    """Another src raises ValueError on every rank, before anything is sent."""
    with pdist.message_queue(ctx) as group:
        with pytest.raises(ValueError, match="src=1: a message_queue group broadcasts only"):
            pdist.broadcast_object(group, "x", src=1)
        assert pdist.broadcast_object(group, "ok" if ctx.rank == 0 else None) == "ok"


@world_sizes(2, 3)
def test_no_shm_entry_outlives_the_group(ctx):
    """The segment is unlinked once every rank attached: nothing stays in /dev/shm."""
    before = _shm_entries()
    with pdist.message_queue(ctx) as group:
        pdist.barrier(ctx)
        assert _shm_entries() - before == set()
        pdist.broadcast_object(group, 1 if ctx.rank == 0 else None)
    pdist.barrier(ctx)
    assert _shm_entries() - before == set()


@world_sizes(2)
def test_bad_arguments(ctx):
    """Sizes must be positive ints."""
    with pytest.raises(ValueError, match="chunk_bytes=0 must be a positive int"):
        pdist.message_queue(ctx, chunk_bytes=0).__enter__()


TWO_HOSTS = """
    import pdist
    with pdist.distributed() as ctx:
        try:
            with pdist.message_queue(ctx):
                print("ENTERED", flush=True)
        except pdist.PdistError as exc:
            print("ERROR", exc, flush=True)
"""


def test_two_hosts_are_refused_on_every_rank():
    """Ranks on different hosts: every rank raises, naming the ranks on other hosts."""
    results = run_ranks(TWO_HOSTS, 2, timeout=120, hosts=[[0], [1]])
    for r in results:
        assert r.returncode == 0, r.output
        assert (
            "ERROR message_queue needs every rank of group 'world' on one host; ranks [1]"
            in r.output
        )


WRITER_DIES = """
    import os, time, pdist
    with pdist.distributed(timeout=3) as ctx:
        with pdist.message_queue(ctx) as group:
            for i in range(3):
                pdist.broadcast_object(group, i if ctx.rank == 0 else None)
            if ctx.rank == 0:
                os._exit(5)
            start = time.monotonic()
            try:
                pdist.broadcast_object(group, None)
            except pdist.PdistError as exc:
                print(f"RAISED after {time.monotonic() - start:.1f}s: {exc}", flush=True)
"""


def test_readers_raise_when_the_writer_dies():
    """A reader waiting past the group's timeout raises instead of waiting forever."""
    results = run_ranks(WRITER_DIES, 3, timeout=90)
    assert results[0].returncode == 5
    for r in results[1:]:
        assert r.returncode == 0, r.output
        assert "a reader waited for the writer" in r.output
        assert raised_after(r.output) < 3 + 3


@world_sizes(1, 2)
def test_graph_capture_on_cpu(ctx):
    """On CPU the block runs as is and the stream is None."""
    ran = []
    with pdist.graph_capture(ctx.tp) as capture:
        ran.append(True)
        assert capture.stream is None
    assert ran == [True]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_graph_capture_on_cuda():
    """On CUDA the block runs on a side stream."""
    assert pdist.testing.spawn(_graph_capture_cuda, 1) == [True]


def _graph_capture_cuda() -> bool:
    with pdist.distributed() as ctx, pdist.graph_capture(ctx) as capture:
        return torch.cuda.current_stream() == capture.stream
