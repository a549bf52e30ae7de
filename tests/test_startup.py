"""distributed()'s start-up: its deadline, the groups it builds and what they cost per rank."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
import torch.distributed as dist
from launcher import run_ranks

import pdist
from benchmarks import scale
from pdist import _guard
from pdist.testing import spawn, world_sizes

# --------------------------------------------------------------------------- the deadline

LATE_RANK = """
    import os, time, pdist
    if int(os.environ["RANK"]) == 2:
        time.sleep(40)
    start = time.monotonic()
    with pdist.distributed() as ctx:
        print("ENTERED", flush=True)
"""


def test_a_late_rank_ends_the_others_with_93_naming_it():
    """Ranks 0 and 1 exit 93 within the deadline plus ~10 s; the message names rank 2."""
    results = run_ranks(
        LATE_RANK,
        3,
        timeout=60,
        env={"PDIST_WORLD_COMM_TIMEOUT_SEC": "4"},
        wait_for=[0, 1],
    )
    for r in results[:2]:
        assert r.returncode == pdist.WORLD_COMM_TIMEOUT_EXIT_CODE, r.output
        assert "distributed() start-up did not finish within the 4s deadline" in r.output
        assert "ranks that never checked in: 2." in r.output
        assert f"rank {r.rank} on {socket.gethostname()}" in r.output
        assert "startup_timeout" in r.output
        assert "ENTERED" not in r.output
        # Interpreter start-up and imports come before the deadline is armed.
        assert r.seconds < 4 + 10 + 15, r.seconds


SRUN = """
    import os, time
    # Launched as srun does: no torchrun agent, so rank 0 hosts the rendezvous store.
    rank = os.environ.pop("RANK")
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE")
    os.environ.update(SLURM_PROCID=rank, SLURM_NTASKS=os.environ.pop("WORLD_SIZE"),
                      SLURM_LOCALID=os.environ.pop("LOCAL_RANK"),
                      MASTER_PORT=os.environ["PDIST_TEST_PORT"])
"""

LATE_RANK_RANK0_HOSTS = (
    SRUN
    + """
    if rank == "2":
        time.sleep(40)
    import pdist
    with pdist.distributed() as ctx:
        print("ENTERED", flush=True)
"""
)


def test_a_late_rank_is_named_when_rank0_hosts_the_store():
    """Under srun rank 0 hosts the store: it checks in at once, and both waiting ranks exit 93."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = run_ranks(
        LATE_RANK_RANK0_HOSTS,
        3,
        timeout=60,
        env={"PDIST_WORLD_COMM_TIMEOUT_SEC": "4", "PDIST_TEST_PORT": str(port)},
        wait_for=[0, 1],
    )
    for r in results[:2]:
        assert r.returncode == pdist.WORLD_COMM_TIMEOUT_EXIT_CODE, r.output
        assert "ENTERED" not in r.output
        assert "initializing the default process group" in r.output
    # Rank 0 is the store: it was never waiting for it, and it can always read the check-ins.
    assert "ranks that never checked in: 2." in results[0].output
    assert "never answered" not in results[0].output


SLOW_BLOCK = """
    import time, pdist
    with pdist.distributed() as ctx:
        time.sleep(4)  # past the 2 s deadline and its 1 s grace
        pdist.barrier(ctx)
    print("DONE", flush=True)
"""


def test_the_deadline_never_covers_the_block():
    """A block that runs past the start-up deadline is not killed."""
    results = run_ranks(SLOW_BLOCK, 2, timeout=90, env={"PDIST_WORLD_COMM_TIMEOUT_SEC": "2"})
    for r in results:
        assert r.returncode == 0, r.output
        assert "DONE" in r.output


