"""A rank that leaves its block is named to the ranks it left behind."""

from __future__ import annotations

import os
import re
import socket
import sys

import pytest
import torch
import torch.distributed as dist

import pdist
from pdist.testing import SpawnError, spawn


def load_batch() -> None:
    raise RuntimeError("boom")


def _leave(how: str) -> None:
    os.environ["PDIST_CHECK"] = "0"  # rank 2's raw all_reduce must pair with pdist's alone
    with pdist.distributed() as ctx:
        x = torch.ones(4)
        for step in range(200):
            if step == 3 and ctx.rank == 1 and how == "raise":
                load_batch()
            if step == 3 and ctx.rank == 2 and how == "exit":
                sys.exit(0)
            if ctx.rank == 2 and how == "raise":
                dist.all_reduce(x)  # a collective pdist does not run
            else:
                pdist.all_reduce(ctx, x)


def _outputs(how: str) -> dict[int, str]:
    """Each rank's section of the failed run's report: its traceback and output."""
    with pytest.raises(SpawnError) as info:
        spawn(_leave, 3, how, timeout=60)
    sections = str(info.value).split("----- rank ")[1:]
    return {int(s.split(" ", 1)[0]): s for s in sections}


def test_the_ranks_left_behind_name_the_rank_that_raised():
    """Rank 1 raises: rank 0 (in pdist.all_reduce) and rank 2 (in dist.all_reduce) name it."""
    out = _outputs("raise")
    where = f"test_departures.py:{load_batch.__code__.co_firstlineno + 1} in load_batch"
    line = f"rank 1 left the job: RuntimeError: boom ({where})"
    # Named first (rank 2, which left after it, may follow); steps 0-2 finished, so rank 0
    # was in the job's fourth all_reduce on the world.
    assert f"Error: {line}; " in out[0]
    assert "; this rank was in all_reduce #4 on group 'world'" in out[0]
    assert "PdistError" in out[0] or "PeerLeftError" in out[0]
    assert "Connection closed" in out[0]  # torch's error, chained
    assert f"pdist (rank 2): {line}" in out[2]


def test_the_ranks_left_behind_name_a_rank_that_exited():
    """Rank 2 calls sys.exit(0): ranks 0 and 1 say it left through sys.exit."""
    out = _outputs("exit")
    for rank in (0, 1):
        assert "rank 2 left the job: SystemExit: exited through sys.exit(0)" in out[rank]
        assert "this rank was in all_reduce #4 on group 'world'" in out[rank]


def _leave_in(call: str) -> None:
    with pdist.distributed() as ctx:
        for step in range(200):
            if step == 3 and ctx.rank == 2:
                load_batch()
            if call == "all_gather_object":
                pdist.all_gather_object(ctx, {"step": step})
            elif call == "broadcast_object":
                pdist.broadcast_object(ctx, {"step": step} if ctx.rank == 0 else None)
            else:
                pdist.barrier(ctx)


@pytest.mark.parametrize("call", ["all_gather_object", "broadcast_object", "barrier"])
def test_object_calls_and_barriers_name_the_rank_that_raised(call):
    """Rank 2 raises: the ranks left in an object call or a barrier name it, not gloo's words."""
    with pytest.raises(SpawnError) as info:
        spawn(_leave_in, 3, call, timeout=60)
    out = {int(s.split(" ", 1)[0]): s for s in str(info.value).split("----- rank ")[1:]}
    # Rank 0 always fails in the call; a receiver of the broadcast may still wait on rank 0.
    for rank in (0, 1) if call != "broadcast_object" else (0,):
        assert "rank 2 left the job: RuntimeError: boom" in out[rank], out[rank]
        # In check mode (the harness's), the ranks wait in the call's agreement first.
        assert re.search(rf"this rank was in {call}( \(check mode\))? on group 'world'", out[rank])


def _store_host_dies(port: int) -> None:
    # Rank 0 hosts the store (as under torchrun without its agent's store), then vanishes.
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    os.environ["MASTER_PORT"] = str(port)
    os.environ["PDIST_CHECK"] = "0"
    with pdist.distributed() as ctx:
        x = torch.ones(4)
        for step in range(200):
            if step == 3 and ctx.rank == 0:
                os._exit(1)  # no exit record, and the store goes with the process
            pdist.all_reduce(ctx, x)


def test_a_store_that_is_gone_too_is_said_so():
    """The store's host dies: the survivors say the store does not answer, within seconds."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(SpawnError) as info:
        spawn(_store_host_dies, 2, port, timeout=60)
    sections = {int(s.split(" ", 1)[0]): s for s in str(info.value).split("----- rank ")[1:]}
    assert "the rendezvous store does not answer either" in sections[1]


def _threads_after_clean_blocks(port: int) -> list[str]:
    import threading
    import time
    from datetime import timedelta

    rank = int(os.environ["RANK"])
    # A store that outlives the blocks, as a launcher's agent's does.
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=30))
    for i in range(3):
        prefixed = dist.PrefixStore(f"block{i}", store)
        with pdist.distributed(store=prefixed, rank=rank, world_size=2) as ctx:
            pdist.all_reduce(ctx, torch.ones(2))  # the block's first collective starts it
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        alive = [t.name for t in threading.enumerate() if t.name == "pdist-roll-call"]
        if not alive:
            break
        time.sleep(0.05)
    return alive


def test_a_clean_block_ends_its_roll_call_thread():
    """Each rank answers roll calls from a thread; it ends with its block, the store outlives it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert spawn(_threads_after_clean_blocks, 2, port, timeout=60) == [[], []]
