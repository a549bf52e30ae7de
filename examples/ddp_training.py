"""DDP training with gradient accumulation (grad_sync) and exact evaluation (EvalSampler).

torchrun --nproc-per-node 2 examples/ddp_training.py
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import pdist

ACCUMULATION = 4


def make_data(n: int, seed: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=gen)
    y = (x.sum(dim=1) > 0).long()  # a separable toy task
    return TensorDataset(x, y)


def main() -> None:
    with pdist.distributed() as ctx:
        torch.manual_seed(0)
        model = pdist.wrap_ddp(ctx, nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        train = make_data(512, seed=1)
        sampler = torch.utils.data.DistributedSampler(
            train, num_replicas=ctx.dp.world_size, rank=ctx.dp.rank_in_group
        )
        loader = DataLoader(train, batch_size=16, sampler=sampler)
        for epoch in range(10):
            sampler.set_epoch(epoch)
            for step, (x, y) in enumerate(loader):
                last = (step + 1) % ACCUMULATION == 0
                # Only the last micro-batch of each window all-reduces gradients.
                with pdist.grad_sync(model, enabled=last):
                    loss = nn.functional.cross_entropy(model(x), y) / ACCUMULATION
                    loss.backward()
                if last:
                    optimizer.step()
                    optimizer.zero_grad()

        # Evaluation: every sample exactly once, gathered back in dataset order.
        test = make_data(101, seed=2)  # not divisible by the world size on purpose
        loader = DataLoader(test, batch_size=8, sampler=pdist.EvalSampler(test, ctx.dp))
        # The unwrapped model: DDP's forward takes part in collectives, and the ranks may
        # hold different numbers of evaluation batches.
        net = model.module.eval()
        with torch.no_grad():
            batches = [{"pred": net(x).argmax(dim=1), "label": y} for x, y in loader]
        out = pdist.collate_batches(ctx.dp, batches)
        accuracy = (out["pred"] == out["label"]).float().mean().item()
        assert out["label"].tolist() == test.tensors[1].tolist()  # dataset order restored
        if pdist.is_rank0(ctx):
            print(f"evaluated {len(out['label'])} samples, accuracy {accuracy:.3f}")
        del model, optimizer  # release DDP's process group before the context exits


if __name__ == "__main__":
    main()
