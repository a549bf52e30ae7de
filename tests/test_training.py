"""grad_sync (DDP, FSDP2), DDP training_step and sync_model_states on real gloo processes."""

from __future__ import annotations

import copy
import gc
import pickle
import time
import warnings

import pytest
import torch
from fsdp_state import needs_fsdp2_on_cpu, param_groups
from torch import nn

import pdist
from pdist.testing import count_collectives, spawn, world_sizes


def _net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 1))


def _data(rank: int, step: int) -> torch.Tensor:
    return torch.randn(5, 4, generator=torch.Generator().manual_seed(100 * rank + step))


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


@world_sizes(2, 3)
def test_ddp_accumulation_defers_then_averages(ctx):
    """Inside grad_sync(False) grads stay local; the next synced step averages the accumulation."""
    model = _net()
    ddp = pdist.wrap_ddp(ctx, model)
    assert isinstance(ddp, pdist.DistributedDataParallel)
    with pdist.grad_sync(ddp, enabled=False):
        assert ddp.require_backward_grad_sync is False
        ddp(_data(ctx.rank, 0)).sum().backward()
    assert ddp.require_backward_grad_sync is True
    local = pdist.all_gather_object(ctx, _grads(model))
    assert not all(torch.equal(local[0][0], other[0]) for other in local[1:])
    ddp(_data(ctx.rank, 1)).sum().backward()
    reference = _net()
    for rank in range(ctx.world_size):
        for step in (0, 1):
            reference(_data(rank, step)).sum().backward()
    for got, ref in zip(_grads(model), _grads(reference), strict=True):
        torch.testing.assert_close(got, ref / ctx.world_size)
    with pytest.raises(RuntimeError, match="inside"), pdist.grad_sync(ddp, enabled=False):
        raise RuntimeError("inside")
    assert ddp.require_backward_grad_sync is True
    with pdist.grad_sync(ddp, enabled=False):
        with pdist.grad_sync(ddp, enabled=True):
            assert ddp.require_backward_grad_sync is True
        assert ddp.require_backward_grad_sync is False
    del ddp  # release the process group before the context exits


@world_sizes(2)
def test_ddp_static_graph_warns_once_and_keeps_syncing(ctx):
    """A static-graph DDP cannot skip sync: its flag is left alone, with one warning per model."""
    ddp = pdist.wrap_ddp(ctx, _net(), static_graph=True)
    with pytest.warns(UserWarning, match="static_graph=True"), pdist.grad_sync(ddp, enabled=False):
        assert ddp.require_backward_grad_sync is True
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pdist.grad_sync(ddp, enabled=False):
            pass
    del ddp


def test_plain_module_is_a_no_op():
    """A module without DDP or FSDP is left alone."""
    model = _net()
    with pdist.grad_sync(model, enabled=False):
        model(torch.ones(2, 4)).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_grad_sync_names_a_model_that_is_no_module():
    """Passing something that is not a module says what to pass, before the block runs."""
    optimizer = torch.optim.SGD(_net().parameters(), lr=0.1)
    with (
        pytest.raises(TypeError, match=r"model must be an nn.Module .*got a SGD"),
        pdist.grad_sync(optimizer, enabled=False),
    ):
        pass


class Stepper(nn.Module):
    """Its forward must not run: training_step goes through DDP's forward instead."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 2)

    def forward(self, x):  # noqa: D102
        raise AssertionError("forward should have been redirected to training_step")

    def training_step(self, x, *, fail: bool = False):  # noqa: D102
        if fail:
            raise ValueError("step failed")
        return self.lin(x).square().mean()


@world_sizes(2, 3)
def test_training_step_runs_ddp_hooks(ctx):
    """training_step syncs gradients like forward does, and leaves forward as it was."""
    net = Stepper()
    ddp = pdist.wrap_ddp(ctx, net)
    ddp.training_step(_data(ctx.rank, 0)).backward()
    grads = pdist.all_gather_object(ctx, _grads(net))
    for other in grads[1:]:
        for a, b in zip(grads[0], other, strict=True):
            torch.testing.assert_close(a, b)
    assert "forward" not in net.__dict__
    with pytest.raises(ValueError, match="step failed"):
        ddp.training_step(_data(ctx.rank, 1), fail=True)
    assert "forward" not in net.__dict__
    with pytest.raises(AssertionError, match="redirected"):
        ddp(_data(ctx.rank, 1))
    del ddp


class SelfCalling(nn.Module):
    """A training_step that calls self(x), as Lightning-style modules do."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 2)

    def forward(self, x):  # noqa: D102
        return self.lin(x)

    def training_step(self, x):  # noqa: D102
        return self(x).square().mean()


