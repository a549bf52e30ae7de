"""Object collectives and tensor dicts on real gloo processes."""

from __future__ import annotations

import collections
import functools
import os
import pickle
import tempfile
import warnings

import pytest
import torch

import pdist
from pdist.testing import count_collectives, world_sizes

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


class EvilPerRank(Evil):
    """Unpickling it creates a marker file named after the unpickling rank."""

    def __reduce__(self):
        return (os.system, (f"touch {self.path}-$RANK",))


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
def test_objects_with_and_without_tensors_travel_together(ctx):
    """Plain objects (their pickle alone) and objects with tensors mix in every transport."""
    mine = {"r": ctx.rank, "t": torch.arange(600.0)} if ctx.rank == 1 else {"r": ctx.rank}
    gathered = pdist.all_gather_object(ctx, mine)
    assert [o["r"] for o in gathered] == [0, 1, 2]
    assert torch.equal(gathered[1]["t"], torch.arange(600.0))
    got = pdist.gather_object(ctx, mine, dst=2)
    assert (got is None) if ctx.rank != 2 else ([o["r"] for o in got] == [0, 1, 2])
    for src in range(3):  # a plain list of 100 items is pickled with the tensor hook
        objs = [mine, list(range(100)), ("a", None, 1.5)] if ctx.rank == src else [None] * 3
        pdist.broadcast_object_list(ctx, objs, src=src)
        assert objs[0]["r"] == src
        assert objs[1:] == [list(range(100)), ("a", None, 1.5)]


@world_sizes(3)
def test_send_recv_object(ctx):
    """send_object/recv_object move an object between two ranks of the group."""
    if ctx.rank == 0:
        pdist.send_object(ctx, _payload(0), dst=2)
    elif ctx.rank == 2:
        _check(pdist.recv_object(ctx, src=0), 0)


@world_sizes(3)
def test_staged_buckets_and_a_tensor_alone_arrive(ctx):
    """Many staged buckets and a tensor sent alone arrive, in order, with their values."""

    def sent() -> dict[str, torch.Tensor]:  # buckets: 16 MiB, 4 MiB, 17 MiB alone, 16 MiB, 4 MiB
        small = {f"w{i}": torch.full((1 << 18,), float(i)) for i in range(40)}
        return {**dict(list(small.items())[:20]), "big": torch.full((17 << 18,), -1.0), **small}

    if ctx.rank == 0:
        pdist.send_tensor_dict(ctx, sent(), dst=2)
    elif ctx.rank == 2:
        got = pdist.recv_tensor_dict(ctx, src=0)
        assert list(got) == list(sent())
        assert all(torch.equal(got[k], v) for k, v in sent().items())


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
    # $RANK expands to the rank that unpickles: rank 1's own entry is a copy, unpickled
    # (and so run) by rank 1 itself, as torch's all_gather_object does.
    mine = EvilPerRank(marker) if ctx.rank == 1 else 0
    if ctx.rank == 0:
        with pytest.raises(pdist.PdistError, match="system"):
            pdist.all_gather_object(ctx, mine, safe=True)
    else:
        pdist.all_gather_object(ctx, mine)
    pdist.barrier(ctx)
    assert not os.path.exists(f"{marker}-0")
    if ctx.rank == 1:
        os.unlink(f"{marker}-1")


@world_sizes(2, 3)
def test_unpicklable_object_raises_on_every_rank(ctx):
    """If one rank cannot pickle its object, it raises pickle's error and every peer the same."""
    bad = ctx.world_size - 1
    messages = []
    for call in (
        lambda: pdist.broadcast_object(ctx, Unpicklable() if ctx.rank == bad else None, src=bad),
        lambda: pdist.all_gather_object(ctx, Unpicklable() if ctx.rank == bad else 1),
        lambda: pdist.gather_object(ctx, Unpicklable() if ctx.rank == bad else 1, dst=0),
    ):
        with pytest.raises(TypeError, match="cannot pickle Unpicklable") as info:
            call()
        if ctx.rank == bad:
            assert type(info.value) is TypeError  # what pickle raised, not re-typed
        else:
            assert isinstance(info.value, pdist.PdistError)
            assert f"failed on rank {bad}: TypeError: cannot pickle" in str(info.value)
            messages.append(str(info.value))
    peers = [m for m in pdist.all_gather_object(ctx, messages) if m]
    assert all(m == peers[0] for m in peers)


def _local_function():
    def step():
        return 1

    return step


@world_sizes(2)
def test_an_unpicklable_function_says_where_to_define_it(ctx):
    """A lambda or a local function: pickle's error, on every rank, says what to do."""
    for fn in (lambda: 1, _local_function()):
        with pytest.raises((pickle.PicklingError, AttributeError, pdist.PdistError)) as info:
            pdist.broadcast_object(ctx, fn if ctx.rank == 0 else None)
        assert isinstance(info.value, pdist.PdistError) == (ctx.rank != 0)
        assert "cannot pickle" in str(info.value)
        assert "define those at module level (not as lambdas or inside functions)" in str(
            info.value
        )


