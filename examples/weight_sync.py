"""RL-style weight sync: a trainer job sends its weights to a separate inference job each step.

Two jobs, each its own torchrun world, sharing only the link's address. Start both:

torchrun --nproc-per-node 2 examples/weight_sync.py --role trainer
torchrun --nproc-per-node 2 examples/weight_sync.py --role inference

Trainer rank 0 and every inference rank form a link of 3 (trainer rank 0 is link rank 0,
inference rank r is link rank 1 + r). After each training step the trainer's fp32 weights
go into the inference job's bf16 model in place, and the inference ranks generate with them.
"""

from __future__ import annotations

import argparse
import contextlib

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role", choices=["trainer", "inference"], required=True)
    parser.add_argument("--link", default="127.0.0.1:29710", help="host:port of the link")
    parser.add_argument("--inference-ranks", type=int, default=2)
    args = parser.parse_args()
    with pdist.distributed() as ctx:
        if args.role == "trainer":
            trainer(ctx, args.link, args.inference_ranks)
        else:
            inference(ctx, args.link)


if __name__ == "__main__":
    main()