@world_sizes(2)
def test_training_step_calling_self_does_not_recurse(ctx):
    """A step calling self(x) reaches the real forward, DDP still averages, forward works after."""
    net = SelfCalling()
    ddp = pdist.wrap_ddp(ctx, net)
    ddp.training_step(_data(ctx.rank, 0)).backward()
    reference = SelfCalling()
    for rank in range(ctx.world_size):
        (reference.training_step(_data(rank, 0)) / ctx.world_size).backward()
    for got, ref in zip(_grads(net), _grads(reference), strict=True):
        torch.testing.assert_close(got, ref)
    assert "forward" not in net.__dict__
    x = _data(ctx.rank, 1)
    torch.testing.assert_close(ddp(x), reference(x))
    del ddp


@world_sizes(1)
def test_wrap_ddp_on_one_rank_returns_the_wrapper(ctx):
    """One rank gets the same wrapper type as many: .module and training_step work under python."""
    net = Stepper()
    ddp = pdist.wrap_ddp(ctx, net)
    assert isinstance(ddp, pdist.DistributedDataParallel)
    assert ddp.module is net
    ddp.training_step(_data(0, 0)).backward()
    assert all(p.grad is not None for p in net.parameters())
    with pdist.grad_sync(ddp, enabled=False):
        assert ddp.require_backward_grad_sync is False
    del ddp


@world_sizes(1)
def test_grad_sync_survives_a_ddp_whose_init_failed(ctx):
    """A half-built DDP (torch refused a frozen model) kept alive by its exception is skipped."""
    frozen = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(RuntimeError) as kept:  # the exception holds the half-built wrapper
        pdist.wrap_ddp(ctx, frozen)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pdist.grad_sync(nn.Linear(2, 2), enabled=False):
            pass
    del kept


def test_wrap_ddp_refuses_process_group_and_device_ids():
    """The group comes from the context (or group=); passing torch's arguments is a TypeError."""
    for name in ("process_group", "device_ids"):
        with pytest.raises(TypeError, match=f"wrap_ddp got {name}=None.*pass group="):
            pdist.wrap_ddp(None, _net(), **{name: None})


def _ddp_over_dp_sp(tp, sp):
    with pdist.distributed(tp=tp, sp=sp) as ctx:
        model = _net()
        ddp = pdist.wrap_ddp(ctx, model)
        ddp(_data(ctx.rank, 0)).sum().backward()
        out = ctx.dp_sp.ranks, ctx.dp.ranks, _grads(model)
        del ddp
        return out


@pytest.mark.parametrize(("world_size", "tp", "sp"), [(2, 1, 2), (4, 2, 1), (4, 1, 2)])
def test_wrap_ddp_averages_over_dp_and_sp(world_size, tp, sp):
    """Gradients are averaged over dp x sp (different inputs everywhere), never over tp peers."""
    results = spawn(_ddp_over_dp_sp, world_size, tp, sp, timeout=90)
    for rank, (dp_sp, dp, grads) in enumerate(results):
        expected_ranks = tuple(r for r in range(world_size) if r % tp == rank % tp)
        assert dp_sp == expected_ranks
        assert set(dp) <= set(dp_sp)
        reference = _net()
        for peer in dp_sp:
            (reference(_data(peer, 0)).sum() / len(dp_sp)).backward()
        for got, ref in zip(grads, _grads(reference), strict=True):
            torch.testing.assert_close(got, ref)
    if tp > 1:  # tp peers saw different inputs and are not averaged together
        assert not torch.equal(results[0][2][0], results[1][2][0])