def _local_class_instance():
    class Local:  # pickle refers to classes by name: a local one cannot travel
        pass

    return Local()


@world_sizes(3)
def test_the_failing_rank_keeps_its_own_error_type(ctx):
    """The rank that cannot pickle raises pickle's AttributeError (as torch); peers a PdistError."""
    bad = 1
    with pytest.raises((AttributeError, pdist.PdistError), match="cannot pickle") as info:
        pdist.gather_object(ctx, _local_class_instance() if ctx.rank == bad else 1, dst=0)
    error = info.value
    if ctx.rank == bad:
        assert type(error) is AttributeError  # what torch's gather_object raises here
        assert "define those at module level" in str(error)
        assert isinstance(error.__cause__, AttributeError)  # pickle's own error, chained
    else:
        assert isinstance(error, pdist.PdistError)
        assert not isinstance(error, AttributeError)
        assert "failed on rank 1: AttributeError: cannot pickle" in str(error)
        assert error.__cause__ is None


@world_sizes(2)
def test_send_object_failure_reaches_the_receiver(ctx):
    """An unpicklable object makes both sender and receiver raise."""
    if ctx.rank == 0:
        with pytest.raises(TypeError, match="cannot pickle Unpicklable"):
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


@world_sizes(2)
def test_send_tensor_dict_of_a_mapping_arrives(ctx):
    """Any Mapping send_tensor_dict accepts arrives as that Mapping (not refused after sending)."""
    sent = collections.UserDict({"w": torch.arange(2048.0), "step": 3})
    if ctx.rank == 0:
        pdist.send_tensor_dict(ctx, sent, dst=1)
    else:
        got = pdist.recv_tensor_dict(ctx, src=0)
        assert type(got) is collections.UserDict
        assert torch.equal(got["w"], sent["w"])
        assert got["step"] == 3


@world_sizes(4)
def test_tensor_dict_send_allgather(ctx):
    """With all_gather_group, each stage rank sends 1/k and the receivers all-gather."""
    tp = pdist.new_tp_group(ctx, 2)  # stage 0: ranks 0,1; stage 1: ranks 2,3
    if ctx.rank < 2:
        pdist.send_tensor_dict(ctx, _tensor_dict(9), dst=ctx.rank + 2, all_gather_group=tp)
    else:
        d = pdist.recv_tensor_dict(ctx, src=ctx.rank - 2, all_gather_group=tp)
        _check_dict(d, 9)


@world_sizes(4)
def test_tensor_dict_send_allgather_without_buckets_and_crossed(ctx):
    """A dict without buckets travels whole; crossed pairs (0 -> 3, 1 -> 2) raise on all four."""
    tp = pdist.new_tp_group(ctx, 2)
    plain = {"step": 3, "small": torch.arange(4.0)}  # inline: no bucket to split
    if ctx.rank < 2:
        pdist.send_tensor_dict(ctx, plain, dst=ctx.rank + 2, all_gather_group=tp)
        pdist.send_tensor_dict(ctx, {}, dst=ctx.rank + 2, all_gather_group=tp)
    else:
        got = pdist.recv_tensor_dict(ctx, src=ctx.rank - 2, all_gather_group=tp)
        assert got["step"] == 3
        assert torch.equal(got["small"], torch.arange(4.0))
        assert pdist.recv_tensor_dict(ctx, src=ctx.rank - 2, all_gather_group=tp) == {}
    crossed = (
        functools.partial(pdist.send_tensor_dict, ctx, _tensor_dict(9), dst=3 - ctx.rank)
        if ctx.rank < 2
        else functools.partial(pdist.recv_tensor_dict, ctx, src=3 - ctx.rank)
    )
    with pytest.raises(pdist.PdistError, match="pair each sender with the receiver at its own"):
        crossed(all_gather_group=tp)
    assert pdist.all_reduce(ctx, torch.ones(1)).item() == 4.0


class Holder:
    """A user class holding a tensor (module level, so every rank can unpickle it)."""

    def __init__(self, t: torch.Tensor, note: str) -> None:
        self.t = t
        self.note = note


def _quantized(seed: int) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch deprecates quantized tensor creation
        return torch.quantize_per_tensor(torch.arange(600.0) + seed, 0.5, 2, torch.quint8)


