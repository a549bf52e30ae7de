"""The start-up guard, timeouts and dead ranks, with real processes."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import time
from datetime import timedelta

import pytest
import torch
from launcher import raised_after, run_ranks
from test_links import free_port
from test_startup import SRUN

import pdist
from pdist.testing import world_sizes

pytestmark = pytest.mark.serial  # stall reports and deadlines, seconds apart: run alone

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

TABLE = [
    (None, 600.0, False),
    ("abc", 600.0, True),
    ("nan", 600.0, True),
    ("inf", 600.0, True),
    ("-5", 600.0, True),
    ("0", None, False),
    ("12.5", 12.5, False),
]


@pytest.mark.parametrize(("raw", "expected", "warns"), TABLE)
def test_world_comm_timeout_parsing(raw, expected, warns, monkeypatch, caplog):
    """The guard's deadline: 0 waits forever; garbage never disarms it."""
    if raw is None:
        monkeypatch.delenv("PDIST_WORLD_COMM_TIMEOUT_SEC", raising=False)
    else:
        monkeypatch.setenv("PDIST_WORLD_COMM_TIMEOUT_SEC", raw)
    with caplog.at_level(logging.WARNING, logger="pdist"):
        assert pdist.world_comm_timeout() == expected
    assert bool(caplog.records) == warns
    if warns:
        assert "PDIST_WORLD_COMM_TIMEOUT_SEC" in caplog.records[0].getMessage()


@world_sizes(2, 3)
def test_guard_success(ctx):
    """A healthy world passes the probe and runs the block."""
    with pdist.world_comm_guard(ctx, timeout=60):
        assert pdist.all_reduce(ctx, torch.ones(1)).item() == ctx.world_size
    with pdist.world_comm_guard(ctx, timeout=0):  # waits forever: no watchdog
        pass
    with pdist.world_comm_guard(ctx, timeout=timedelta(0)):  # so does a zero timedelta
        pass


GUARD_MISSING_RANK = """
    import time, pdist
    with pdist.distributed() as ctx:
        if ctx.rank == 2:
            time.sleep(120)  # never reaches the guard
        if ctx.rank == 0:
            time.sleep({late})
        print("GUARD", flush=True)
        with pdist.world_comm_guard(ctx, timeout=3):
            pass
"""


@pytest.mark.parametrize("late", [0, 0.5], ids=["together", "rank0_late"])
def test_missing_rank_exits_93_and_is_named(late):
    """Ranks 0 and 1 end with 93 soon after the deadline, naming rank 2.

    With rank 0 late, rank 1 gives up first and closes its connections: rank 0's probe then
    fails past its deadline, and must still end with 93, not a traceback.
    """
    results = run_ranks(GUARD_MISSING_RANK.format(late=late), 3, timeout=90, wait_for=[0, 1])
    for r in results[:2]:
        assert r.returncode == pdist.WORLD_COMM_TIMEOUT_EXIT_CODE, r.output
        assert "ranks that never checked in: 2." in r.output
        assert "3s deadline" in r.output
        assert "PDIST_WORLD_COMM_TIMEOUT_SEC" in r.output
    # Both survivors end within deadline + grace of each other (start-up costs differ).
    assert abs(results[0].seconds - results[1].seconds) < 3 + 1 + 5


GUARD_SLOW_BLOCK = """
    import time, pdist
    with pdist.distributed() as ctx:
        start = time.monotonic()
        with pdist.world_comm_guard(ctx, timeout=2):
            print("ENTERED", flush=True)
            time.sleep(120)
"""


def test_block_outliving_the_deadline_exits_93():
    """The deadline covers the block too."""
    results = run_ranks(GUARD_SLOW_BLOCK, 2, timeout=90)
    for r in results:
        assert r.returncode == pdist.WORLD_COMM_TIMEOUT_EXIT_CODE, r.output
        assert "world_comm_guard block did not finish" in r.output
        assert "while running the guarded block" in r.output
        assert "none (all checked in)" in r.output


UNEVEN_HOSTS = """
    import pdist
    try:
        with pdist.distributed() as ctx:
            pass
    except pdist.PdistError as exc:
        print("ERROR", exc, flush=True)
"""


def test_uneven_hosts_fail_on_every_rank():
    """Hosts with different numbers of ranks raise PdistError on every rank."""
    results = run_ranks(UNEVEN_HOSTS, 3, timeout=120, hosts=[[0], [1, 2]])
    for r in results:
        assert r.returncode == 0, r.output
        assert "ERROR hosts hold different numbers of ranks" in r.output


