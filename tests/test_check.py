"""Check mode: a mismatched tensor collective raises on every rank, never a wrong tensor."""

from __future__ import annotations

import logging
import os
import time

import pytest
import torch

import pdist
from pdist._env import env_flag
from pdist.testing import count_collectives, spawn


def _mismatch(source: str, what: str) -> list[tuple[str, str, float]]:
    """Each collective, called with a mismatched shape or dtype: (name, error, seconds)."""
    os.environ["PDIST_CHECK"] = "1" if source == "env" else "0"
    with pdist.distributed(check=source == "keyword") as ctx:
        if what == "shape":
            x = torch.ones(2, 3 + ctx.rank)
        else:
            x = torch.ones(2, 3, dtype=torch.float64 if ctx.rank == 1 else torch.float32)
        calls = {
            "all_gather": lambda: pdist.all_gather(ctx, x, dim=-1),
            "all_reduce": lambda: pdist.all_reduce(ctx, x),
            "all_reduce_": lambda: pdist.all_reduce_(ctx, x),
            "broadcast": lambda: pdist.broadcast(ctx, x),
            "gather": lambda: pdist.gather(ctx, x),
        }
        seen = []
        for name, call in calls.items():
            start = time.monotonic()
            with pytest.raises(pdist.RankMismatchError) as info:
                call()
            seen.append((name, str(info.value), time.monotonic() - start))
        pdist.barrier(ctx)  # the group is still usable
        return seen


@pytest.mark.parametrize("source", ["keyword", "env"])
@pytest.mark.parametrize("what", ["shape", "dtype"])
def test_a_mismatch_raises_on_every_rank_naming_each_ranks_tensor(source, what):
    """check=True or PDIST_CHECK=1: every rank raises within seconds, then a barrier completes."""
    results = spawn(_mismatch, 3, source, what, timeout=90)
    rank1 = "shape (2, 4) float32" if what == "shape" else "shape (2, 3) float64"
    for seen in results:
        for name, message, seconds in seen:
            assert f"{name} on group 'world' (check mode)" in message
            assert f"ranks [1]: {name}: {rank1}" in message
            assert seconds < 10


def _collectives_per_call(check: bool) -> int:
    os.environ["PDIST_CHECK"] = "0"
    with pdist.distributed(check=check) as ctx:
        x = torch.ones(4)
        pdist.all_reduce(ctx, x)  # warm up
        with count_collectives() as calls:
            pdist.all_reduce(ctx, x)
        return sum(calls.values())


def test_check_mode_is_off_by_default_and_one_small_exchange_when_on():
    """Off: one collective per call; on: one more (the agreement on the CPU group)."""
    assert spawn(_collectives_per_call, 2, False, timeout=60) == [1, 1]
    assert spawn(_collectives_per_call, 2, True, timeout=60) == [2, 2]


def _harness_check() -> bool:
    with pdist.distributed() as ctx:
        return bool(ctx.world.lifetime.check)


def test_the_test_harness_runs_in_check_mode(monkeypatch):
    """pdist.testing.spawn turns check mode on unless the caller's PDIST_CHECK=0."""
    monkeypatch.delenv("PDIST_CHECK", raising=False)
    assert spawn(_harness_check, 2, timeout=60) == [True, True]
    monkeypatch.setenv("PDIST_CHECK", "0")
    assert spawn(_harness_check, 2, timeout=60) == [False, False]


@pytest.mark.parametrize(
    ("raw", "expected", "warns"),
    [
        ("", False, False),
        ("1", True, False),
        ("on", True, False),
        ("0", False, False),
        ("no", False, False),
        ("maybe", False, True),
        ("2", False, True),
    ],
)
def test_pdist_check_is_parsed_robustly(raw, expected, warns, caplog):
    """PDIST_CHECK takes 1/0 words; anything else warns, naming the variable, and stays off."""
    with caplog.at_level(logging.WARNING, logger="pdist"):
        assert env_flag("PDIST_CHECK", False, {"PDIST_CHECK": raw}) is expected
    assert any("PDIST_CHECK" in r.getMessage() for r in caplog.records) is warns


def test_check_must_be_a_bool():
    """check= is True or False."""
    with pytest.raises(TypeError, match="check="):
        pdist.distributed(check="yes")  # type: ignore[arg-type]
