"""Launcher detection and ``PDIST_*`` settings, resolved into one frozen ``Settings``.

``resolve_settings`` is pure: ``distributed()``'s arguments, the environment and
the machine's accelerator (probed elsewhere) become one value, so every rule is tested
without processes. A duration setting that is not a finite non-negative number falls back
to its default, with a warning naming the variable: a typo must never disarm a timeout.
"""

from __future__ import annotations

import logging
import math
import os
import re
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import attrs
import torch

from ._layout import KEYWORDS, Layout, make_axes_layout, make_layout

__all__ = [
    "DEFAULT_BACKENDS",
    "DEFAULT_ON_STALL",
    "DEFAULT_STALL_ANSWER_SEC",
    "DEFAULT_STALL_TIMEOUT_SEC",
    "DEFAULT_TIMEOUT_SEC",
    "DEFAULT_WORLD_COMM_TIMEOUT_SEC",
    "KNOWN_BACKENDS",
    "ON_STALL_MODES",
    "Accelerator",
    "Adopted",
    "Launch",
    "Request",
    "Settings",
    "collective_seconds",
    "deadline_seconds",
    "detect_launch",
    "device_and_backend",
    "env_backend",
    "env_flag",
    "env_seconds",
    "resolve_layout",
    "resolve_settings",
    "stall_settings",
    "to_seconds",
    "world_comm_timeout",
]

logger = logging.getLogger("pdist")

DEFAULT_TIMEOUT_SEC = 1800.0  # torch's
DEFAULT_WORLD_COMM_TIMEOUT_SEC = 600.0
DEFAULT_STALL_TIMEOUT_SEC = 300.0
DEFAULT_STALL_ANSWER_SEC = 10.0  # how long a stall report waits for the ranks' answers
ON_STALL_MODES = ("report", "exit")


class _DefaultMode(str):
    """``on_stall``'s default ``"report"``: ``PDIST_ON_STALL`` replaces it, never a value set."""

    __slots__ = ()


DEFAULT_ON_STALL: str = _DefaultMode("report")


@attrs.frozen(kw_only=True)
class Launch:
    """Where this process sits in the job; ``launcher``: ``"torchrun"``, ``"slurm"``, ``"none"``."""

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
    """Read the launcher's variables: torchrun's first, then SLURM's, else a one-rank world."""
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        launcher, names = "torchrun", ("RANK", "WORLD_SIZE", "LOCAL_RANK")
        addr, port = env.get("MASTER_ADDR"), None
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        launcher, names = "slurm", ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")
        job_id = _int_var(env, "SLURM_JOB_ID") if "SLURM_JOB_ID" in env else 0
        first = _first_slurm_host(env.get("SLURM_JOB_NODELIST", ""))
        addr = env.get("MASTER_ADDR") or first or "127.0.0.1"
        port = 20000 + job_id % 20000  # derived from the job: two jobs sharing a node stay apart
    else:
        return Launch(launcher="none", rank=0, world_size=1, local_rank=0)
    rank, world_size, local_rank = names
    launch = Launch(
        launcher=launcher,
        rank=_int_var(env, rank),
        world_size=_int_var(env, world_size),
        local_rank=_int_var(env, local_rank) if local_rank in env else 0,
        master_addr=addr,
        master_port=_int_var(env, "MASTER_PORT") if "MASTER_PORT" in env else port,
    )
    if launch.world_size < 1 or launch.rank >= launch.world_size:
        msg = (
            f"launcher {launch.launcher!r} gave rank={launch.rank} and "
            f"world_size={launch.world_size}; the rank must be below the world size"
        )
        raise ValueError(msg)
    return launch