def test_a_store_that_never_answers_is_named():
    """No rendezvous store at MASTER_ADDR:MASTER_PORT: exit 93 saying so, naming the address."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again below: nobody listens there
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC")},
        "RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "PDIST_WORLD_COMM_TIMEOUT_SEC": "3",
    }
    code = "import pdist\nwith pdist.distributed():\n    pass\n"
    start = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == pdist.WORLD_COMM_TIMEOUT_EXIT_CODE, out.stderr
    assert f"the rendezvous store at 127.0.0.1:{port} never answered" in out.stderr
    assert "while connecting to the rendezvous store" in out.stderr
    assert time.monotonic() - start < 3 + 10 + 20


def test_a_near_miss_warns(caplog):
    """Finishing past the deadline but inside the grace period logs a warning, not an exit."""
    deadline = _guard.Deadline(0.2, rank=0, world_size=1, what="the thing", hint="raise it")
    deadline.arm()
    time.sleep(0.5)  # the grace is at least 1 s
    with caplog.at_level(logging.WARNING, logger="pdist"):
        took = deadline.disarm()
    assert took >= 0.5
    assert "past its 0.2s deadline (saved by the grace period)" in caplog.text


FAILS_AFTER_THE_DEADLINE = """
    import time
    from pdist import _guard
    deadline = _guard.Deadline(0.3, rank=1, world_size=2, what="start-up", hint="raise it")
    deadline.arm()
    deadline.abort_if_expired(RuntimeError("too early"))  # before the deadline: returns
    print("RETURNED", flush=True)
    time.sleep(0.6)  # past the deadline, inside the grace (at least 1 s)
    deadline.abort_if_expired(RuntimeError("Connection closed by peer"))
    print("NOT REACHED", flush=True)
