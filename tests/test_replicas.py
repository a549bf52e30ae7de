"""Fault-tolerant replicas: real processes, a coordinator, replicas killed and restarted.

Every replica is its own process (its own one-rank ``distributed()`` job), started from this
file (``python tests/test_replicas.py ARGS``); the coordinator is ``python -m pdist
coordinator``. The reference is one plain-torch process training on the whole batch.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).parent.parent
STEPS, BATCH, WIDTH = 12, 12, 6


def _model(width: int = WIDTH) -> torch.nn.Module:
    nn = torch.nn
    return nn.Sequential(nn.Linear(4, width), nn.Tanh(), nn.Linear(width, 2))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The fixed global batch of ``step``, the same on every replica."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(BATCH, 4, generator=g), torch.randn(BATCH, 2, generator=g)


def _loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((model(x) - y) ** 2).sum() / BATCH  # sum over the share, divided by the global batch


def _await(out: Path, names: list[str]) -> None:
    """The test's pacing: wait (60 s at most) for files it or a replica writes."""
    end = time.monotonic() + 60
    while not all((out / n).exists() for n in names) and time.monotonic() < end:
        time.sleep(0.05)


class _TensorParallel(torch.nn.Module):
    """The MLP over ``ctx.tp``: the first layer's rows split, the second replicated."""

    def __init__(self, ctx: Any, whole: torch.nn.Module) -> None:
        super().__init__()
        self.tp = ctx.tp
        rows = whole[0].out_features // self.tp.world_size
        self.w1 = torch.nn.Linear(4, rows)
        self.w2 = whole[2]
        with torch.no_grad():
            self.w1.weight.copy_(whole[0].weight.chunk(self.tp.world_size)[self.tp.rank_in_group])
            self.w1.bias.copy_(whole[0].bias.chunk(self.tp.world_size)[self.tp.rank_in_group])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import pdist

        return self.w2(pdist.all_gather(self.tp, torch.tanh(self.w1(x)), dim=-1))


