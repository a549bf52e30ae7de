"""``python -m pdist coordinator --port P``: where fault-tolerant replicas meet.

It hosts the ``TCPStore`` the replicas connect to and, polling it, makes the two
decisions [`fault_tolerant`][pdist.fault_tolerant] leaves to one place: who is in the next quorum
(every live replica that asked, once all live ones have and at least ``min_replicas``
did), and whether a quorum's step committed (every rank of every member finished its
block; a failure reported or a member gone makes it not). Each decision is written once;
the replicas only read it. A replica is live while its heartbeat counter moves: one
that has not moved for ``--dead-after`` seconds, or that said it left, is out.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from pdist._compat import TCPStore
from pdist._replicas import PREFIX, order

__all__ = ["Coordinator", "death_to_commit", "serve"]


class Coordinator:
    """The coordinator's state: replicas seen, their heartbeats, the open quorum."""

    def __init__(self, store: Any, dead_after: float, say: Callable[[str], None] = print) -> None:
        self.store, self.dead_after, self.say = store, dead_after, say
        self.ids: list[str] = []
        self.beats: dict[str, tuple[int, float]] = {}
        self.answered: dict[str, tuple[str, int]] = {}
        self.quorum = 0
        self.open: dict[str, Any] | None = None  # the quorum whose commit is not decided
        self.members: list[str] = []
        self.live = ""

    def key(self, name: str) -> str:
        """The store key of ``name``."""
        return PREFIX + name

    def _get(self, name: str) -> str | None:
        key = self.key(name)
        return self.store.get(key).decode() if self.store.check([key]) else None

    def _live(self, asks: dict[str, dict[str, Any]]) -> list[str]:
        now = time.monotonic()
        while self.store.add(self.key("reg"), 0) > len(self.ids):
            rid = self._get(f"reg/{len(self.ids) + 1}")
            if rid is None:  # counted, its id not written yet: the next tick reads it
                break
            self.ids.append(rid)
        live = []
        for rid in dict.fromkeys(self.ids):
            beat = int(self.store.add(self.key(f"hb/{rid}"), 0))
            if self.beats.get(rid, (-1, 0.0))[0] != beat:
                self.beats[rid] = (beat, now)
            gone = self._get(f"gone/{rid}")
            if gone is not None and gone == asks.get(rid, {}).get("token"):
                continue
            if now - self.beats[rid][1] < self.dead_after:
                live.append(rid)
        return sorted(live, key=order)

    def tick(self) -> None:
        """Read the store once; decide the open quorum's commit, or the next quorum."""
        asks = {}
        for rid in dict.fromkeys(self.ids):
            if (text := self._get(f"ask/{rid}")) is not None:
                asks[rid] = json.loads(text)
        live = self._live(asks)
        if ",".join(live) != self.live:
            self.live = ",".join(live)
            self.store.set(self.key("live"), self.live)
        if self.open is not None:
            self._decide_commit(live)
            return
        pending = {
            rid: a
            for rid, a in asks.items()
            if rid in live and (a["token"], a["n"]) != self.answered.get(rid)
        }
        enough = pending and len(pending) >= max(a["min"] for a in pending.values())
        if enough and set(live) <= set(pending):
            self._decide_quorum(pending)

    def _decide_quorum(self, asks: dict[str, dict[str, Any]]) -> None:
        """The next quorum: its members, its step, the healing source and the healed."""
        self.quorum += 1
        q, members = self.quorum, sorted(asks, key=order)
        rank = [(asks[m]["step"], not asks[m]["new"]) for m in members]
        source = rank.index(max(rank))  # the lowest index at the highest step (known first)
        step = rank[source][0]
        healed = [m for i, m in enumerate(members) if i != source and rank[i] != rank[source]]
        if all(asks[m]["new"] for m in members):  # the first quorum: everyone from one state
            healed = [m for i, m in enumerate(members) if i != source]
        ranks = [asks[m]["ranks"] for m in members]
        tokens = [asks[m]["token"] for m in members]  # the processes: a restart is another
        info = {"step": step, "replicas": members, "ranks": ranks, "tokens": tokens}
        self.store.set(
            self.key(f"round/{q}"), json.dumps(info | {"source": source, "healed": healed})
        )
        for m in members:
            self.answered[m] = (asks[m]["token"], asks[m]["n"])
            self.store.set(self.key(f"answer/{asks[m]['token']}/{asks[m]['n']}"), str(q))
        joined = [m for m in members if m not in self.members]
        left = [m for m in self.members if m not in members]
        self.members, self.open = members, info | {"quorum": q}
        self.say(
            f"pdist coordinator: quorum {q} at step {step}: replicas {members}; joined {joined}; "
            f"left {left}; healed {healed}"
        )

    def _decide_commit(self, live: list[str]) -> None:
        info = self.open
        assert info is not None
        q = info["quorum"]
        gone = [m for m in info["replicas"] if m not in live]
        fail = self._get(f"fail/{q}")
        done = self.store.add(self.key(f"done/{q}"), 0)
        if fail is None and not gone and done < sum(info["ranks"]):
            return
        committed = fail is None and not gone
        self.store.set(self.key(f"commit/{q}"), "1" if committed else "0")
        self.open = None
        if not committed:
            why = fail or f"replica(s) {gone} stopped answering"
            self.say(f"pdist coordinator: step {info['step']} (quorum {q}) did not commit: {why}")


