"""FSDP2 and HSDP on pdist's meshes, against single-process training; a clean exit after FSDP2."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import warnings

import pytest
import torch
from fsdp_state import needs_fsdp2_on_cpu, param_groups
from torch import nn
from torch.distributed import TCPStore

import pdist
from pdist.testing import spawn, world_sizes

STEPS = 3


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)
    )


def _batch(index: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Four samples for data-parallel index ``index`` at ``step``."""
    gen = torch.Generator().manual_seed(1000 * step + index)
    return torch.randn(4, 8, generator=gen), torch.randn(4, 4, generator=gen)


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def _train(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for batch in batches:
        _loss(model, batch).backward()
        optimizer.step()
        optimizer.zero_grad()


def _shard(model: nn.Sequential, mesh) -> nn.Sequential:
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach()


def _against_single_process(kind, axes, sp):
    with pdist.distributed(sp=sp) as ctx:
        index, n = ctx.dp_sp.rank_in_group, ctx.dp_sp.world_size
        # The reference: one process, the same model, every rank's samples in one batch.
        reference = _mlp()
        whole = [
            tuple(torch.cat(parts) for parts in zip(*(_batch(i, s) for i in range(n)), strict=True))
            for s in range(STEPS)
        ]
        _train(reference, whole)

        model = _mlp()
        mesh = None
        if kind == "ddp":
            wrapped = pdist.wrap_ddp(ctx, model)
        else:
            mesh = pdist.device_mesh(ctx, axes)
            wrapped = _shard(model, mesh)
        _train(wrapped, [_batch(index, s) for s in range(STEPS)])
        diff = max(
            (_full(p) - r).abs().max().item()
            for p, r in zip(model.parameters(), reference.parameters(), strict=True)
        )
        layout = None if mesh is None else (mesh.mesh.tolist(), mesh.mesh_dim_names)
        del wrapped, model, mesh  # release the process groups before the block exits
        return diff, layout


CASES = [
    ("ddp", None, 1, None),
    ("ddp", None, 2, None),  # sp ranks see different samples: DDP averages over dp x sp
    ("fsdp", ("dp",), 1, ([0, 1, 2, 3], ("dp",))),
    ("fsdp", ("dp_sp",), 2, ([0, 1, 2, 3], ("dp_sp",))),
    ("hsdp", ("dp", "sp"), 2, ([[0, 1], [2, 3]], ("dp", "sp"))),
]


@needs_fsdp2_on_cpu
@pytest.mark.parametrize(("kind", "axes", "sp", "layout"), CASES)
def test_matches_single_process_training(kind, axes, sp, layout):
    """3 AdamW steps on 4 ranks match one process on the whole batch within 1e-5."""
    for diff, got_layout in spawn(_against_single_process, 4, kind, axes, sp, timeout=120):
        assert diff <= 1e-5, (kind, axes, sp, diff)
        assert got_layout == layout


def _flags(model: nn.Sequential) -> list[tuple[bool, bool]]:
    return [
        (g.reduce_grads, g.all_reduce_grads)
        for layer in model
        if isinstance(layer, nn.Linear)
        for g in param_groups(layer)
    ]


def _accumulate(defer_reduce_scatter):
    with pdist.distributed(sp=2) as ctx:
        mesh = pdist.device_mesh(ctx, ("dp", "sp"))  # HSDP: replicate over dp, shard over sp
        model = _shard(_mlp(), mesh)
        first, second = _batch(ctx.rank, 0), _batch(ctx.rank, 1)
        with pdist.grad_sync(model, enabled=False, defer_reduce_scatter=defer_reduce_scatter):
            inside = _flags(model)
            _loss(model, first).backward()
            # Unsharded gradients wait in FSDP's own buffers; sharded ones were reduce-scattered.
            held = [
                p._unsharded_param.grad is not None
                for layer in model
                if isinstance(layer, nn.Linear)
                for g in param_groups(layer)
                for p in g.fsdp_params
            ]
            with pdist.grad_sync(model, enabled=True):  # nested: syncs in full again
                nested = _flags(model)
        after = _flags(model)
        assert nested == after == [(True, True)] * 3
        _loss(model, second).backward()
        got = [_full(p.grad) for p in model.parameters()]

        reference = _shard(_mlp(), mesh)
        (_loss(reference, first) + _loss(reference, second)).backward()
        diff = max(
            (g - _full(r.grad)).abs().max().item()
            for g, r in zip(got, reference.parameters(), strict=True)
        )
        del model, reference, mesh
        return inside, held, after, diff


@needs_fsdp2_on_cpu
@pytest.mark.parametrize("defer_reduce_scatter", [False, True])
def test_grad_sync_hsdp_defers_all_reduce_or_everything(defer_reduce_scatter):
    """HSDP 2x2 over (dp, sp): the chosen flags inside, restored after, same gradients."""
    for inside, held, after, diff in spawn(_accumulate, 4, defer_reduce_scatter, timeout=120):
        expected_inside = (not defer_reduce_scatter, False)
        assert inside == [expected_inside] * 3
        # Only the deferred reduce-scatter keeps unsharded gradients (the memory price).
        assert held == [defer_reduce_scatter] * 6
        assert after == [(True, True)] * 3
        assert diff <= 1e-6


@needs_fsdp2_on_cpu
@world_sizes(2)
def test_grad_sync_on_an_fsdp_submodule_warns(ctx):
    """A submodule holding no FSDP module inside a fully_shard model warns; the root does not."""
    mesh = pdist.device_mesh(ctx, ("dp",))
    model = _shard(_mlp(), mesh)
    with (
        pytest.warns(UserWarning, match=r"Tanh holds no FSDP module but sits inside"),
        pdist.grad_sync(model[1], enabled=False),
    ):
        pass
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for module in (model, model[0]):
            with pdist.grad_sync(module, enabled=False):
                pass
    del model, mesh


# One interpreter imports torch once, then forks a fresh 2-rank job per attempt. Each child
# runs the job at the top level of this script and leaves through the interpreter's normal
# finalization (sys.exit), which is where the abort happened; only the import is shared.
EXIT_AFTER_FSDP = """
import os, sys
import torch, pdist
import torch._dynamo, torch.distributed.tensor, torch.optim.adamw  # what fully_shard imports late
from torch import nn
from torch.distributed.fsdp import fully_shard

for attempt, port in enumerate(sys.argv[1:]):
    children = {}
    for rank in range(2):
        pid = os.fork()
        if pid == 0:
            break
        children[pid] = rank
    else:
        for _ in range(2):
            pid, status = os.waitpid(-1, 0)
            print(f"ATTEMPT {attempt} RANK {children[pid]} STATUS {status}", flush=True)
        continue
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1", MASTER_PORT=port, TORCHELASTIC_USE_AGENT_STORE="True",
    )
    with pdist.distributed() as ctx:
        mesh = pdist.device_mesh(ctx, ("dp",))
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 4))
        fully_shard(model[0], mesh=mesh)
        fully_shard(model[2], mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        model(torch.randn(3, 16)).sum().backward()
        optimizer.step()
        del model, optimizer, mesh  # dropped, never collected by hand
    sys.exit(0)  # a normal interpreter exit, with whatever the job left behind
"""


@needs_fsdp2_on_cpu
@pytest.mark.timeout(600)
def test_fsdp2_script_exits_cleanly_ten_times():
    """An FSDP2 step, then a plain exit: 10 fresh 2-rank jobs all exit 0 (no SIGABRT)."""
    stores = [
        TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False) for _ in range(10)
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run(
        [sys.executable, "-c", EXIT_AFTER_FSDP, *(str(s.port) for s in stores)],
        capture_output=True,
        text=True,
        timeout=540,
        env=env,
        check=False,
    )
    statuses = re.findall(r"ATTEMPT (\d+) RANK (\d) STATUS (\d+)", out.stdout)
    assert len(statuses) == 20, out.stdout + out.stderr
    failed = [(a, r, os.waitstatus_to_exitcode(int(st))) for a, r, st in statuses if st != "0"]
    assert failed == [], out.stdout + out.stderr[-4000:]
    assert out.returncode == 0, out.stderr[-4000:]
