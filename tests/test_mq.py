"""The shared-memory message queue and graph_capture."""

from __future__ import annotations

import collections
import contextlib
import errno
import logging
import mmap
import os
import re
import struct
import threading
import time
import types
from datetime import timedelta

import pytest
import torch
from fail_together import outcome_of, rewriting
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


@world_sizes(1, 2)
def test_bad_arguments(ctx):
    """Sizes must be positive ints: ValueError on one rank, the same RemoteError on every rank."""
    expected = ValueError if ctx.world_size == 1 else pdist.PdistError
    with pytest.raises(expected, match="chunk_bytes=0 must be a positive int"):
        pdist.message_queue(ctx, chunk_bytes=0).__enter__()
    with pytest.raises(expected, match=r"idle_timeout=-1 must be a finite positive duration"):
        pdist.message_queue(ctx, idle_timeout=-1).__enter__()


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
        assert "rank 0 (pid " in r.output
        assert "exited while rank" in r.output
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


# --------------------------------------------------------------------------- set-up fails together

HOSTILE = {
    "hostile writer, absolute path": "/etc/passwd",
    "hostile writer, traversal": "pdist-mq-../../etc/passwd",
    "hostile writer, another prefix": "pdist-probe-" + "0" * 32,
}


def _mq_one_bad_rank(case: str):
    """Enter message_queue with one rank's part broken as ``case`` says; how each rank ended."""
    with pdist.distributed(timeout=30) as ctx:
        kwargs = {}
        undo = []
        if case == "chunk_bytes differs" and ctx.rank == 1:
            kwargs = {"chunk_bytes": 1024}
        elif case == "chunks differs" and ctx.rank == 2:
            kwargs = {"chunks": 3}
        elif case == "chunk_bytes=0" and ctx.rank == 1:
            kwargs = {"chunk_bytes": 0}
        elif case == "chunk_bytes past any file size":
            kwargs = {"chunk_bytes": 1 << 64}
        elif case == "writer cannot reserve" and ctx.rank == 0:
            reserve = os.posix_fallocate

            def full(fd, offset, length):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

            os.posix_fallocate = full
            undo.append(lambda: setattr(os, "posix_fallocate", reserve))
        elif case == "reader cannot open" and ctx.rank == 2:
            real_open = os.open

            def refuse(path, flags, *args, **kwargs):
                if "pdist-mq-" in str(path) and not flags & os.O_CREAT:
                    raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)
                return real_open(path, flags, *args, **kwargs)

            os.open = refuse
            undo.append(lambda: setattr(os, "open", real_open))
        elif case in HOSTILE and ctx.rank == 0:  # the writer's set-up record names another path
            hostile = pdist.testing.inject(outgoing=rewriting("segment", HOSTILE[case]))
            hostile.__enter__()
            undo.append(lambda: hostile.__exit__(None, None, None))

        def enter() -> None:
            try:
                with pdist.message_queue(ctx, **kwargs) as group:
                    pdist.broadcast_object(group, 1 if ctx.rank == 0 else None)
            finally:
                for step in undo:
                    step()

        return outcome_of(ctx, enter)


RING = r"/dev/shm/pdist-mq-[0-9a-f]{32}"
SET_UP = {
    "chunk_bytes differs": (
        "RankMismatchError",
        r"chunk_bytes differs across ranks: 4194304 on ranks \[0, 2\]; 1024 on rank 1; "
        "pass the same chunk_bytes and chunks on every rank",
    ),
    "chunks differs": ("RankMismatchError", r"chunks differs across ranks: 6 on ranks \[0, 1\]"),
    "chunk_bytes=0": (
        "RemoteValueError",
        r"failed on rank 1: ValueError: chunk_bytes=0 must be a positive int; pass the same",
    ),
    "writer cannot reserve": (
        "RemoteError",
        r"failed on rank 0: PdistError: rank 0 could not reserve \d+ bytes for the ring in "
        r"/dev/shm: \[Errno 28\] No space left on device; give it more room",
    ),
    "chunk_bytes past any file size": (
        "RemoteError",
        r"failed on rank 0: PdistError: rank 0 could not reserve \d+ bytes for the ring in "
        r"/dev/shm: Python int too large to convert to C long; give it more room",
    ),
    "reader cannot open": (
        "RemoteError",
        rf"failed on rank 2: PdistError: rank 2 could not open the ring {RING}: \[Errno 13\]",
    ),
    **{
        case: (
            "PdistError",
            rf"the writer \(rank 0\) named the segment {re.escape(repr(name))}; readers open "
            r"only /dev/shm/pdist-mq-<32 hex digits>, never another path",
        )
        for case, name in HOSTILE.items()
    },
}