def _rich(seed: int):
    """Everything pickle carries that a tree-only format would refuse or mangle."""
    shared = [seed, "shared"]
    dd = collections.defaultdict(list)
    dd["a"].append(torch.arange(300.0) + seed)  # 1200 bytes: travels in a bucket
    loop = {"name": "loop"}
    loop["me"] = loop
    base = torch.arange(2000.0).reshape(40, 50) + seed
    sparse = torch.sparse_coo_tensor(
        [[0, 2, 1], [1, 0, 2]], [3.0, 4.0, float(seed)], (3, 3), check_invariants=True
    )
    return {
        "dd": dd,
        "od": collections.OrderedDict([("z", 1), ("a", shared), ("m", seed)]),
        "shared": [shared, shared],
        "loop": loop,
        "holder": Holder(torch.full((400,), float(seed)), "held"),
        "param": torch.nn.Parameter(torch.ones(300) * seed),
        "frozen": torch.nn.Parameter(torch.ones(3), requires_grad=False),
        "sparse": sparse,
        "q": _quantized(seed),
        "view": base.t()[::2],
        "empties": ((), ((),), ()),
        "small": torch.tensor([seed]),
    }


def _check_rich(out, seed: int) -> None:
    expected = _rich(seed)
    assert type(out["dd"]) is collections.defaultdict
    assert out["dd"].default_factory is list
    assert torch.equal(out["dd"]["a"][0], expected["dd"]["a"][0])
    assert type(out["od"]) is collections.OrderedDict
    assert list(out["od"].items()) == list(expected["od"].items())
    assert out["shared"][0] is out["shared"][1] is out["od"]["a"]
    assert out["loop"]["me"] is out["loop"]
    assert type(out["holder"]) is Holder
    assert out["holder"].note == "held"
    assert torch.equal(out["holder"].t, expected["holder"].t)
    assert type(out["param"]) is torch.nn.Parameter
    assert out["param"].requires_grad
    assert torch.equal(out["param"].detach(), expected["param"].detach())
    assert type(out["frozen"]) is torch.nn.Parameter
    assert not out["frozen"].requires_grad
    assert out["sparse"].layout == torch.sparse_coo
    assert torch.equal(out["sparse"].to_dense(), expected["sparse"].to_dense())
    assert out["q"].is_quantized
    assert out["q"].q_scale() == 0.5
    assert torch.equal(out["q"].dequantize(), expected["q"].dequantize())
    assert out["view"].shape == (25, 40)
    assert torch.equal(out["view"], expected["view"])
    assert out["empties"] == ((), ((),), ())
    assert torch.equal(out["small"], expected["small"])


@world_sizes(2, 3)
def test_rich_payloads_round_trip_on_every_path(ctx):
    """Rich payloads survive every object path with types, identity and values intact."""
    last = ctx.world_size - 1
    objs = [_rich(last), "tail"] if ctx.rank == last else [None]
    pdist.broadcast_object_list(ctx, objs, src=last)
    _check_rich(objs[0], last)
    assert objs[1] == "tail"
    for rank, obj in enumerate(pdist.all_gather_object(ctx, _rich(ctx.rank))):
        _check_rich(obj, rank)
    got = pdist.gather_object(ctx, _rich(ctx.rank), dst=last)
    if ctx.rank == last:
        for rank, obj in enumerate(got):
            _check_rich(obj, rank)
    else:
        assert got is None
    if ctx.rank == 0:
        pdist.send_object(ctx, _rich(0), dst=last)
    elif ctx.rank == last:
        _check_rich(pdist.recv_object(ctx, src=0), 0)
    with pdist.message_queue(ctx.world) as group:
        for _ in range(2):
            _check_rich(pdist.broadcast_object(group, _rich(0) if ctx.rank == 0 else None), 0)


@world_sizes(1, 2)
def test_all_gather_object_returns_copies(ctx):
    """Every entry is a copy, the caller's own included, as with torch."""
    mine = {"t": torch.full((1000,), float(ctx.rank)), "l": [ctx.rank]}
    got = pdist.all_gather_object(ctx, mine)
    own = got[ctx.rank]
    assert own is not mine
    assert own["l"] is not mine["l"]
    assert own["t"].data_ptr() != mine["t"].data_ptr()
    assert torch.equal(own["t"], mine["t"])
    got = pdist.gather_object(ctx, mine, dst=0)
    if ctx.rank == 0:
        assert got[0] is not mine
        assert got[0]["t"].data_ptr() != mine["t"].data_ptr()


@world_sizes(2)
def test_uneven_gathers(ctx):
    """One rank with much more tensor data than the others: each rank's bytes travel alone."""
    big = torch.arange(100_000.0) if ctx.rank == 1 else torch.ones(300)
    for rank, obj in enumerate(pdist.all_gather_object(ctx, {"t": big})):
        assert obj["t"].numel() == (100_000 if rank == 1 else 300)
        assert obj["t"][-1].item() == (99_999.0 if rank == 1 else 1.0)
    got = pdist.gather_object(ctx, {"t": big}, dst=0)
    if ctx.rank == 0:
        assert torch.equal(got[1]["t"], torch.arange(100_000.0))
        assert torch.equal(got[0]["t"], torch.ones(300))


