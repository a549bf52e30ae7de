"""Object collectives and tensor dicts on real gloo processes."""

from __future__ import annotations

import collections
import os
import tempfile

import pytest
import torch

import pdist
from pdist.testing import world_sizes

Point = collections.namedtuple("Point", "x y")


class Config:
    """A user class, allowed explicitly through safe=[Config]."""

    def __init__(self, lr: float) -> None:
        self.lr = lr


class Evil:
    """Unpickling it would run a shell command."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


class Unpicklable:
    """Refuses to be pickled."""

    def __reduce__(self):
        raise TypeError("cannot pickle Unpicklable")


def _payload(rank: int):
    t = torch.arange(6.0).reshape(2, 3)
    return {
        "rank": rank,
        "t": t,
        "again": t,
        "point": Point(1, torch.tensor([rank])),
        "nested": [("a", torch.ones(2, dtype=torch.bfloat16)), {"b": torch.tensor(True)}],
        "big": torch.full((5000,), float(rank)),
        "empty": torch.empty(0, 4),
        "scalar": torch.tensor(3.5),
        "param": torch.nn.Parameter(torch.ones(2)),
        "text": "x" * 10,
    }


def _check(obj, rank: int) -> None:
    assert obj["rank"] == rank
    assert torch.equal(obj["t"], torch.arange(6.0).reshape(2, 3))
    assert obj["again"] is obj["t"]
    assert obj["point"].x == 1
    assert isinstance(obj["point"], Point)
    assert obj["nested"][0][1].dtype == torch.bfloat16
    assert obj["nested"][1]["b"].item() is True
    assert torch.equal(obj["big"], torch.full((5000,), float(rank)))
    assert obj["empty"].shape == (0, 4)
    assert obj["scalar"].shape == ()
    assert isinstance(obj["param"], torch.nn.Parameter)
    assert obj["param"].requires_grad
    assert obj["t"].device == torch.device("cpu")


@world_sizes(2, 3)
def test_broadcast_object_round_trips(ctx):
    """broadcast_object delivers the source's object (from any src) to every rank."""
    for src in range(ctx.world_size):
        obj = _payload(src) if ctx.rank == src else None
        out = pdist.broadcast_object(ctx, obj, src=src)
        _check(out, src)
        if ctx.rank == src:
            assert out is obj


@world_sizes(2, 3)
def test_all_gather_and_gather_object(ctx):
    """all_gather_object and gather_object return every rank's object in group order."""
    gathered = pdist.all_gather_object(ctx, _payload(ctx.rank))
    for rank, obj in enumerate(gathered):
        _check(obj, rank)
    last = ctx.world_size - 1
    got = pdist.gather_object(ctx, {"r": ctx.rank, "t": torch.tensor([ctx.rank])}, dst=last)
    if ctx.rank == last:
        assert [o["r"] for o in got] == list(range(ctx.world_size))
        assert [o["t"].item() for o in got] == list(range(ctx.world_size))
    else:
        assert got is None


@world_sizes(3)
def test_send_recv_object(ctx):
    """send_object/recv_object move an object between two ranks of the group."""
    if ctx.rank == 0:
        pdist.send_object(ctx, _payload(0), dst=2)
    elif ctx.rank == 2:
        _check(pdist.recv_object(ctx, src=0), 0)


@world_sizes(2)
def test_safe_refuses_code_execution(ctx):
    """safe=True refuses a class outside the allow-list without running it."""
    marker = os.path.join(tempfile.gettempdir(), f"pdist-evil-{os.environ['MASTER_PORT']}")
    evil = Evil(marker) if ctx.rank == 0 else None
    if ctx.rank == 0:
        pdist.broadcast_object(ctx, evil)
    else:
        with pytest.raises(pdist.PdistError, match=r"system"):
            pdist.broadcast_object(ctx, None, safe=True)
    pdist.barrier(ctx)
    assert not os.path.exists(marker)
    # The allow-list admits tensors, containers, dtypes and devices ...
    obj = {"t": torch.ones(2), "d": torch.float16, "dev": torch.device("cpu"), "l": [1, (2, 3.0)]}
    out = pdist.broadcast_object(ctx, obj if ctx.rank == 0 else None, safe=True)
    assert out["d"] is torch.float16
    assert torch.equal(out["t"], torch.ones(2))
    # ... and the classes the caller adds.
    cfg = pdist.broadcast_object(ctx, Config(0.1) if ctx.rank == 0 else None, safe=[Config])
    assert cfg.lr == 0.1
    if ctx.rank == 1:
        pdist.send_object(ctx, Evil(marker), dst=0)
    else:
        with pytest.raises(pdist.PdistError, match="system"):
            pdist.recv_object(ctx, src=1, safe=True)
    pdist.barrier(ctx)
    assert not os.path.exists(marker)