@pytest.mark.parametrize("case", list(SET_UP))
def test_set_up_fails_together(case):
    """One rank's bad part of the set-up raises the same error on every rank within seconds."""
    kind, pattern = SET_UP[case]
    results = pdist.testing.spawn(_mq_one_bad_rank, 3, case)
    named = re.search(r"failed on rank (\d)", results[0].message)
    bad = int(named.group(1)) if named else -1  # the failing rank may raise its own type too
    assert {o.type for r, o in enumerate(results) if r != bad} == {kind}, results
    assert all(o.pdist for o in results), results
    assert len({o.message for o in results}) == 1, results
    assert re.search(pattern, results[0].message), results
    assert all(o.seconds < 10 for o in results), results
    assert all(o.after == [0, 1, 2] for o in results), results


SMALL_SHM = """
    import os, time, pdist
    with pdist.distributed(timeout=30) as ctx:
        start = time.monotonic()
        try:
            with pdist.message_queue(ctx):  # a 24 MiB ring in a 4 MiB /dev/shm
                print("ENTERED", flush=True)
        except pdist.PdistError as exc:
            print(f"RAISED after {time.monotonic() - start:.1f}s: {exc}", flush=True)
        pdist.barrier(ctx)
        print("SHM", sorted(n for n in os.listdir("/dev/shm") if n.startswith("pdist-")))
"""


def test_a_full_dev_shm_fails_at_set_up_on_every_rank():
    """The ring is reserved at set-up: a small /dev/shm raises on every rank, not SIGBUS later."""
    results = run_ranks(SMALL_SHM, 2, timeout=120, hosts=[[0, 1]], shm_size="4m")
    for r in results:
        assert r.returncode == 0, r.output
        assert "ENTERED" not in r.output, r.output
        assert re.search(
            r"failed on rank 0: PdistError: rank 0 could not reserve 25166336 bytes for the ring "
            r"in /dev/shm: \[Errno 28\] No space left on device; give it more room "
            r"\(docker run --shm-size=...\) or pass a smaller chunk_bytes x chunks "
            r"\(now 4194304 x 6\)",
            r.output,
        ), r.output
        assert raised_after(r.output) < 10
        assert "SHM []" in r.output, r.output


# --------------------------------------------------------------------------- lifetime and poisoning


@world_sizes(2)
def test_a_queue_used_after_its_block_says_so(ctx):
    """After the queue's block exits, a broadcast on its group raises PdistError, not mmap's."""
    with pdist.message_queue(ctx) as group:
        pdist.broadcast_object(group, 1 if ctx.rank == 0 else None)
    with pytest.raises(pdist.PdistError, match=r"block of group 'world' has exited"):
        pdist.broadcast_object(group, 1 if ctx.rank == 0 else None)


def _queue_outlives_its_context():
    stack = contextlib.ExitStack()
    with pdist.distributed(timeout=30) as ctx:
        group = stack.enter_context(pdist.message_queue(ctx))
        pdist.broadcast_object(group, 1 if ctx.rank == 0 else None)
        rank = ctx.rank
    try:
        pdist.broadcast_object(group, 2 if rank == 0 else None)
        return "broadcast after the context closed"
    except pdist.PdistError as exc:
        return str(exc)
    finally:
        stack.close()


def test_a_queue_refuses_after_its_context_exited():
    """A queue kept open past its distributed() block refuses to broadcast, on every rank."""
    for message in pdist.testing.spawn(_queue_outlives_its_context, 2):
        assert message.startswith("this pdist context is closed"), message


@world_sizes(2)
def test_an_error_the_writer_sends_leaves_the_queue_usable(ctx):
    """An error marker reaches every rank in step: the next broadcast works."""
    with pdist.message_queue(ctx) as group:
        expected = AttributeError if ctx.rank == 0 else pdist.PdistError  # pickle's, on rank 0
        with pytest.raises(expected, match="cannot pickle"):
            pdist.broadcast_object(group, (lambda: 1) if ctx.rank == 0 else None)
        assert pdist.broadcast_object(group, "next" if ctx.rank == 0 else None) == "next"


