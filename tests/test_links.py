"""Links: Groups of members of separate jobs, joined at an address, outside torch's default group.

Every member is a real process started from a script (``launcher.run_ranks``); two jobs
are two launches, each with its own store (its own ``MASTER_PORT``), sharing only the
link's address.
"""

from __future__ import annotations

import socket
import threading
from typing import Any

import pytest
from launcher import RankResult, run_ranks

import pdist


def free_port() -> int:
    """A TCP port nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def passed(results: list[RankResult], ranks: int) -> None:
    """Every rank ended with status 0 and printed ``OK``."""
    assert len(results) == ranks
    for r in results:
        assert r.returncode == 0, f"rank {r.rank}:\n{r.output}"
        assert "OK" in r.output, f"rank {r.rank}:\n{r.output}"


def run_jobs(jobs: list[tuple[str, int]], *, timeout: float, env: dict[str, str]) -> list[Any]:
    """Launch each ``(script, world_size)`` as its own job at once; their results in order."""
    out: list[Any] = [None] * len(jobs)

    def launch(i: int) -> None:
        out[i] = run_ranks(jobs[i][0], jobs[i][1], timeout=timeout, env=env)

    threads = [threading.Thread(target=launch, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


PLAIN = """
    import os
    import torch, torch.distributed as dist
    import pdist

    rank = int(os.environ["RANK"])
    trio, pair = os.environ["LINK_A"], os.environ["LINK_B"]

    def check(g, label):
        n = g.world_size
        assert g.ranks == tuple(range(n)) and g.rank == g.rank_in_group
        got = pdist.all_gather_object(g, (label, g.rank))
        assert got == [(label, r) for r in range(n)], got
        x = pdist.all_reduce(g, torch.full((3,), float(g.rank + 1)))
        assert x.tolist() == [n * (n + 1) / 2] * 3, x
        last = pdist.broadcast_object(g, {"from": g.rank}, src=n - 1)
        assert last == {"from": n - 1}, last
        t = pdist.broadcast(g, torch.arange(4.0) * (g.rank + 1), src=n - 1)
        assert t.tolist() == [0.0, n, 2.0 * n, 3.0 * n], t
        got = pdist.gather_object(g, g.rank, dst=n - 1)
        assert got == (list(range(n)) if g.rank == n - 1 else None), got
        z = torch.full((2,), complex(g.rank + 1, 1.0))  # rooted, by link index, complex too
        got = pdist.reduce(g, z, dst=n - 1, op="sum")
        want = [complex(n * (n + 1) / 2, n)] * 2
        assert (got.tolist() == want) if g.rank == n - 1 else got is None, got
        got = pdist.gather(g, torch.tensor([float(g.rank)]), dst=n - 1, dim=0)
        assert (got.tolist() == [float(r) for r in range(n)]) if g.rank == n - 1 else got is None
        if g.rank == 0:
            pdist.send_object(g, label, dst=1)
        elif g.rank == 1:
            assert pdist.recv_object(g, src=0) == label
        assert pdist.same_node_ranks(g) == list(range(n))
        pdist.barrier(g)

    with pdist.link(trio, rank=rank, world_size=3, timeout=60, name="trio") as a:
        check(a, "trio")
        if rank > 0:
            with pdist.link(pair, rank=rank - 1, world_size=2, timeout=60, name="pair") as b:
                check(b, "pair")
                check(a, "trio")  # both open at once
        else:
            check(a, "trio")
    assert not dist.is_initialized()
    print("OK")
"""


def test_links_between_plain_processes() -> None:
    """Three plain processes: a link of 3 and one of 2 open at once; torch's world stays unset."""
    env = {"LINK_A": f"127.0.0.1:{free_port()}", "LINK_B": f"127.0.0.1:{free_port()}"}
    passed(run_ranks(PLAIN, 3, timeout=120, env=env), 3)