@world_sizes(3)
def test_uneven_gathers_of_one_lone_tensor(ctx):
    """A lone tensor (16 KiB, sent in place) on one rank of three, none elsewhere: uneven.

    Each rank's region travels alone, and the sender's own region is filled too.
    """
    expected = torch.full((4096,), 7.0)
    obj = {"t": expected.clone() if ctx.rank == 0 else None}
    got = pdist.all_gather_object(ctx, obj)
    assert torch.equal(got[0]["t"], expected)
    assert [o["t"] for o in got[1:]] == [None, None]
    for dst in (0, 1):
        got = pdist.gather_object(ctx, obj, dst=dst)
        if ctx.rank == dst:
            assert torch.equal(got[0]["t"], expected)


def _many(n: int):
    return {"ts": [torch.full((1024,), float(i)) for i in range(n)], "step": 3}


def _counted(fn) -> int:
    with count_collectives() as calls:
        fn()
    return sum(calls.values())


@world_sizes(2)
def test_object_collectives_do_not_grow_with_the_number_of_tensors(ctx):
    """200 or 300 tensors of 4 KiB cost the same collectives on every object path, at most 6."""
    by_n = {}
    for n in (200, 300):
        src = _many(n)
        mine = src if ctx.rank == 0 else None
        counts = {
            "broadcast_object": _counted(lambda: pdist.broadcast_object(ctx, mine)),  # noqa: B023
            "broadcast_object_list": _counted(
                lambda: pdist.broadcast_object_list(ctx, [mine])  # noqa: B023
            ),
            "broadcast_tensor_dict": _counted(
                lambda: pdist.broadcast_tensor_dict(ctx, mine)  # noqa: B023
            ),
            "all_gather_object": _counted(lambda: pdist.all_gather_object(ctx, src)),  # noqa: B023
            "gather_object": _counted(lambda: pdist.gather_object(ctx, src)),  # noqa: B023
        }
        if ctx.rank == 0:
            counts["send_object"] = _counted(lambda: pdist.send_object(ctx, src, dst=1))  # noqa: B023
            counts["send_tensor_dict"] = _counted(
                lambda: pdist.send_tensor_dict(ctx, src, dst=1)  # noqa: B023
            )
        else:
            got = {}
            counts["send_object"] = _counted(lambda: got.update(o=pdist.recv_object(ctx, src=0)))  # noqa: B023
            counts["send_tensor_dict"] = _counted(
                lambda: got.update(d=pdist.recv_tensor_dict(ctx, src=0))  # noqa: B023
            )
            assert [t[0].item() for t in got["o"]["ts"]] == [float(i) for i in range(n)]
            assert torch.equal(got["d"]["ts"][-1], src["ts"][-1])
        by_n[n] = counts
    assert by_n[200] == by_n[300], by_n
    assert max(by_n[200].values()) <= 6, by_n


@world_sizes(2)
def test_safe_refuses_a_class_off_the_allow_list_on_every_path(ctx):
    """safe=True refuses Config on every receive path; safe=[Config] admits it."""
    payload = {"cfg": Config(0.5), "t": torch.ones(600)}
    mine = payload if ctx.rank == 0 else None
    refused = pytest.raises(pdist.PdistError, match="Config")

    def receive(call, *, on=(1,)):
        if ctx.rank in on:
            with refused:
                call()
        else:
            call()

    receive(lambda: pdist.broadcast_object(ctx, mine, safe=True))
    receive(lambda: pdist.broadcast_object_list(ctx, [mine], safe=True))
    receive(lambda: pdist.broadcast_tensor_dict(ctx, mine, safe=True))
    receive(lambda: pdist.all_gather_object(ctx, payload, safe=True), on=(0, 1))
    receive(lambda: pdist.gather_object(ctx, payload, dst=1, safe=True))
    if ctx.rank == 0:
        pdist.send_object(ctx, payload, dst=1)
        pdist.send_tensor_dict(ctx, payload, dst=1)
    else:
        with refused:
            pdist.recv_object(ctx, src=0, safe=True)
        with refused:
            pdist.recv_tensor_dict(ctx, src=0, safe=True)
    with pdist.message_queue(ctx.world) as group:
        receive(lambda: pdist.broadcast_object(group, mine, safe=True))
        receive(lambda: pdist.broadcast_tensor_dict(group, mine, safe=True))
    assert pdist.broadcast_object(ctx, mine, safe=[Config])["cfg"].lr == 0.5
    assert pdist.all_gather_object(ctx, payload, safe=[Config])[0]["cfg"].lr == 0.5
