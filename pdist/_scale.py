"""``python -m pdist bench --simulate-world W[,W...]``: start-up cost on a simulated world.

One process plays rank ``r`` of a W-rank job through torch's fake process
group (``init_process_group("fake", store=FakeStore(), rank=r,
world_size=W)``), which accepts every collective and moves no data; pdist's
``distributed()`` adopts it. Each measurement runs in a fresh interpreter, so
that peak memory is its own:

- ``pdist``: ``distributed(tp=8)``, which builds the world, ``tp``, ``sp``,
  ``dp``, ``dp_sp`` and ``node`` groups (hosts of ``LOCAL_WORLD_SIZE=8``
  ranks) and runs host detection;
- ``mesh``: ``init_device_mesh("cpu", (W // 8, 1, 8))`` on the same world, the
  baseline;
- ``pdist-split``: pdist again, as it builds on an accelerator-bound world
  (NCCL with ``device_id``), where each partition's device groups come from
  one ``split_group`` over the world. The fake group cannot split, so
  ``split_group`` is replaced by a stand-in that counts the call and builds
  the caller's block locally; the figure that matters there is the count of
  world-wide split calls.

torch is otherwise patched only to count: ``new_group`` and ``split_group``
calls (and how many of them involve every rank of the world), and the bytes
that all-gathers write on this rank. CPU time is ``time.process_time()``
around the call; added peak RSS is the growth of ``ru_maxrss``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["DEFAULT_WORLDS", "format_table", "measure", "simulate"]

DEFAULT_WORLDS = (512, 4096, 8192, 16384)
_TP = 8
_PER_HOST = 8


def _counting(stats: dict[str, int]) -> Callable[[], None]:
    """Wrap torch's communicator-creating calls and all-gathers with counters.

    Returns the function that puts torch's own functions back.
    """
    import torch.distributed as dist
    from torch.distributed import device_mesh, distributed_c10d

    real_new_group = dist.new_group
    real_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

    def new_group(*args: Any, **kwargs: Any) -> Any:
        stats["new_group"] += 1
        if not kwargs.get("use_local_synchronization", False):
            stats["world_wide"] += 1  # every rank of the world takes part
        return real_new_group(*args, **kwargs)

    def split_group(*args: Any, **kwargs: Any) -> Any:
        stats["split_group"] += 1
        stats["world_wide"] += 1
        blocks = kwargs["split_ranks"]
        rank = dist.get_rank()
        mine = next(b for b in blocks if rank in b)
        return real_new_group(list(mine), use_local_synchronization=True, backend="fake")

    def all_gather(out: Any, inp: Any, *args: Any, **kwargs: Any) -> Any:
        stats["all_gather_bytes"] += out.numel() * out.element_size()
        return real_all_gather(out, inp, *args, **kwargs)

    patches = {"new_group": new_group, "split_group": split_group}
    saved: list[tuple[Any, str, Any]] = []
    for module in (dist, distributed_c10d, device_mesh):
        for name, wrapper in patches.items():
            if hasattr(module, name):
                saved.append((module, name, getattr(module, name)))
                setattr(module, name, wrapper)
    for name in ("all_gather_single", "all_gather_into_tensor"):
        if hasattr(dist, name):
            saved.append((dist, name, getattr(dist, name)))
            setattr(dist, name, all_gather)

    def restore() -> None:
        for module, name, original in reversed(saved):
            setattr(module, name, original)

    return restore


def simulate(world_size: int, mode: str, *, clean_up: bool = False) -> dict[str, Any]:
    """Measure one start-up in this process; see the module docstring.

    The memory figure is meaningful only in a fresh process (see :func:`measure`).
    With ``clean_up`` the start-up's groups and the simulated world are destroyed
    and torch's functions restored afterwards, so that a test can run several
    simulations in one worker.
    """
    import gc
    import resource
    import time

    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    os.environ["LOCAL_WORLD_SIZE"] = str(_PER_HOST)
    rank = world_size // 2 + 3 if world_size > 8 else world_size - 1
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    stats = {"new_group": 0, "split_group": 0, "world_wide": 0, "all_gather_bytes": 0}
    from torch.distributed.device_mesh import init_device_mesh

    from . import _subgroups
    from ._context import distributed

    restore = _counting(stats)
    splits = _subgroups._splits
    if mode == "pdist-split":
        _subgroups._splits = lambda world: True
    try:
        gc.collect()
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        start = time.process_time()
        if mode == "mesh":
            held: Any = init_device_mesh(
                "cpu", (world_size // _TP, 1, _TP), mesh_dim_names=("dp", "sp", "tp")
            )
        else:
            held = distributed(tp=_TP)
            held.__enter__()
        seconds = time.process_time() - start
        added = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss
        if clean_up and mode != "mesh":
            held.__exit__(None, None, None)
        del held
    finally:
        if clean_up:
            restore()
            _subgroups._splits = splits
            if dist.is_initialized():
                dist.destroy_process_group()
    return {
        "world_size": world_size,
        "mode": mode,
        "rank": rank,
        "cpu_seconds": seconds,
        "added_rss_mib": added / 1024,
        **stats,
    }


def measure(world_size: int, mode: str, *, timeout: float = 600.0) -> dict[str, Any]:
    """:func:`simulate` in a fresh interpreter (peak memory is per process)."""
    code = (
        "import json, os, sys; from pdist._scale import simulate; "
        f"print('PDIST-SCALE', json.dumps(simulate({world_size}, {mode!r}))); "
        "sys.stdout.flush(); os._exit(0)"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )
    for line in out.stdout.splitlines():
        if line.startswith("PDIST-SCALE "):
            result: dict[str, Any] = json.loads(line.split(" ", 1)[1])
            return result
    msg = f"simulating W={world_size} ({mode}) failed:\n{out.stdout}\n{out.stderr[-4000:]}"
    raise RuntimeError(msg)


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """The side-by-side table ``python -m pdist bench --simulate-world`` prints."""
    by = {(r["world_size"], r["mode"]): r for r in rows}
    worlds = sorted({r["world_size"] for r in rows})
    lines = [
        f"{'W':>6} | {'pdist cpu':>9} {'mesh cpu':>9} {'ratio':>6} | {'pdist rss':>9} "
        f"{'mesh rss':>9} | {'pdist calls':>11} {'mesh calls':>10} | {'host bytes':>10} "
        f"{'/ W':>5} | {'split path: world-wide splits':>29}"
    ]
    for w in worlds:
        p, m, s = by.get((w, "pdist")), by.get((w, "mesh")), by.get((w, "pdist-split"))
        if p is None or m is None:
            continue
        ratio = p["cpu_seconds"] / m["cpu_seconds"] if m["cpu_seconds"] > 0 else float("inf")
        splits = (
            "-"
            if s is None
            else f"{s['split_group']} (+{s['world_wide'] - s['split_group']} other)"
        )
        lines.append(
            f"{w:>6} | {p['cpu_seconds']:>8.3f}s {m['cpu_seconds']:>8.3f}s {ratio:>5.2f}x | "
            f"{p['added_rss_mib']:>6.1f}MiB {m['added_rss_mib']:>6.1f}MiB | "
            f"{p['new_group'] + p['split_group']:>11} {m['new_group'] + m['split_group']:>10} | "
            f"{p['all_gather_bytes']:>10} {p['all_gather_bytes'] / w:>5.0f} | {splits:>29}"
        )
    return "\n".join(lines)