def _train_step(ctx: Any, model: torch.nn.Module, q: Any, opts: dict[str, Any]) -> None:
    """Backward on this replica's share of the global batch, then the all-reduce across replicas."""
    import torch.distributed as dist

    import pdist

    x, y = _batch(q.step)
    tp = ctx.tp.world_size  # every tp rank computes the whole loss: each takes 1/tp of it
    (_loss(model, x[q.index :: q.size], y[q.index :: q.size]) / tp).backward()
    if tp > 1:  # the replicated layer's gradient: the sum of the tp ranks' parts
        for p in model.w2.parameters():
            pdist.all_reduce_(ctx.tp, p.grad)
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    if q.step == opts.get("raise_at"):  # the user's own error, inside the block
        msg = f"the user's own error at step {q.step}"
        raise ValueError(msg)
    if q.step == opts.get("kill_at"):  # die inside the block, in the all-reduce
        dist.all_reduce(grads, group=q.group.device_group, async_op=True)
        (Path(opts["out"]) / "killed").write_text(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    pdist.all_reduce_(q.group, grads)
    offset = 0
    for p in model.parameters():
        p.grad.copy_(grads[offset : offset + p.numel()].view_as(p))
        offset += p.numel()


def _die_building(step: int, out: Path) -> None:
    from pdist import _replicas

    build = _replicas.FaultTolerant._build

    def dying(self: Any, q: int, info: dict[str, Any]) -> Any:
        if info["step"] == step:
            (out / "killed").write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        return build(self, q, info)

    _replicas.FaultTolerant._build = dying  # type: ignore[method-assign]


def replica(opts: dict[str, Any]) -> None:
    """One replica's job (one of its ranks): ``STEPS`` steps under ``fault_tolerant``."""
    import pdist

    out = Path(opts["out"])
    if "die_building" in opts:  # the test's own hook: die once the quorum is decided
        _die_building(opts["die_building"], out)
    torch.manual_seed(opts["seed"])  # a fresh random init per replica: healing must fix it
    model = _model(opts.get("width", WIDTH))
    commits: list[tuple[int, float]] = []
    with pdist.distributed(tp=opts.get("tp", 1)) as ctx:
        model = _TensorParallel(ctx, model) if ctx.tp.world_size > 1 else model
        opt = torch.optim.Adam(model.parameters(), lr=0.02)
        mine = f"{opts['tag']}-{ctx.rank}"
        with pdist.fault_tolerant(
            ctx,
            opts["address"],
            replica_id=opts["id"],
            min_replicas=opts.get("min", 1),
            timeout=opts.get("timeout", 20),
        ) as ft:
            (out / f"started-{mine}").write_text("1")
            _await(out, [f"started-{t}-{ctx.rank}" for t in opts.get("start_with", [])])
            state = {"model": model, "optim": opt}
            while ft.step < STEPS:
                _await(out, opts.get("holds", {}).get(str(ft.step), []))
                with ft.quorum(state) as q:
                    if q.step == 0 and not (out / f"init-{opts['id']}-{ctx.rank}.pt").exists():
                        torch.save(model.state_dict(), out / f"init-{opts['id']}-{ctx.rank}.pt")
                    _train_step(ctx, model, q, opts)
                if q.committed:
                    opt.step()
                    commits.append((q.step, time.time()))
                opt.zero_grad()
                if ft.step == opts.get("die_after"):  # die between steps
                    os.kill(os.getpid(), signal.SIGKILL)
    final = {"model": model.state_dict(), "optim": opt.state_dict(), "commits": commits}
    torch.save(final, out / f"final-{mine}.pt")


class Run:
    """A coordinator and the replicas of one test; everything it started ends with it."""

    def __init__(self, tmp: Path, port: int, *coordinator: str) -> None:
        self.tmp, self.address = tmp, f"127.0.0.1:{port}"
        self.env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.logs: list[Any] = []
        self._start("coordinator", "-m", "pdist", "coordinator", f"--port={port}", *coordinator)

    def _start(self, tag: str, *args: str, env: dict[str, str] | None = None) -> None:
        log = open(self.tmp / f"{tag}.log", "w")  # noqa: SIM115 (closed in close())
        self.logs.append(log)
        self.procs[tag] = subprocess.Popen(
            [sys.executable, *args], env=env or self.env, stdout=log, stderr=subprocess.STDOUT
        )

    def replica(self, tag: str, *, tp: int = 1, **opts: Any) -> None:
        """Start the replica ``tag`` (this file as a script, ``tp`` ranks) with ``opts``."""
        from test_links import free_port

        opts = {"address": self.address, "out": str(self.tmp), "tag": tag, "tp": tp, **opts}
        port = str(free_port())
        for rank in range(tp):
            launcher = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(tp)}
            launcher |= {"LOCAL_WORLD_SIZE": str(tp), "MASTER_ADDR": "127.0.0.1"}
            env = self.env | (launcher | {"MASTER_PORT": port} if tp > 1 else {})
            name = tag if rank == 0 else f"{tag}.{rank}"
            self._start(name, str(Path(__file__)), json.dumps(opts), env=env)

    def log(self, tag: str) -> str:
        """What ``tag`` printed so far."""
        return (self.tmp / f"{tag}.log").read_text()

    def wait(self, tag: str, timeout: float) -> int:
        """``tag``'s exit status; a failure if it runs past ``timeout``."""
        try:
            return self.procs[tag].wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{tag} did not end within {timeout}s:\n{self.log(tag)}")

    def close(self) -> None:
        """Kill whatever still runs."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for log in self.logs:
            log.close()


@pytest.fixture
def run(tmp_path: Path) -> Any:
    from test_links import free_port

    r = Run(tmp_path, free_port())
    yield r
    r.close()


def _reference(init: dict[str, torch.Tensor]) -> dict[str, Any]:
    """One process training on the whole batch: what every replica must end with."""
    model = _model()
    model.load_state_dict(init)
    opt = torch.optim.Adam(model.parameters(), lr=0.02)
    for step in range(STEPS):
        _loss(model, *_batch(step)).backward()
        opt.step()
        opt.zero_grad()
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def _tensors(tree: Any, path: str = "") -> dict[str, torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return {path: tree}
    if isinstance(tree, dict):
        return {k: v for key in tree for k, v in _tensors(tree[key], f"{path}/{key}").items()}
    if isinstance(tree, list):
        return {k: v for i, x in enumerate(tree) for k, v in _tensors(x, f"{path}/{i}").items()}
    return {}


def _whole(ranks: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """A replica's model and optimizer state as one process's (tp shards concatenated)."""
    parts = [_tensors({"model": r["model"], "optim": r["optim"]}) for r in ranks]
    out = {}
    for key, t in parts[0].items():
        sharded = "w1." in key or key.startswith(("/optim/state/0/", "/optim/state/1/"))
        name = key.replace("w1.", "0.").replace("w2.", "2.")
        out[name] = torch.cat([p[key] for p in parts]) if sharded and t.dim() else t
    return out


def _check_exact(run: Run, tags: list[str], tp: int) -> None:
    """Every replica's ranks bitwise equal, and within 1e-5 of one process; the kill's cost."""
    finals = {t: [torch.load(run.tmp / f"final-{t}-{r}.pt") for r in range(tp)] for t in tags}
    init = _whole(
        [{"model": torch.load(run.tmp / f"init-0-{r}.pt"), "optim": {}} for r in range(tp)]
    )
    want = _tensors(_reference({k.removeprefix("/model/"): v for k, v in init.items()}))
    for tag, ranks in finals.items():
        for rank, final in enumerate(ranks):
            got, first = _tensors(final), _tensors(finals[tags[0]][rank])
            for name, t in got.items():
                assert torch.equal(t, first[name]), f"{tag} rank {rank}: {name} differs"
        got = _whole(ranks)
        assert got.keys() == want.keys(), (tag, sorted(got), sorted(want))
        for name, t in got.items():
            torch.testing.assert_close(t, want[name], atol=1e-5, rtol=0, msg=f"{tag}: {name}")
    killed = float((run.tmp / "killed").read_text())
    survivors = [r for t in tags if t != "restart" for r in finals[t]]
    after = max(min(t for _, t in r["commits"] if t > killed) - killed for r in survivors)
    print(f"from the kill to the survivors' next committed step: {after:.2f} s")
    assert after < 5.0, after
    steps = [s for s, _ in finals[tags[0]][0]["commits"]]
    assert steps == list(range(STEPS)), steps  # each step committed once: step 4 was redone
    log = run.log("coordinator")
    assert "step 4 (quorum 5) did not commit" in log, log  # quorums 1-4: steps 0-3
    assert "joined ['1']; left []; healed ['1']" in log, log


def test_a_replica_killed_in_the_all_reduce_and_restarted_ends_exact(run: Run) -> None:
    """3 replicas, one SIGKILLed in step 4's all-reduce and restarted: all end bitwise equal."""
    holds = {"7": ["started-wrong-0"], "9": ["started-restart-0"]}
    for rid in range(3):
        kill = {"kill_at": 4} if rid == 1 else {"holds": holds}
        run.replica(f"r{rid}", id=rid, seed=100 + rid, start_with=["r0", "r1", "r2"], **kill)
    assert run.wait("r1", 120) == -signal.SIGKILL, run.log("r1")
    # It comes back with another model first: refused, naming the tensor; the others go on.
    run.replica("wrong", id=1, seed=999, width=WIDTH + 1)
    assert run.wait("wrong", 120) == 1
    assert "RankMismatchError" in run.log("wrong"), run.log("wrong")
    assert "state['model']['0.weight'] is (7, 4)" in run.log("wrong"), run.log("wrong")
    time.sleep(1)  # a few seconds after the kill
    run.replica("restart", id=1, seed=998)
    for tag in ("r0", "r2", "restart"):
        assert run.wait(tag, 120) == 0, run.log(tag)
    _check_exact(run, ["r0", "r2", "restart"], tp=1)