def to_seconds(value: float | timedelta, name: str) -> float:
    """A duration argument (seconds or a ``timedelta``) as finite positive seconds."""
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
) -> float:
    """Seconds from the variable ``name``; unset gives ``default``, so does a bad value (warning).

    ``0`` gives ``0.0`` (forever: the caller reads it so) when ``zero_means_forever``, else it
    is bad too.
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
        return 0.0
    if not math.isfinite(seconds) or seconds <= 0:
        expected = "a finite number >= 0" if zero_means_forever else "a finite number > 0"
        msg = "pdist: ignoring %s=%r (expected %s of seconds); using the default %gs"
        logger.warning(msg, name, raw, expected, default)
        return default
    return seconds


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def env_flag(name: str, default: bool, environ: Mapping[str, str] | None = None) -> bool:
    """A yes/no variable: ``1/true/yes/on`` or ``0/false/no/off``; else ``default`` (warning)."""
    env = os.environ if environ is None else environ
    raw = env.get(name, "").strip()
    if not raw:
        return default
    if raw.lower() in _TRUE + _FALSE:
        return raw.lower() in _TRUE
    msg = "pdist: ignoring %s=%r (expected 1 or 0); using the default %s"
    logger.warning(msg, name, raw, int(default))
    return default


def env_backend(environ: Mapping[str, str] | None = None) -> str | None:
    """The backend named by ``PDIST_BACKEND``, lower-cased, or None when unset."""
    env = os.environ if environ is None else environ
    raw = env.get("PDIST_BACKEND", "").strip().lower()
    return raw or None


def world_comm_timeout(environ: Mapping[str, str] | None = None) -> float | None:
    """The start-up deadline from ``PDIST_WORLD_COMM_TIMEOUT_SEC``: seconds, or None (forever)."""
    return deadline_seconds(None, "", environ)


KNOWN_BACKENDS = ("gloo", "nccl", "xccl", "hccl", "mpi", "ucc")
# Where torch cannot say (``get_default_backend_for_device``).
DEFAULT_BACKENDS: dict[str, str] = {
    "cuda": "nccl", "xpu": "xccl", "npu": "hccl", "hpu": "hccl", "mps": "gloo", "cpu": "gloo"
}  # fmt: skip
# The device types a backend's tensors must live on; the others take any device.
_BACKEND_DEVICE = {"nccl": ("cuda",), "xccl": ("xpu",), "hccl": ("npu", "hpu")}


@attrs.frozen(kw_only=True)
class Accelerator:
    """The machine's accelerator (device type, visible devices, default backend), as torch says."""

    type: str
    count: int
    backend: str


@attrs.frozen(kw_only=True)
class Adopted:
    """An already-initialized default process group that ``distributed()`` adopts."""

    rank: int
    world_size: int
    backend: str


@attrs.frozen(kw_only=True)
class Request:
    """``distributed()``'s arguments as the caller passed them; ``resolve_settings`` checks them.

    ``sizes``: the layout keywords given (``tp=``, ``sp=``, ``cp=``, ``pp=``: the keyword
    axes of ``_layout.GROUPS``), by name; ``store_given``: a store was passed in. The other
    fields are ``distributed()``'s arguments of the same names.
    """

    sizes: Mapping[str, int] = attrs.field(factory=dict)
    ep: int = 1
    axes: Mapping[str, int] | None = None
    backend: str | None = None
    device: str | torch.device | int | None = None
    timeout: float | timedelta | None = None
    startup_timeout: float | timedelta | None = None
    l2_fetch_granularity: int | None = None
    stall_timeout: float | timedelta | None = None
    on_stall: str = DEFAULT_ON_STALL
    check: bool = False
    store_given: bool = False
    rank: int | None = None
    world_size: int | None = None
    local_rank: int | None = None
    cpu_affinity: bool = True


@attrs.frozen(kw_only=True)
class Settings:
    """Everything ``distributed()`` needs to know before it touches torch.distributed.

    Durations are seconds; ``startup_timeout`` None waits forever, ``stall_timeout``
    None means no watch, ``l2_fetch_granularity`` None leaves the device alone.
    ``adopt``: the default group is already initialized; adopt it, leave it alone.
    """

    launch: Launch
    layout: Layout
    backend: str
    device: torch.device
    timeout: timedelta
    subgroup_timeout: timedelta
    startup_timeout: float | None
    l2_fetch_granularity: int | None
    stall_timeout: float | None
    on_stall: str
    stall_answer: float
    cpu_affinity: bool
    adopt: bool
    check: bool = False  # check mode: every tensor collective first agrees on its arguments


