"""What the stall watch costs, watch on against off (``nox -s bench -- --stall-overhead``).

Run as ``python -m benchmarks.stall [--nproc N] [--runs R] [--quick] [--json PATH]`` from
the repository root; a developer harness, not part of the wheel.

torch reads the flight recorder's buffer size once per process, so each setting runs in a world
of fresh processes. Worlds alternate on, off, off, on, on, off, ..., so that drift on a shared
machine hits both alike and neither setting always runs first in its pair; a case's ratio is
the median over those pairs of watched / unwatched. The watch's own CPU time per second is a
figure no neighbour's load can blur. "Off" is ``stall_timeout=0``: no thread, and torch's
recorder as torch sets it (where it records no gloo collective, pdist's own record stands in,
so "on" pays for it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import threading
import time
from datetime import timedelta
from typing import Any

import torch

from pdist import DistContext, Group, all_reduce, broadcast_object, distributed, wrap_ddp
from pdist._compat import recorder_sees_gloo
from pdist._group import Lifetime
from pdist._inflight import recorded
from pdist.cli.bench import Case, Fns, run_cases

__all__ = ["format_overhead", "main", "measure_overhead", "overhead_rank"]


def _all_reduce(ctx: DistContext, stack: contextlib.ExitStack) -> Fns:
    x = torch.ones(1 << 18)  # 1 MiB of float32
    return {"pdist": lambda: all_reduce(ctx, x)}


def _broadcast_object(ctx: DistContext, stack: contextlib.ExitStack) -> Fns:
    obj = {"step": 7, "lr": 3e-4, "name": "run"} if ctx.rank == 0 else None
    return {"pdist": lambda: broadcast_object(ctx, obj)}


def _ddp_step(ctx: DistContext, stack: contextlib.ExitStack) -> Fns:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    model = wrap_ddp(ctx, net)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(32, 256)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        model(x).sum().backward()
        opt.step()

    return {"pdist": step}


CASES = [
    Case("all_reduce 1 MiB", 1 << 20, _all_reduce, 20),
    Case("broadcast_object tiny dict", 64, _broadcast_object, 200),
    Case("DDP step 256x256 MLP, batch 32", 4 * (256 * 256 + 2 * 256 + 1), _ddp_step, 20),
]


def _watch_cpu_seconds() -> float:
    """CPU seconds the stall watch's threads of this process have run so far (0: unknown)."""
    total = 0
    for thread in threading.enumerate():
        if not thread.name.startswith("pdist-stall") or thread.native_id is None:
            continue
        path = f"/proc/self/task/{thread.native_id}/schedstat"
        with contextlib.suppress(OSError, IndexError, ValueError), open(path) as f:
            total += int(f.read().split()[0])  # nanoseconds on the CPU
    return total / 1e9


def overhead_rank(stall_timeout: float, quick: bool) -> dict[str, float]:
    """Seconds per call of each case, and ``"watch cpu"``: the watch's CPU seconds per second."""
    with distributed(stall_timeout=stall_timeout) as ctx:
        start = time.monotonic()
        records = list(run_cases(ctx, CASES, quick=quick, progress=False))
        cpu = _watch_cpu_seconds() / (time.monotonic() - start)
    return {**{r.name: r.seconds["pdist"] for r in records}, "watch cpu": cpu}


def hook_cost(calls: int = 200_000) -> dict[str, float]:
    """Seconds per call that ``@recorded`` (as on a p2p call) adds to a no-op, record on and off."""
    lifetime = Lifetime()
    group = Group(
        name="world",
        ranks=(0, 1),
        rank=0,
        rank_in_group=0,
        device=torch.device("cpu"),
        timeout=timedelta(seconds=1),
        lifetime=lifetime,
        device_key=0,
        cpu_key=0,
    )

    def plain(group: Group, x: object) -> None:
        return None

    hooked = recorded("noop", p2p=True)(plain)

    def best(fn: Any) -> float:
        times = []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(calls):
                fn(group, b"x")
            times.append((time.perf_counter() - start) / calls)
        return min(times)

    base, off = best(plain), best(hooked)
    lifetime.in_flight.active = True
    return {"record off": off - base, "record on": best(hooked) - base}


def measure_overhead(nproc: int, runs: int, quick: bool) -> dict[str, Any]:
    """Alternate ``runs`` watched worlds with ``runs`` unwatched ones: the report, per case."""
    from pdist.testing import spawn

    cases: dict[str, dict[str, Any]] = {c.name: {"on": [], "off": []} for c in CASES}
    cpu: list[float] = []
    for i in range(2 * runs):
        setting = "on" if i % 4 in (0, 3) else "off"  # pairs on-off, off-on, ...
        timeout = 300.0 if setting == "on" else 0.0
        figures = spawn(
            overhead_rank, nproc, timeout, quick, timeout=1200, capture_output=False, fresh=True
        )[0]
        if setting == "on":
            cpu.append(figures.pop("watch cpu"))
        for case in CASES:
            cases[case.name][setting].append(figures[case.name])
    for runs_of in cases.values():
        pairs = zip(runs_of["on"], runs_of["off"], strict=True)
        runs_of["ratio"] = statistics.median(a / b for a, b in pairs)
    return {
        "world_size": nproc,
        "runs": runs,
        "torch_version": torch.__version__,
        "cases": cases,
        "watch_cpu_per_second": cpu,
        "hook_seconds_per_call": hook_cost(),
        "recorder_sees_gloo": recorder_sees_gloo(),
    }


def format_overhead(report: dict[str, Any]) -> str:
    """The table ``--stall-overhead`` prints: medians on and off, and their ratio per case."""
    lines = [
        f"stall watch overhead: {report['world_size']} ranks, torch "
        f"{report['torch_version']}, {report['runs']} watched and {report['runs']} unwatched "
        "worlds, alternated",
        f"{'case':<32} {'watch on':>10} {'watch off':>10}  {'on/off':>6}  (each pair's ratio)",
    ]
    for name, case in report["cases"].items():
        on, off = statistics.median(case["on"]), statistics.median(case["off"])
        each = ", ".join(f"{a / b:.2f}" for a, b in zip(case["on"], case["off"], strict=True))
        lines.append(
            f"{name:<32} {on * 1e6:>8.0f}us {off * 1e6:>8.0f}us  {case['ratio']:>6.3f}  ({each})"
        )
    cpu = report["watch_cpu_per_second"]
    lines.append(
        f"the watch's threads used {1e3 * statistics.median(cpu):.2f} ms of CPU per second "
        f"(median of the watched worlds, rank 0; max {1e3 * max(cpu):.2f} ms)"
    )
    hook = report["hook_seconds_per_call"]
    where = "gloo p2p only" if report["recorder_sees_gloo"] else "every recorded call"
    lines.append(
        f"pdist's own record ({where}): {1e9 * hook['record on']:.0f} ns per call while the "
        f"watch is on, {1e9 * hook['record off']:.0f} ns while it is off"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Measure the overhead and print its table (``--json PATH``: every figure too)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.stall", description=__doc__)
    parser.add_argument("--nproc", type=int, default=2, help="ranks per world (default 2)")
    parser.add_argument("--runs", type=int, default=3, help="worlds per setting (default 3)")
    parser.add_argument("--quick", action="store_true", help="fewer iterations per case")
    parser.add_argument("--json", metavar="PATH", help="write every figure to PATH")
    args = parser.parse_args(argv)
    if args.nproc < 1 or args.runs < 1:
        parser.error("--nproc and --runs must be at least 1")
    report = measure_overhead(args.nproc, args.runs, args.quick)
    print(format_overhead(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