def test_two_replicas_of_two_tp_ranks_one_killed_and_restarted_end_exact(run: Run) -> None:
    """2 replicas of tp=2: each rank heals from its counterpart; every shard ends exact."""
    holds = {"7": ["started-restart-0", "started-restart-1"]}
    for rid in range(2):
        kill = {"kill_at": 4} if rid == 1 else {"holds": holds}
        run.replica(f"r{rid}", tp=2, id=rid, seed=100 + rid, start_with=["r0", "r1"], **kill)
    assert run.wait("r1", 120) == -signal.SIGKILL, run.log("r1")
    assert run.wait("r1.1", 60) != 0, run.log("r1.1")
    time.sleep(1)
    run.replica("restart", tp=2, id=1, seed=998)
    for tag in ("r0", "r0.1", "restart", "restart.1"):
        assert run.wait(tag, 120) == 0, run.log(tag)
    _check_exact(run, ["r0", "restart"], tp=2)


def test_min_replicas_the_survivor_of_two_kills_commits_nothing_alone_and_raises(run: Run) -> None:
    """min_replicas=2, two of three killed: the survivor raises within timeout + 10 s."""
    for rid in range(3):
        kill = {"kill_at": 3} if rid else {}
        opts = {"min": 2, "timeout": 5, "start_with": ["r0", "r1", "r2"], **kill}
        run.replica(f"r{rid}", id=rid, seed=100 + rid, **opts)
    for tag in ("r1", "r2"):
        assert run.wait(tag, 120) == -signal.SIGKILL, run.log(tag)
    killed = float((run.tmp / "killed").read_text())
    assert run.wait("r0", 60) == 1, run.log("r0")
    took = time.time() - killed
    assert took < 5 + 10, took
    assert "live replicas: [0], min_replicas=2" in run.log("r0"), run.log("r0")
    assert "replicas ['0'];" not in run.log("coordinator"), run.log("coordinator")