"""


def test_a_failure_after_the_deadline_ends_like_the_deadline():
    """A peer that gave up makes this rank fail inside its grace: it exits 93 all the same."""
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(FAILS_AFTER_THE_DEADLINE)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == pdist.WORLD_COMM_TIMEOUT_EXIT_CODE, out.stderr
    assert "RETURNED" in out.stdout
    assert "NOT REACHED" not in out.stdout
    assert "0.3s deadline while starting (RuntimeError: Connection closed by peer)" in out.stderr


def test_grace_is_bounded():
    """The grace is 5 % of the deadline, between 1 and 10 seconds."""
    assert _guard.grace(4) == 1.0
    assert _guard.grace(100) == 5.0
    assert _guard.grace(10_000) == 10.0


# --------------------------------------------------------------------------- groups


def _sum(group: pdist.Group) -> int:
    t = torch.tensor([group.rank])
    dist.all_reduce(t, group=group.device_group)
    c = torch.tensor([group.rank])
    dist.all_reduce(c, group=group.cpu_group)
    assert t.item() == c.item()
    return int(t.item())


@world_sizes(4)
def test_new_group_builds_the_callers_group(ctx):
    """new_group([[0, 2], [1, 3]]) gives each rank its pair, with working communicators."""
    g = pdist.new_group(ctx, [[0, 2], [1, 3]], name="pairs")
    assert g is not None
    assert g.ranks == ((0, 2) if ctx.rank % 2 == 0 else (1, 3))
    assert g.name == "pairs"
    assert _sum(g) == sum(g.ranks)
    # A rank in no list gets None, and later groups still form on every rank.
    h = pdist.new_group(ctx, [[0, 1, 2]], name="three")
    if ctx.rank == 3:
        assert h is None
    else:
        assert h is not None
        assert h.ranks == (0, 1, 2)
        assert h.rank_in_group == ctx.rank
        assert pdist.all_gather(h, torch.tensor([ctx.rank]), dim=0).tolist() == [0, 1, 2]
    tp2 = pdist.new_tp_group(ctx, 2)
    assert _sum(tp2) == sum(tp2.ranks)


@world_sizes(4)
def test_new_group_fails_together_on_bad_or_mismatched_lists(ctx):
    """Bad lists raise ValueError on every rank; lists that differ, RankMismatchError."""
    with pytest.raises(ValueError, match=r"rank 1 appears in rank_lists\[0\] and \[1\]"):
        pdist.new_group(ctx, [[0, 1], [1, 2]], name="bad")
    with pytest.raises(ValueError, match=r"rank 7, outside the world of size 4"):
        pdist.new_group(ctx, [[0, 7]], name="bad")
    with pytest.raises(ValueError, match=r"rank_lists\[0\]=\[2, 0\] is not in increasing order"):
        pdist.new_group(ctx, [[2, 0]], name="bad")
    lists = [[0, 1], [2, 3]] if ctx.rank != 1 else [[0, 2], [1, 3]]
    with pytest.raises(pdist.RankMismatchError, match=r"ranks \[0, 2, 3\]: .*ranks \[1\]"):
        pdist.new_group(ctx, lists, name="mixed")
    lists = [[0, 1], [2, 3]] if ctx.rank != 2 else "0,1"
    with pytest.raises(pdist.RankMismatchError, match=r"ranks \[2\]: TypeError: rank_lists='0,1'"):
        pdist.new_group(ctx, lists, name="typed")
    size = 2 if ctx.rank != 3 else 4
    with pytest.raises(pdist.RankMismatchError, match=r"ranks \[3\]: size=4"):
        pdist.new_tp_group(ctx, size)
    # Nothing was built by the failed calls: a good call still works everywhere.
    g = pdist.new_group(ctx, [[0, 1], [2, 3]], name="good")
    assert g is not None
    assert _sum(g) == sum(g.ranks)


@world_sizes(3)
def test_new_group_with_a_bad_name_on_one_rank_fails_on_every_rank(ctx):
    """A bad name on rank 1 only is refused on every rank, not left to a hang."""
    name = None if ctx.rank == 1 else "pairs"
    with pytest.raises(pdist.RankMismatchError, match=r"ranks \[1\]: TypeError: name=None"):
        pdist.new_group(ctx, [[0, 1]], name=name)
    assert pdist.all_reduce(ctx, torch.ones(1)).item() == 3
    with pytest.raises(TypeError, match=r"name=5 must be None or a non-empty str"):
        pdist.new_tp_group(ctx, 1, name=5)


@world_sizes(4)
def test_one_name_is_one_communicator(ctx):
    """The same name and lists again share communicators; another name gets its own."""
    a = pdist.new_tp_group(ctx, 2)
    assert pdist.new_tp_group(ctx, 2).device_group is a.device_group
    b = pdist.new_tp_group(ctx, 2, name="again")
    assert b.device_group is not a.device_group
    assert b.name == "again"
    c = pdist.new_group(ctx, [[0, 1], [2, 3]], name="same")
    assert c is not None
    assert c.device_group not in (a.device_group, b.device_group)
    assert pdist.new_group(ctx, [[0, 1], [2, 3]], name="same") == c
    assert pdist.new_group(ctx, [[0, 1], [2, 3]], name="same").cpu_group is c.cpu_group
    assert pdist.new_tp_group(ctx, 4).device_group is not ctx.world.device_group
    assert _sum(c) == sum(c.ranks)
    assert ctx.dp.device_group is ctx.world.device_group  # tp = sp = 1
    assert ctx.dp_sp.device_group is ctx.dp.device_group
    assert ctx.tp.device_group is ctx.sp.device_group  # both all singletons


def _axis_groups(tp: int, sp: int) -> dict[str, tuple[int, ...]]:
    with pdist.distributed(tp=tp, sp=sp) as ctx:
        out = {a: getattr(ctx, a).ranks for a in ("tp", "sp", "dp", "dp_sp", "node")}
        assert _sum(ctx.dp_sp) == sum(ctx.dp_sp.ranks)
        return out


def test_dp_sp_is_the_gradient_group():
    """dp_sp holds the ranks sharing a tp index: (0, 1) for sp=2 on 2 ranks; no tp peers."""
    for rank, out in enumerate(spawn(_axis_groups, 2, 1, 2, timeout=60)):
        assert out["dp_sp"] == (0, 1)
        assert out["sp"] == (0, 1)
        assert out["dp"] == (rank,)
    for rank, out in enumerate(spawn(_axis_groups, 4, 2, 1, timeout=60)):
        assert out["dp_sp"] == ((0, 2) if rank % 2 == 0 else (1, 3))
        assert out["dp_sp"] == out["dp"]
        assert not set(out["tp"]) - {rank} & set(out["dp_sp"])


def _different_tp() -> str:
    tp = 2 if int(os.environ["RANK"]) == 0 else 1
    with (
        pytest.raises(pdist.RankMismatchError) as info,
        pdist.distributed(tp=tp, startup_timeout=30),
    ):
        pass
    assert not dist.is_initialized()
    return str(info.value)


def test_ranks_asking_for_different_layouts_fail_together():
    """tp=2 on rank 0 but tp=1 on rank 1: both raise naming the ranks, rather than hang."""
    for message in spawn(_different_tp, 2, timeout=90):
        # The layout, then the settings agreed with it (check mode, backend, device type).
        assert "ranks [0]: tp=2, sp=1, check=" in message, message
        assert "; ranks [1]: tp=1, sp=1, check=" in message, message


def _mesh(tp: int, sp: int, axes) -> tuple:
    with pdist.distributed(tp=tp, sp=sp) as ctx:
        mesh = pdist.device_mesh(ctx, axes)
        out = (
            mesh.mesh_dim_names,
            mesh.mesh.tolist(),
            [tuple(dist.get_process_group_ranks(g)) for g in mesh.get_all_groups()],
        )
        del mesh
        return out


@pytest.mark.parametrize(
    ("tp", "sp", "axes", "names", "mesh_of"),
    [
        (2, 1, None, ("dp", "sp", "tp"), lambda r: [[[0, 1]], [[2, 3]]]),
        (2, 1, ("dp",), ("dp",), lambda r: [r % 2, r % 2 + 2]),
        (2, 1, ("dp_sp",), ("dp_sp",), lambda r: [r % 2, r % 2 + 2]),
        (2, 1, ("tp",), ("tp",), lambda r: [r - r % 2, r - r % 2 + 1]),
        (1, 2, ("dp", "sp"), ("dp", "sp"), lambda r: [[0, 1], [2, 3]]),
    ],
)
def test_device_mesh_sub_meshes(tp, sp, axes, names, mesh_of):
    """Each sub-mesh holds the caller's ranks, built over the context's own groups."""
    for rank, (dim_names, mesh, groups) in enumerate(spawn(_mesh, 4, tp, sp, axes, timeout=60)):
        assert dim_names == names
        assert mesh == mesh_of(rank)
        assert all(rank in g for g in groups)


def _patched_mesh() -> tuple:
    with pdist.distributed(sp=2) as ctx:  # FastVideo's layout: tp and sp both [0, 1] [2, 3]
        tp = pdist.new_tp_group(ctx, 2)
        with pdist.patch_tp(ctx, tp) as enc_ctx:
            one = pdist.device_mesh(enc_ctx, ("tp",))
            out = (one.mesh.tolist(), dist.get_process_group_ranks(one.get_group()))
            del one
            with pytest.raises(ValueError, match=r"ctx.dp holds ranks \((0, 2|1, 3)\)") as info:
                pdist.device_mesh(enc_ctx)
        return (*out, str(info.value))


def test_device_mesh_refuses_groups_that_form_no_mesh():
    """A patched tp that is another partition of the sp ranks gives no silently wrong mesh."""
    for rank, (mesh, ranks, message) in enumerate(spawn(_patched_mesh, 4, timeout=60)):
        mine = [0, 1] if rank < 2 else [2, 3]
        assert mesh == ranks == mine  # one axis: the group itself
        assert "do not form one (dp, sp, tp) mesh" in message


def _bad_mesh(axes) -> str:
    with pdist.distributed() as ctx, pytest.raises((TypeError, ValueError)) as info:
        pdist.device_mesh(ctx, axes)
    return str(info.value)


@pytest.mark.parametrize(
    ("axes", "match"),
    [
        ("dp", "must be None or a non-empty tuple"),
        (("pp",), "'pp' is not one of"),
        (("dp", "dp"), "names an axis twice"),
        (("dp_sp", "dp"), "'dp_sp' already holds 'dp' and 'sp'"),
        (("tp", "dp"), "slowest to fastest"),
    ],
)
def test_device_mesh_refuses_bad_axes(axes, match):
    """Unknown, repeated, overlapping or misordered axes are refused with the fix."""
    [message] = spawn(_bad_mesh, 1, axes, timeout=60)
    assert match in message


# --------------------------------------------------------------------------- simulated hosts

NODES = """
    import pdist
    with pdist.distributed() as ctx:
        print("NODE", list(ctx.node.ranks), flush=True)
        print("SAME", pdist.same_node_ranks(ctx, source_rank=2), flush=True)
