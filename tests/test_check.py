"""Check mode: a mismatched tensor collective raises on every rank, never a wrong tensor."""

from __future__ import annotations

import logging
import os
import re
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


def _uneven_mismatch() -> list[tuple[str, str, float]]:
    """Each uneven path, one rank's argument wrong: (case, error, seconds) on this rank."""
    os.environ["PDIST_CHECK"] = "0"
    with pdist.distributed(check=True) as ctx:
        r = ctx.rank
        send = [[2, 1, 0], [0, 0, 0], [3, 4, 0]][r]  # rows rank r sends each rank
        recv = [[2, 0, 3], [1, 0, 4], [0, 0, 0]][r]
        x = torch.ones(2, 5, [2, 1, 3][r])
        tokens = torch.randn(4, 3, generator=torch.Generator().manual_seed(r))
        ids = torch.tensor([[0, 1], [2, 3], [4, 5], [5, 0]])
        routed = pdist.moe_dispatch(ctx, tokens, ids, 6)
        out = routed.tokens * 2
        cases = {
            # Rank 1's sizes differ in rank 2's entry (its own is right).
            "sizes": lambda: pdist.all_gather(
                ctx, x, dim=-1, sizes=[2, 1, 4] if r == 1 else [2, 1, 3]
            ),
            # Rank 2's own entry is not its shard's size.
            "own size": lambda: pdist.all_gather(ctx, x, dim=-1, sizes=[2, 1, 2]),
            "scatter sizes": lambda: pdist.reduce_scatter(
                ctx, torch.ones(6, 2), dim=0, sizes=[3, 3, 0] if r == 0 else [2, 2, 2]
            ),
            "rows": lambda: pdist.all_to_all(ctx, torch.ones(sum(send), 4 + (r == 1)), send),
            "vouched": lambda: pdist.all_to_all(
                ctx, torch.ones(sum(send), 4), send, [2, 1, 3] if r == 0 else recv
            ),
            "expert_out rows": lambda: pdist.moe_combine(routed, out[1:] if r == 1 else out),
            "expert_out width": lambda: pdist.moe_combine(routed, out[:, :2] if r == 0 else out),
            "weights": lambda: pdist.moe_combine(routed, out, torch.ones(4, 2 + (r == 2))),
        }
        seen = []
        for name, call in cases.items():
            start = time.monotonic()
            with pytest.raises((pdist.RankMismatchError, ValueError)) as info:
                call()
            seen.append(
                (name, f"{type(info.value).__name__}: {info.value}", time.monotonic() - start)
            )
        pdist.barrier(ctx)  # the group is still usable
        return seen


EXPECTED = {
    "sizes": r"RankMismatchError: all_gather on group 'world' \(check mode\): ranks passed "
    r"different arguments; ranks \[0, 2\]: .*sizes=\[2, 1, 3\].*; ranks \[1\]: .*sizes=\[2, 1, 4\]",
    "own size": r"ValueError: all_gather \(check mode\) on group 'world' failed on rank 2: "
    r"ValueError: all_gather: sizes\[2\]=2 on rank 2, but x has size 3 along dim 2",
    "scatter sizes": r"RankMismatchError: .*ranks \[0\]: reduce_scatter: .*sizes=\[3, 3, 0\]",
    "rows": r"RankMismatchError: .*ranks \[1\]: all_to_all: rows of shape \(5,\) float32",
    "vouched": r"RankMismatchError: all_to_all on group 'world' \(check mode\).*ranks \[0\]: "
    r"recv_counts=\[2, 1, 3\] on rank 0, but rank 1 sends it 0 rows \(its send_counts\[0\]\)",
    "expert_out rows": r"ValueError: moe_combine \(check mode\) on group 'world' failed on "
    r"rank 1: ValueError: expert_out has \d+ rows on rank 1, but routed.tokens has \d+",
    "expert_out width": r"RankMismatchError: .*ranks \[0\]: moe_combine: rows of shape \(2,\)",
    "weights": r"ValueError: .*failed on rank 2: ValueError: weights has shape \(4, 3\)",
}


def test_uneven_and_expert_paths_are_checked_on_every_rank():
    """Check mode covers sizes=, all_to_all's rows and vouched counts, and moe_combine's inputs."""
    results = spawn(_uneven_mismatch, 3, timeout=120)
    for seen in results:
        assert [name for name, _, _ in seen] == list(EXPECTED)
        for name, message, seconds in seen:
            assert re.search(EXPECTED[name], message), (name, message)
            assert seconds < 10, (name, seconds)


def _local_errors() -> list[tuple[str, str, float]]:
    """Rank 1 passes an argument its own checks refuse: (case, error, seconds) on this rank."""
    os.environ["PDIST_CHECK"] = "0"
    with pdist.distributed(check=True) as ctx:
        one = ctx.rank == 1
        ints = torch.ones(6, 2, dtype=torch.int64 if one else torch.float32)
        x = torch.ones(2, 3)
        cases = {
            "all_reduce": lambda: pdist.all_reduce(ctx, ints, op="mean"),
            "reduce_scatter": lambda: pdist.reduce_scatter(
                ctx, ints, dim=0, op="mean", sizes=[2, 2, 2]
            ),
            "all_gather": lambda: pdist.all_gather(
                ctx, torch.ones(3) if one else x, dim=1, sizes=[3, 3, 3]
            ),
            "broadcast": lambda: pdist.broadcast(ctx, x.t() if one else x.t().contiguous()),
            "gather": lambda: pdist.gather(ctx, x, dst=5 if one else 0),
            "reduce": lambda: pdist.reduce(ctx, x, op="max" if one else "sum"),
        }
        seen = []
        for name, call in cases.items():
            start = time.monotonic()
            with pytest.raises((TypeError, ValueError)) as info:
                call()
            seen.append((name, str(info.value), time.monotonic() - start))
        pdist.barrier(ctx)  # the group is still usable
        return seen


def test_a_rank_whose_own_checks_fail_makes_every_rank_raise_in_check_mode():
    """In check mode an argument error on one rank joins the agreement: all raise it, then go on."""
    for seen in spawn(_local_errors, 3, timeout=120):
        assert [name for name, _, _ in seen] == [
            "all_reduce",
            "reduce_scatter",
            "all_gather",
            "broadcast",
            "gather",
            "reduce",
        ]
        for name, message, seconds in seen:
            assert f"{name} (check mode) on group 'world' failed on rank 1" in message, message
            assert seconds < 10, (name, seconds)
