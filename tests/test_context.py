"""distributed(), Group, DistContext and the group variants, on real gloo processes."""

from __future__ import annotations

import os
import re
from datetime import timedelta

import attrs
import pytest
import torch
import torch.distributed as dist

import pdist
from pdist._compat import before_destroying_groups
from pdist._layout import make_layout
from pdist.testing import spawn, world_sizes

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _group_sum(group: pdist.Group) -> int:
    """Sum of global ranks over the group's own torch process groups."""
    t = torch.tensor([group.rank])
    dist.all_reduce(t, group=group.device_group)
    c = torch.tensor([group.rank])
    dist.all_reduce(c, group=group.cpu_group)
    assert t.item() == c.item()
    return int(t.item())


@world_sizes(1, 2, 3, 4)
def test_default_groups(ctx):
    """tp and sp are singletons, dp and node hold the whole (one-host) world."""
    w = ctx.world_size
    assert ctx.world.ranks == tuple(range(w))
    assert ctx.world.rank_in_group == ctx.rank
    assert ctx.tp.ranks == (ctx.rank,)
    assert ctx.sp.ranks == (ctx.rank,)
    assert ctx.dp.ranks == tuple(range(w))
    assert ctx.node.ranks == tuple(range(w))
    assert ctx.device == torch.device("cpu")
    assert ctx.backend == "gloo"
    for g in (ctx.world, ctx.node, ctx.tp, ctx.sp, ctx.dp):
        assert _group_sum(g) == sum(g.ranks)


@world_sizes(3)
def test_group_neighbours(ctx):
    """first/last/next/prev are global ranks and wrap around inside the group."""
    g = ctx.world
    assert (g.first_rank, g.last_rank) == (0, 2)
    assert g.next_rank == (ctx.rank + 1) % 3
    assert g.prev_rank == (ctx.rank - 1) % 3
    assert g.is_first_rank == (ctx.rank == 0)
    assert g.is_last_rank == (ctx.rank == 2)
    assert g.world_size == 3


def _axes(tp: int, sp: int) -> dict[str, tuple[int, ...]]:
    with pdist.distributed(tp=tp, sp=sp) as ctx:
        out = {name: getattr(ctx, name).ranks for name in ("tp", "sp", "dp")}
        out["sums"] = tuple(_group_sum(getattr(ctx, name)) for name in ("tp", "sp", "dp"))
        pdist.barrier(ctx)
        return out


@pytest.mark.parametrize(
    ("world_size", "tp", "sp"), [(4, 2, 2), (4, 1, 2), (4, 2, 1), (3, 3, 1), (3, 1, 3), (4, 4, 1)]
)
def test_axis_groups_follow_layout(world_size, tp, sp):
    """Each rank's tp/sp/dp groups are the layout's, and their process groups span exactly them."""
    layout = make_layout(world_size, tp=tp, sp=sp)
    results = spawn(_axes, world_size, tp, sp, timeout=60)
    for rank, out in enumerate(results):
        for i, axis in enumerate(("tp", "sp", "dp")):
            assert out[axis] == layout.group_of(axis, rank)
            assert out["sums"][i] == sum(layout.group_of(axis, rank))


def _after_exit() -> tuple[bool, str, str]:
    with pdist.distributed() as ctx:
        pass
    with pytest.raises(pdist.PdistError, match="context is closed") as info:
        _ = ctx.tp.device_group
    with pytest.raises(pdist.PdistError, match="context is closed"):
        pdist.barrier(ctx)
    return dist.is_initialized(), str(info.value), repr(ctx.world)


def test_closed_context_raises_and_keeps_no_group():
    """After exit the groups are destroyed and using them raises PdistError."""
    for initialized, message, _ in spawn(_after_exit, 2, timeout=60):
        assert initialized is False
        assert "distributed()" in message


def _closed_one_rank() -> list[str]:
    with pdist.distributed() as ctx:
        pass
    calls = {
        "all_reduce": lambda: pdist.all_reduce(ctx, torch.ones(2)),
        "all_gather": lambda: pdist.all_gather(ctx.tp, torch.ones(2)),
        "broadcast_object": lambda: pdist.broadcast_object(ctx, 1),
        "all_gather_object": lambda: pdist.all_gather_object(ctx.world, 1),
        "barrier": lambda: pdist.barrier(ctx),
    }
    seen = []
    for name, call in calls.items():
        with pytest.raises(pdist.PdistError, match="context is closed"):
            call()
        seen.append(name)
    return seen


def test_a_closed_one_rank_group_raises_too():
    """A one-rank group reaches no process group, yet after exit it raises like any other."""
    assert spawn(_closed_one_rank, 1, timeout=60) == [
        ["all_reduce", "all_gather", "broadcast_object", "all_gather_object", "barrier"]
    ]