"""


@pytest.mark.parametrize("hosts", [[[0, 1], [2, 3]], [[0, 2], [1, 3]]])
def test_node_groups_on_blocked_and_cyclic_hosts(hosts):
    """Ranks placed in blocks or round-robin over two hosts get their host's ranks.

    Each host's ranks share /dev/shm only with each other; every rank also
    agrees on which ranks share rank 2's host.
    """
    results = run_ranks(NODES, 4, timeout=120, hosts=hosts)
    with_2 = next(h for h in hosts if 2 in h)
    for r in results:
        assert r.returncode == 0, r.output
        mine = next(h for h in hosts if r.rank in h)
        assert f"NODE {sorted(mine)}" in r.output
        assert f"SAME {sorted(with_2)}" in r.output


PROBE_FAILS = """
    import os, subprocess, pdist
    if os.environ["RANK"] == "2":
        subprocess.run(["mount", "-o", "remount,ro", "/dev/shm"], check=True)
    try:
        with pdist.distributed(timeout=30):
            pass
    except pdist.PdistError as exc:
        print("ERROR", exc, flush=True)
"""


def test_a_rank_that_cannot_create_its_probe_fails_every_rank():
    """A read-only /dev/shm on one host: every rank raises, naming rank 2."""
    results = run_ranks(PROBE_FAILS, 3, timeout=120, hosts=[[0, 1], [2]])
    for r in results:
        assert r.returncode == 0, r.output
        assert (
            "ERROR host detection on group 'world': rank 2 could not create its probe" in r.output
        )


# --------------------------------------------------------------------------- scale


def _simulations(runs: list[tuple[int, str]]) -> list[dict]:
    return [scale.simulate(w, mode, clean_up=True) for w, mode in runs]


def test_communicator_calls_do_not_grow_with_the_world():
    """Simulated 16..256 ranks: few members-only calls, 160 B per rank, a split per partition."""
    runs = [(16, "pdist"), (64, "pdist"), (256, "pdist"), (256, "mesh")]
    runs += [(16, "pdist-split"), (256, "pdist-split")]
    [results] = spawn(_simulations, 1, runs, timeout=120)
    plain, mesh, split = results[:3], results[3], results[4:]
    for run in plain:
        assert run["new_group"] + run["split_group"] == plain[0]["new_group"] <= 4
        assert run["world_wide"] == 0
        assert run["all_gather_bytes"] == 160 * run["world_size"]
    assert mesh["new_group"] > 32  # the baseline calls new_group for every block
    for run in split:
        assert run["split_group"] == 3  # tp, sp (singletons), dp; dp_sp = dp, node = tp
        assert run["world_wide"] == run["split_group"]


def test_a_five_axis_job_holds_one_communicator_per_partition():
    """Simulated pp=4, cp=2, tp=8, ep=8: calls <= groups held + 2, O(W) gathers, few splits."""
    runs = [(512, "pdist-full"), (2048, "pdist-full"), (512, "pdist-split-full")]
    [results] = spawn(_simulations, 1, runs, timeout=120)
    for run in results:
        assert run["new_group"] + run["split_group"] <= run["held"] + 2
        assert run["all_gather_bytes"] == 160 * run["world_size"]
    assert results[0]["new_group"] == results[1]["new_group"]  # not growing with W
    assert results[2]["world_wide"] == results[2]["split_group"] <= results[2]["held"]


def _three_blocks() -> list[float]:
    out = []
    for tp in (1, 2, 2):
        with pdist.distributed(tp=tp) as ctx:
            out.append(pdist.all_reduce(ctx.tp, torch.ones(1)).item())
            out.append(pdist.all_reduce(ctx, torch.ones(1)).item())
    return out


def test_blocks_one_after_another_share_a_store_safely():
    """Each block keeps its rendezvous keys apart, so later blocks never read stale addresses."""
    for _ in range(3):
        assert spawn(_three_blocks, 2, timeout=90) == [[1.0, 2.0, 2.0, 2.0, 2.0, 2.0]] * 2


BLOCKS_IN_A_ROW = (
    SRUN
    + """
    import pdist
    for block in range(20):
        with pdist.distributed(timeout=20) as ctx:
            pdist.barrier(ctx.world)
    print("BLOCKS DONE", flush=True)
