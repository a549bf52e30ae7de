"""Launch real rank processes from a script (for tests that need exit codes or namespaces).

``pdist.testing.spawn`` reuses worker processes; tests that end processes on
purpose (the guard's exit code, a dying rank) or that put ranks into their own
mount namespaces (simulated hosts) start fresh interpreters here instead.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass

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
    mount namespace with a private tmpfs on /dev/shm (needs root and unshare),
    of ``shm_size`` (``mount -o size=``, e.g. ``"4m"``) when given.
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
    procs = []
    start = time.monotonic()
    for group in groups:
        lines = []
        for local, rank in enumerate(group):
            assign = f"RANK={rank} LOCAL_RANK={local} LOCAL_WORLD_SIZE={len(group)}"
            run = f"{assign} {shlex.quote(sys.executable)} {shlex.quote(script)}"
            lines.append(f"({run} > {logs[rank]} 2>&1; echo $? > {codes[rank]}) &")
        body = "\n".join(lines) + "\nwait\n"
        if hosts is not None:
            size = f"-o size={shlex.quote(shm_size)} " if shm_size else ""
            body = f"mount -t tmpfs {size}tmpfs /dev/shm || exit 97\n" + body
            cmd = ["unshare", "--mount", "sh", "-c", body]
        else:
            cmd = ["sh", "-c", body]
        procs.append(subprocess.Popen(cmd, env=base, start_new_session=True))
    ended: dict[int, float] = {}
    deadline = start + timeout
    needed = set(range(world_size) if wait_for is None else wait_for)
    while time.monotonic() < deadline and not needed <= set(ended):
        for rank, path in enumerate(codes):
            if rank not in ended and os.path.exists(path) and os.path.getsize(path):
                ended[rank] = time.monotonic() - start
        time.sleep(0.05)
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
        proc.wait()
    results = []
    for rank in range(world_size):
        with open(logs[rank], errors="replace") as f:
            output = f.read()
        rc = None
        if rank in ended:
            with open(codes[rank]) as f:
                rc = int(f.read().strip())
        results.append(RankResult(rank, rc, output, ended.get(rank, float("inf"))))
    del store
    return results


def raised_after(output: str) -> float:
    """The seconds a rank printed as ``RAISED after <s>s``."""
    assert "RAISED after" in output, output
    return float(output.split("RAISED after ")[1].split("s")[0])
