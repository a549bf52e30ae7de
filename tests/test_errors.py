"""pdist's exception types: public, printed as ``pdist.X``, short tracebacks, own failures first."""

from __future__ import annotations

import pickle
import re
import traceback

import pytest
import torch

import pdist
from pdist.testing import SpawnError, inject, spawn, world_sizes

ERRORS = [
    "PdistError",
    "PeerLeftError",
    "RankMismatchError",
    "RemoteError",
    "RemoteRankMismatchError",
    "RemoteTypeError",
    "RemoteValueError",
]


@pytest.mark.parametrize("name", ERRORS)
def test_every_error_is_public_and_prints_as_pdist(name):
    """pdist.X exists, is in __all__, prints as pdist.X and survives pickle."""
    cls = getattr(pdist, name)
    assert name in pdist.__all__
    assert issubclass(cls, pdist.PdistError)
    error = cls("what failed, on which rank, and the fix")
    line = traceback.format_exception_only(error)[-1]
    assert line == f"pdist.{name}: what failed, on which rank, and the fix\n"
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is cls
    assert str(again) == str(error)


def test_peer_left_error_keeps_store_gone_through_pickle():
    error = pickle.loads(pickle.dumps(pdist.PeerLeftError("gone", store_gone=True)))
    assert type(error) is pdist.PeerLeftError
    assert error.store_gone


def test_dir_lists_no_future_import():
    assert "annotations" not in dir(pdist)


def test_the_mismatch_class_is_caught_as_rank_mismatch():
    assert issubclass(pdist.RemoteRankMismatchError, pdist.RankMismatchError)
    assert issubclass(pdist.RemoteRankMismatchError, pdist.RemoteError)


# --------------------------------------------------------------------------- own failure first


def _local_class_instance():
    class Local:  # pickle refers to classes by name: a local one cannot travel
        pass

    return Local()


@world_sizes(3)
def test_every_rank_that_failed_raises_its_own_error(ctx):
    """torch's test: every rank's object is a local class; each raises pickle's own error."""
    with pytest.raises((AttributeError, pickle.PicklingError)) as info:
        pdist.all_gather_object(ctx, _local_class_instance())
    error = info.value
    assert not isinstance(error, pdist.RemoteError)
    assert "Local" in str(error)


@world_sizes(3)
def test_only_a_rank_that_did_not_fail_raises_the_remote_error(ctx):
    """Ranks 0 and 2 fail: each raises its own error; rank 1 the RemoteError naming rank 0."""
    obj = 1 if ctx.rank == 1 else _local_class_instance()
    with pytest.raises((AttributeError, pickle.PicklingError, pdist.RemoteError)) as info:
        pdist.all_gather_object(ctx, obj)
    error = info.value
    if ctx.rank == 1:
        assert isinstance(error, pdist.RemoteError)
        assert "failed on rank 0" in str(error)
    else:
        assert not isinstance(error, pdist.RemoteError)


def _disagrees(index: int) -> None:
    """A packing hook that finds a disagreement (as a check of the peers' records would)."""
    raise pdist.RankMismatchError("simulated: the ranks disagree")


def _out_of_memory(nbytes: int) -> None:
    raise MemoryError(f"simulated: no room for {nbytes} bytes")


@world_sizes(3)
def test_one_disagreement_raises_the_same_class_on_every_rank(ctx):
    """A RankMismatchError on rank 0 is a RemoteRankMismatchError on all three ranks."""
    payload = {"w": torch.arange(8192.0)}
    faults = inject(pack=_disagrees if ctx.rank == 0 else None)
    with faults, pytest.raises(pdist.RankMismatchError) as info:
        pdist.broadcast_object(ctx, payload if ctx.rank == 0 else None)
    assert type(info.value) is pdist.RemoteRankMismatchError
    assert "failed on rank 0: RankMismatchError: simulated" in str(info.value)


@world_sizes(3)
def test_one_pdist_failure_raises_the_same_class_on_every_rank(ctx):
    """Rank 1 cannot allocate (a PdistError there): every rank raises a plain RemoteError."""
    payload = {"w": torch.arange(8192.0)}
    faults = inject(allocate=_out_of_memory if ctx.rank == 1 else None)
    with faults, pytest.raises(pdist.RemoteError) as info:
        pdist.broadcast_object(ctx, payload if ctx.rank == 0 else None)
    assert type(info.value) is pdist.RemoteError
    assert "failed on rank 1: PdistError: could not allocate" in str(info.value)


# --------------------------------------------------------------------------- short tracebacks


def load_batch() -> None:
    raise RuntimeError("boom")


def _survive() -> None:
    with pdist.distributed() as ctx:
        x = torch.ones(4)
        for step in range(200):
            if step == 3 and ctx.rank == 1:
                load_batch()
            pdist.all_reduce(ctx, x)


def test_a_survivors_traceback_starts_at_the_users_call():
    """Rank 0's PeerLeftError shows the user's call and at most two pdist frames after it."""
    with pytest.raises(SpawnError) as info:
        spawn(_survive, 2, timeout=60)
    rank0 = str(info.value).split("----- rank 0")[1].split("----- rank ")[0]
    cause, _, peer_left = rank0.partition("The above exception was the direct cause")
    assert "pdist.PeerLeftError: rank 1 left the job" in peer_left
    assert "Connection closed" in cause or "Connection reset" in cause  # torch's, chained
    files = re.findall(r'File "([^"]+)", line \d+, in (\w+)', peer_left)
    functions = [fn for _, fn in files]
    assert "all_reduce" in functions
    inner = files[functions.index("_survive") + 1 :]
    assert len(inner) <= 2, peer_left  # pdist.all_reduce, and where it was raised


@pytest.mark.parametrize(
    "own",
    [
        ValueError("bad"),
        TypeError("bad"),
        pdist.RankMismatchError("differs"),
        pdist.PeerLeftError("gone"),
        pdist.PdistError("no room"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_the_failing_rank_and_its_peers_raise_one_class(own):
    """A unit test of a private piece: the class a failure raises as, on its rank and elsewhere."""
    from pdist._errors import failure, kind_name

    mine = failure("m", kind_name(own), own)
    theirs = failure("m", kind_name(own), None)
    assert type(mine) is type(theirs)
    assert isinstance(theirs, pdist.RemoteError)
    assert mine.__cause__ is own
