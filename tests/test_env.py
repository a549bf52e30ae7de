"""Launcher detection and robust parsing of PDIST_* settings."""

from __future__ import annotations

import logging
from datetime import timedelta

import pytest
import torch

from pdist._env import (
    Accelerator,
    Adopted,
    Request,
    detect_launch,
    env_backend,
    env_seconds,
    resolve_settings,
    to_seconds,
)

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
    assert env_seconds("X", 600.0, zero_means_forever=True, environ=env) == 0.0  # forever
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


# --------------------------------------------------------------------------- settings

TORCHRUN = {
    "RANK": "1",
    "WORLD_SIZE": "4",
    "LOCAL_RANK": "1",
    "MASTER_ADDR": "h",
    "MASTER_PORT": "5",
}
CUDA8 = Accelerator(type="cuda", count=8, backend="nccl")


def _settings(environ=None, accelerator=None, adopted=None, **kwargs):
    sizes = {k: kwargs.pop(k) for k in ("tp", "sp", "cp", "pp") if k in kwargs}
    return resolve_settings(
        Request(sizes=sizes, **kwargs),
        environ=TORCHRUN if environ is None else environ,
        accelerator=accelerator,
        adopted=adopted,
    )


def test_settings_defaults_on_a_cpu_machine():
    """No accelerator: the CPU and gloo, torch's 1800 s timeout, a 600 s start-up deadline."""
    s = _settings()
    assert (s.launch.rank, s.launch.world_size, s.launch.local_rank) == (1, 4, 1)
    assert s.device == torch.device("cpu")
    assert s.backend == "gloo"
    assert s.timeout == s.subgroup_timeout == timedelta(seconds=1800)
    assert s.startup_timeout == 600.0
    assert (s.layout.dp, s.layout.sp, s.layout.tp) == (4, 1, 1)
    assert not s.adopt


@pytest.mark.parametrize(
    ("kind", "backend"), [("cuda", "nccl"), ("xpu", "xccl"), ("hpu", "hccl"), ("mps", "gloo")]
)
def test_each_accelerator_kind_gets_its_device_and_backend(kind, backend):
    """The accelerator at LOCAL_RANK and its default backend, whatever the device kind."""
    s = _settings(accelerator=Accelerator(type=kind, count=2, backend=backend))
    assert s.device == torch.device(kind, 1)
    assert s.backend == backend


def test_explicit_device_and_backend_choices():
    """An int is an accelerator index; 'cpu' and gloo stay on the CPU; PDIST_BACKEND is read."""
    assert _settings(accelerator=CUDA8, device=3).device == torch.device("cuda", 3)
    assert _settings(accelerator=CUDA8, device="cuda").device == torch.device("cuda", 1)
    assert _settings(accelerator=CUDA8, device="cpu").backend == "gloo"
    assert _settings(accelerator=CUDA8, backend="gloo").device == torch.device("cpu")
    env = {**TORCHRUN, "PDIST_BACKEND": "GLOO"}
    assert _settings(env, accelerator=CUDA8).device == torch.device("cpu")


def test_local_rank_beyond_the_visible_devices_says_how_to_fix_it():
    """A SLURM task that sees one GPU as cuda:0 but has LOCAL_RANK=3 gets a clear error."""
    env = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "3"}
    one = Accelerator(type="cuda", count=1, backend="nccl")
    with pytest.raises(
        ValueError, match=r"LOCAL_RANK=3 has no cuda device: only 1 CUDA device"
    ) as info:
        _settings(env, accelerator=one)
    assert "device='cuda:0'" in str(info.value)
    assert _settings(env, accelerator=one, device=0).device == torch.device("cuda", 0)


BAD_SETTINGS = [
    ({"device": "cuda:0"}, None, ValueError, r"device='cuda:0' needs CUDA, which is not available"),
    ({"device": "xpu"}, CUDA8, ValueError, r"device='xpu' needs XPU, which is not available"),
    ({"device": 0}, None, ValueError, r"device=0 names an accelerator index, but none"),
    ({"device": "cuda:9"}, CUDA8, ValueError, r"index 9\) is beyond the 8 visible CUDA"),
    ({"backend": "nccl"}, None, ValueError, r"backend='nccl' needs a CUDA device.*not available"),
    ({"backend": "xccl", "device": "cpu"}, CUDA8, ValueError, r"backend='xccl' needs a XPU device"),
    ({"backend": "pigeon"}, None, ValueError, r"backend='pigeon' is not one of"),
    ({"tp": 3}, None, ValueError, r"tp=3 does not divide world_size=4"),
    ({"timeout": 0}, None, ValueError, r"timeout=0 must be a finite positive"),
    ({"startup_timeout": -2}, None, ValueError, r"startup_timeout=-2 must be a finite positive"),
    ({"startup_timeout": "5"}, None, TypeError, r"startup_timeout='5' must be a number"),
    ({"rank": -1}, None, ValueError, r"rank=-1 must be a non-negative int"),
    ({"rank": 7}, None, ValueError, r"rank=7 must be below world_size=4"),
    ({"world_size": 0}, None, ValueError, r"world_size=0 must be a positive int"),
]


