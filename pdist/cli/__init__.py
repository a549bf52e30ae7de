"""The command line, ``python -m pdist doctor|bench|coordinator`` (or ``pdist``).

No pdist module imports it.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

__all__ = ["main", "on_ranks"]

R = TypeVar("R")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        msg = f"{text!r} is not an integer"
        raise argparse.ArgumentTypeError(msg) from None
    if value < 1:
        msg = f"{value} must be at least 1"
        raise argparse.ArgumentTypeError(msg)
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdist", description="pdist command line tools")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{doctor,bench,coordinator}")
    doctor = sub.add_parser("doctor", help="check the distributed set-up and report its health")
    doctor.add_argument("--nproc", type=_positive, help="spawn N local ranks")
    bench = sub.add_parser("bench", help="time pdist's collectives against torch baselines")
    bench.add_argument("--nproc", type=_positive, help="spawn N local ranks (default 2)")
    bench.add_argument("--quick", action="store_true", help="a short run (a minute on 2 CPU ranks)")
    bench.add_argument(
        "--json", metavar="PATH", help="write every figure, with the set-up it ran on, to PATH"
    )
    coordinator = sub.add_parser(
        "coordinator", help="host the store fault-tolerant replicas meet at"
    )
    coordinator.add_argument("--port", type=_positive, required=True, help="the port to listen on")
    coordinator.add_argument("--host", default="0.0.0.0", help="the address to listen on")
    coordinator.add_argument(
        "--dead-after",
        type=float,
        default=1.0,
        help="seconds without a heartbeat after which a replica is left out (default 1)",
    )
    return parser


def on_ranks(fn: Callable[..., R], nproc: int | None, *args: Any, timeout: float) -> tuple[R, bool]:
    """``fn(*args)`` on every rank under torchrun, else on ``nproc`` (default 2) spawned ranks.

    Returns:
        Its result (rank 0's when spawned), and whether this process reports it.
    """
    if "RANK" in os.environ and nproc is None:
        return fn(*args), os.environ["RANK"] == "0"
    from pdist.testing import spawn

    # Spawned ranks run as the user's own jobs would: check mode as this environment sets
    # it (off by default), not the test harness's default (on), which would time a round
    # trip into every collective of the bench.
    check = os.environ.get("PDIST_CHECK", "0")
    out = spawn(_configured, nproc or 2, check, fn, *args, timeout=timeout, capture_output=False)
    return out[0], True


def _configured(check: str, fn: Callable[..., R], *args: Any) -> R:
    os.environ["PDIST_CHECK"] = check
    return fn(*args)


def _write(path: str | None, report: Any, count: int) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {count} records to {path}")


RATIO_LEGEND = (
    "ratios: pdist's time / the baseline's time; below 1.00x pdist is faster, above it slower; "
    "in brackets the spread over the interleaved batches (the middle half; all of them in a "
    "quick run)"
)
QUICK_WARNING = (
    "quick run: 3 batches per figure, so a ratio can swing by 2x on a busy machine; "
    "quote only a full run's figures"
)
CASES_LEGEND = {
    "(a)": "(a) one 128 MiB tensor with metadata, against a raw broadcast of the same bytes "
    "(into warm memory, and into fresh memory as a result of its own must be)",
    "(b)": "(b) 1000 tensors of 64 KiB (a state dict's shape), against one flat broadcast of "
    "the same bytes, one broadcast per tensor, and the copies a flat transport needs",
    "(c)": "(c) a tiny dict, against torch.distributed.broadcast_object_list",
}


def _ratio(baseline: str, ratio: float, spread: list[float] | None) -> str:
    """``torch 1.02x [0.97-1.08]``: a ratio and its spread over the batches."""
    return f"{baseline} {ratio:.2f}x" + (f" [{spread[0]:.2f}-{spread[1]:.2f}]" if spread else "")


def _format(records: list[dict[str, Any]], *, quick: bool = False) -> str:
    width = max([42, *(len(r["name"]) for r in records)])
    lines = [
        RATIO_LEGEND,
        *([QUICK_WARNING] if quick else []),
        f"{'case':<{width}} {'bytes':>11} {'pdist':>10} {'algbw GB/s':>10} {'busbw GB/s':>10}  "
        "ratios (pdist / baseline) [spread]",
    ]
    for r in records:
        spreads = r.get("spreads", {})
        ratios = ", ".join(_ratio(k, v, spreads.get(k)) for k, v in r["ratios"].items())
        lines.append(
            f"{r['name']:<{width}} {r['bytes']:>11} {r['seconds']['pdist'] * 1e6:>8.0f}us "
            f"{r['algbw_gbps']:>10.2f} {r['busbw_gbps']:>10.2f}  {ratios}"
        )
    shown = [text for key, text in CASES_LEGEND.items() if any(key in r["name"] for r in records)]
    return "\n".join(lines + (["structured broadcast cases:", *shown] if shown else []))


def _bench(args: argparse.Namespace) -> int:
    from .cases import bench_rank

    report, reports = on_ranks(bench_rank, args.nproc, args.quick, True, timeout=3600)
    if not reports:
        return 0
    print(
        f"pdist bench: {report['world_size']} ranks, {report['backend']} on {report['device']}, "
        f"torch {report['torch_version']}, {'quick' if args.quick else 'full'} run"
    )
    print(_format(report["records"], quick=args.quick))
    if not args.quick:  # its own processes: a coordinator and 3 one-rank replicas
        from .coordinator import death_to_commit

        seconds = death_to_commit(3)
        report["fault_tolerance"] = {"replicas": 3, "death_to_commit_seconds": seconds}
        print(f"fault_tolerant: a replica's death to the survivors' next commit {seconds:.2f}s")
    _write(args.json, report, len(report["records"]))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line on ``argv`` (default ``sys.argv[1:]``); returns the exit code."""
    args = _parser().parse_args(argv)
    if args.command == "bench":
        return _bench(args)
    if args.command == "coordinator":
        from .coordinator import serve

        return serve(args.port, host=args.host, dead_after=args.dead_after)
    from .doctor import doctor

    return doctor(args.nproc)
