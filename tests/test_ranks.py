"""is_rank0, rank0_only, rank0_first and barrier on real processes."""

from __future__ import annotations

import os
import tempfile

import pytest
from launcher import run_ranks

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


@world_sizes(4)
def test_is_rank0_of_a_group_answers_for_its_first_rank(ctx):
    """is_rank0(group) is the rank rank0_only(group) runs on; is_rank0(ctx) is global rank 0."""
    tp = pdist.new_tp_group(ctx, 2)
    assert pdist.is_rank0(tp) == (ctx.rank in (0, 2))
    assert pdist.is_rank0(ctx) == (ctx.rank == 0)
    ran = pdist.rank0_only(tp)(lambda: True)()
    assert bool(ran) == pdist.is_rank0(tp)


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


# --------------------------------------------------------------------------- factory forms


def _marker(tag):
    return os.path.join(tempfile.gettempdir(), f"pdist-{tag}-{os.environ['MASTER_PORT']}")


@world_sizes(2, 3)
def test_rank0_only_factory_on_function_zero_arg_function_and_method(ctx):
    """@rank0_only(ctx) runs a plain function, a zero-argument one and a method on rank 0 only."""
    calls = []

    @pdist.rank0_only(ctx)
    def plain(a, *, b):
        calls.append("plain")
        return a + b

    @pdist.rank0_only(ctx)
    def no_args():
        calls.append("no_args")
        return "done"

    class Model:
        def __init__(self):
            self.saved = 0

        @pdist.rank0_only(ctx)
        def save(self, path):
            self.saved += 1
            return path

    model = Model()
    first = ctx.rank == 0
    assert plain(1, b=2) == (3 if first else None)
    assert no_args() == ("done" if first else None)
    assert model.save("ckpt") == ("ckpt" if first else None)
    assert model.saved == (1 if first else 0)
    assert calls == (["plain", "no_args"] if first else [])
    assert plain.__name__ == "plain"
    assert Model.save.__name__ == "save"


@world_sizes(2, 3)
def test_rank0_first_factory_on_function_zero_arg_function_and_method(ctx):
    """@rank0_first(ctx) lets rank 0 finish first, for a function, a zero-arg one and a method."""
    path = _marker("r0f-factory")

    @pdist.rank0_first(ctx)
    def prepare():
        # Rank 0 creates the file; the others must find it already there.
        if ctx.rank == 0:
            with open(path, "w") as f:
                f.write("ready")
            return "made"
        with open(path) as f:
            return f.read()

    @pdist.rank0_first(ctx)
    def read(suffix):
        with open(path) as f:
            return f.read() + suffix

    class Cache:
        def __init__(self):
            self.filled = False

        @pdist.rank0_first(ctx)
        def fill(self, key):
            self.filled = True
            with open(path) as f:
                return (key, f.read())

    try:
        assert prepare() == ("made" if ctx.rank == 0 else "ready")
        assert read("!") == "ready!"
        cache = Cache()
        assert cache.fill("k") == ("k", "ready")
        assert cache.filled
        pdist.barrier(ctx)
    finally:
        if ctx.rank == 0:
            os.unlink(path)


@world_sizes(3)
def test_rank0_first_factory_failure_reaches_every_rank(ctx):
    """In the factory form too, rank 0's error makes every other rank raise instead of waiting."""

    @pdist.rank0_first(ctx)
    def download():
        if ctx.rank == 0:
            raise OSError("mirror unreachable")
        return "ran"

    if ctx.rank == 0:
        with pytest.raises(OSError, match="mirror unreachable"):
            download()
    else:
        with pytest.raises(
            pdist.PdistError, match=r"failed on rank 0: OSError: mirror unreachable"
        ):
            download()
    # Nobody is left inside a collective: the world still works.
    pdist.barrier(ctx)


@world_sizes(3)
def test_factory_forms_on_a_group_use_its_first_rank(ctx):
    """Given a Group, both decorators run first on that group's first rank (here global rank 1)."""
    pair = pdist.new_group(ctx, [[1, 2]], name="pair")
    if pair is None:
        assert ctx.rank == 0
        return

    @pdist.rank0_only(pair)
    def only():
        return ctx.rank

    @pdist.rank0_first(pair)
    def first():
        return ctx.rank

    assert only() == (1 if ctx.rank == 1 else None)
    assert first() == ctx.rank
    pdist.barrier(pair)


@world_sizes(2)
def test_direct_form_still_takes_the_ctx_first(ctx):
    """The direct form keeps working next to the factory form."""
    assert _only(ctx, 4) == (8 if ctx.rank == 0 else None)
    assert _only(ctx.world, 4) == (8 if ctx.rank == 0 else None)


def test_direct_form_without_a_ctx_says_to_use_the_factory_form():
    """A direct-form function called without a context names the factory form as the fix."""
    with pytest.raises(TypeError, match=r"first argument must be a DistContext or Group, got 21"):
        _only(21, 1)
    with pytest.raises(TypeError, match=r"factory form @pdist.rank0_first\(ctx\)"):
        _prepare("not a ctx", "path")


@pytest.mark.parametrize("decorator", [pdist.rank0_only, pdist.rank0_first])
def test_decorators_refuse_what_is_neither_callable_nor_a_ctx(decorator):
    """rank0_only(42) is a TypeError naming both forms."""
    with pytest.raises(TypeError, match=r"pass a DistContext or Group"):
        decorator(42)


# --------------------------------------------------------------------------- is_local_rank0


@world_sizes(1, 3)
def test_is_local_rank0_on_one_host(ctx):
    """On one host only rank 0 is the host's first rank."""
    assert pdist.is_local_rank0(ctx) == (ctx.rank == 0)
    with pytest.raises(TypeError, match="must be a pdist DistContext"):
        pdist.is_local_rank0(ctx.world)


LOCAL_RANK0_HOSTS = """
    import pdist
    with pdist.distributed() as ctx:
        print("LOCAL0", pdist.is_local_rank0(ctx), "RANK0", pdist.is_rank0(ctx), flush=True)
"""


def test_is_local_rank0_is_per_host():
    """With two simulated hosts of one rank each, both ranks are their host's first rank."""
    results = run_ranks(LOCAL_RANK0_HOSTS, 2, timeout=120, hosts=[[0], [1]])
    for r in results:
        assert r.returncode == 0, r.output
        assert f"LOCAL0 True RANK0 {r.rank == 0}" in r.output
