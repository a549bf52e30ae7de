"""Start-up guard: a deadline on building the world communicator, enforced by a watchdog.

A rank stuck while the world communicator comes up sits inside a C call that
no signal or exception can reach, so the guard's watchdog thread ends the
process itself, with ``WORLD_COMM_TIMEOUT_EXIT_CODE``, after logging which
ranks never checked in.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Store

from . import _env
from ._context import DistContext
from ._errors import PdistError

__all__ = ["WORLD_COMM_TIMEOUT_EXIT_CODE", "world_comm_guard", "world_comm_timeout"]

logger = logging.getLogger("pdist")

WORLD_COMM_TIMEOUT_EXIT_CODE = 93
"""Exit code of a process the guard's watchdog ended."""

_PREFIX = "pdist/guard"
_STORE_READ_SECONDS = 2.0


def world_comm_timeout() -> float | None:
    """The guard's deadline from ``PDIST_WORLD_COMM_TIMEOUT_SEC``: seconds, or None (forever).

    Unset gives 600 s; ``0`` waits forever; a non-number, ``nan``, ``inf`` or a
    negative value logs a warning naming the variable and gives the default.
    """
    return _env.env_seconds(
        "PDIST_WORLD_COMM_TIMEOUT_SEC", _env.DEFAULT_WORLD_COMM_TIMEOUT_SEC, zero_means_forever=True
    )


def _grace(seconds: float) -> float:
    # A build that finishes right at the deadline must not be killed.
    return min(10.0, max(1.0, 0.05 * seconds))


def _default_store() -> Store | None:
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except Exception:  # no default group, or a torch without the helper
        return None


def _read_checkins(store: Store, keys: list[str]) -> dict[int, str] | None:
    """Which ranks checked in (rank -> host), read in a helper thread with a bounded wait.

    The main thread may be stuck inside the store, so the watchdog never waits on it.
    """
    found: dict[int, str] = {}
    done = threading.Event()

    def read() -> None:
        for rank, key in enumerate(keys):
            if store.check([key]):
                found[rank] = store.get(key).decode(errors="replace")
        done.set()

    threading.Thread(target=read, name="pdist-guard-read", daemon=True).start()
    return dict(found) if done.wait(_STORE_READ_SECONDS) else None


def _abort(
    ctx: DistContext, seconds: float, store: Store | None, keys: list[str], what: str
) -> None:
    checked = _read_checkins(store, keys) if store is not None else None
    host = socket.gethostname()
    if checked is None:
        missing_text = "unknown (the rendezvous store did not answer)"
    else:
        missing = [r for r in range(ctx.world_size) if r not in checked]
        described = [
            f"{r} (host {host})" if r in ctx.node.ranks else f"{r} (host unknown)" for r in missing
        ]
        missing_text = ", ".join(described) if described else "none (all checked in)"
    message = (
        f"pdist: rank {ctx.rank} on {host}: {what} did not finish within the {seconds:g}s "
        f"deadline; ranks that never checked in: {missing_text}. Raise the deadline with "
        f"world_comm_guard(ctx, timeout=...) or PDIST_WORLD_COMM_TIMEOUT_SEC (0 waits forever), "
        f"or find out why those ranks are late. Exiting with code {WORLD_COMM_TIMEOUT_EXIT_CODE}."
    )
    logger.error(message)
    sys.stderr.write(message + "\n")
    sys.stderr.flush()
    os._exit(WORLD_COMM_TIMEOUT_EXIT_CODE)


def _resolve(timeout: float | timedelta | None) -> float | None:
    if timeout is None:
        return world_comm_timeout()
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout == 0:
        return None
    return _env.to_seconds(timeout, "timeout")


@contextlib.contextmanager
def world_comm_guard(ctx: DistContext, timeout: float | timedelta | None = None) -> Iterator[None]:
    """Build the world communicator under a deadline that also covers the block.

    On entry every rank checks in (its rank and host, in the rendezvous store)
    and runs a probe all-reduce on the world device group, whose sum is
    verified. If the probe and the block do not finish within the deadline
    (plus a short grace), a watchdog logs which ranks never checked in, the
    deadline and how to raise it, and ends the process with
    ``WORLD_COMM_TIMEOUT_EXIT_CODE`` (93): the stall sits inside a C call
    that no exception can reach.

    .. note:: Every rank of the world must enter it.

    Args:
        ctx: The context.
        timeout: Seconds or ``timedelta``; ``0`` waits forever; None reads
            :func:`world_comm_timeout` (``PDIST_WORLD_COMM_TIMEOUT_SEC``, default 600).

    Raises:
        PdistError: The probe's sum is wrong (a broken communicator).
    """
    seconds = _resolve(timeout)
    store = _default_store()
    keys: list[str] = []
    if store is not None:
        # The k-th guard of every rank shares generation k.
        generation = store.add(f"{_PREFIX}/calls/{ctx.rank}", 1)
        keys = [f"{_PREFIX}/{generation}/rank/{r}" for r in range(ctx.world_size)]
        store.set(keys[ctx.rank], socket.gethostname())
    finished = threading.Event()
    stage = ["building the world communicator"]
    watchdog = None
    if seconds is not None and math.isfinite(seconds):
        limit = seconds

        def watch() -> None:
            if not finished.wait(limit + _grace(limit)):
                _abort(ctx, limit, store, keys, stage[0])

        watchdog = threading.Thread(target=watch, name="pdist-world-comm-guard", daemon=True)
        watchdog.start()
    try:
        start = time.monotonic()
        if ctx.world_size > 1:
            probe = torch.full((1,), float(ctx.rank + 1), device=ctx.device)
            dist.all_reduce(probe, group=ctx.world.device_group)
            expected = ctx.world_size * (ctx.world_size + 1) / 2
            if probe.item() != expected:
                msg = (
                    f"world communicator probe on rank {ctx.rank}: all-reduce gave "
                    f"{probe.item()}, expected {expected}; the communicator is broken"
                )
                raise PdistError(msg)
        took = time.monotonic() - start
        logger.info("pdist: world communicator of %d ranks built in %.2fs", ctx.world_size, took)
        stage[0] = "the guarded block"
        yield
    finally:
        finished.set()
        if watchdog is not None:
            watchdog.join()
