"""The spawn harness itself: results, failures, timeouts."""

from __future__ import annotations

import os
import sys
import time

import pytest

from pdist.testing import SpawnError, count_collectives, spawn


def _rank_and_pid(offset: int) -> tuple[int, int]:
    return int(os.environ["RANK"]) + offset, os.getpid()


def test_results_come_back_in_rank_order_and_workers_are_reused():
    """spawn returns each rank's value in rank order; a second call reuses the processes."""
    first = spawn(_rank_and_pid, 3, 10)
    second = spawn(_rank_and_pid, 3, 10)
    assert [r for r, _ in first] == [10, 11, 12]
    assert [p for _, p in first] == [p for _, p in second]
    assert len({p for _, p in first}) == 3


def _fail_on_one() -> None:
    if os.environ["RANK"] == "1":
        raise ValueError("rank one is unhappy")


def test_failure_names_the_rank_and_carries_its_traceback():
    """A raising rank is named, with its remote traceback."""
    with pytest.raises(
        SpawnError, match=r"rank 1 of 3 failed: ValueError: rank one is unhappy"
    ) as info:
        spawn(_fail_on_one, 3, timeout=30)
    assert info.value.rank == 1
    assert "_fail_on_one" in info.value.remote_traceback


def _die() -> None:
    if os.environ["RANK"] == "0":
        sys.stdout.flush()
        os._exit(7)


def test_a_dying_rank_is_reported_with_its_exit_code():
    """A rank that exits without answering is reported, not waited for."""
    with pytest.raises(SpawnError, match=r"rank 0 died \(exit code 7\)"):
        spawn(_die, 2, timeout=30)


def _sleep_forever_on(rank: int) -> None:
    if os.environ["RANK"] == str(rank):
        time.sleep(3600)


def test_timeout_dumps_stacks_and_kills():
    """A hanging rank times out; its stack is dumped and the run ends."""
    # Warm workers first: a fresh pool spends seconds importing torch, which would count
    # against the 2 s and leave rank 0 "still running" too.
    spawn(_rank_and_pid, 2, 0)
    start = time.monotonic()
    with pytest.raises(SpawnError, match=r"timed out after 2s; ranks \[1\]") as info:
        spawn(_sleep_forever_on, 2, 1, timeout=2)
    assert time.monotonic() - start < 20
    assert "_sleep_forever_on" in info.value.remote_traceback
    # The pool was discarded; a new run works.
    assert [r for r, _ in spawn(_rank_and_pid, 2, 0)] == [0, 1]


def _print_something() -> int:
    print(f"hello from {os.environ['RANK']}")
    return 1


def test_output_is_echoed(capsys):
    """Each rank's output appears in the caller's stdout."""
    spawn(_print_something, 2)
    out = capsys.readouterr().out
    assert "hello from 0" in out
    assert "hello from 1" in out


def test_bad_world_size():
    """world_size must be a positive int."""
    with pytest.raises(ValueError, match="world_size=0 must be a positive int"):
        spawn(_rank_and_pid, 0)


def _leak_a_group() -> bool:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    return dist.is_initialized()


def _is_initialized() -> bool:
    import torch.distributed as dist

    return dist.is_initialized()


def test_a_leaked_process_group_does_not_reach_the_next_job():
    """Workers are reused, so a group a job leaves initialized is destroyed after it."""
    assert spawn(_leak_a_group, 2) == [True, True]
    assert spawn(_is_initialized, 2) == [False, False]


def test_count_collectives_prints_nothing(capfd):
    """The profiler's start/stop lines (kineto's USDT/STAGE lines on fd 2) are swallowed."""
    for _ in range(2):
        with count_collectives() as calls:
            pass
    assert calls == {}
    assert capfd.readouterr() == ("", "")


def test_count_collectives_keeps_the_blocks_own_output(capfd):
    """What the block itself writes to stdout and stderr still comes out."""
    with count_collectives():
        print("to stdout")
        print("to stderr", file=sys.stderr)
    out, err = capfd.readouterr()
    assert out == "to stdout\n"
    assert err == "to stderr\n"


def _count_a_barrier() -> dict[str, int]:
    import pdist

    os.environ["PDIST_CHECK"] = "0"  # check mode would add its agreement
    with pdist.distributed() as ctx, count_collectives() as calls:
        pdist.barrier(ctx)
    return dict(calls)


def test_count_collectives_on_ranks_counts_and_stays_quiet(capfd):
    """On real ranks the count is right and no profiler line reaches the echoed output."""
    results = spawn(_count_a_barrier, 2)
    assert all(sum(calls.values()) == 1 for calls in results), results
    out, err = capfd.readouterr()
    assert "USDT" not in out + err
    assert "profiler_start" not in out + err