def _raise_inside() -> bool:
    with pytest.raises(KeyError, match="boom"), pdist.distributed():
        raise KeyError("boom")
    return dist.is_initialized()


def test_exit_on_exception_destroys_what_it_created():
    """An exception inside the block propagates and the default group is destroyed."""
    assert spawn(_raise_inside, 2, timeout=60) == [False, False]


def _reenter() -> str:
    manager = pdist.distributed()
    with manager:
        pass
    with pytest.raises(pdist.PdistError, match="single-use") as info, manager:
        pass
    return str(info.value)


def test_distributed_is_single_use():
    """A second `with` on the same distributed() raises on every rank."""
    assert len(set(spawn(_reenter, 2, timeout=60))) == 1


def _bad(kwargs: dict) -> tuple[str, str, bool]:
    with pytest.raises((ValueError, TypeError)) as info:
        pdist.distributed(**kwargs)
    return type(info.value).__name__, str(info.value), dist.is_initialized()


BAD = [
    ({"tp": 3}, r"tp=3 does not divide world_size=4; choose one of \[1, 2, 4\]"),
    ({"sp": 0}, r"sp=0 must be a positive integer"),
    ({"tp": -1}, r"tp=-1 must be a positive integer"),
    ({"tp": 2, "sp": 3}, r"sp=3 does not divide"),
    ({"backend": "nccl", "device": "cpu"}, r"backend='nccl' needs a CUDA device"),
    ({"backend": "carrier-pigeon"}, r"backend='carrier-pigeon' is not one of"),
    ({"timeout": -1}, r"timeout=-1 must be a finite positive duration"),
    ({"device": "not-a-device"}, r"device='not-a-device' is not a torch device"),
]
if not torch.cuda.is_available():
    BAD.append(({"device": "cuda:0"}, r"device='cuda:0' needs CUDA"))
else:
    BAD.append(({"device": "cuda:99"}, r"beyond the \d+ visible CUDA device"))


@pytest.mark.parametrize(("kwargs", "match"), BAD)
def test_bad_arguments_fail_on_every_rank_before_any_collective(kwargs, match):
    """Bad arguments raise the same error on every rank, with no group initialized."""
    results = spawn(_bad, 4, kwargs, timeout=60)
    assert len(set(results)) == 1
    _, message, initialized = results[0]
    assert not initialized
    assert re.search(match, message), message


def _adopt() -> tuple[int, bool, bool]:
    dist.init_process_group("gloo")
    with pdist.distributed() as ctx:
        total = _group_sum(ctx.world)
        assert ctx.world.device_group is dist.group.WORLD
    still = dist.is_initialized()
    t = torch.ones(1)
    dist.all_reduce(t)  # the adopted default group still works
    before_destroying_groups()  # (torch 2.6's destructor can deadlock right after a collective)
    dist.destroy_process_group()
    return total, still, t.item() == int(os.environ["WORLD_SIZE"])


def test_adopts_an_initialized_default_group_and_leaves_it():
    """A default group initialized before distributed() survives its exit."""
    for total, still, ok in spawn(_adopt, 3, timeout=60):
        assert total == 0 + 1 + 2
        assert still
        assert ok


def _no_launcher() -> tuple[int, int, bool, bool]:
    for name in LAUNCH_VARS:
        os.environ.pop(name, None)
    with pdist.distributed() as ctx:
        assert dist.is_initialized()
        out = (ctx.rank, ctx.world_size, ctx.tp.world_size == 1)
    return (*out, dist.is_initialized())


def test_plain_python_gets_a_one_rank_world():
    """Without launcher variables, distributed() builds a working one-rank world."""
    assert spawn(_no_launcher, 1, timeout=60) == [(0, 1, True, False)]


def test_world_size_without_rendezvous_is_refused(monkeypatch):
    """world_size > 1 with no launcher and no store says how to rendezvous."""
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match="pass store= or run under torchrun"):
        pdist.distributed(world_size=2, rank=0)


def _explicit_store(port: int) -> int:
    for name in LAUNCH_VARS:
        os.environ.pop(name, None)
    rank = int(os.environ["PDIST_TEST_RANK"])
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False)
    with pdist.distributed(store=store, rank=rank, world_size=2) as ctx:
        return _group_sum(ctx.world)


def _set_rank_var_and_run(port: int) -> int:
    os.environ["PDIST_TEST_RANK"] = os.environ["RANK"]
    return _explicit_store(port)


def test_explicit_store_rank_and_world_size():
    """store=, rank= and world_size= replace the launcher's rendezvous."""
    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    assert spawn(_set_rank_var_and_run, 2, store.port, timeout=60) == [1, 1]


