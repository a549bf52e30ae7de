"""Start-up cost of one rank of a simulated W-rank job (``nox -s scale``).

Run as ``python -m benchmarks.scale [W,W,...|default] [--json PATH]`` from the repository
root; a developer harness, not part of the wheel.

The rank runs ``distributed(tp=8, stall_timeout=0)`` (start-up alone) on torch's fake process
group, in a fresh interpreter per measurement, next to ``init_device_mesh`` (mode ``mesh``) and
to pdist on an accelerator-bound world whose device groups are split from it (``pdist-split``).
The ``-full`` modes do the same for the five-axis job ``pp=4, cp=2, tp=8, ep=8``; its ``mesh``
builds torch's dense mesh ``(pp, dp, cp, sp, tp)`` plus the expert mesh ``(pp, edp, ep)``.
Only torch is patched, never pdist, so the figures are pdist's own.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pdist import _compat, distributed

__all__ = ["DEFAULT_WORLDS", "LAYOUTS", "MODES", "format_table", "main", "measure", "simulate"]

DEFAULT_WORLDS = (512, 4096, 8192, 16384)
# The simulated jobs' layouts: distributed()'s keywords (the mesh baseline builds the same).
LAYOUTS = {"": {"tp": 8}, "-full": {"pp": 4, "cp": 2, "tp": 8, "ep": 8}}
MODES = tuple(f"{base}{suffix}" for suffix in LAYOUTS for base in ("pdist", "mesh", "pdist-split"))
_PER_HOST = 8


def _replace(stack: contextlib.ExitStack, owner: Any, name: str, new: Any) -> None:
    """Set ``owner.name`` (a torch function, a group's property) to ``new`` until ``stack`` ends."""
    stack.callback(setattr, owner, name, getattr(owner, name))
    setattr(owner, name, new)


def _world() -> dist.ProcessGroup:
    world = dist.group.WORLD
    assert world is not None  # simulate() initialized it
    return world


def _fill(out: torch.Tensor, inp: torch.Tensor, ranks: list[int], boot: bytes) -> None:
    """Write into ``out`` what ``ranks`` would gather: ``inp`` each, with its host's boot id."""
    # Through ctypes, not torch: a torch copy of a few KiB can spin threads for milliseconds.
    if out.device.type != "cpu" or not (out.is_contiguous() and inp.is_contiguous()):
        return
    mine = ctypes.string_at(inp.data_ptr(), inp.numel() * inp.element_size())
    hosts = {
        h: mine.replace(boot, b"sim%05x" % h + boot[8:]) for h in {r // _PER_HOST for r in ranks}
    }
    hosts[dist.get_rank() // _PER_HOST] = mine  # "sim" above: never a real (hex) boot id
    data = b"".join(hosts[r // _PER_HOST] for r in ranks)
    ctypes.memmove(out.data_ptr(), data, min(len(data), out.numel() * out.element_size()))


def _wrap_torch(stack: contextlib.ExitStack, stats: dict[str, int]) -> None:
    """Count torch's group-creating calls and all-gathers; make up the records gathered."""
    from torch.distributed import device_mesh, distributed_c10d

    new_group, boot = dist.new_group, Path("/proc/sys/kernel/random/boot_id").read_bytes().strip()

    def counted_new_group(*args: Any, **kwargs: Any) -> Any:
        stats["new_group"] += 1
        stats["world_wide"] += not kwargs.get("use_local_synchronization", False)
        return new_group(*args, **kwargs)

    def split_group(*args: Any, split_ranks: list[list[int]], **kwargs: Any) -> Any:
        stats["split_group"] += 1
        stats["world_wide"] += 1
        mine = next(b for b in split_ranks if dist.get_rank() in b)
        with contextlib.ExitStack() as stack:
            _replace(stack, _world(), "bound_device_id", None)  # or new_group splits the world
            return new_group(mine, use_local_synchronization=True, backend="fake")

    def gathering(real: Callable[..., Any]) -> Callable[..., Any]:
        def all_gather(out: torch.Tensor, inp: torch.Tensor, group: Any = None, **kw: Any) -> Any:
            stats["all_gather_bytes"] += out.numel() * out.element_size()
            work = real(out, inp, group=group, **kw)
            _fill(out, inp, dist.get_process_group_ranks(group or _world()), boot)
            return work

        return all_gather

    for module in (dist, distributed_c10d, device_mesh):
        for name, wrapper in (("new_group", counted_new_group), ("split_group", split_group)):
            if hasattr(module, name):
                _replace(stack, module, name, wrapper)
    for name in ("all_gather_single", "all_gather_into_tensor"):
        if hasattr(dist, name):
            _replace(stack, dist, name, gathering(getattr(dist, name)))


def _bind_to_meta(stack: contextlib.ExitStack) -> None:
    """Make the fake world look bound to an accelerator, as NCCL's with ``device_id=``."""
    for name, fake in (
        ("is_available", lambda: True),
        ("current_accelerator", lambda *a, **k: torch.device("meta")),
        ("device_count", lambda: _PER_HOST),
    ):
        _replace(stack, torch.accelerator, name, fake)
    _replace(stack, _world(), "bound_device_id", torch.device("meta", 0))


def _split_mode(mode: str) -> tuple[str, dict[str, int]]:
    for suffix, sizes in LAYOUTS.items():
        base = mode.removesuffix(suffix) if suffix else mode
        if base in ("pdist", "mesh", "pdist-split") and (suffix or mode == base):
            return base, sizes
    msg = f"mode={mode!r} is not one of {MODES}"
    raise ValueError(msg)


def _meshes(world_size: int, sizes: dict[str, int]) -> list[Any]:
    """The meshes torch builds for of the layout: the dense one, and the expert one where ep > 1."""
    from torch.distributed.device_mesh import init_device_mesh

    all_sizes = {"pp": 1, "cp": 1, "sp": 1, "tp": 1, "ep": 1, **sizes}
    dp = world_size // (all_sizes["pp"] * all_sizes["cp"] * all_sizes["sp"] * all_sizes["tp"])
    all_sizes["dp"] = dp
    dims = [(a, all_sizes[a]) for a in ("pp", "dp", "cp", "sp", "tp")]
    dims = [(a, n) for a, n in dims if a in ("dp", "sp", "tp") or n > 1]
    meshes = [
        init_device_mesh("cpu", tuple(n for _, n in dims), mesh_dim_names=tuple(a for a, _ in dims))
    ]
    pp, ep = all_sizes["pp"], all_sizes["ep"]
    if ep > 1:
        expert = [("pp", pp), ("edp", world_size // pp // ep), ("ep", ep)]
        expert = [(a, n) for a, n in expert if a != "pp" or n > 1]
        shape, names = tuple(n for _, n in expert), tuple(a for a, _ in expert)
        meshes.append(init_device_mesh("cpu", shape, mesh_dim_names=names))
    return meshes


def _held(ctx: Any) -> int:
    """The distinct communicators the context holds (its groups' device and CPU groups)."""
    names = ("world", "node", *ctx.layout.group_names)
    pgs = {id(ctx.group(n).device_group) for n in names}
    return len(pgs | {id(ctx.group(n).cpu_group) for n in names})


def simulate(world_size: int, mode: str, *, clean_up: bool = False) -> dict[str, Any]:
    """One start-up's figures, measured in this process (only a fresh one's memory counts).

    With ``clean_up`` the groups, the world and torch's functions are put back afterwards.
    A world the mode's layout does not divide is skipped (``"skipped": True``).
    """
    base, sizes = _split_mode(mode)
    ranks = sizes.get("pp", 1) * sizes.get("cp", 1) * sizes.get("tp", 1)
    if (
        world_size % _PER_HOST
        or world_size % ranks
        or world_size // sizes.get("pp", 1) % sizes.get("ep", 1)
    ):
        return {"world_size": world_size, "mode": mode, "skipped": True}
    _compat.register_fake_backend()
    os.environ["LOCAL_WORLD_SIZE"] = str(_PER_HOST)
    rank = world_size // 2 + 3 if world_size > 8 else world_size - 1
    dist.init_process_group("fake", store=_compat.HashStore(), rank=rank, world_size=world_size)
    stats = {"new_group": 0, "split_group": 0, "world_wide": 0, "all_gather_bytes": 0}
    stack = contextlib.ExitStack()
    try:
        _wrap_torch(stack, stats)
        if base == "pdist-split":
            _bind_to_meta(stack)
        gc.collect()
        rss, start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, time.process_time()
        if base == "mesh":
            held: Any = _meshes(world_size, sizes)
        else:
            keywords: dict[str, Any] = dict(sizes)
            held = distributed(**keywords, stall_timeout=0)
            ctx = held.__enter__()
            if clean_up:  # before the patches go: the stack closes last in, first out
                stack.callback(held.__exit__, None, None, None)
        seconds = time.process_time() - start
        added = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss
        stats["held"] = 0 if base == "mesh" else _held(ctx)
        del held
    finally:
        if clean_up:
            stack.close()
            dist.destroy_process_group()
    cpu = {"cpu_seconds": seconds, "added_rss_mib": added / 1024}
    return {"world_size": world_size, "mode": mode, "rank": rank, **cpu, **stats}


def measure(world_size: int, mode: str, *, timeout: float = 600.0) -> dict[str, Any]:
    """:func:`simulate` in a fresh interpreter (peak memory is per process)."""
    code = (
        "import json, os, sys; from benchmarks.scale import simulate; "
        f"print('PDIST-SCALE', json.dumps(simulate({world_size}, {mode!r}))); "
        "sys.stdout.flush(); os._exit(0)"
    )
    root = str(Path(__file__).resolve().parent.parent)  # where ``benchmarks`` is importable
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, *(p for p in sys.path if p)])}
    cmd = [sys.executable, "-c", code]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, check=False)
    for line in out.stdout.splitlines():
        if line.startswith("PDIST-SCALE "):
            result: dict[str, Any] = json.loads(line.split(" ", 1)[1])
            return result
    msg = f"simulating W={world_size} ({mode}) failed:\n{out.stdout}\n{out.stderr[-4000:]}"
    raise RuntimeError(msg)


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """The table :func:`main` prints: the modes of each world side by side.

    ``calls``: torch's group-creating calls (``new_group`` + ``split_group``); ``held``:
    the communicators the context holds.
    """
    by = {(r["world_size"], r["mode"]): r for r in rows if not r.get("skipped")}
    lines = []
    for suffix, sizes in LAYOUTS.items():
        layout = ", ".join(f"{k}={v}" for k, v in sizes.items())
        lines += [
            f"layout {layout}:",
            f"{'W':>6} | {'pdist cpu':>9} {'mesh cpu':>9} {'ratio':>6} | {'pdist rss':>9} "
            f"{'mesh rss':>9} | {'pdist calls':>11} {'held':>5} {'mesh calls':>10} | "
            f"{'host bytes':>10} {'/ W':>5} | {'split path: world-wide splits':>29}",
        ]
        for w in sorted({w for w, _ in by}):
            found = [by.get((w, f"{mode}{suffix}")) for mode in ("pdist", "mesh", "pdist-split")]
            if any(r is None for r in found):
                continue
            p, m, s = (r for r in found if r is not None)
            ratio = p["cpu_seconds"] / m["cpu_seconds"] if m["cpu_seconds"] > 0 else float("inf")
            splits = f"{s['split_group']} (+{s['world_wide'] - s['split_group']} other)"
            lines.append(
                f"{w:>6} | {p['cpu_seconds']:>8.3f}s {m['cpu_seconds']:>8.3f}s {ratio:>5.2f}x | "
                f"{p['added_rss_mib']:>6.1f}MiB {m['added_rss_mib']:>6.1f}MiB | "
                f"{p['new_group'] + p['split_group']:>11} {p.get('held', 0):>5} "
                f"{m['new_group'] + m['split_group']:>10} | "
                f"{p['all_gather_bytes']:>10} {p['all_gather_bytes'] / w:>5.0f} | {splits:>29}"
            )
    return "\n".join(lines)


def _worlds(text: str) -> list[int]:
    worlds = list(DEFAULT_WORLDS) if text == "default" else [int(w) for w in text.split(",")]
    if not worlds or any(w < 8 or w % 8 for w in worlds):
        msg = f"{text!r}: give multiples of 8 (the job uses tp=8 and 8 ranks per host)"
        raise argparse.ArgumentTypeError(msg)
    return worlds


def main(argv: list[str] | None = None) -> int:
    """Measure every mode on each world (default 512, 4096, 8192, 16384) and print the table."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scale", description=__doc__)
    parser.add_argument("worlds", nargs="?", type=_worlds, default=list(DEFAULT_WORLDS))
    parser.add_argument("--json", metavar="PATH", help="write every figure to PATH")
    args = parser.parse_args(argv)
    rows = []
    for w in args.worlds:
        for mode in MODES:
            sys.stderr.write(f"simulating W={w} ({mode})\n")
            rows.append(measure(w, mode))
    print("simulated start-up: one simulated rank of a W-rank job per layout, 8 ranks/host")
    print(format_table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