@pytest.mark.parametrize(("kwargs", "accelerator", "error", "match"), BAD_SETTINGS)
def test_bad_settings_name_the_argument_and_the_fix(kwargs, accelerator, error, match):
    """Each invalid argument raises before any process group exists, naming it."""
    with pytest.raises(error, match=match):
        _settings(accelerator=accelerator, **kwargs)


def test_a_bad_pdist_backend_names_the_variable():
    """An invalid PDIST_BACKEND is reported as PDIST_BACKEND, not as the backend= argument."""
    with pytest.raises(ValueError, match=r"PDIST_BACKEND='pigeon' is not one of"):
        _settings({**TORCHRUN, "PDIST_BACKEND": "pigeon"})
    with pytest.raises(ValueError, match=r"PDIST_BACKEND='nccl' needs a CUDA device"):
        _settings({**TORCHRUN, "PDIST_BACKEND": "NCCL"})


def test_startup_timeout_sources():
    """startup_timeout: explicit seconds or timedelta, 0 = forever, else the environment."""
    assert _settings(startup_timeout=12).startup_timeout == 12.0
    assert _settings(startup_timeout=timedelta(minutes=2)).startup_timeout == 120.0
    assert _settings(startup_timeout=0).startup_timeout is None
    assert _settings(startup_timeout=timedelta(0)).startup_timeout is None
    env = {**TORCHRUN, "PDIST_WORLD_COMM_TIMEOUT_SEC": "0"}
    assert _settings(env).startup_timeout is None
    env = {**TORCHRUN, "PDIST_WORLD_COMM_TIMEOUT_SEC": "42"}
    assert _settings(env).startup_timeout == 42.0


def test_adopted_world_wins_over_the_launcher():
    """An initialized default group's rank, size and backend are taken as they are."""
    s = _settings(adopted=Adopted(rank=5, world_size=8, backend="fake"), tp=2)
    assert (s.launch.rank, s.launch.world_size, s.backend, s.adopt) == (5, 8, "fake", True)
    assert s.layout.dp == 4


@pytest.mark.parametrize(
    ("kwargs", "match"), [({"world_size": 4}, "world_size=4"), ({"rank": 0}, "rank=0")]
)
def test_an_adopted_world_refuses_other_ranks(kwargs, match):
    """rank=/world_size= that contradict the adopted default group are refused, not obeyed."""
    adopted = Adopted(rank=1, world_size=2, backend="gloo")
    with pytest.raises(ValueError, match=rf"{match} contradicts the initialized default"):
        _settings(adopted=adopted, **kwargs)
    s = _settings(adopted=adopted, rank=1, world_size=2)  # agreeing values are fine
    assert (s.launch.rank, s.launch.world_size) == (1, 2)


def test_subgroup_timeout_from_the_environment():
    """PDIST_SUBGROUP_TIMEOUT_SEC overrides the subgroups' timeout only."""
    env = {**TORCHRUN, "PDIST_SUBGROUP_TIMEOUT_SEC": "7"}
    s = _settings(env, timeout=42)
    assert (s.timeout, s.subgroup_timeout) == (timedelta(seconds=42), timedelta(seconds=7))


@pytest.mark.parametrize("value", [0, 100, 256, True, "128", 128.0])
def test_l2_fetch_granularity_is_checked(value):
    """l2_fetch_granularity takes None or 32, 64, 128 bytes, naming the parameter otherwise."""
    with pytest.raises(ValueError, match=r"l2_fetch_granularity=.* must be None .* 32, 64 or 128"):
        resolve_settings(Request(l2_fetch_granularity=value), environ={})


def test_l2_fetch_granularity_defaults_to_leaving_the_device_alone():
    """None (the default) leaves the device alone; 128 is kept as given."""
    assert resolve_settings(Request(), environ={}).l2_fetch_granularity is None
    assert (
        resolve_settings(Request(l2_fetch_granularity=128), environ={}).l2_fetch_granularity == 128
    )