def test_replicas_whose_coordinator_is_gone_raise_naming_its_address(run: Run) -> None:
    """The coordinator killed mid-run: every replica raises within timeout + 10 s."""
    tags = ["r0", "r1"]
    for rid in range(2):
        holds = {"3": ["coordinator-killed"]}
        run.replica(f"r{rid}", id=rid, seed=100 + rid, timeout=5, start_with=tags, holds=holds)
    _await(run.tmp, [f"started-{t}-0" for t in tags])
    time.sleep(1)
    run.procs["coordinator"].kill()
    (run.tmp / "coordinator-killed").write_text("1")
    killed = time.time()
    for tag in tags:
        assert run.wait(tag, 60) == 1, run.log(tag)
        assert f"the coordinator at {run.address} does not answer" in run.log(tag), run.log(tag)
    assert time.time() - killed < 5 + 10


# Serial: under 4 workers on 2 cores, replica 0 was twice shut out of every quorum the restarted
# replica formed alone, while the coordinator listed it live (a race in quorum forming, seen
# only under load; passes alone and in unloaded runs). Left open in #47's note.
@pytest.mark.serial
def test_a_replica_back_before_it_is_missed_gets_a_new_group(tmp_path: Path) -> None:
    """Killed between steps, back under its id within --dead-after: the Group is rebuilt."""
    from test_links import free_port

    run = Run(tmp_path, free_port(), "--dead-after=30")
    try:
        for rid in range(2):
            died = {"die_after": 4} if rid == 1 else {}
            run.replica(f"r{rid}", id=rid, seed=100 + rid, start_with=["r0", "r1"], **died)
        assert run.wait("r1", 120) == -signal.SIGKILL, run.log("r1")
        run.replica("restart", id=1, seed=998)  # the coordinator still hears replica 1 live
        for tag in ("r0", "restart"):
            assert run.wait(tag, 120) == 0, run.log(tag)
        log = run.log("coordinator")
        assert "quorum 5 at step 4: replicas ['0', '1']; joined []; left []; healed ['1']" in log
        assert "did not commit" not in log, log  # the old Group was not taken for the new one
        ends = [_tensors(torch.load(tmp_path / f"final-{t}-0.pt")) for t in ("r0", "restart")]
        for name, t in ends[0].items():
            assert torch.equal(t, ends[1][name]), name
    finally:
        run.close()


