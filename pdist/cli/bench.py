"""The runner of ``pdist bench``: a figure is the slowest rank's median over repeated batches.

pdist and its baselines are interleaved batch by batch (in a rotating order) so that drift hits
them alike. The device is synchronized before every clock read: a batch's time is its work.
"""

from __future__ import annotations

import collections
import contextlib
import statistics
import sys
import time
from collections.abc import Callable, Iterator

import attrs
import torch
import torch.distributed as dist

from pdist import DistContext
from pdist._compat import synchronize

__all__ = ["Case", "Fns", "Record", "run_cases"]

Fns = dict[str, Callable[[], object]]


@attrs.frozen
class Case:
    """``setup(ctx, stack)`` returns the functions to time: ``"pdist"`` and baselines, by name."""

    name: str
    nbytes: int
    setup: Callable[[DistContext, contextlib.ExitStack], Fns]
    inner: int = 1
    busbw_factor: Callable[[int], float] = lambda n: 1.0
    quick: bool = True


@attrs.frozen
class Record:
    """The figures of one case."""

    name: str
    bytes: int
    world_size: int
    seconds: dict[str, float]
    ratios: dict[str, float]
    # Per baseline, the spread of the ratio over the interleaved batches: the middle half
    # (quartiles) from 4 batches on, else the lowest and the highest.
    spreads: dict[str, list[float]]
    algbw_gbps: float
    busbw_gbps: float


def _synchronizer(device: torch.device) -> Callable[[], None]:
    if device.type == "cpu":
        return lambda: None
    return lambda: synchronize(device)


def _batch(fn: Callable[[], object], inner: int, synchronize: Callable[[], None]) -> float:
    synchronize()
    start = time.perf_counter()
    for _ in range(inner):
        fn()
    synchronize()
    return (time.perf_counter() - start) / inner


Samples = dict[str, list[float]]


def _spread(ratios: list[float]) -> list[float]:
    """The middle half of ``ratios`` (from 4 of them on), else their lowest and highest."""
    if len(ratios) >= 4:
        q1, _, q3 = statistics.quantiles(ratios, n=4)
        return [q1, q3]
    return [min(ratios), max(ratios)]


def _paired(mine: list[float], theirs: list[float]) -> list[float]:
    """The ratio of each interleaved batch: pdist's time over the baseline's in the same round."""
    return [p / b for p, b in zip(mine, theirs, strict=True) if b > 0] or [0.0]


def _measure(
    ctx: DistContext, fns: Fns, inner: int, warmup: int, repeats: int
) -> tuple[dict[str, float], Samples]:
    """Every function's median seconds (the slowest rank's), and its batches' (the same)."""
    cpu = ctx.world.cpu_group
    synchronize = _synchronizer(ctx.device)
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    synchronize()
    samples: dict[str, list[float]] = collections.defaultdict(list)
    names = list(fns)
    for repeat in range(repeats):
        # The order rotates, so that no function always runs first after the previous case.
        for name in names[repeat % len(names) :] + names[: repeat % len(names)]:
            dist.barrier(group=cpu)
            samples[name].append(_batch(fns[name], inner, synchronize))
    medians = torch.tensor([statistics.median(samples[n]) for n in fns], dtype=torch.float64)
    batches = torch.tensor([samples[n] for n in fns], dtype=torch.float64)
    dist.all_reduce(medians, op=dist.ReduceOp.MAX, group=cpu)
    dist.all_reduce(batches, op=dist.ReduceOp.MAX, group=cpu)
    return (
        dict(zip(fns, medians.tolist(), strict=True)),
        dict(zip(fns, batches.tolist(), strict=True)),
    )


def _bench_row(ctx: DistContext, case: Case, seconds: dict[str, float], batches: Samples) -> Record:
    mine = seconds["pdist"]
    algbw = case.nbytes / mine / 1e9 if mine > 0 else 0.0
    baselines = [n for n, s in seconds.items() if n != "pdist" and s > 0]
    return Record(
        name=case.name,
        bytes=case.nbytes,
        world_size=ctx.world_size,
        seconds=seconds,
        ratios={n: mine / seconds[n] for n in baselines},
        spreads={n: _spread(_paired(batches["pdist"], batches[n])) for n in baselines},
        algbw_gbps=algbw,
        busbw_gbps=algbw * case.busbw_factor(ctx.world_size),
    )


def run_cases(
    ctx: DistContext, cases: list[Case], *, quick: bool, progress: bool
) -> Iterator[Record]:
    """Run ``cases`` (the quick ones with ``quick``) on every rank; yields their records."""
    progress = progress and sys.stderr.isatty()
    selected = [c for c in cases if c.quick or not quick]
    # 21 interleaved batches: on a shared 2-core machine fewer left ratios swinging by 2x.
    warmup, repeats = (1, 3) if quick else (3, 21)
    for i, case in enumerate(selected, 1):
        if progress:
            sys.stderr.write(f"\r[{i}/{len(selected)}] {case.name:<48}")
            sys.stderr.flush()
        with contextlib.ExitStack() as stack:
            fns = case.setup(ctx, stack)
            seconds, batches = _measure(ctx, fns, case.inner, warmup, repeats)
            del fns
        yield _bench_row(ctx, case, seconds, batches)
    if progress:
        sys.stderr.write("\r" + " " * 60 + "\r")
        sys.stderr.flush()