def _in_range(device: object, kind: str, index: int, accelerator: Accelerator) -> torch.device:
    """Device ``index`` of ``kind``; ``device`` None means the index came from the local rank."""
    if index < accelerator.count:
        return torch.device(kind, index)
    label = kind.upper()
    if device is None:
        msg = (
            f"LOCAL_RANK={index} has no {kind} device: only {accelerator.count} {label} "
            f"device(s) are visible to this process (a launcher that gives each task one GPU "
            f"shows it as {kind}:0); pass device='{kind}:0' or device=<index>, or make every "
            f"device visible to every rank of the host"
        )
    else:
        msg = (
            f"device={device!r} (index {index}) is beyond the {accelerator.count} visible "
            f"{label} device(s); check CUDA_VISIBLE_DEVICES and the processes per node"
        )
    raise ValueError(msg)


def _resolve_device(
    device: str | torch.device | int | None,
    backend: str | None,
    local_rank: int,
    accelerator: Accelerator | None,
) -> torch.device:
    if device is None:
        if accelerator is None or backend == "gloo":
            return torch.device("cpu")
        return _in_range(None, accelerator.type, local_rank, accelerator)
    if isinstance(device, int) and not isinstance(device, bool):
        if accelerator is None:
            msg = f"device={device!r} names an accelerator index, but none is available"
            raise ValueError(msg)
        device = torch.device(accelerator.type, device)
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        msg = f"device={device!r} is not a torch device ({exc})"
        raise ValueError(msg) from None
    if resolved.type == "cpu":
        return resolved
    if accelerator is None or resolved.type != accelerator.type:
        msg = f"device={device!r} needs {resolved.type.upper()}, which is not available"
        raise ValueError(msg + "; use device='cpu'")
    index = local_rank if resolved.index is None else resolved.index
    return _in_range(device, resolved.type, index, accelerator)


def _resolve_backend(
    backend: str | None,
    device: torch.device,
    accelerator: Accelerator | None,
    name: str = "backend",
) -> str:
    """``name`` is where ``backend`` came from: the argument, or ``PDIST_BACKEND``."""
    if backend is None:
        if accelerator is not None and device.type == accelerator.type:
            return accelerator.backend
        return DEFAULT_BACKENDS.get(device.type, "gloo")
    if not isinstance(backend, str) or backend.lower() not in KNOWN_BACKENDS:
        msg = f"{name}={backend!r} is not one of {KNOWN_BACKENDS}"
        raise ValueError(msg)
    backend = backend.lower()
    needs = _BACKEND_DEVICE.get(backend, ())
    if needs and device.type not in needs:
        label = needs[0].upper()
        available = accelerator is not None and accelerator.type == needs[0]
        msg = (
            f"{name}={backend!r} needs a {label} device, but the device is {str(device)!r}"
            + ("" if available else f" ({label} is not available)")
            + "; use backend='gloo' on CPU"
        )
        raise ValueError(msg)
    return backend


def device_and_backend(
    device: str | torch.device | int | None,
    backend: str | None,
    index: int,
    accelerator: Accelerator | None,
    environ: Mapping[str, str] | None = None,
) -> tuple[torch.device, str]:
    """A device and backend as ``distributed()`` resolves them (``index``: the default one)."""
    requested = backend if backend is not None else env_backend(environ)
    source = "backend" if backend is not None else "PDIST_BACKEND"
    resolved = _resolve_device(device, requested, index, accelerator)
    return resolved, _resolve_backend(requested, resolved, accelerator, source)