JOB = """
    import os
    import torch, torch.distributed as dist
    import pdist

    role = os.environ["ROLE"]
    with pdist.distributed() as ctx:
        member = 0 if role == "trainer" else 1 + ctx.rank
        if role == "inference" or ctx.rank == 0:
            with pdist.link(os.environ["LINK"], rank=member, world_size=3, timeout=60) as g:
                got = pdist.all_gather_object(g, (role, ctx.rank))
                assert got == [("trainer", 0), ("inference", 0), ("inference", 1)], got
                x = pdist.all_reduce(g, torch.tensor([float(member + 1)]))
                assert x.item() == 6.0, x
                assert pdist.same_node_ranks(g) == [0, 1, 2]
                assert dist.get_world_size() == 2 and dist.get_rank() == ctx.rank
                # The weight sync: the trainer's fp32 model into both bf16 inference models.
                torch.manual_seed(0)
                trained = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4))
                if role == "trainer":
                    pdist.broadcast_weights(g, trained.state_dict(), bucket_bytes=1024)
                else:
                    torch.manual_seed(1)
                    served = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4))
                    served = served.to(torch.bfloat16)
                    pdist.broadcast_weights(g, into=served.state_dict(), bucket_bytes=1024)
                    for name, t in served.state_dict().items():
                        want = trained.state_dict()[name].to(torch.bfloat16)
                        assert torch.equal(t, want), name
        # The job's own world still works after the link.
        assert pdist.all_reduce(ctx.world, torch.ones(1)).item() == 2.0
        assert pdist.all_gather_object(ctx, ctx.rank) == [0, 1]
    print("OK")
"""


def test_link_between_two_jobs() -> None:
    """Trainer rank 0 and both inference ranks (two jobs) link; weights reach the bf16 models."""
    link = f"127.0.0.1:{free_port()}"
    trainer, inference = run_jobs(
        [(JOB.replace('os.environ["ROLE"]', '"trainer"'), 2), (JOB, 2)],
        timeout=120,
        env={"LINK": link, "ROLE": "inference"},
    )
    passed(trainer, 2)
    passed(inference, 2)


MISSING = """
    import os, time
    import pdist

    rank = int(os.environ["RANK"])
    if rank == 2:
        time.sleep(60)  # never joins
    if rank == 1:
        time.sleep(1.5)  # joins later: member 0 gives up first
    start = time.monotonic()
    try:
        with pdist.link(os.environ["LINK"], rank=rank, world_size=3, timeout=3):
            print("JOINED")
    except pdist.PdistError as exc:
        print(f"RAISED after {time.monotonic() - start:.1f}s: {exc}")
    print("OK")
"""


def test_member_that_never_comes() -> None:
    """A member that never joins: every other member raises naming it, within timeout + 15 s."""
    results = run_ranks(
        MISSING, 3, timeout=60, env={"LINK": f"127.0.0.1:{free_port()}"}, wait_for=[0, 1]
    )
    for r in results[:2]:
        assert r.returncode == 0, r.output
        assert "RAISED after" in r.output, r.output
        assert "link rank(s) [2] did not join" in r.output, r.output
        assert float(r.output.split("RAISED after ")[1].split("s")[0]) < 3 + 15


SIZES = """
    import os, time
    import pdist

    rank = int(os.environ["RANK"])
    size = 3 if rank == 2 else 2  # rank 2 thinks the link has three members
    start = time.monotonic()
    try:
        with pdist.link(os.environ["LINK"], rank=rank, world_size=size, timeout=20):
            print("JOINED")
            time.sleep(5)  # the store stays open while rank 2 checks in
    except pdist.PdistError as exc:
        print(f"RAISED after {time.monotonic() - start:.1f}s: {exc}")
    print("OK")
"""


def test_a_member_of_another_world_size_is_told_at_once() -> None:
    """A member whose world_size differs from member 0's raises at join, naming both sizes."""
    results = run_ranks(SIZES, 3, timeout=60, env={"LINK": f"127.0.0.1:{free_port()}"})
    assert "JOINED" in results[0].output, results[0].output
    assert "JOINED" in results[1].output, results[1].output
    out = results[2].output
    assert "world_size=3 on link rank 2, but member 0 passed world_size=2" in out, out
    assert float(out.split("RAISED after ")[1].split("s")[0]) < 15


ROUNDS = """
    import os
    import torch
    import pdist

    rank = int(os.environ["RANK"])
    for i in range(20):
        with pdist.link(os.environ["LINK"], rank=rank, world_size=2, timeout=30) as g:
            assert pdist.all_reduce(g, torch.tensor([float(i)])).item() == 2.0 * i
    print("OK")
"""


def test_twenty_links_in_a_row() -> None:
    """One address hosts 20 links one after another."""
    passed(run_ranks(ROUNDS, 2, timeout=120, env={"LINK": f"127.0.0.1:{free_port()}"}), 2)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"address": "nohost", "rank": 0, "world_size": 2}, "address='nohost'"),
        ({"address": "h:1", "rank": 2, "world_size": 2}, "rank=2"),
        ({"address": "h:1", "rank": 0, "world_size": 0}, "world_size=0"),
    ],
)
def test_link_bad_arguments(kwargs: dict[str, Any], match: str) -> None:
    """Bad arguments raise ValueError naming the parameter before anything connects."""
    with pytest.raises(ValueError, match=match), pdist.link(**kwargs):
        pass