def _poisoned_reader(how: str):
    """A reader times out while idle; both of its calls raise, the second as poisoned."""
    os.environ.pop(pdist._mq.IDLE_TIMEOUT_ENV, None)
    kwargs = {"idle_timeout": 1}
    if how == "environment":
        os.environ[pdist._mq.IDLE_TIMEOUT_ENV] = "1"
        kwargs = {}
    try:
        with pdist.distributed(timeout=30) as ctx, pdist.message_queue(ctx, **kwargs) as group:
            errors = []
            if ctx.rank == 1:
                for _ in range(2):
                    start = time.monotonic()
                    try:
                        pdist.broadcast_object(group, None)
                    except pdist.PdistError as exc:
                        errors.append((str(exc), time.monotonic() - start))
            pdist.barrier(ctx)  # the writer sends nothing until the reader gave up
            return errors
    finally:
        os.environ.pop(pdist._mq.IDLE_TIMEOUT_ENV, None)


@pytest.mark.parametrize("how", ["keyword", "environment"])
def test_an_idle_reader_times_out_then_the_queue_is_poisoned(how):
    """idle_timeout (or PDIST_MQ_IDLE_TIMEOUT_SEC) bounds a reader's wait; then every use raises."""
    (first, took), (second, _) = pdist.testing.spawn(_poisoned_reader, 2, how)[1]
    assert re.search(
        r"rank 1 waited 1\.\ds for message 1 from the writer \(rank 0\) "
        r"\(PDIST_MQ_IDLE_TIMEOUT_SEC / idle_timeout: 1s\)",
        first,
    ), first
    assert 1 <= took < 10
    assert second.startswith("this message_queue on group 'world' is unusable after an earlier")
    assert "rank 1 waited" in second


def _writer_raises_inside():
    """The writer's block raises; the readers then wait for a message that never comes."""
    with pdist.distributed(timeout=30) as ctx:
        start = time.monotonic()
        with contextlib.suppress(RuntimeError), pdist.message_queue(ctx) as g:
            if ctx.rank == 0:
                raise RuntimeError("the writer fails")
            try:
                pdist.broadcast_object(g, None)
            except pdist.PdistError as exc:
                return str(exc), time.monotonic() - start
        return None


def test_readers_raise_when_the_writer_leaves_through_an_exception():
    """A writer that leaves its queue block by raising (alive) ends the readers' wait at once."""
    results = pdist.testing.spawn(_writer_raises_inside, 3, timeout=60)
    assert results[0] is None
    for message, took in results[1:]:
        assert "rank 0 left the queue (its block raised" in message, message
        assert took < 10


def _poisoned_writer():
    """The writer runs out of slots (the reader never reads) past the group's timeout."""
    with pdist.distributed(timeout=2) as ctx, pdist.message_queue(ctx, chunks=2) as group:
        if ctx.rank == 1:
            return []  # alive, but never reads
        errors = []
        for i in range(4):
            start = time.monotonic()
            try:
                pdist.broadcast_object(group, i)
            except pdist.PdistError as exc:
                errors.append((i, str(exc), time.monotonic() - start))
        return errors


def test_a_writer_out_of_slots_times_out_then_the_queue_is_poisoned():
    """The writer waits at most the group's timeout for a slot; then every use raises."""
    (i, first, took), (j, second, _) = pdist.testing.spawn(_poisoned_writer, 2)[0]
    assert (i, j) == (2, 3)
    assert re.search(
        r"rank 0 waited 2\.\ds for ranks \[1\] to consume message 1 and free a slot "
        r"\(the group's timeout: 2s\)",
        first,
    ), first
    assert took < 10
    assert "is unusable after an earlier failure" in second


