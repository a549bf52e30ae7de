"""is_rank0, rank0_only, rank0_first and barrier on real processes."""

from __future__ import annotations

import os
import tempfile

import pytest

import pdist
from pdist.testing import world_sizes


@pdist.rank0_only
def _only(ctx, value):
    return value * 2


@world_sizes(1, 3)
def test_rank0_only(ctx):
    """rank0_only runs on rank 0 and returns None elsewhere."""
    assert pdist.is_rank0(ctx) == (ctx.rank == 0)
    assert _only(ctx, 21) == (42 if ctx.rank == 0 else None)


@pdist.rank0_first
def _prepare(ctx, path):
    # Rank 0 creates the file; the others must find it already there.
    if ctx.rank == 0:
        with open(path, "w") as f:
            f.write("ready")
        return "made"
    with open(path) as f:
        return f.read()


@world_sizes(3)
def test_rank0_first_runs_rank0_before_the_others(ctx):
    """The others run only after rank 0 finished."""
    path = os.path.join(tempfile.gettempdir(), f"pdist-r0f-{os.environ['MASTER_PORT']}")
    try:
        assert _prepare(ctx, path) == ("made" if ctx.rank == 0 else "ready")
        pdist.barrier(ctx)
    finally:
        if ctx.rank == 0:
            os.unlink(path)


@pdist.rank0_first
def _fails_on_rank0(ctx):
    if ctx.rank == 0:
        raise OSError("download failed")
    return "ran"


@world_sizes(3)
def test_rank0_first_failure_reaches_every_rank(ctx):
    """If rank 0 raises, the others raise too instead of waiting."""
    if ctx.rank == 0:
        with pytest.raises(OSError, match="download failed"):
            _fails_on_rank0(ctx)
    else:
        with pytest.raises(pdist.PdistError, match=r"failed on rank 0: OSError: download failed"):
            _fails_on_rank0(ctx)


@world_sizes(1, 2)
def test_barrier_accepts_groups_and_contexts(ctx):
    """barrier works on a context (its world) and on any group; bad types are refused."""
    pdist.barrier(ctx)
    pdist.barrier(ctx.tp)
    with pytest.raises(TypeError, match="must be a pdist Group or DistContext"):
        pdist.barrier("world")
