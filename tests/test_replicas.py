"""Fault-tolerant replicas: real processes, a coordinator, replicas killed and restarted.

Every replica is its own process (its own one-rank ``distributed()`` job), started from this
file (``python tests/test_replicas.py ARGS``); the coordinator is ``python -m pdist
coordinator``. The reference is one plain-torch process training on the whole batch.
"""

from __future__ import annotations

import json
import os
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


def replica(opts: dict[str, Any]) -> None:
    """One replica's job: ``STEPS`` steps under ``fault_tolerant`` (in a process of its own)."""
    import torch.distributed as dist

    import pdist

    out = Path(opts["out"])
    torch.manual_seed(opts["seed"])  # a fresh random init per process: healing must fix it
    model = _model(opts.get("width", WIDTH))
    opt = torch.optim.Adam(model.parameters(), lr=0.02)
    commits: list[tuple[int, float]] = []
    with (
        pdist.distributed() as ctx,
        pdist.fault_tolerant(
            ctx,
            opts["address"],
            replica_id=opts["id"],
            min_replicas=opts.get("min", 1),
            timeout=opts.get("timeout", 20),
        ) as ft,
    ):
        (out / f"started-{opts['tag']}").write_text("1")
        _await(out, [f"started-{t}" for t in opts.get("start_with", [])])
        state = {"model": model, "optim": opt}
        while ft.step < STEPS:
            _await(out, opts.get("holds", {}).get(str(ft.step), []))
            with ft.quorum(state) as q:
                if q.step == 0 and not (out / f"init-{opts['id']}.pt").exists():
                    torch.save(model.state_dict(), out / f"init-{opts['id']}.pt")
                x, y = _batch(q.step)
                _loss(model, x[q.index :: q.size], y[q.index :: q.size]).backward()
                grads = torch.cat([p.grad.flatten() for p in model.parameters()])
                if q.step == opts.get("kill_at"):  # die inside the block, in the all-reduce
                    dist.all_reduce(grads, group=q.group.device_group, async_op=True)
                    (out / "killed").write_text(repr(time.time()))
                    os.kill(os.getpid(), signal.SIGKILL)
                pdist.all_reduce_(q.group, grads)
                offset = 0
                for p in model.parameters():
                    p.grad.copy_(grads[offset : offset + p.numel()].view_as(p))
                    offset += p.numel()
            if q.committed:
                opt.step()
                commits.append((q.step, time.time()))
            opt.zero_grad()
    final = {"model": model.state_dict(), "optim": opt.state_dict(), "commits": commits}
    torch.save(final, out / f"final-{opts['tag']}.pt")


class Run:
    """A coordinator and the replicas of one test; everything it started ends with it."""

    def __init__(self, tmp: Path, port: int) -> None:
        self.tmp, self.address = tmp, f"127.0.0.1:{port}"
        self.env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        self.procs: dict[str, subprocess.Popen[str]] = {}
        self.logs: list[Any] = []
        self._start("coordinator", "-m", "pdist", "coordinator", f"--port={port}")

    def _start(self, tag: str, *args: str) -> subprocess.Popen[str]:
        log = open(self.tmp / f"{tag}.log", "w")  # noqa: SIM115 (closed in close())
        self.logs.append(log)
        proc = subprocess.Popen(
            [sys.executable, *args], env=self.env, stdout=log, stderr=subprocess.STDOUT, text=True
        )
        self.procs[tag] = proc
        return proc

    def replica(self, tag: str, **opts: Any) -> subprocess.Popen[str]:
        """Start the replica ``tag`` (this file as a script) with ``opts``."""
        opts = {"address": self.address, "out": str(self.tmp), "tag": tag, **opts}
        return self._start(tag, str(Path(__file__)), json.dumps(opts))

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


def test_a_replica_killed_in_the_all_reduce_and_restarted_ends_exact(run: Run) -> None:
    """3 replicas, one SIGKILLed in step 4's all-reduce and restarted: all end bitwise equal."""
    holds = {"7": ["started-wrong"], "9": ["started-restart"]}
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
    finals = {tag: torch.load(run.tmp / f"final-{tag}.pt") for tag in ("r0", "r2", "restart")}
    init = torch.load(run.tmp / "init-0.pt")
    want = _tensors(_reference(init))
    for tag, final in finals.items():
        got = _tensors({"model": final["model"], "optim": final["optim"]})
        assert got.keys() == want.keys(), (tag, sorted(got), sorted(want))
        first = _tensors({"model": finals["r0"]["model"], "optim": finals["r0"]["optim"]})
        for name, t in got.items():
            assert torch.equal(t, first[name]), f"{tag}: {name} differs from replica 0's"
            torch.testing.assert_close(t, want[name], atol=1e-5, rtol=0, msg=f"{tag}: {name}")
    killed = float((run.tmp / "killed").read_text())
    after = [
        min(t for _, t in final["commits"] if t > killed) - killed
        for tag, final in finals.items()
        if tag != "restart"
    ]
    print(f"from the kill to the survivors' next committed step: {max(after):.2f} s")
    assert max(after) < 5.0, after
    steps = [s for s, _ in finals["r0"]["commits"]]
    assert steps == list(range(STEPS)), steps  # each step committed once: step 4 was redone
    log = run.log("coordinator")
    assert "step 4 (quorum 5) did not commit" in log, log  # quorums 1-4: steps 0-3
    assert "joined ['1']; left []; healed ['1']" in log, log


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
    _await(run.tmp, [f"started-{t}" for t in tags])
    time.sleep(1)
    run.procs["coordinator"].kill()
    (run.tmp / "coordinator-killed").write_text("1")
    killed = time.time()
    for tag in tags:
        assert run.wait(tag, 60) == 1, run.log(tag)
        assert f"the coordinator at {run.address} does not answer" in run.log(tag), run.log(tag)
    assert time.time() - killed < 5 + 10


if __name__ == "__main__":
    replica(json.loads(sys.argv[1]))
