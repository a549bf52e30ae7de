"""Launcher detection and robust parsing of PDIST_* settings."""

from __future__ import annotations

import logging
from datetime import timedelta

import pytest

from pdist._env import detect_launch, env_backend, env_seconds, to_seconds

TABLE = [
    # raw value, expected, warns
    (None, 30.0, False),
    ("", 30.0, False),
    ("abc", 30.0, True),
    ("nan", 30.0, True),
    ("inf", 30.0, True),
    ("-5", 30.0, True),
    ("12.5", 12.5, False),
]


@pytest.mark.parametrize(("raw", "expected", "warns"), TABLE)
def test_env_seconds_table(raw, expected, warns, caplog):
    """Unset/garbage/nan/inf/negative fall back to the default, warning with the variable name."""
    environ = {} if raw is None else {"PDIST_TIMEOUT_SEC": raw}
    with caplog.at_level(logging.WARNING, logger="pdist"):
        assert env_seconds("PDIST_TIMEOUT_SEC", 30.0, environ=environ) == expected
    messages = [r.getMessage() for r in caplog.records]
    if warns:
        assert len(messages) == 1
        assert "PDIST_TIMEOUT_SEC" in messages[0]
        assert "default 30s" in messages[0]
    else:
        assert messages == []


def test_zero_means_forever_only_where_allowed(caplog):
    """0 disarms only the guard's deadline; for a collective timeout it is invalid."""
    env = {"X": "0"}
    assert env_seconds("X", 600.0, zero_means_forever=True, environ=env) is None
    with caplog.at_level(logging.WARNING, logger="pdist"):
        assert env_seconds("X", 600.0, environ=env) == 600.0
    assert "X" in caplog.records[0].getMessage()
    # inf never disarms, even where 0 would.
    assert env_seconds("X", 600.0, zero_means_forever=True, environ={"X": "inf"}) == 600.0


def test_to_seconds():
    """Durations are numbers of seconds or timedeltas, finite and positive."""
    assert to_seconds(3, "timeout") == 3.0
    assert to_seconds(timedelta(minutes=1), "timeout") == 60.0
    with pytest.raises(ValueError, match=r"timeout=0 must be a finite positive"):
        to_seconds(0, "timeout")
    with pytest.raises(ValueError, match="timeout=inf"):
        to_seconds(float("inf"), "timeout")
    with pytest.raises(TypeError, match=r"timeout='5' must be a number"):
        to_seconds("5", "timeout")  # type: ignore[arg-type]


def test_detect_torchrun_then_slurm_then_none():
    """torchrun's variables win over SLURM's; neither means a one-rank world."""
    torchrun = {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "MASTER_ADDR": "h",
        "MASTER_PORT": "29500",
    }
    slurm = {
        "SLURM_PROCID": "5",
        "SLURM_NTASKS": "8",
        "SLURM_LOCALID": "1",
        "SLURM_JOB_ID": "1234",
        "SLURM_JOB_NODELIST": "gpu[003-005,010]",
    }
    launch = detect_launch({**torchrun, **slurm})
    assert (launch.launcher, launch.rank, launch.world_size, launch.local_rank) == (
        "torchrun",
        3,
        4,
        1,
    )
    launch = detect_launch(slurm)
    assert (launch.launcher, launch.rank, launch.world_size, launch.local_rank) == (
        "slurm",
        5,
        8,
        1,
    )
    assert launch.master_addr == "gpu003"
    assert launch.master_port == 20000 + 1234
    launch = detect_launch({})
    assert (launch.launcher, launch.rank, launch.world_size) == ("none", 0, 1)


def test_detect_rejects_bad_launcher_values():
    """A non-integer or out-of-range launcher variable is a clear error."""
    with pytest.raises(ValueError, match=r"RANK='x' is not an integer"):
        detect_launch({"RANK": "x", "WORLD_SIZE": "2"})
    with pytest.raises(ValueError, match=r"rank=2 and world_size=2"):
        detect_launch({"RANK": "2", "WORLD_SIZE": "2"})


def test_env_backend():
    """PDIST_BACKEND is read lower-cased; empty means unset."""
    assert env_backend({"PDIST_BACKEND": "GLOO"}) == "gloo"
    assert env_backend({"PDIST_BACKEND": " "}) is None
    assert env_backend({}) is None