@world_sizes(2)
def test_grad_sync_on_the_wrong_module_warns(ctx):
    """.module of a DDP (pdist's or torch's) and its submodules warn, naming the wrapper."""
    ddp = pdist.wrap_ddp(ctx, _net())
    match = r"Sequential holds no DDP or FSDP module but is wrapped by DistributedDataParallel"
    with pytest.warns(UserWarning, match=match), pdist.grad_sync(ddp.module, enabled=False):
        pass
    with (
        pytest.warns(UserWarning, match="Linear holds no DDP"),
        pdist.grad_sync(ddp.module[0], enabled=False),
    ):
        pass
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pdist.grad_sync(ddp, enabled=False), pdist.grad_sync(ddp.module, enabled=True):
            pass
        with pdist.grad_sync(_net(), enabled=False):  # a plain module is fine
            pass
        # Copies are inside no DDP: the link pickles and copies as nothing.
        for copied in (copy.deepcopy(ddp.module), pickle.loads(pickle.dumps(ddp.module))):
            with pdist.grad_sync(copied, enabled=False):
                pass

    torch_ddp = nn.parallel.DistributedDataParallel(_net(), process_group=ctx.dp_sp.device_group)
    wrong = torch_ddp.module
    with pytest.warns(UserWarning, match="not its .module"), pdist.grad_sync(wrong, enabled=False):
        pass

    inner = ddp.module
    del ddp, torch_ddp
    gc.collect()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pdist.grad_sync(inner, enabled=False):  # the DDP is gone: the module is plain now
            pass


def _fsdp_model(mesh):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model[2], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _flags(model) -> list[bool]:
    return [g.all_reduce_grads for m in (model[0], model[2]) for g in param_groups(m)]


@pytest.mark.skipif(
    hasattr(torch.cpu.Stream, "record_event"), reason="this torch runs FSDP2 on CPU"
)
@world_sizes(2)
def test_grad_sync_refuses_fsdp2_on_cpu_where_torch_cannot_run_it(ctx):
    """torch 2.6: grad_sync on a CPU fully_shard model raises naming the feature and torch 2.7."""
    model = _fsdp_model(pdist.device_mesh(ctx, ("dp",)))
    with pytest.raises(pdist.PdistError, match=r"FSDP2 .* on CPU .* needs torch >= 2\.7"):  # noqa: SIM117
        with pdist.grad_sync(model, enabled=False):
            pass
    del model


def _full_grads(model) -> list[torch.Tensor]:
    return [p.grad.full_tensor().clone() for p in model.parameters()]


@needs_fsdp2_on_cpu
@world_sizes(4)
def test_fsdp2_hsdp_defers_only_the_all_reduce(ctx):
    """HSDP 2x2: flags off inside, restored exactly after; gradients match no accumulation."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = _fsdp_model(mesh)
    xa, xb = torch.randn(3, 8) + ctx.rank, torch.randn(3, 8) - ctx.rank
    model[2].set_requires_all_reduce(False, recurse=False)  # already off: must stay off
    assert _flags(model) == [True, False]
    with pdist.grad_sync(model, enabled=False):
        assert _flags(model) == [False, False]
        model(xa).sum().backward()
    assert _flags(model) == [True, False]
    with pytest.raises(KeyError), pdist.grad_sync(model, enabled=False):
        raise KeyError("boom")
    assert _flags(model) == [True, False]

    model[2].set_requires_all_reduce(True, recurse=False)
    model(xb).sum().backward()
    accumulated = _full_grads(model)

    reference = _fsdp_model(mesh)
    (reference(xa).sum() + reference(xb).sum()).backward()
    for got, ref in zip(accumulated, _full_grads(reference), strict=True):
        torch.testing.assert_close(got, ref)
    del model, reference, mesh


class Tied(nn.Module):
    """Shared weights, a buffer-holding BatchNorm and a head to ignore."""

    def __init__(self, seed: int, dtype=torch.float32, width: int = 4) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.a = nn.Linear(width, width).to(dtype)
        self.b = nn.Linear(width, width).to(dtype)
        self.b.weight = self.a.weight
        self.norm = nn.BatchNorm1d(width)
        self.norm.running_mean.fill_(float(seed))
        self.head = nn.Linear(width, 2)


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


@world_sizes(2, 3)
def test_sync_model_states(ctx):
    """Parameters and buffers equal src's afterwards, except the ignored ones."""
    src = ctx.world_size - 1
    model = Tied(seed=ctx.rank)
    before = _state(model)
    pdist.sync_model_states(ctx, model, src=src, ignore=("head",))
    states = pdist.all_gather_object(ctx, _state(model))
    expected = _state(Tied(seed=src))
    for name, value in states[ctx.rank].items():
        if name.startswith("head."):
            assert torch.equal(value, before[name]), name
        else:
            assert torch.equal(value, expected[name]), name
    assert model.b.weight is model.a.weight

    model = Tied(seed=ctx.rank)
    pdist.sync_model_states(ctx, model, src=0, broadcast_buffers=False)
    assert model.norm.running_mean[0].item() == float(ctx.rank)
    assert torch.equal(model.a.bias, Tied(seed=0).a.bias)


