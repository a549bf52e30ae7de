"""A small mixture-of-experts layer with expert parallelism, trained a few steps.

``pdist.distributed(ep=2)`` makes ``ctx.ep`` the expert-parallel group (blocks of 2
consecutive ranks) and ``ctx.edp`` the ranks at the same place in their blocks,
which hold the same experts. Each rank of an ``ep`` group holds ``EXPERTS / ep``
experts (expert ``e`` on its group rank ``e // (EXPERTS / ep)``), and every rank
has its own batch of tokens (data parallelism over all ranks). A replicated router
picks each token's top-2 experts; ``pdist.moe_dispatch`` sends the tokens to the
ranks of their experts, grouped by local expert, each expert runs on its rows,
and ``pdist.moe_combine`` brings the outputs back, weighted by the router.

Gradients, for a loss averaged over the data-parallel ranks: the router's are
averaged over ``ctx.dp_sp`` like any dense weight's. An expert's arrive through
the backward all-to-all already summed over its ``ep`` group's tokens, so they are
summed over ``ctx.edp`` and divided by the data-parallel size (averaging over
``edp`` alone would leave them ``ep`` times too large). After every step the
weights equal those of one process that runs every expert on every rank's tokens.

torchrun --nproc-per-node 2 examples/moe.py   (also 4; or plain python: one rank)
"""

from __future__ import annotations

import os

import torch
from torch import nn
from torch.nn import functional

import pdist

TOKENS, DIM, EXPERTS, TOP, STEPS, LR = 6, 8, 4, 2, 3, 0.1


class MoE(nn.Module):
    """A router and the experts ``first .. first + count - 1``, one linear layer each."""

    def __init__(self, first: int, count: int) -> None:
        super().__init__()
        torch.manual_seed(0)  # the same weights on every rank and in the reference
        self.router = nn.Linear(DIM, EXPERTS)
        experts = [nn.Linear(DIM, DIM) for _ in range(EXPERTS)]  # all made: same seeds
        self.experts = nn.ModuleList(experts[first : first + count])

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's top-2 experts and their softmax weights, ``[T, 2]`` each."""
        weights, ids = self.router(x).softmax(-1).topk(TOP, dim=-1)
        return ids, weights

    def forward(self, group: pdist.Group, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        ids, weights = self.route(x)
        routed = pdist.moe_dispatch(group, x, ids, EXPERTS)
        parts = routed.tokens.split(routed.counts)  # one block per local expert
        out = torch.cat([expert(rows) for expert, rows in zip(self.experts, parts, strict=True)])
        return pdist.moe_combine(routed, out, weights)  # [T, DIM]

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """Every expert on one process (the module holds all of them)."""
        ids, weights = self.route(x)
        outs = torch.stack([expert(x) for expert in self.experts], dim=1)  # [T, E, DIM]
        chosen = outs.gather(1, ids.unsqueeze(-1).expand(-1, -1, DIM))  # [T, 2, DIM]
        return (chosen * weights.unsqueeze(-1)).sum(1)


def main() -> None:
    # ep=2 needs a world size that 2 divides; one rank (plain python) holds every expert.
    ep = 2 if int(os.environ.get("WORLD_SIZE", "1")) % 2 == 0 else 1
    with pdist.distributed(ep=ep) as ctx:
        p, r = ctx.ep.world_size, ctx.ep.rank_in_group  # this rank's place among the experts
        local = EXPERTS // p
        model, reference = MoE(r * local, local), MoE(0, EXPERTS)
        gen = torch.Generator().manual_seed(1)
        data = [torch.randn(ctx.world_size, TOKENS, DIM, generator=gen) for _ in range(STEPS)]
        for step, batch in enumerate(data):  # batch[i]: rank i's tokens
            target = batch.flip(-1)
            out = model(ctx.ep, batch[ctx.rank])
            functional.mse_loss(out, target[ctx.rank]).backward()
            for w in model.router.parameters():  # replicated: averaged as dense weights are
                pdist.all_reduce_(ctx.dp_sp, w.grad, op="mean")
            for w in model.experts.parameters():  # summed over ep already; over edp here
                pdist.all_reduce_(ctx.edp, w.grad).div_(ctx.dp_sp.world_size)
            full = reference.reference(batch.flatten(0, 1))  # every rank's tokens at once
            functional.mse_loss(full, target.flatten(0, 1)).backward()
            with torch.no_grad():
                for m in (model, reference):
                    for w in m.parameters():
                        w -= LR * w.grad
                        w.grad = None
            torch.testing.assert_close(model.router.weight, reference.router.weight)
            for e, expert in enumerate(model.experts):
                theirs = reference.experts[r * local + e]
                torch.testing.assert_close(expert.weight, theirs.weight, msg=f"step {step}")
                torch.testing.assert_close(expert.bias, theirs.bias, msg=f"step {step}")
        if pdist.is_rank0(ctx):
            print(
                f"MoE layer over {ctx.world_size} rank(s), ep={p}, {EXPERTS} experts, top-{TOP}: "
                f"{STEPS} SGD steps match one process running every expert"
            )


if __name__ == "__main__":
    main()
