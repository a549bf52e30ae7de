"""Multi-process test harness: run a function on every rank of a real gloo world.

Worker processes are started once per world size and reused by later calls
(spawning and importing torch dominates otherwise); a call that fails or times
out discards its workers. Each call gets a fresh rendezvous store on a port the
OS picks, so parallel test runs never collide. Only ``world_sizes`` imports pytest.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import faulthandler
import functools
import importlib
import inspect
import multiprocessing as mp
import os
import pickle
import re
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any, TypeVar

from ._errors import PdistError

__all__ = ["SpawnError", "count_collectives", "inject", "spawn", "world_sizes"]

R = TypeVar("R")

DEFAULT_TIMEOUT = 120.0
_GRACE_AFTER_FAILURE = 5.0


class SpawnError(PdistError):
    """A rank of a [`spawn`][pdist.testing.spawn] run failed, died or timed out.

    Attributes:
        rank: The first failing rank (None for a timeout of the whole run).
        remote_traceback: That rank's formatted traceback or stack dump.
    """

    def __init__(self, message: str, *, rank: int | None, remote_traceback: str) -> None:
        super().__init__(message)
        self.rank = rank
        self.remote_traceback = remote_traceback


def _worker_main(conn: Connection, rank: int) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    base_env = dict(os.environ)
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            break
        if job is None:
            break
        log_path, env, path, payload = job
        sys.path[:] = path
        os.environ.clear()
        os.environ.update(base_env | env)
        # Without a log path the rank writes to the inherited stdout/stderr as it runs.
        with open(log_path or os.devnull, "w") as log:
            sys.stdout.flush()
            sys.stderr.flush()
            saved = [os.dup(fd) for fd in (1, 2)]
            if log_path:
                for fd in (1, 2):
                    os.dup2(log.fileno(), fd)
            faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
            try:
                fn, args = pickle.loads(payload)
                result = fn(*args)
                try:
                    reply = pickle.dumps(("ok", result))
                except Exception as exc:
                    msg = f"rank {rank}: cannot pickle the result: {exc!r}"
                    reply = pickle.dumps(("error", msg))
            except BaseException:
                reply = pickle.dumps(("error", traceback.format_exc()))
            finally:
                # A job that left the default group initialized must not leak it into the next.
                if dist.is_available() and dist.is_initialized():
                    print("pdist.testing: the job left a process group initialized; destroying it")
                    from ._compat import before_destroying_groups

                    before_destroying_groups()
                    dist.destroy_process_group()
                sys.stdout.flush()
                sys.stderr.flush()
                faulthandler.unregister(signal.SIGUSR1)
                for fd, old in zip((1, 2), saved, strict=True):
                    os.dup2(old, fd)
                    os.close(old)
        conn.send_bytes(reply)
    # Skip interpreter teardown: objects a test left behind must not abort the worker.
    os._exit(0)


class _Pool:
    def __init__(self, world_size: int) -> None:
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.conns: list[Connection] = []
        self.procs: list[Any] = []
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker_main, args=(child, rank), daemon=True)
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(timeout=5)
        for c in self.conns:
            c.close()

    def close(self) -> None:
        for c in self.conns:
            with contextlib.suppress(OSError):
                c.send(None)
        for p in self.procs:
            p.join(timeout=5)
        self.kill()


_pools: dict[int, _Pool] = {}


@atexit.register
def _close_pools() -> None:
    while _pools:
        _pools.popitem()[1].close()


def _discard(world_size: int) -> None:
    pool = _pools.pop(world_size, None)
    if pool is not None:
        pool.kill()


def _read(path: str) -> str:
    with contextlib.suppress(OSError), open(path, errors="replace") as f:
        return f.read()
    return ""


def spawn(
    fn: Callable[..., R],
    world_size: int,
    *args: Any,
    timeout: float | timedelta = DEFAULT_TIMEOUT,
    capture_output: bool = True,
    fresh: bool = False,
) -> list[R]:
    """Run ``fn(*args)`` on ``world_size`` local ranks; return their results in rank order.

    Each rank sees torchrun's variables and a rendezvous store hosted by the
    caller, so ``fn`` can call ``pdist.distributed()`` directly. ``fn`` (defined
    at module level), ``args`` and the results must be picklable. The ranks run in
    check mode (``PDIST_CHECK=1``: tensor collectives with mismatched shapes or dtypes
    raise on every rank) unless the caller's environment sets ``PDIST_CHECK=0``.

    Args:
        fn: The function every rank runs.
        world_size: Number of ranks (>= 1).
        *args: Arguments passed to ``fn`` on every rank.
        timeout: Seconds (or ``timedelta``) for the whole run.
        capture_output: Echo each rank's output after the run (and in a failure's
            message); False lets ranks write to this process's stdout as they run.
        fresh: Run on new worker processes, dropped afterwards: for code that
            reads a process-wide setting once (torch's flight recorder size).

    Returns:
        ``[result of rank 0, result of rank 1, ...]``.

    Raises:
        SpawnError: A rank raised, died, or the run timed out (the message holds
            the traceback or every rank's stacks); the workers are then killed.
        ValueError: ``world_size`` is not a positive int.
    """
    from ._compat import TCPStore
    from ._env import to_seconds

    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        msg = f"world_size={world_size!r} must be a positive int"
        raise ValueError(msg)
    seconds = to_seconds(timeout, "timeout")
    payload = pickle.dumps((fn, args))
    store = TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    pool = _pools.get(world_size)
    if fresh or pool is None or not all(p.is_alive() for p in pool.procs):
        _discard(world_size)
        pool = _pools[world_size] = _Pool(world_size)
    tmp = tempfile.mkdtemp(prefix="pdist-spawn-")
    logs = [os.path.join(tmp, f"rank{r}.log") for r in range(world_size)]
    world_env = {
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(store.port),
        # The store lives in this process, as torchrun's agent store does.
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RESTART_COUNT": "0",
        # Check mode: a test's mismatched collective raises on every rank, never a wrong
        # tensor; PDIST_CHECK=0 in the caller's environment turns it off.
        "PDIST_CHECK": os.environ.get("PDIST_CHECK", "1"),
    }
    for rank, conn in enumerate(pool.conns):
        env = world_env | {"RANK": str(rank), "LOCAL_RANK": str(rank)}
        conn.send((logs[rank] if capture_output else "", env, list(sys.path), payload))
    try:
        return _collect(pool, logs, seconds)
    except BaseException:
        # Interrupted (a test runner's own timeout, Ctrl-C): the ranks may still be inside
        # this job; a later call must not hand its job to them.
        _discard(world_size)
        raise
    finally:
        if fresh:
            _discard(world_size)
        del store
        shutil.rmtree(tmp, ignore_errors=True)


def _collect(pool: _Pool, logs: list[str], seconds: float) -> list[Any]:
    world_size = pool.world_size
    deadline = time.monotonic() + seconds
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    pending = dict(enumerate(pool.conns))
    while pending:
        now = time.monotonic()
        if errors:
            deadline = min(deadline, now + _GRACE_AFTER_FAILURE)
        if now >= deadline:
            break
        for ready in wait(list(pending.values()), timeout=deadline - now):
            rank = next(r for r, c in pending.items() if c is ready)
            conn = pending.pop(rank)
            try:
                status, value = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                proc = pool.procs[rank]
                proc.join(timeout=5)
                status, value = "error", f"rank {rank} died (exit code {proc.exitcode})"
            if status == "ok":
                results[rank] = value
            else:
                errors[rank] = value
    if pending:
        # Dump the stacks of the ranks still running, then kill them all.
        for rank in pending:
            proc = pool.procs[rank]
            if proc.pid is not None and proc.is_alive():
                os.kill(proc.pid, signal.SIGUSR1)
        time.sleep(1.0)
    outputs = [_read(p) for p in logs]
    if not pending and not errors:
        for rank, out in enumerate(outputs):
            if out:
                sys.stdout.write(f"----- rank {rank} output -----\n{out}")
        return [results[r] for r in range(world_size)]
    _discard(world_size)
    report = "\n".join(
        f"----- rank {r} ({'failed' if r in errors else 'still running' if r in pending else 'ok'})"
        f" -----\n{errors.get(r, '')}{outputs[r]}"
        for r in range(world_size)
    )
    if errors:
        first = next(iter(errors))  # the earliest failure; later ones are often its echo
        last_line = errors[first].strip().splitlines()[-1] if errors[first].strip() else ""
        msg = f"rank {first} of {world_size} failed: {last_line}\n{report}"
        raise SpawnError(msg, rank=first, remote_traceback=errors[first])
    msg = (
        f"timed out after {seconds:g}s; ranks {sorted(pending)} of {world_size} still running "
        f"(stacks below)\n{report}"
    )
    raise SpawnError(msg, rank=None, remote_traceback=report)


# kineto (the profiler's C++ side) writes these to file descriptor 2 on every start and stop,
# whatever Python's logging says; its level comes from KINETO_LOG_LEVEL, read once per process.
# A CUDA build of torch on a machine without a GPU also logs, at every start, that it found none.
_KINETO_NOISE = re.compile(
    r"^(?:(?:USDT|STAGE):\d{4}-\d\d-\d\d [^\n]*\] [^\n]*"
    r"|ERROR:\d{4}-\d\d-\d\d [^\n]*\] gpuGetDeviceCount failed with code \d+)\n?",
    re.MULTILINE,
)


@contextlib.contextmanager
def _quiet_kineto() -> Iterator[None]:
    """Drop kineto's start/stop log lines written to fd 2 meanwhile; pass anything else on."""
    with tempfile.TemporaryFile() as sink:
        sys.stderr.flush()
        saved = os.dup(2)
        try:
            os.dup2(sink.fileno(), 2)
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            rest = _KINETO_NOISE.sub("", sink.read().decode(errors="replace"))
            if rest:
                sys.stderr.write(rest)
                sys.stderr.flush()


@contextlib.contextmanager
def count_collectives() -> Iterator[collections.Counter[str]]:
    """Count the collectives this process issues inside the block, by name.

    ``torch.profiler`` records each gloo (and NCCL) collective as an event such
    as ``gloo:broadcast``; the counter is filled when the block exits. The
    profiler's own log lines are swallowed; the block's output is untouched.

    Example:
        ```python
        with count_collectives() as calls:
            pdist.broadcast_object(ctx, obj)
        assert sum(calls.values()) == 1
        ```
    """
    from torch.profiler import ProfilerActivity, profile

    counts: collections.Counter[str] = collections.Counter()
    prof: Any = profile(activities=[ProfilerActivity.CPU])  # torch.profiler is untyped
    with _quiet_kineto():
        prof.__enter__()
    try:
        yield counts
    finally:
        with _quiet_kineto():
            prof.__exit__(None, None, None)
    counts.update(e.name for e in prof.events() if e.name.startswith(("gloo:", "nccl:")))


@contextlib.contextmanager
def inject(
    *,
    allocate: Callable[[int], object] | None = None,
    pack: Callable[[int], object] | None = None,
    outgoing: Callable[[bytes], bytes] | None = None,
) -> Iterator[None]:
    """Inject faults into this rank's pdist calls inside the block: pdist's three test seams.

    What a hook raises is that step's failure on this rank, so a test can check
    that every other rank raises too instead of waiting (see the testing guide).

    Args:
        allocate: Called with the size in bytes before every buffer pdist sends
            from or receives into; raise to make that allocation fail.
        pack: Called with a bucket's index before it is packed for sending;
            raise to make packing fail.
        outgoing: Given every framed message this rank is about to send,
            returns what to send instead: a hostile or corrupt peer.

    Example:
        ```python
        with pdist.testing.inject(allocate=out_of_memory):  # a hook that raises
            pdist.broadcast_object(ctx, None)  # every rank raises, naming this one
        ```
    """
    from . import _seams

    token = _seams.active.set(_seams.Faults(allocate=allocate, pack=pack, outgoing=outgoing))
    try:
        yield
    finally:
        _seams.active.reset(token)


def _run_test(module: str, qualname: str) -> None:
    from ._context import distributed

    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    test_fn = obj.__pdist_test__
    with distributed() as ctx:
        test_fn(ctx)


def world_sizes(
    *sizes: int, timeout: float = DEFAULT_TIMEOUT
) -> Callable[[Callable[..., None]], Any]:
    """Pytest decorator: run a test taking ``ctx`` on every rank of each world size.

    One pytest item per size (``test_x[2]``); every rank runs the body inside
    ``pdist.distributed()``. The test must be a module-level function.

    Example:
        ```python
        @pdist.testing.world_sizes(2, 3)
        def test_sum(ctx):
            assert pdist.all_reduce(ctx, torch.ones(1)).item() == ctx.world_size
        ```
    """
    import pytest

    for size in sizes:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            msg = f"world size {size!r} must be a positive int"
            raise ValueError(msg)

    def decorate(test_fn: Callable[..., None]) -> Any:
        @functools.wraps(test_fn)
        def wrapper(world_size: int) -> None:
            spawn(_run_test, world_size, test_fn.__module__, test_fn.__qualname__, timeout=timeout)

        wrapper.__pdist_test__ = test_fn  # type: ignore[attr-defined]
        wrapper.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
            [inspect.Parameter("world_size", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
        )
        del wrapper.__wrapped__  # pytest must see the signature above, not the test's
        return pytest.mark.parametrize("world_size", sizes)(wrapper)

    return decorate