def serve(port: int, *, host: str = "0.0.0.0", dead_after: float = 1.0) -> int:
    """Host the store on ``port`` and decide quorums until interrupted; returns the exit code."""
    wait = timedelta(seconds=30)
    store = TCPStore(host, port, None, True, wait, wait_for_workers=False)
    print(f"pdist coordinator: listening on {host}:{port}", flush=True)
    coordinator = Coordinator(store, dead_after, functools.partial(print, flush=True))
    try:
        while True:
            coordinator.tick()
            time.sleep(0.005)
    except KeyboardInterrupt:
        return 0


def bench_replica(address: str, replica_id: str, replicas: str, out: str) -> None:
    """One replica of ``death_to_commit`` (its own process): replica 1 dies in step 4."""
    import torch

    import pdist

    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    commits: list[float] = []
    with (
        pdist.distributed() as ctx,
        pdist.fault_tolerant(ctx, address, replica_id=replica_id) as ft,
    ):
        Path(out, f"started-{replica_id}").write_text("1")
        while not all(Path(out, f"started-{i}").exists() for i in range(int(replicas))):
            time.sleep(0.01)  # start together: the kill falls in a quorum of all
        while ft.step < 8:
            with ft.quorum({"model": model, "optim": opt}) as q:
                model(torch.randn(8, 64)).square().sum().backward()
                grads = torch.cat(
                    [p.grad.flatten() for p in model.parameters() if p.grad is not None]
                )
                if replica_id == "1" and q.step == 4:
                    torch.distributed.all_reduce(grads, group=q.group.device_group, async_op=True)
                    Path(out, "killed").write_text(repr(time.time()))
                    os.kill(os.getpid(), signal.SIGKILL)
                pdist.all_reduce_(q.group, grads)
            if q.committed:
                commits.append(time.time())
            opt.zero_grad()
    Path(out, f"commits-{replica_id}").write_text(json.dumps(commits))


def death_to_commit(replicas: int = 3, dead_after: float = 1.0) -> float:
    """Seconds from a replica's SIGKILL inside a step's all-reduce to the survivors' next commit.

    A coordinator in this process, and ``replicas`` one-rank replicas (gloo) as processes.
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = TCPStore("127.0.0.1", port, None, True, timedelta(seconds=30), wait_for_workers=False)
    coordinator, stop = Coordinator(store, dead_after, lambda line: None), threading.Event()

    def tick() -> None:
        while not stop.wait(0.005):
            coordinator.tick()

    threading.Thread(target=tick, daemon=True, name="pdist-coordinator").start()
    launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_", "TORCHELASTIC_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(launcher)}  # its own jobs
    with tempfile.TemporaryDirectory() as out:
        code = "import sys; from pdist.cli.coordinator import bench_replica as r; r(*sys.argv[1:])"
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", code, f"127.0.0.1:{port}", str(i), str(replicas), out],
                env=env,
            )
            for i in range(replicas)
        ]
        try:
            codes = [p.wait(timeout=300) for p in procs]
        finally:
            stop.set()
            for p in procs:  # a process that has ended is not signalled
                p.kill()
                p.wait()
        if codes != [0, -signal.SIGKILL, *[0] * (replicas - 2)]:
            msg = f"death_to_commit: the replicas ended with {codes}"
            raise RuntimeError(msg)
        killed = float(Path(out, "killed").read_text())
        firsts = [
            min(t for t in json.loads(Path(out, f"commits-{i}").read_text()) if t > killed)
            for i in range(replicas)
            if i != 1
        ]
        return float(max(firsts) - killed)
