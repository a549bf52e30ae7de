"""Launcher detection and ``PDIST_*`` settings, parsed robustly.

Every setting that holds a duration falls back to its default, with a warning
naming the variable and the default, when it is not a finite non-negative
number: a typo must never disarm a timeout.
"""

from __future__ import annotations

import logging
import math
import os
import re
from collections.abc import Mapping
from datetime import timedelta

import attrs

__all__ = [
    "DEFAULT_TIMEOUT_SEC",
    "DEFAULT_WORLD_COMM_TIMEOUT_SEC",
    "Launch",
    "detect_launch",
    "env_backend",
    "env_seconds",
    "to_seconds",
]

logger = logging.getLogger("pdist")

DEFAULT_TIMEOUT_SEC = 1800.0
"""Collective timeout when neither ``timeout=`` nor ``PDIST_TIMEOUT_SEC`` is given (torch's)."""

DEFAULT_WORLD_COMM_TIMEOUT_SEC = 600.0
"""Deadline of the world-communicator guard when ``PDIST_WORLD_COMM_TIMEOUT_SEC`` is unset."""


@attrs.frozen(kw_only=True)
class Launch:
    """Where this process sits in the job, as the launcher described it.

    Attributes:
        launcher: ``"torchrun"``, ``"slurm"`` or ``"none"`` (a one-rank world).
        rank: Global rank.
        world_size: Number of processes in the job.
        local_rank: Index of this process on its host.
        master_addr: Rendezvous host, when the launcher names one.
        master_port: Rendezvous port, when the launcher names one.
    """

    launcher: str
    rank: int
    world_size: int
    local_rank: int
    master_addr: str | None = None
    master_port: int | None = None


def _int_var(environ: Mapping[str, str], name: str) -> int:
    raw = environ[name]
    try:
        value = int(raw)
    except ValueError:
        msg = f"environment variable {name}={raw!r} is not an integer; check your launcher"
        raise ValueError(msg) from None
    if value < 0:
        msg = f"environment variable {name}={raw!r} is negative; check your launcher"
        raise ValueError(msg)
    return value


def _first_slurm_host(nodelist: str) -> str:
    """First host of a SLURM node list such as ``gpu[003-005,010],cpu1``."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist)
    if match is None:
        return nodelist
    prefix, ranges = match.group(1), match.group(2)
    if ranges is None:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def detect_launch(environ: Mapping[str, str] | None = None) -> Launch:
    """Read the launcher's variables: torchrun's first, then SLURM's, else a one-rank world.

    Args:
        environ: The environment to read; ``os.environ`` by default.

    Returns:
        The launch description.

    Raises:
        ValueError: A launcher variable is not a non-negative integer, or the
            rank is not below the world size.
    """
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        launch = Launch(
            launcher="torchrun",
            rank=_int_var(env, "RANK"),
            world_size=_int_var(env, "WORLD_SIZE"),
            local_rank=_int_var(env, "LOCAL_RANK") if "LOCAL_RANK" in env else 0,
            master_addr=env.get("MASTER_ADDR"),
            master_port=_int_var(env, "MASTER_PORT") if "MASTER_PORT" in env else None,
        )
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        job_id = _int_var(env, "SLURM_JOB_ID") if "SLURM_JOB_ID" in env else 0
        addr = env.get("MASTER_ADDR") or _first_slurm_host(env.get("SLURM_JOB_NODELIST", ""))
        launch = Launch(
            launcher="slurm",
            rank=_int_var(env, "SLURM_PROCID"),
            world_size=_int_var(env, "SLURM_NTASKS"),
            local_rank=_int_var(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0,
            master_addr=addr or "127.0.0.1",
            # A port derived from the job id keeps two jobs sharing a node apart.
            master_port=(
                _int_var(env, "MASTER_PORT") if "MASTER_PORT" in env else 20000 + job_id % 20000
            ),
        )
    else:
        return Launch(launcher="none", rank=0, world_size=1, local_rank=0)
    if launch.world_size < 1 or launch.rank >= launch.world_size:
        msg = (
            f"launcher {launch.launcher!r} gave rank={launch.rank} and "
            f"world_size={launch.world_size}; the rank must be below the world size"
        )
        raise ValueError(msg)
    return launch


def to_seconds(value: float | timedelta, name: str) -> float:
    """A duration argument (seconds or a ``timedelta``) as finite positive seconds.

    Raises:
        TypeError: ``value`` is neither a number nor a ``timedelta``.
        ValueError: ``value`` is not finite and positive.
    """
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        msg = f"{name}={value!r} must be a number of seconds or a datetime.timedelta"
        raise TypeError(msg)
    if not math.isfinite(seconds) or seconds <= 0:
        msg = f"{name}={value!r} must be a finite positive duration"
        raise ValueError(msg)
    return seconds


def env_seconds(
    name: str,
    default: float,
    *,
    zero_means_forever: bool = False,
    environ: Mapping[str, str] | None = None,
) -> float | None:
    """Read a duration in seconds from the environment variable ``name``.

    Unset or empty gives ``default``. A value that is not a number, ``nan``,
    ``inf`` or negative logs a warning naming the variable and the default,
    and gives the default. ``0`` gives ``None`` (wait forever) when
    ``zero_means_forever``, else it is invalid like the others.

    Returns:
        Seconds, or ``None`` for "no deadline".
    """
    env = os.environ if environ is None else environ
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if seconds == 0 and zero_means_forever:
        return None
    if not math.isfinite(seconds) or seconds <= 0:
        expected = "a finite number >= 0" if zero_means_forever else "a finite number > 0"
        logger.warning(
            "pdist: ignoring %s=%r (expected %s of seconds); using the default %gs",
            name,
            raw,
            expected,
            default,
        )
        return default
    return seconds


def env_backend(environ: Mapping[str, str] | None = None) -> str | None:
    """The backend named by ``PDIST_BACKEND``, lower-cased, or None when unset."""
    env = os.environ if environ is None else environ
    raw = env.get("PDIST_BACKEND", "").strip().lower()
    return raw or None
