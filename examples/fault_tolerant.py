"""Fault-tolerant replicas: one is killed mid-step and restarted, and all end with one model.

One command tells the whole story:

python examples/fault_tolerant.py

It starts a coordinator (``python -m pdist coordinator``) and 3 replicas, each its own
one-rank job training the same MLP on its share of a fixed global batch. Replica 1 kills
itself (SIGKILL) inside step 4's all-reduce; the survivors redo step 4 without it and go on;
a new replica 1, with a fresh random init, is started, healed from the others, and joins.
At the end the three replicas' weights are compared: bitwise equal. Under torchrun (``nox
-s examples`` runs it on 2 ranks) rank 0 tells the story and the other ranks only exit.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

import pdist

STEPS, BATCH, KILL_AT, JOIN_BY = 10, 24, 4, 7
LAUNCHER = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
LAUNCHER |= {"GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_NAME"}


def replica(address: str, replica_id: int, seed: int, out: Path) -> None:
    torch.manual_seed(seed)  # every replica starts from its own init: the first quorum fixes it
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    with (
        pdist.distributed() as ctx,
        pdist.fault_tolerant(ctx, address, replica_id=replica_id, timeout=60) as ft,
    ):
        (out / f"joined-{replica_id}-{seed}").write_text("1")
        while seed == 0 and not all((out / f"joined-{i}-0").exists() for i in range(3)):
            time.sleep(0.1)  # the demo starts the three together
        state = {"model": model, "optim": opt}
        while ft.step < STEPS:
            if ft.step == JOIN_BY and replica_id != 1:  # the demo waits for the restart
                while not (out / "joined-1-1").exists():
                    time.sleep(0.1)
            with ft.quorum(state) as q:
                g = torch.Generator().manual_seed(q.step)  # the fixed global batch of this step
                x, y = torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 1, generator=g)
                share = slice(q.index, None, q.size)  # this replica's share
                loss = (model(x[share]) - y[share]).square().sum() / BATCH  # sum, then divide
                loss.backward()
                grads = torch.cat([p.grad.flatten() for p in model.parameters()])
                if replica_id == 1 and seed == 0 and q.step == KILL_AT:
                    os.kill(os.getpid(), signal.SIGKILL)  # dies inside the block
                pdist.all_reduce_(q.group, grads)
                torch.nn.utils.vector_to_parameters(grads, [p.grad for p in model.parameters()])
                healed = " (healed)" if q.healed else ""
                print(f"replica {replica_id}: step {q.step} of {q.replicas}{healed}", flush=True)
            if q.committed:
                opt.step()  # only a committed step moves the model
            opt.zero_grad()
    torch.save(model.state_dict(), out / f"final-{replica_id}.pt")


def main() -> None:
    out = Path(tempfile.mkdtemp(prefix="pdist-ft-"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER}
    env = {k: v for k, v in env.items() if not k.startswith("TORCHELASTIC_")}  # own jobs

    def start(*args: object) -> subprocess.Popen[bytes]:
        return subprocess.Popen([sys.executable, *map(str, args)], env=env)

    coordinator = start("-m", "pdist", "coordinator", "--port", port)
    here, address = Path(__file__).resolve(), f"127.0.0.1:{port}"
    replicas = {
        i: start(here, "--replica", i, "--seed", 0, "--address", address, "--out", out)
        for i in range(3)
    }
    try:
        replicas[1].wait(timeout=300)
        print(f"example: replica 1 was killed (status {replicas[1].returncode}); restarting it")
        replicas[1] = start(here, "--replica", 1, "--seed", 1, "--address", address, "--out", out)
        codes = [p.wait(timeout=300) for p in replicas.values()]
        assert codes == [0, 0, 0], codes
        finals = [torch.load(out / f"final-{i}.pt") for i in range(3)]
        for name, t in finals[0].items():
            assert all(torch.equal(t, f[name]) for f in finals[1:]), name
        print("example: the three replicas' weights are bitwise equal. OK")
    finally:
        for p in [*replicas.values(), coordinator]:
            if p.poll() is None:
                p.kill()
                p.wait()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--replica", type=int)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--address")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.replica is not None:
        replica(args.address, args.replica, args.seed, args.out)
    elif os.environ.get("RANK", "0") == "0":  # under torchrun: rank 0 tells the story
        main()
