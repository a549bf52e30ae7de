"""Launch real rank processes from a script (for tests that need exit codes or namespaces).

``pdist.testing.spawn`` reuses worker processes; tests that end processes on
purpose (the guard's exit code, a dying rank) or that put ranks into their own
mount namespaces (simulated hosts) start fresh interpreters here instead.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from dataclasses import dataclass
from typing import Any

from torch.distributed import TCPStore


@dataclass
class RankResult:
    """How one rank ended."""

    rank: int
    returncode: int | None  # None: killed at the deadline
    output: str
    seconds: float  # from launch to exit


def run_ranks(
    code: str,
    world_size: int,
    *,
    timeout: float,
    hosts: list[list[int]] | None = None,
    env: dict[str, str] | None = None,
    wait_for: list[int] | None = None,
    shm_size: str | None = None,
) -> list[RankResult]:
    """Run ``code`` as a script on ``world_size`` ranks; kill whatever runs past ``timeout``.

    With ``wait_for``, the run ends (killing the others) once those ranks ended.

    ``hosts`` groups ranks into simulated hosts: each group runs in its own
    mount namespace with a private tmpfs on /dev/shm (needs root), of
    ``shm_size`` (``mount -o size=``, e.g. ``"4m"``) when given.

    The ranks are forked from a zygote that imported torch once
    (``zygote.py``); each runs ``code`` as ``python script.py`` would.
    """
    store = TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    tmp = tempfile.mkdtemp(prefix="pdist-launch-")
    script = os.path.join(tmp, "rank.py")
    with open(script, "w") as f:
        f.write(textwrap.dedent(code))
    base = {
        **os.environ,
        **(env or {}),
        "WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(store.port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RESTART_COUNT": "0",
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
    }
    logs = [os.path.join(tmp, f"rank{r}.log") for r in range(world_size)]
    codes = [os.path.join(tmp, f"rank{r}.rc") for r in range(world_size)]
    groups = hosts or [[r] for r in range(world_size)]
    start = time.monotonic()
    leaders = [
        _zygote().fork_host(
            {
                "ranks": group,
                "env": base,
                "script": script,
                "logs": logs,
                "codes": codes,
                "private_shm": hosts is not None,
                "shm_size": shm_size,
            }
        )
        for group in groups
    ]
    ended: dict[int, float] = {}
    deadline = start + timeout
    needed = set(range(world_size) if wait_for is None else wait_for)
    while time.monotonic() < deadline and not needed <= set(ended):
        for rank, path in enumerate(codes):
            if rank not in ended and os.path.exists(path):
                ended[rank] = time.monotonic() - start
        time.sleep(0.05)
    for leader in leaders:
        _kill_host(leader)
    results = []
    for rank in range(world_size):
        try:
            with open(logs[rank], errors="replace") as f:
                output = f.read()
        except FileNotFoundError:  # killed before it started
            output = ""
        rc = None
        if rank in ended:
            with open(codes[rank]) as f:
                rc = int(f.read().strip())
        results.append(RankResult(rank, rc, output, ended.get(rank, float("inf"))))
    del store
    return results


class _Zygote:
    """The zygote process (``zygote.py``) of this test process, started on first use."""

    def __init__(self) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "zygote.py")
        self.proc = subprocess.Popen(
            [sys.executable, path],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=True,
        )
        self._lock = threading.Lock()  # two jobs launched from two threads share the zygote
        self._answer()  # READY: torch is imported

    def _answer(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the launcher's zygote died (exit status {self.proc.wait()})")
        return line.strip()

    def fork_host(self, request: dict[str, Any]) -> int:
        """Fork a host leader running ``request``'s ranks; returns its pid (its session id)."""
        assert self.proc.stdin is not None
        with self._lock:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            return int(self._answer())

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()


_zygotes: list[_Zygote] = []  # at most one, alive
_starting = threading.Lock()


def _zygote() -> _Zygote:
    with _starting:
        return _started()


def _started() -> _Zygote:
    if not _zygotes or _zygotes[0].proc.poll() is not None:
        _zygotes[:] = [_Zygote()]
        atexit.register(_zygotes[0].close)
    return _zygotes[0]


def _kill_host(leader: int) -> None:
    """Kill a host's leader, ranks and their children (one session), and wait until it is gone."""
    try:
        os.killpg(leader, signal.SIGKILL)
    except ProcessLookupError:
        return
    # The zygote reaps its leaders; the killed ranks are reparented and reaped elsewhere.
    for _ in range(200):
        try:
            os.kill(leader, 0)
        except ProcessLookupError:
            return
        time.sleep(0.01)


def raised_after(output: str) -> float:
    """The seconds a rank printed as ``RAISED after <s>s``."""
    assert "RAISED after" in output, output
    return float(output.split("RAISED after ")[1].split("s")[0])