HOST_MISSING = """
    import os, time
    import pdist

    rank = int(os.environ["RANK"])
    if rank == 0:
        time.sleep(60)  # the store's host never comes
    start = time.monotonic()
    try:
        with pdist.link(os.environ["LINK"], rank=rank, world_size=3, timeout=3):
            print("JOINED")
    except pdist.PdistError as exc:
        print(f"RAISED after {time.monotonic() - start:.1f}s: {exc}")
    print("OK")
"""


def test_host_that_never_comes() -> None:
    """Member 0 (the store's host) never comes: the others raise naming link rank 0."""
    results = run_ranks(
        HOST_MISSING, 3, timeout=60, env={"LINK": f"127.0.0.1:{free_port()}"}, wait_for=[1, 2]
    )
    for r in results[1:]:
        assert "link rank(s) [0] did not join" in r.output, r.output
        assert float(r.output.split("RAISED after ")[1].split("s")[0]) < 3 + 15


LEAVER = """
    import os
    import torch
    import pdist

    def load_batch():
        raise RuntimeError("boom")

    rank = int(os.environ["RANK"])
    try:
        with pdist.link(os.environ["LINK"], rank=rank, world_size=3, timeout=20) as g:
            pdist.barrier(g)
            for step in range(100):
                if rank == 1 and step == 3:
                    load_batch()
                pdist.all_reduce(g, torch.ones(4))
    except pdist.PdistError as exc:
        print(f"RAISED {type(exc).__name__}: {exc}")
    except RuntimeError as exc:
        print(f"LEFT {exc}")
    print("OK")
"""


def test_a_member_that_raises_is_named_to_the_others() -> None:
    """Member 1 raises inside its link block: members 0 and 2 raise naming it and its error."""
    results = run_ranks(LEAVER, 3, timeout=90, env={"LINK": f"127.0.0.1:{free_port()}"})
    passed(results, 3)
    assert "LEFT boom" in results[1].output
    for r in (results[0], results[2]):
        line = "RAISED PeerLeftError: link rank 1 left the job: RuntimeError: boom"
        assert line in r.output, r.output
        assert "in load_batch)" in r.output, r.output


LATE = """
    import os, time
    import pdist

    rank = int(os.environ["RANK"])
    if rank == 1:
        time.sleep(4)  # comes after member 0 gave up (at 2 s), while it lingers
    start = time.monotonic()
    try:
        with pdist.link(os.environ["LINK"], rank=rank, world_size=2, timeout=2 + rank):
            print("JOINED")
    except pdist.PdistError as exc:
        print(f"RAISED after {time.monotonic() - start:.1f}s: {exc}")
    print("OK")
"""


def test_a_member_that_comes_after_member_0_gave_up_is_told_so() -> None:
    """A late member: told that member 0 gave up waiting for it, not that member 0 never came."""
    results = run_ranks(LATE, 2, timeout=60, env={"LINK": f"127.0.0.1:{free_port()}"})
    passed(results, 2)
    assert "link rank(s) [1] did not join" in results[0].output, results[0].output
    late = results[1].output
    assert "member 0 gave up waiting for link rank(s) [1] and closed the link" in late, late
    assert "[0] did not join" not in late, late


DUPLICATE = """
    import os, time
    import pdist

    rank = int(os.environ["RANK"])
    if rank == 2:
        time.sleep(3)  # after the link of processes 0 and 1 formed and ended
    start = time.monotonic()
    try:
        with pdist.link(os.environ["LINK"], rank=min(rank, 1), world_size=2, timeout=4) as g:
            pdist.barrier(g)
            print("JOINED")
            if rank == 1:
                os._exit(0)  # no goodbye: member 0 keeps its closed store a few seconds
    except pdist.PdistError as exc:
        print(f"RAISED after {time.monotonic() - start:.1f}s: {exc}")
    print("OK")
"""


def test_a_second_process_with_a_rank_after_the_link_ended_is_told_so() -> None:
    """Process 2 passes rank 1 too, after the link ended: told so, not that member 0 never came."""
    results = run_ranks(DUPLICATE, 3, timeout=60, env={"LINK": f"127.0.0.1:{free_port()}"})
    assert "JOINED" in results[0].output, results[0].output
    late = results[2].output
    assert "a link at this address formed and ended before link rank 1 came" in late, late
    assert "[0] did not join" not in late, late