@world_sizes(2)
def test_all_gather_object_safe_refusal(ctx):
    """A safe receiver refuses another rank's evil object in all_gather_object too."""
    marker = os.path.join(tempfile.gettempdir(), f"pdist-evil2-{os.environ['MASTER_PORT']}")
    mine = Evil(marker) if ctx.rank == 1 else 0
    if ctx.rank == 0:
        with pytest.raises(pdist.PdistError, match="system"):
            pdist.all_gather_object(ctx, mine, safe=True)
    else:
        pdist.all_gather_object(ctx, mine)
    pdist.barrier(ctx)
    assert not os.path.exists(marker)


@world_sizes(2, 3)
def test_unpicklable_object_raises_on_every_rank(ctx):
    """If one rank cannot pickle its object, every rank raises the same error."""
    bad = ctx.world_size - 1
    messages = []
    for call in (
        lambda: pdist.broadcast_object(ctx, Unpicklable() if ctx.rank == bad else None, src=bad),
        lambda: pdist.all_gather_object(ctx, Unpicklable() if ctx.rank == bad else 1),
        lambda: pdist.gather_object(ctx, Unpicklable() if ctx.rank == bad else 1, dst=0),
    ):
        with pytest.raises(
            pdist.PdistError, match=rf"failed on rank {bad}: TypeError: cannot pickle"
        ) as info:
            call()
        messages.append(str(info.value))
    same = pdist.all_gather_object(ctx, messages)
    assert all(m == messages for m in same)


@world_sizes(2)
def test_send_object_failure_reaches_the_receiver(ctx):
    """An unpicklable object makes both sender and receiver raise."""
    if ctx.rank == 0:
        with pytest.raises(pdist.PdistError, match="cannot pickle Unpicklable"):
            pdist.send_object(ctx, Unpicklable(), dst=1)
    else:
        with pytest.raises(pdist.PdistError, match="cannot pickle Unpicklable"):
            pdist.recv_object(ctx, src=0)


def _tensor_dict(rank: int):
    return {
        "hidden": torch.arange(4096.0).reshape(64, 64) + rank,
        "small": torch.tensor([rank]),
        "mask": torch.ones(3, 3, dtype=torch.bool),
        "empty": torch.empty(0),
        "meta": {"step": 7, "inner": {"bf": torch.ones(10, dtype=torch.bfloat16)}},
    }


def _check_dict(d, rank: int) -> None:
    expected = _tensor_dict(rank)
    assert torch.equal(d["hidden"], expected["hidden"])
    assert torch.equal(d["small"], expected["small"])
    assert d["mask"].dtype == torch.bool
    assert d["empty"].numel() == 0
    assert d["meta"]["step"] == 7
    assert torch.equal(d["meta"]["inner"]["bf"], expected["meta"]["inner"]["bf"])


@world_sizes(2, 3)
def test_broadcast_tensor_dict(ctx):
    """Nested tensor dicts arrive intact from any src."""
    src = ctx.world_size - 1
    out = pdist.broadcast_tensor_dict(ctx, _tensor_dict(src) if ctx.rank == src else None, src=src)
    _check_dict(out, src)
    with pytest.raises(pdist.PdistError, match="tensor_dict must be a dict, got list"):
        pdist.broadcast_tensor_dict(ctx, [1] if ctx.rank == 0 else None)


@world_sizes(3)
def test_send_recv_tensor_dict(ctx):
    """send_tensor_dict/recv_tensor_dict default to pipeline order."""
    if ctx.rank == 0:
        pdist.send_tensor_dict(ctx, _tensor_dict(0))
    elif ctx.rank == 1:
        d = pdist.recv_tensor_dict(ctx)
        _check_dict(d, 0)
        pdist.send_tensor_dict(ctx, d)
    else:
        _check_dict(pdist.recv_tensor_dict(ctx, src=1), 0)


@world_sizes(4)
def test_tensor_dict_send_allgather(ctx):
    """With all_gather_group, each stage rank sends 1/k and the receivers all-gather."""
    tp = pdist.new_tp_group(ctx, 2)  # stage 0: ranks 0,1; stage 1: ranks 2,3
    if ctx.rank < 2:
        pdist.send_tensor_dict(ctx, _tensor_dict(9), dst=ctx.rank + 2, all_gather_group=tp)
    else:
        d = pdist.recv_tensor_dict(ctx, src=ctx.rank - 2, all_gather_group=tp)
        _check_dict(d, 9)