def collective_seconds(
    timeout: float | timedelta | None, environ: Mapping[str, str] | None = None
) -> float:
    """A collective timeout argument as seconds: None reads ``PDIST_TIMEOUT_SEC`` (1800 s)."""
    if timeout is None:
        return env_seconds("PDIST_TIMEOUT_SEC", DEFAULT_TIMEOUT_SEC, environ=environ)
    return to_seconds(timeout, "timeout")


def deadline_seconds(
    value: float | timedelta | None,
    name: str,
    environ: Mapping[str, str] | None = None,
    var: tuple[str, float] = ("PDIST_WORLD_COMM_TIMEOUT_SEC", DEFAULT_WORLD_COMM_TIMEOUT_SEC),
) -> float | None:
    """A deadline argument as seconds, or None (``0``: forever); None reads ``var``, its default."""
    if value is None:
        return env_seconds(*var, zero_means_forever=True, environ=environ) or None
    zero = timedelta(0) if isinstance(value, timedelta) else 0
    if not isinstance(value, bool) and isinstance(value, (int, float, timedelta)) and value == zero:
        return None
    return to_seconds(value, name)


def _on_stall(value: object, environ: Mapping[str, str]) -> str:
    if value is DEFAULT_ON_STALL:
        raw = environ.get("PDIST_ON_STALL", "").strip()
        if raw and raw.lower() not in ON_STALL_MODES:
            msg = f"PDIST_ON_STALL={raw!r} is not one of {ON_STALL_MODES}"
            raise ValueError(msg)
        return raw.lower() or "report"
    if not isinstance(value, str) or value not in ON_STALL_MODES:
        msg = f"on_stall={value!r} is not one of {ON_STALL_MODES}"
        raise ValueError(msg)
    return str(value)


def stall_settings(
    stall_timeout: float | timedelta | None,
    on_stall: str = DEFAULT_ON_STALL,
    environ: Mapping[str, str] | None = None,
) -> tuple[float | None, str, float]:
    """The stall watch's ``(stall_timeout, on_stall, answer wait)``; ``0`` turns the watch off.

    Unset arguments read ``PDIST_STALL_TIMEOUT_SEC`` and ``PDIST_ON_STALL``; a value the caller
    wrote wins. The answer wait reads ``PDIST_STALL_ANSWER_SEC``.
    """
    env = os.environ if environ is None else environ
    var = ("PDIST_STALL_TIMEOUT_SEC", DEFAULT_STALL_TIMEOUT_SEC)
    seconds = deadline_seconds(stall_timeout, "stall_timeout", env, var)
    answer = env_seconds("PDIST_STALL_ANSWER_SEC", DEFAULT_STALL_ANSWER_SEC, environ=env)
    return seconds, _on_stall(on_stall, env), answer


def _launch(
    env: Mapping[str, str],
    overrides: dict[str, int | None],
    adopted: Adopted | None,
    store_given: bool,
) -> Launch:
    """The launcher's description, with the adopted group's and the caller's overrides."""
    for name, value in overrides.items():
        least = 1 if name == "world_size" else 0
        is_int = isinstance(value, int) and not isinstance(value, bool)
        if value is None or (is_int and value >= least):
            continue
        what = "a positive int (the number of ranks in the job)" if least else "a non-negative int"
        msg = f"{name}={value!r} must be {what}"
        raise ValueError(msg)
    launch = detect_launch(env)
    if adopted is not None:
        for name, actual in (("rank", adopted.rank), ("world_size", adopted.world_size)):
            value = overrides[name]
            if value is not None and value != actual:
                msg = (
                    f"{name}={value} contradicts the initialized default process group "
                    f"({name} {actual}), which distributed() adopts as it is; drop {name}="
                )
                raise ValueError(msg)
        launch = attrs.evolve(launch, rank=adopted.rank, world_size=adopted.world_size)
    given: dict[str, Any] = {name: value for name, value in overrides.items() if value is not None}
    launch = attrs.evolve(launch, **given)
    if launch.rank >= launch.world_size:
        msg = f"rank={launch.rank} must be below world_size={launch.world_size}"
        raise ValueError(msg)
    if adopted is None and not store_given and launch.world_size > 1 and launch.launcher == "none":
        msg = (
            f"world_size={launch.world_size} without a launcher needs a rendezvous: "
            "pass store= or run under torchrun/SLURM"
        )
        raise ValueError(msg)
    return launch