def _out_of_step():
    with pdist.distributed(timeout=30) as ctx, pdist.message_queue(ctx) as group:
        if ctx.rank == 0:
            queue = group.header_transport
            queue._words.store(queue._slot(1) // 8, 7)  # message 7 in message 1's slot
        pdist.barrier(ctx)
        errors = []
        if ctx.rank == 1:
            for _ in range(2):
                try:
                    pdist.broadcast_object(group, None)
                except pdist.PdistError as exc:
                    errors.append(str(exc))
        return errors


def test_an_unexpected_sequence_number_raises():
    """A reader that finds another message's number in its slot raises; the queue is poisoned."""
    first, second = pdist.testing.spawn(_out_of_step, 2)[1]
    assert "rank 1 expected message 1 but its slot holds message 7" in first
    assert "is unusable after an earlier failure" in second


def _idle_reader():
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logger = logging.getLogger("pdist")
    handler, level = Keep(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        with pdist.distributed(timeout=2) as ctx, pdist.message_queue(ctx) as group:
            if ctx.rank == 0:
                time.sleep(4)  # twice the group's timeout
            start = time.monotonic()
            got = pdist.broadcast_object(group, "late" if ctx.rank == 0 else None)
            return got, time.monotonic() - start, [m for m in records if "has waited" in m]
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def test_an_idle_reader_outlasts_the_group_timeout_and_logs():
    """A reader idle past the group's timeout still gets the message, logging while it waits."""
    got, waited, logs = pdist.testing.spawn(_idle_reader, 2)[1]
    assert got == "late"
    assert waited > 2
    assert logs, "the idle reader logged nothing"
    assert "for message 1 from the writer (rank 0)" in logs[0]


# --------------------------------------------------------------------------- memory ordering


class _Spy:
    """Words that record every access, around the real ones (a factory, as ``_atomics()`` is)."""

    name = "spy"

    def __init__(self, inner):
        self.inner = inner
        self.calls = []

    def __call__(self, buffer):
        self.words = self.inner(buffer)
        return self

    def load(self, index):
        self.calls.append(("load", index))
        return self.words.load(index)

    def store(self, index, value):
        self.calls.append(("store", index, value))
        self.words.store(index, value)

    def release(self):
        self.words.release()


# Unit tests of the ring's private pieces: no public call can observe the order of its stores.


def test_libatomic_release_stores_and_acquire_loads_round_trip():
    """libatomic's words (the path of weakly ordered CPUs) round-trip, one aligned word each."""
    lib = pdist._mq._open_libatomic()
    if lib is None:
        pytest.skip("no libatomic here")
    buffer = bytearray(24)
    words = pdist._mq._choose_atomics("aarch64", lambda: lib)(buffer)
    assert words.name == "libatomic"
    for value in (0, 1, 2**32, 2**63, 2**64 - 1):
        words.store(1, value)
        assert int.from_bytes(buffer[8:16], "little") == value
        assert words.load(1) == value
    assert buffer[:8] == buffer[16:] == bytes(8)  # exactly one aligned word
    words.release()


def _side(rank: int):
    """A stand-in for a two-rank group, as one side of a queue sees it."""
    lifetime = types.SimpleNamespace(closed=False)
    return types.SimpleNamespace(
        name="pair", ranks=(0, 1), rank=rank, rank_in_group=rank, world_size=2,
        is_first_rank=rank == 0, timeout=timedelta(seconds=5), lifetime=lifetime,
        is_closed=False,
    )  # fmt: skip


def test_the_ring_publishes_after_the_data_and_consumes_through_the_atomics():
    """The sequence number is the writer's last store; a reader loads it, then its progress."""
    region = mmap.mmap(-1, 64 * 2 + 2 * (64 + 64))
    region[:32] = struct.pack("<8sQQQ", b"pdistmq1", 1, 64, 2)
    spy = _Spy(pdist._mq._atomics())
    writer = pdist._mq._MessageQueue(_side(0), region, spy, None, None)
    reader = pdist._mq._MessageQueue(_side(1), region, spy, None, None)
    slot = writer._slot(1) // 8
    assert writer.broadcast_bytes(_side(0), b"hello", 0) == b"hello"
    assert spy.calls == [("load", 8), ("store", slot, 1)]  # reader 0's progress, then publish
    spy.calls.clear()
    assert reader.broadcast_bytes(_side(1), None, 0) == b"hello"
    assert spy.calls == [("load", slot), ("store", 8, 1)]  # then its progress
    assert writer._words.load(8) == 1
    reader.close()
    writer.close()


def test_without_libatomic_only_x86_goes_on():
    """x86's ordering (TSO) needs no fences: plain words; a weakly ordered CPU needs libatomic."""
    assert pdist._mq._choose_atomics("x86_64", lambda: pytest.fail("opened libatomic")) is (
        pdist._mq._plain_words
    )
    buffer = bytearray(16)
    plain = pdist._mq._choose_atomics("x86_64", lambda: None)(buffer)
    plain.store(1, 2**64 - 1)
    assert plain.load(1) == 2**64 - 1
    assert buffer == bytes(8) + b"\xff" * 8
    plain.release()
    with pytest.raises(pdist.PdistError, match=r"libatomic on aarch64 .*apt install libatomic1"):
        pdist._mq._choose_atomics("aarch64", lambda: None)


@world_sizes(3)
def test_two_threads_on_two_groups(ctx):
    """Two threads, each with its own queue on its own group, do not mix their messages."""
    groups = [ctx.world, pdist.new_group(ctx, [[0, 1], [2]], name="pair")]
    groups = [g for g in groups if g.world_size > 1]  # rank 2 is alone in its pair
    results: list = [None] * len(groups)

    def run(i):
        with pdist.message_queue(groups[i], chunks=2) as group:
            me = group.is_first_rank
            results[i] = [pdist.broadcast_object(group, (i, k) if me else None) for k in range(9)]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(groups))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert results == [[(i, k) for k in range(9)] for i in range(len(groups))]