"""
)


@pytest.mark.serial
@pytest.mark.parametrize("world", [2, 3])
def test_blocks_in_a_row_when_rank0_hosts_the_store(world):
    """20 bare blocks in a row under srun's launch (rank 0 hosts the store) all open and close."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = run_ranks(BLOCKS_IN_A_ROW, world, timeout=90, env={"PDIST_TEST_PORT": str(port)})
    for r in results:
        assert r.returncode == 0, r.output
        assert "BLOCKS DONE" in r.output


@world_sizes(2)
def test_a_second_name_over_the_world_carries_traffic_beside_it(ctx):
    """One thread broadcasts on the world, one on a second group of the same ranks: no mixing."""
    second = pdist.new_group(ctx, [[0, 1]], name="second")
    assert second is not None
    assert second.cpu_group is not ctx.world.cpu_group
    assert second.device_group is not ctx.world.device_group
    assert pdist.new_group(ctx, [[0, 1]], name="second") == second
    got: dict[str, list[float]] = {"world": [], "second": []}

    def run(group: pdist.Group, base: float, out: list[float]) -> None:
        for i in range(40):
            x = torch.full((1000 + 17 * i,), base + i if ctx.rank == 0 else -1.0)
            out.append(pdist.broadcast(group, x).sum().item() / x.numel())

    threads = [
        threading.Thread(target=run, args=(ctx.world, 0.0, got["world"])),
        threading.Thread(target=run, args=(second, 1000.0, got["second"])),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert got["world"] == [float(i) for i in range(40)]
    assert got["second"] == [1000.0 + i for i in range(40)]


@world_sizes(2)
def test_ranks_that_name_a_group_differently_raise_on_every_rank(ctx):
    """The name is compared with the ranks: a name per rank would split one cache in two."""
    name = f"n{ctx.rank}"
    with pytest.raises(pdist.RankMismatchError, match=r"ranks \[0\]: \(\(0, 1\),\), name='n0'"):
        pdist.new_group(ctx, [[0, 1]], name=name)
    with pytest.raises(pdist.RankMismatchError, match=r"ranks \[1\]: size=2, name='n1'"):
        pdist.new_tp_group(ctx, 2, name=name)
    pdist.barrier(ctx)
