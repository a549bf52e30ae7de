"""sync_model_states: one bad rank fails every rank fast; tensors off the group's device.

Each failing case runs on real gloo ranks inside ``distributed(timeout=30)``;
rank 1 gets a bad argument while the others are correct, and every rank must
raise the same error type, naming rank 1, within 10 s.
"""

from __future__ import annotations

import re

import pytest
import torch
from fail_together import Case, assert_failed_together, fails, out_of_memory, run_case
from torch import nn

import pdist
from pdist.testing import inject, spawn


def _net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))


def _bad_model(ctx):
    pdist.sync_model_states(ctx, None if ctx.rank == 1 else _net(ctx.rank))


def _meta_model(ctx):
    model = _net(ctx.rank)
    if ctx.rank == 1:
        model = model.to("meta")
    pdist.sync_model_states(ctx, model)


def _bad_ignore(ctx):
    pdist.sync_model_states(ctx, _net(ctx.rank), ignore=5 if ctx.rank == 1 else ())


def _ignore_of_ints(ctx):
    pdist.sync_model_states(ctx, _net(ctx.rank), ignore=[0] if ctx.rank == 1 else ())


def _src_out_of_range(ctx):
    pdist.sync_model_states(ctx, _net(ctx.rank), src=7 if ctx.rank == 1 else 0)


def _other_src(ctx):
    pdist.sync_model_states(ctx, _net(ctx.rank), src=1 if ctx.rank == 1 else 0)


def _bad_buffers_flag(ctx):
    pdist.sync_model_states(ctx, _net(ctx.rank), broadcast_buffers="yes" if ctx.rank == 1 else True)


def _staging_fails(ctx):
    model = _net(ctx.rank)
    if ctx.rank == 1:
        with inject(allocate=out_of_memory(1)):  # the staging of the tensors fails
            pdist.sync_model_states(ctx, model)
    else:
        pdist.sync_model_states(ctx, model)


def _wide(seed: int) -> nn.Module:
    """40 parameters of 1 MiB: buckets of 16, 16 and 8 MiB."""
    return nn.ParameterList(nn.Parameter(torch.full((1 << 18,), i + seed / 2)) for i in range(40))


def _late_pack_fails(ctx):
    """The source fails to pack the third bucket, after the first two packed."""
    model = _wide(ctx.rank)
    if ctx.rank == 0:
        with inject(pack=fails("simulated late packing failure", from_index=2)):
            pdist.sync_model_states(ctx, model)
    else:
        pdist.sync_model_states(ctx, model)


class _Unreadable(nn.Module):
    """A module whose states cannot be listed (such as one whose wrapper broke)."""

    def named_parameters(self, *args, **kwargs):
        raise RuntimeError("simulated unreadable module")


def _module_raises(ctx):
    pdist.sync_model_states(ctx, _Unreadable() if ctx.rank == 1 else _net(ctx.rank))


def _dtensor_model(ctx):
    from torch.distributed.tensor import DTensor, Replicate

    model = _net(ctx.rank)
    mesh = pdist.device_mesh(ctx, ("dp",))
    if ctx.rank == 1:  # as fully_shard or tensor parallelism leave a model
        weight = DTensor.from_local(model[0].weight.detach(), mesh, [Replicate()], run_check=False)
        model[0].weight = nn.Parameter(weight)
    pdist.sync_model_states(ctx, model)


CASES = {
    # name: the call (rank 1 goes wrong), the error type on every rank, the text
    "module_raises": Case(
        _module_raises, 3, 1, RuntimeError, re.escape("simulated unreadable module")
    ),
    "model_none": Case(
        _bad_model, 3, 1, TypeError, re.escape("model=None on rank 1 is not an nn.Module")
    ),
    "meta_model": Case(
        _meta_model,
        3,
        1,
        ValueError,
        re.escape("model on rank 1 has parameters or buffers on the meta"),
    ),
    "ignore_int": Case(_bad_ignore, 3, 1, TypeError, re.escape("ignore=5 on rank 1 is not a name")),
    "ignore_of_ints": Case(_ignore_of_ints, 3, 1, TypeError, re.escape("holds 0, not a name")),
    "src_out_of_range": Case(
        _src_out_of_range, 3, 1, ValueError, re.escape("src=7 is outside group 'world'")
    ),
    "other_src": Case(
        _other_src, 3, 1, pdist.RankMismatchError, re.escape("rank 1: src=1"), names_the_rank=False
    ),
    "buffers_flag": Case(
        _bad_buffers_flag, 3, 1, TypeError, re.escape("broadcast_buffers='yes' on rank 1")
    ),
    "staging_fails": Case(_staging_fails, 3, 1, RuntimeError, re.escape("simulated out of memory")),
    "late_pack_fails": Case(  # the source (rank 0) is the bad rank
        _late_pack_fails, 3, 0, RuntimeError, re.escape("simulated late packing failure")
    ),
    "dtensor": Case(
        _dtensor_model,
        3,
        1,
        ValueError,
        re.escape("rank 1 holds DTensor parameters or buffers (['0.weight'"),
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_one_bad_rank_makes_every_rank_raise_quickly(name):
    """Every rank raises the expected error, naming rank 1 and the fix, within 10 s."""
    case = CASES[name]
    assert_failed_together(case, spawn(run_case, case.world, case, timeout=120))


_LAZY_READY: list[bool] = []  # per worker process: the lazy backend initializes once


def _lazy_sync(mixed: bool, wide: bool = False):
    import torch._lazy
    import torch._lazy.ts_backend

    if not _LAZY_READY:
        torch._lazy.ts_backend.init()
        _LAZY_READY.append(True)
    with pdist.distributed(timeout=30) as ctx:
        model = _wide(ctx.rank) if wide else _net(ctx.rank)
        if not (mixed and ctx.rank == 0):
            model = model.to("lazy")
        first = next(model.parameters())
        try:
            pdist.sync_model_states(ctx, model)
        except pdist.RankMismatchError as exc:
            return str(exc)
        assert next(model.parameters()) is first  # written back, not replaced
        return {k: v.cpu() for k, v in model.state_dict().items()}


def test_tensors_off_the_group_device_are_written_back():
    """A model on another device than a CPU group's (torch's lazy device) is updated in place."""
    states = spawn(_lazy_sync, 2, False, timeout=120)
    expected = _net(0).state_dict()
    for rank, state in enumerate(states):
        for key, value in expected.items():
            assert torch.equal(state[key], value), (rank, key)


def test_tensors_off_the_group_device_pass_through_staging():
    """Off the transport's device every tensor is staged, over several buckets."""
    states = spawn(_lazy_sync, 2, False, True, timeout=120)
    for rank, state in enumerate(states):
        for key, value in _wide(0).state_dict().items():
            assert torch.equal(state[key], value), (rank, key)


def test_a_device_type_difference_is_a_mismatch():
    """The fingerprint carries the device type: cpu on one rank, lazy on another, refused."""
    messages = spawn(_lazy_sync, 2, True, timeout=120)
    for message in messages:
        assert "differ from those of src rank 0" in message
        assert "on cpu vs" in message
        assert "on lazy" in message
