"""A process that has imported torch once and forks rank processes from it (see launcher.py).

Importing torch costs about 3 s of CPU per process on a 2-core machine, and the
launcher's tests start some 70 rank processes. This zygote pays it once: it
reads one JSON request per line on stdin (a simulated host: its ranks, their
environment, script and log files), forks a host leader and answers with the
leader's pid. The leader starts a session (so the launcher can kill the whole
host with one ``killpg``), gives the host a private ``/dev/shm`` when asked
(``unshare --mount`` plus a tmpfs, as the shell launcher did), forks one
process per rank and writes each rank's exit status (``128 + signal`` when a
signal ended it, as a shell reports it) to the rank's ``.rc`` file.

A rank runs its script as ``python script.py`` would: as ``__main__``, with
its own environment, its output in its log file, ``SystemExit`` codes and
tracebacks as the interpreter reports them, and the interpreter's exit steps
(waiting for non-daemon threads, then ``atexit`` handlers) before it ends.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import json
import os
import runpy
import signal
import sys
import threading
import traceback
from typing import Any

# The imports each rank would otherwise pay for.
import torch
import torch.distributed  # noqa: F401

import pdist  # noqa: F401

_CLONE_NEWNS = 0x00020000
_MS_REC = 0x4000
_MS_PRIVATE = 1 << 18
_NO_SHM = 97  # the status every rank of a host gets when its /dev/shm cannot be mounted


def _private_shm(size: str | None) -> None:
    """This process (and its children) get their own mount namespace and a fresh /dev/shm."""
    libc = ctypes.CDLL(None, use_errno=True)

    def check(result: int, what: str) -> None:
        if result != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"{what}: {os.strerror(errno)}")

    check(libc.unshare(_CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    # As unshare --mount does: nothing mounted here propagates back to the host.
    check(libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None), "mount --make-rprivate /")
    options = f"size={size}".encode() if size else None
    check(libc.mount(b"tmpfs", b"/dev/shm", b"tmpfs", 0, options), "mount tmpfs on /dev/shm")


def _exit_code(code: object) -> int:
    """What the interpreter makes of ``sys.exit(code)``."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _run_rank(request: dict[str, Any], rank: int, local_rank: int, local_size: int) -> None:
    """The rank process: run the script as ``python script.py`` would; never returns."""
    code = 1
    try:
        os.environ.clear()
        os.environ.update(request["env"])
        os.environ.update(
            RANK=str(rank), LOCAL_RANK=str(local_rank), LOCAL_WORLD_SIZE=str(local_size)
        )
        log = os.open(request["logs"][rank], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(null)
        os.close(log)
        sys.stdin = open(0, closefd=False)  # noqa: SIM115  the process's own streams
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        sys.argv = [request["script"]]
        try:
            runpy.run_path(request["script"], run_name="__main__")
            code = 0
        except SystemExit as exc:
            code = _exit_code(exc.code)
        except BaseException:  # what the interpreter prints for an uncaught exception
            traceback.print_exc()
            code = 1
        threading._shutdown()  # type: ignore[attr-defined]  # as the interpreter's exit does
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # a closed stream: nothing left to write
                stream.flush()
        os._exit(code)


def _shell_status(wait_status: int) -> int:
    """A rank's exit status as a shell reports it: its code, or 128 + the signal that ended it."""
    code = os.waitstatus_to_exitcode(wait_status)
    return code if code >= 0 else 128 - code


def _write_status(path: str, code: int) -> None:
    partial = f"{path}.partial"
    with open(partial, "w") as f:
        f.write(f"{code}\n")
    os.rename(partial, path)  # the launcher never reads a half-written status


def _lead_host(request: dict[str, Any]) -> None:
    """The host leader: a session, maybe a private /dev/shm, one child per rank; never returns."""
    try:
        os.setsid()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        ranks: list[int] = request["ranks"]
        if request["private_shm"]:
            try:
                _private_shm(request["shm_size"])
            except OSError as exc:
                for rank in ranks:
                    with open(request["logs"][rank], "w") as f:
                        f.write(f"launcher: no private /dev/shm for this host: {exc}\n")
                    _write_status(request["codes"][rank], _NO_SHM)
                os._exit(_NO_SHM)
        children = {}
        for local_rank, rank in enumerate(ranks):
            pid = os.fork()
            if pid == 0:
                _run_rank(request, rank, local_rank, len(ranks))
            children[pid] = rank
        while children:
            pid, status = os.wait()
            if pid in children:
                _write_status(request["codes"][children.pop(pid)], _shell_status(status))
    finally:
        os._exit(0)


def main() -> None:
    """Answer each request line with the pid of a host leader forked for it."""
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # host leaders are reaped automatically
    print("READY", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _lead_host(request)
        print(pid, flush=True)


if __name__ == "__main__":
    main()