def _l2_fetch_granularity(value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value not in (32, 64, 128):
        msg = (
            f"l2_fetch_granularity={value!r} must be None (leave the device alone) or a number "
            "of bytes CUDA accepts: 32, 64 or 128 (the seed sets 128)"
        )
        raise ValueError(msg)
    return value


def resolve_layout(
    world_size: int, *, ep: int = 1, axes: Mapping[str, int] | None = None, **sizes: int
) -> Layout:
    """The layout of ``distributed()``'s size arguments (pure: the same error on every rank).

    ``sizes``: the keyword axes' (``tp=``, ``sp=``, ``cp=``, ``pp=``); ``axes``: user-named ones.

    Raises:
        TypeError: A size that is no int, or ``axes`` that is no mapping of str to int.
        ValueError: ``axes=`` beside a ``tp``/``sp``/``cp``/``pp`` keyword, or sizes that
            do not fit the world (see ``make_layout``).
    """
    if axes is None:
        return make_layout(world_size, ep=ep, **sizes)
    given = {n: sizes[n] for n in KEYWORDS if n in sizes}  # in the keywords' order
    given = {n: v for n, v in given.items() if type(v) is not int or v != 1}
    if given:
        shown = ", ".join(f"{n}={v!r}" for n, v in given.items())
        msg = (
            f"axes= excludes the {'/'.join(KEYWORDS)} keywords, but {shown} was given as well; "
            f"name every axis inside axes, e.g. axes={{'dp': -1, {next(iter(given))!r}: "
            f"{next(iter(given.values()))!r}}}"
        )
        raise ValueError(msg)
    return make_axes_layout(world_size, axes, ep=ep)


def resolve_settings(
    request: Request,
    *,
    environ: Mapping[str, str] | None = None,
    accelerator: Accelerator | None = None,
    adopted: Adopted | None = None,
) -> Settings:
    """``distributed()``'s arguments and the environment as ``Settings`` (pure).

    Besides the ``request``: ``environ`` (default ``os.environ``), ``accelerator`` (None on a
    CPU-only machine) and ``adopted`` (the initialized default group, if any). Check mode is
    on when ``check`` is true or ``PDIST_CHECK`` says so.
    """
    r = request
    if not isinstance(r.check, bool):
        msg = f"check={r.check!r} must be True or False"
        raise TypeError(msg)
    env = os.environ if environ is None else environ
    overrides = {"rank": r.rank, "world_size": r.world_size, "local_rank": r.local_rank}
    launch = _launch(env, overrides, adopted, r.store_given)
    layout = resolve_layout(launch.world_size, ep=r.ep, axes=r.axes, **r.sizes)
    device, backend = device_and_backend(r.device, r.backend, launch.local_rank, accelerator, env)
    seconds = collective_seconds(r.timeout, env)
    sub_seconds = env_seconds("PDIST_SUBGROUP_TIMEOUT_SEC", seconds, environ=env)
    stall, mode, answer = stall_settings(r.stall_timeout, r.on_stall, env)
    return Settings(
        launch=launch,
        layout=layout,
        backend=backend if adopted is None else adopted.backend,
        device=device,
        timeout=timedelta(seconds=seconds),
        subgroup_timeout=timedelta(seconds=sub_seconds),
        startup_timeout=deadline_seconds(r.startup_timeout, "startup_timeout", env),
        l2_fetch_granularity=_l2_fetch_granularity(r.l2_fetch_granularity),
        stall_timeout=stall,
        on_stall=mode,
        stall_answer=answer,
        cpu_affinity=bool(r.cpu_affinity),
        adopt=adopted is not None,
        check=r.check or env_flag("PDIST_CHECK", False, env),
    )