def test_a_member_that_dies_before_the_group_is_built_costs_a_step(run: Run) -> None:
    """A member gone between the quorum's decision and its Group: the other goes on at once."""
    for rid in range(2):
        died = {"die_building": 0} if rid == 1 else {}  # step 0: a Group is built
        run.replica(f"r{rid}", id=rid, seed=100 + rid, start_with=["r0", "r1"], timeout=60, **died)
    assert run.wait("r1", 120) == -signal.SIGKILL, run.log("r1")
    assert run.wait("r0", 120) == 0, run.log("r0")
    killed = float((run.tmp / "killed").read_text())
    commits = torch.load(run.tmp / "final-r0-0.pt")["commits"]
    after = min(t for _, t in commits if t > killed) - killed
    assert after < 5.0, after  # not timeout=60 in gloo's rendezvous
    assert [s for s, _ in commits] == list(range(STEPS))


def test_a_users_error_in_the_block_propagates_and_the_others_redo_the_step(run: Run) -> None:
    """A ValueError of the user's code leaves its replica; the other redoes the step alone."""
    for rid in range(2):
        raised = {"raise_at": 2} if rid == 1 else {}
        run.replica(f"r{rid}", id=rid, seed=100 + rid, start_with=["r0", "r1"], **raised)
    assert run.wait("r1", 120) == 1, run.log("r1")
    assert "ValueError: the user's own error at step 2" in run.log("r1"), run.log("r1")
    assert run.wait("r0", 120) == 0, run.log("r0")
    log = run.log("coordinator")
    assert "step 2 (quorum 3) did not commit: replica '1' rank 0: ValueError" in log, log
    assert "quorum 4 at step 2: replicas ['0']; joined []; left ['1']" in log, log
    commits = torch.load(run.tmp / "final-r0-0.pt")["commits"]
    assert [s for s, _ in commits] == list(range(STEPS))


def test_the_coordinator_reads_a_registration_once_its_id_is_written() -> None:
    """A replica counted in ``reg`` before its id is written is read on a later tick."""
    from datetime import timedelta

    from pdist._compat import TCPStore
    from pdist.cli.coordinator import Coordinator

    store = TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=10), wait_for_workers=False)
    lines: list[str] = []
    coordinator = Coordinator(store, 30.0, lines.append)
    store.add("pdist/ft/reg", 1)  # the replica counted itself; its id comes next
    coordinator.tick()
    store.set("pdist/ft/reg/1", "7")
    ask = {"token": "t", "n": 1, "step": 0, "new": True, "min": 1, "ranks": 1}
    store.set("pdist/ft/ask/7", json.dumps(ask))
    coordinator.tick()  # reads the id (and hears it live); the next tick, its ask
    coordinator.tick()
    assert store.get("pdist/ft/live") == b"7"
    assert lines == ["pdist coordinator: quorum 1 at step 0: replicas ['7']; joined ['7']; "
                     "left []; healed []"]  # fmt: skip
    assert store.get("pdist/ft/answer/t/1") == b"1"


def test_the_bench_row_times_a_death_to_the_next_commit() -> None:
    """``pdist bench``'s row: a replica SIGKILLed in an all-reduce costs well under 5 s."""
    from pdist.cli.coordinator import death_to_commit

    seconds = death_to_commit(2)
    print(f"death to commit (bench row, 2 replicas): {seconds:.2f} s")
    assert 0 < seconds < 5.0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"address": "no-port"}, "address='no-port' must be 'host:port'"),
        ({"replica_id": "a/b"}, "replica_id='a/b' must be"),
        ({"replica_id": True}, "replica_id=True must be"),
        ({"min_replicas": 0}, "min_replicas=0 must be a positive int"),
    ],
)
def test_bad_arguments_raise_before_anything_connects(kwargs: dict[str, Any], match: str) -> None:
    """A bad address, replica_id or min_replicas: ValueError naming it, nothing started."""
    import pdist

    args = {"address": "127.0.0.1:1", "replica_id": 0, **kwargs}
    address = args.pop("address")
    with (
        pytest.raises(ValueError, match=re.escape(match)),
        pdist.fault_tolerant(None, address, **args),
    ):
        pass


def test_coordinator_needs_a_port() -> None:
    """``pdist coordinator`` without --port is a usage error (exit status 2)."""
    from pdist.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["coordinator"])
    assert exit_info.value.code == 2


if __name__ == "__main__":
    replica(json.loads(sys.argv[1]))