@world_sizes(2, 3)
def test_sync_model_states_mismatch_raises_everywhere_quickly(ctx):
    """dtype, shape and name mismatches raise RankMismatchError on every rank within seconds."""
    odd = ctx.rank == ctx.world_size - 1
    cases = [
        (Tied(0, dtype=torch.float16 if odd else torch.float32), r"a\.weight float16 \[4, 4\]"),
        (Tied(0, width=5 if odd else 4), r"a\.weight float32 \[5, 5\]"),
    ]
    renamed = Tied(0)
    if odd:
        renamed.extra = nn.Parameter(torch.zeros(1))
    cases.append((renamed, r"names only there: \['extra'\], names missing there: \[\]"))
    for model, match in cases:
        start = time.monotonic()
        with pytest.raises(pdist.RankMismatchError, match=match) as info:
            pdist.sync_model_states(ctx, model)
        assert f"ranks [{ctx.world_size - 1}] differ from those of src rank 0" in str(info.value)
        assert time.monotonic() - start < 5
    pdist.barrier(ctx)


def _big_params(ctx, n: int, *, strided_on: int = -1) -> nn.ParameterList:
    """``n`` parameters of 9 MiB (a bucket each), transposed views on rank ``strided_on``."""
    made = [torch.full((1536, 1536), i + ctx.rank * 0.5) for i in range(n)]
    return nn.ParameterList(nn.Parameter(t.t() if ctx.rank == strided_on else t) for t in made)


@world_sizes(2, 3)
def test_sync_model_states_when_only_one_rank_stages_its_buckets(ctx):
    """Parameters that only one rank cannot receive in place: that rank alone stages them."""
    model = _big_params(ctx, 3, strided_on=ctx.world_size - 1)
    pdist.sync_model_states(ctx, model)
    assert all(torch.equal(p, torch.full((1536, 1536), float(i))) for i, p in enumerate(model))


@world_sizes(2)
def test_sync_model_states_statuses_do_not_grow_with_the_buckets(ctx):
    """Buckets that travel in place (one tensor each) cost no more statuses, however many."""
    counts = []
    for n in (1, 3):
        model = _big_params(ctx, n)
        with count_collectives() as calls:
            pdist.sync_model_states(ctx, model)
        counts.append(calls)
    assert counts[1]["gloo:allreduce"] == counts[0]["gloo:allreduce"]
    assert counts[1]["gloo:broadcast"] == counts[0]["gloo:broadcast"] + 2


@world_sizes(2)
def test_sync_model_states_collectives_do_not_grow(ctx):
    """Tensors travel in buckets: 10 or 200 parameters cost the same collectives."""
    counts = []
    for n in (10, 200):
        model = nn.ModuleList(nn.Linear(4, 4) for _ in range(n))
        with count_collectives() as calls:
            pdist.sync_model_states(ctx, model)
        counts.append(sum(calls.values()))
    assert counts[0] == counts[1]
