"""RL-style weight sync: a trainer job sends its weights to a separate inference job each step.

Two jobs, each its own torchrun world, sharing only the link's address. Start both:

torchrun --nproc-per-node 2 examples/weight_sync.py --role trainer
torchrun --nproc-per-node 2 examples/weight_sync.py --role inference

Without ``--role`` (``torchrun --nproc-per-node 2 examples/weight_sync.py``, or plain
``python examples/weight_sync.py``) this job is the trainer and its rank 0 starts the
inference job itself (``--inference-ranks`` ranks under torchrun) on a free port, and
waits for it: the exit status is 0 only when both jobs succeeded.

Trainer rank 0 and every inference rank form a link of 3 (trainer rank 0 is link rank 0,
inference rank r is link rank 1 + r). After each training step the trainer's fp32 weights
go into the inference job's bf16 model in place, and the inference ranks generate with them.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import subprocess
import sys

import torch
from torch import nn

import pdist

STEPS = 3


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))


def trainer(ctx: pdist.DistContext, address: str, inference_ranks: int) -> None:
    model = pdist.wrap_ddp(ctx, build())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    weights = model.module.state_dict()
    # Only trainer rank 0 is a member of the link; the others just train.
    link = pdist.link(address, rank=0, world_size=1 + inference_ranks, timeout=120)
    with link if ctx.rank == 0 else contextlib.nullcontext() as g:
        for step in range(STEPS):
            torch.manual_seed(100 * step + ctx.rank)
            loss = model(torch.randn(32, 16)).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if g is not None:
                pdist.broadcast_weights(g, weights)  # fp32, straight from the trainer
                print(f"trainer: step {step} loss {loss.item():.4f}, weights sent")


def inference(ctx: pdist.DistContext, address: str) -> None:
    model = build().to(torch.bfloat16).eval()  # the engine serves in bf16
    into = model.state_dict()  # views of the model's tensors: filled in place
    link_rank, size = 1 + ctx.rank, 1 + ctx.world_size
    with pdist.link(address, rank=link_rank, world_size=size, timeout=120) as g:
        for step in range(STEPS):
            pdist.broadcast_weights(g, into=into)  # cast to bf16 on arrival
            with torch.no_grad():
                out = model(torch.ones(1, 16, dtype=torch.bfloat16))
            outs = pdist.all_gather_object(ctx, out.float().tolist())  # the job's own world
            if ctx.rank == 0:
                same = all(o == outs[0] for o in outs)
                print(f"inference: step {step} output {outs[0][0][:2]} (all ranks equal: {same})")


def start_inference(address: str, ranks: int) -> subprocess.Popen[bytes]:
    """Start the inference job as its own torchrun world (before this job's ``distributed()``)."""
    # This process's launcher variables (RANK, MASTER_PORT, ...) belong to the trainer job.
    launcher = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR"}
    launcher |= {"MASTER_PORT", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_NAME"}
    launcher |= {"ROLE_WORLD_SIZE"}
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in launcher and not k.startswith("TORCHELASTIC_")
    }
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", str(ranks), __file__, "--role", "inference"]
    return subprocess.Popen([*command, "--link", address], env=env)


def free_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--role",
        choices=["trainer", "inference"],
        help="default: this job trains, and its rank 0 starts the inference job itself",
    )
    parser.add_argument("--link", help="host:port of the link (default 127.0.0.1:29710)")
    parser.add_argument("--inference-ranks", type=int, default=2)
    args = parser.parse_args()
    job = None  # the inference job, when this process started it
    if args.role is None and int(os.environ.get("RANK", "0")) == 0:
        address = args.link or free_address()
        job = start_inference(address, args.inference_ranks)
    else:
        address = args.link or "127.0.0.1:29710"
    try:
        with pdist.distributed() as ctx:
            if args.role == "inference":
                inference(ctx, address)
            else:
                trainer(ctx, address, args.inference_ranks)
    except BaseException:
        if job is not None:
            job.terminate()  # this job failed: do not leave the other one waiting for the link
        raise
    if job is not None and job.wait(timeout=300) != 0:
        sys.exit(f"the inference job exited with status {job.returncode}")


if __name__ == "__main__":
    main()
