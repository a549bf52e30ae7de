"""Command line: ``python -m pdist doctor`` and ``python -m pdist bench`` (also ``pdist``)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["main"]


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
    sub = parser.add_subparsers(dest="command", required=True, metavar="{doctor,bench}")
    doctor = sub.add_parser("doctor", help="check the distributed set-up and report its health")
    doctor.add_argument("--nproc", type=_positive, default=None, help="spawn N local ranks")
    bench = sub.add_parser("bench", help="time pdist's collectives against torch baselines")
    bench.add_argument(
        "--nproc", type=_positive, default=None, help="spawn N local ranks (default 2)"
    )
    bench.add_argument(
        "--quick", action="store_true", help="a short run (under a minute on 2 CPU ranks)"
    )
    bench.add_argument(
        "--json",
        metavar="PATH",
        default=None,
        help="write every figure, with the torch version, backend and world size, to PATH",
    )
    bench.add_argument(
        "--simulate-world",
        metavar="W[,W...]",
        type=_worlds,
        default=None,
        help="measure start-up on simulated worlds of W ranks (torch's fake process group) "
        "next to init_device_mesh, instead of timing collectives; 'default' = "
        "512,4096,8192,16384",
    )
    bench.add_argument(
        "--stall-overhead",
        action="store_true",
        help="time an all_reduce, a broadcast_object and a DDP step with the stall watch on "
        "against stall_timeout=0, in alternating worlds of fresh processes",
    )
    bench.add_argument(
        "--runs",
        type=_positive,
        default=3,
        help="with --stall-overhead: worlds per setting (default 3)",
    )
    return parser


def _worlds(text: str) -> list[int]:
    from ._scale import DEFAULT_WORLDS

    if text == "default":
        return list(DEFAULT_WORLDS)
    worlds = [_positive(part) for part in text.split(",") if part.strip()]
    for w in worlds:
        if w % 8:
            msg = f"{w} is not a multiple of 8 (the simulated job uses tp=8 and 8 ranks per host)"
            raise argparse.ArgumentTypeError(msg)
    if not worlds:
        msg = "give at least one world size"
        raise argparse.ArgumentTypeError(msg)
    return worlds


def _simulate(worlds: list[int], json_path: str | None) -> int:
    from ._scale import format_table, measure

    rows = []
    for w in worlds:
        for mode in ("pdist", "mesh", "pdist-split"):
            sys.stderr.write(f"simulating W={w} ({mode})\n")
            rows.append(measure(w, mode))
    print("pdist bench --simulate-world: one simulated rank of a W-rank job, tp=8, 8 ranks/host")
    print(format_table(rows))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(rows, f, indent=2)
        print(f"wrote {len(rows)} records to {json_path}")
    return 0


def _format(records: list[dict[str, Any]]) -> str:
    lines = [
        f"{'case':<42} {'bytes':>11} {'pdist':>10} {'algbw':>8} {'busbw':>8}  ratios vs baselines",
    ]
    for r in records:
        ratios = ", ".join(f"{k} {v:.2f}x" for k, v in r["ratios"].items())
        lines.append(
            f"{r['name']:<42} {r['bytes']:>11} {r['seconds']['pdist'] * 1e6:>8.0f}us "
            f"{r['algbw_gbps']:>6.2f}GB {r['busbw_gbps']:>6.2f}GB  {ratios}"
        )
    return "\n".join(lines)


def _stall_overhead(args: argparse.Namespace) -> int:
    from ._bench_stall import format_overhead, measure_overhead

    report = measure_overhead(args.nproc or 2, args.runs, args.quick)
    print(format_overhead(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {len(report['cases'])} cases to {args.json}")
    return 0


def _bench(args: argparse.Namespace) -> int:
    if args.simulate_world is not None:
        return _simulate(args.simulate_world, args.json)
    if args.stall_overhead:
        return _stall_overhead(args)
    from ._bench_cases import bench_rank as _bench_rank

    if "RANK" in os.environ and args.nproc is None:
        report = _bench_rank(args.quick, progress=True)
        if os.environ.get("RANK") != "0":
            return 0
    else:
        from .testing import spawn

        nproc = args.nproc or 2
        report = spawn(_bench_rank, nproc, args.quick, True, timeout=3600, capture_output=False)[0]
    print(
        f"pdist bench: {report['world_size']} ranks, {report['backend']} on {report['device']}, "
        f"torch {report['torch_version']}, {'quick' if args.quick else 'full'} run"
    )
    print(_format(report["records"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {len(report['records'])} records to {args.json}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m pdist`` and the ``pdist`` console script."""
    args = _parser().parse_args(argv)
    if args.command == "bench":
        return _bench(args)
    from ._doctor import doctor

    return doctor(args.nproc)


if __name__ == "__main__":
    sys.exit(main())
