"""``python -m pdist bench``: pdist's collectives timed against baselines in the same run.

Every case is timed as the median of repeated batches after warm-up, pdist
and its baselines interleaved batch by batch (in a rotating order) so that
drift hits them alike;
a rank's figure is the slowest rank's median. Ratios are pdist / baseline.
The device is synchronized before every timer read, so that on an accelerator
a batch's time is the work it did, not the time to enqueue it.
"""

from __future__ import annotations

import collections
import contextlib
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import torch
import torch.distributed as dist

from ._group import DistContext

__all__ = ["Case", "Record", "environment", "run_cases"]


@attrs.frozen
class Case:
    """One benchmark case: ``setup(ctx, stack)`` returns the functions to time, by name.

    The function named ``"pdist"`` is the subject; the others are baselines.
    Whatever the setup enters on ``stack`` is closed after the case.
    """

    name: str
    nbytes: int
    setup: Callable[[DistContext, contextlib.ExitStack], dict[str, Callable[[], object]]]
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
    algbw_gbps: float
    busbw_gbps: float

    def as_json(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return attrs.asdict(self)


def environment(ctx: DistContext) -> dict[str, Any]:
    """What the figures depend on: torch's version, the backend, the device kind, the world size."""
    return {
        "torch_version": torch.__version__,
        "backend": ctx.backend,
        "device": ctx.device.type,
        "world_size": ctx.world_size,
    }


def _synchronizer(device: torch.device) -> Callable[[], None]:
    """A function that waits for the work queued on ``device`` (nothing to wait for on CPU)."""
    if device.type == "cpu":
        return lambda: None
    return lambda: torch.accelerator.synchronize(device)


def _batch(fn: Callable[[], object], inner: int, synchronize: Callable[[], None]) -> float:
    synchronize()
    start = time.perf_counter()
    for _ in range(inner):
        fn()
    synchronize()
    return (time.perf_counter() - start) / inner


def _measure(
    ctx: DistContext, fns: dict[str, Callable[[], object]], *, inner: int, warmup: int, repeats: int
) -> dict[str, float]:
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
    dist.all_reduce(medians, op=dist.ReduceOp.MAX, group=cpu)
    return dict(zip(fns, medians.tolist(), strict=True))


def run_cases(
    ctx: DistContext,
    cases: list[Case],
    *,
    quick: bool,
    progress: bool,
) -> Iterator[Record]:
    """Run ``cases`` on every rank; yields one record per case (identical on every rank).

    With ``progress``, the case being timed is shown on stderr, and only when
    stderr is a terminal (piped or redirected output gets no progress lines).
    """
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
            seconds = _measure(ctx, fns, inner=case.inner, warmup=warmup, repeats=repeats)
            del fns
        mine = seconds["pdist"]
        ratios = {n: mine / s for n, s in seconds.items() if n != "pdist" and s > 0}
        algbw = case.nbytes / mine / 1e9 if mine > 0 else 0.0
        yield Record(
            name=case.name,
            bytes=case.nbytes,
            world_size=ctx.world_size,
            seconds=seconds,
            ratios=ratios,
            algbw_gbps=algbw,
            busbw_gbps=algbw * case.busbw_factor(ctx.world_size),
        )
    if progress:
        sys.stderr.write("\r" + " " * 60 + "\r")
        sys.stderr.flush()