def _timeouts() -> tuple[float, ...]:
    os.environ["PDIST_SUBGROUP_TIMEOUT_SEC"] = "7"
    with pdist.distributed(timeout=timedelta(seconds=42)) as ctx:
        groups = (ctx.world, ctx.tp, ctx.dp, pdist.new_tp_group(ctx, 2), pdist.new_sp_group(ctx, 1))
        return tuple(g.timeout.total_seconds() for g in groups)


def test_timeouts_reach_world_and_subgroups():
    """timeout= sets the world's timeout; PDIST_SUBGROUP_TIMEOUT_SEC the subgroups'.

    An axis spanning the world (dp with tp = sp = 1) is the world's communicator and
    says so: its timeout is the world's. A group the user names has its own.
    """
    assert spawn(_timeouts, 2, timeout=60) == [(42.0, 7.0, 42.0, 7.0, 7.0)] * 2


@world_sizes(4)
def test_patch_tp_yields_a_new_context(ctx):
    """patch_tp nests, leaves the original alone and changes nothing on error."""
    tp2 = pdist.new_tp_group(ctx, 2)
    assert tp2.ranks == ((0, 1) if ctx.rank < 2 else (2, 3))
    assert _group_sum(tp2) == sum(tp2.ranks)
    tp4 = pdist.new_tp_group(ctx, 4, name="big")
    assert tp4.name == "big"
    with pdist.patch_tp(ctx, tp2) as inner:
        assert inner.tp is tp2
        assert ctx.tp.ranks == (ctx.rank,)
        with pdist.patch_tp(inner, tp4) as innermost:
            assert innermost.tp is tp4
            assert inner.tp is tp2
        assert attrs.evolve(inner, tp=ctx.tp) == ctx
    with pytest.raises(RuntimeError, match="inside"), pdist.patch_tp(ctx, tp2):
        raise RuntimeError("inside")
    assert ctx.tp.ranks == (ctx.rank,)
    sp2 = pdist.new_sp_group(ctx, 2)
    assert sp2.ranks == tp2.ranks
    assert sp2.name == "sp2"
    with pytest.raises(ValueError, match="size=3 does not divide world_size=4"):
        pdist.new_tp_group(ctx, 3)
    other = pdist.new_tp_group(ctx, 1)
    with pytest.raises(ValueError, match="does not contain rank"):
        pdist.patch_tp(attrs.evolve(ctx, rank=(ctx.rank + 1) % 4), other).__enter__()


@world_sizes(4)
def test_patch_sp_yields_a_new_context(ctx):
    """patch_sp replaces sp only, nests with patch_tp, and leaves the original alone."""
    sp2, tp2 = pdist.new_sp_group(ctx, 2), pdist.new_tp_group(ctx, 2)
    with pdist.patch_sp(ctx, sp2) as inner, pdist.patch_tp(inner, tp2) as both:
        assert inner.sp is sp2
        assert inner.tp is ctx.tp
        assert (both.sp, both.tp) == (sp2, tp2)
        assert pdist.all_reduce(inner.sp, torch.ones(1)).item() == 2
    assert ctx.sp.ranks == (ctx.rank,)
    with pytest.raises(TypeError, match="must be a pdist Group"):
        pdist.patch_sp(ctx, "sp").__enter__()


def _mesh(tp: int, sp: int) -> tuple:
    with pdist.distributed(tp=tp, sp=sp) as ctx:
        mesh = pdist.device_mesh(ctx)
        out = (
            mesh.mesh_dim_names,
            tuple(mesh.mesh.shape),
            tuple(dist.get_process_group_ranks(mesh.get_group("tp"))),
            tuple(dist.get_process_group_ranks(mesh.get_group("dp"))),
            ctx.tp.ranks,
            ctx.dp.ranks,
        )
        del mesh
        return out


def test_device_mesh_matches_the_context():
    """device_mesh has dims (dp, sp, tp) over the context's own groups."""
    for names, shape, tp, dp, ctx_tp, ctx_dp in spawn(_mesh, 4, 2, 1, timeout=60):
        assert names == ("dp", "sp", "tp")
        assert shape == (2, 1, 2)
        assert tp == ctx_tp
        assert dp == ctx_dp


def _l2_on_cpu(caplog_level: int) -> list[str]:
    import logging

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logger = logging.getLogger("pdist")
    handler = Keep(level=caplog_level)
    logger.addHandler(handler)
    try:
        with pdist.distributed(l2_fetch_granularity=128) as ctx:
            pdist.barrier(ctx)
    finally:
        logger.removeHandler(handler)
    return records


def test_l2_fetch_granularity_on_cpu_warns_and_goes_on():
    """On CPU ranks the setting does nothing but say why, once per rank."""
    import logging

    for records in spawn(_l2_on_cpu, 2, logging.WARNING, timeout=60):
        assert any(
            "L2 fetch granularity of cpu to 128 bytes: it applies to CUDA" in r for r in records
        )
