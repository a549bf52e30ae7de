"""Pipeline x data parallelism: torch's GPipe over ``ctx.pp``, FSDP2 over ``ctx.dp``.

torchrun --nproc-per-node 4 examples/pipeline_fsdp.py

``distributed(pp=2)`` on 4 ranks gives the layout ``pp, dp`` (slowest first): the pipeline
groups are ``[0, 2] [1, 3]`` (stage 0 on ranks 0-1, stage 1 on ranks 2-3) and the
data-parallel groups ``[0, 1] [2, 3]``. pdist builds the groups; torch's own machinery
does the rest: ``PipelineStage`` sends activations over ``ctx.pp.device_group`` and each
stage's parameters are sharded over ``device_mesh(ctx, ("dp",))``.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

import pdist

STAGES, MICROBATCHES, STEPS = 2, 4, 20


def make_stage(index: int) -> nn.Module:
    torch.manual_seed(index)  # the same stage weights on every dp rank
    if index == 0:
        return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))


def batch(dp_index: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + dp_index)  # each dp rank its own samples
    x = torch.randn(32, 16, generator=gen)
    return x, x[:, :4].sum(dim=1, keepdim=True)  # a learnable toy target


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, target)


def main() -> None:
    with pdist.distributed(pp=STAGES) as ctx:
        stage_index = ctx.pp.rank_in_group
        module = make_stage(stage_index)
        mesh = pdist.device_mesh(ctx, ("dp",))
        fully_shard(module, mesh=mesh)  # shard this stage's weights over its dp ranks
        stage = PipelineStage(module, stage_index, STAGES, ctx.device, group=ctx.pp.device_group)
        schedule = ScheduleGPipe(stage, n_microbatches=MICROBATCHES, loss_fn=loss_fn)
        optimizer = torch.optim.AdamW(module.parameters(), lr=3e-3)
        for step in range(STEPS):
            x, y = batch(ctx.dp.rank_in_group, step)
            losses: list[torch.Tensor] = []
            if stage.is_first:
                schedule.step(x)
            else:
                schedule.step(target=y, losses=losses)
            optimizer.step()  # FSDP2 already averaged the gradients over dp
            optimizer.zero_grad()
            if stage.is_last and ctx.dp.is_first_rank and step % 5 == 4:
                loss = torch.stack(losses).mean().item()
                print(f"step {step + 1}: loss {loss:.4f} (rank {ctx.rank}, stage {stage_index})")
        del schedule, stage, optimizer, module, mesh  # release the groups before the block exits


if __name__ == "__main__":
    main()