DEAD_RANK = """
    import os, time, torch, pdist
    with pdist.distributed(timeout=5) as ctx:
        pdist.barrier(ctx)
        if ctx.rank == 1:
            os._exit(3)
        start = time.monotonic()
        try:
            for _ in range(100):
                pdist.all_reduce(ctx, torch.ones(1))
                time.sleep(0.05)
        except RuntimeError as exc:
            print(f"RAISED after {time.monotonic() - start:.1f}s", flush=True)
    print("EXITED", flush=True)
"""


def test_survivor_raises_within_the_timeout_and_the_run_ends():
    """A rank exiting mid-run makes the survivor's next collective raise, and exit works."""
    results = run_ranks(DEAD_RANK, 2, timeout=90)
    assert results[1].returncode == 3
    survivor = results[0]
    assert survivor.returncode == 0, survivor.output
    assert raised_after(survivor.output) < 5 + 3
    assert "EXITED" in survivor.output


HUNG_RANK = """
    import time, torch, pdist
    with pdist.distributed(timeout=3) as ctx:
        pdist.barrier(ctx)
        if ctx.rank == 1:
            time.sleep(60)
        else:
            start = time.monotonic()
            try:
                pdist.all_reduce(ctx, torch.ones(1))
            except RuntimeError:
                print(f"RAISED after {time.monotonic() - start:.1f}s", flush=True)
    print("EXITED", flush=True)
"""


def test_collective_timeout_applies_to_a_hung_peer():
    """A peer that stops answering makes the collective raise after the timeout."""
    results = run_ranks(HUNG_RANK, 2, timeout=90, wait_for=[0])
    survivor = results[0]
    assert 2 < raised_after(survivor.output) < 3 + 5
    assert "EXITED" in survivor.output


STUCK_STORE = """
    import time
    import torch.distributed as dist
    import pdist

    class Stuck(dist.Store):
        # A store that answers the start-up but never the guard's check-in.
        def __init__(self):
            super().__init__()
            self.inner = dist.HashStore()

        def add(self, key, value):
            if "checkin/guard" in key:
                time.sleep(3600)  # accepted the connection but never answers
            return self.inner.add(key, value)

        def set(self, key, value):
            self.inner.set(key, value)

        def get(self, key):
            return self.inner.get(key)

        def check(self, keys):
            return self.inner.check(keys)

        def wait(self, keys, timeout=None):
            self.inner.wait(keys) if timeout is None else self.inner.wait(keys, timeout)

        def delete_key(self, key):
            return self.inner.delete_key(key)

        def num_keys(self):
            return self.inner.num_keys()

    with pdist.distributed(store=Stuck()) as ctx:
        with pdist.world_comm_guard(ctx, timeout=1):
            print("INSIDE", flush=True)
"""


def test_guard_check_in_is_under_the_deadline():
    """A store that never answers the guard's check-in still ends the rank with 93."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(STUCK_STORE)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == pdist.WORLD_COMM_TIMEOUT_EXIT_CODE, out.stderr
    assert "while checking in with the rendezvous store" in out.stderr
    assert "INSIDE" not in out.stdout


FROZEN_STORE_HOST = (
    SRUN
    + """
    import signal, torch
    import pdist
    start = time.time()
    try:
        with pdist.distributed(timeout=5, stall_timeout=60) as ctx:
            with pdist.message_queue(ctx.world) as queue:
                pdist.broadcast_object(queue, {"step": 1})
            pdist.barrier(ctx)
            if ctx.rank == 0:  # the store's host stops answering, as when its link goes down
                os.kill(os.getpid(), signal.SIGSTOP)
            start = time.time()
            print(f"LOOP at {start:.3f}", flush=True)
            while True:
                pdist.all_reduce(ctx, torch.ones(1))
                time.sleep(0.01)
    except Exception as exc:
        print(f"RAISED after {time.time() - start:.1f}s: {type(exc).__name__}", flush=True)
    print(f"LEFT after {time.time() - start:.1f}s", flush=True)
"""
)


def test_no_pdist_thread_keeps_a_survivor_from_exiting():
    """The store's host freezes mid-run: every survivor raises and its process exits in time."""
    launched = time.time()
    results = run_ranks(
        FROZEN_STORE_HOST,
        3,
        timeout=120,
        env={"PDIST_TEST_PORT": str(free_port())},
        wait_for=[1, 2],
    )
    for r in results[1:]:
        assert r.returncode == 0, r.output
        assert "RAISED after" in r.output, r.output
        loop = float(r.output.split("LOOP at ")[1].split()[0])
        assert launched + r.seconds - loop < 5 + 15, r.output
