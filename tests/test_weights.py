"""broadcast_weights: names agreed first, into filled in place (cast), buckets, dead sources."""

from __future__ import annotations

import pytest
import torch
from launcher import run_ranks
from test_links import free_port, passed
from torch.utils._pytree import tree_map

import pdist
from pdist.testing import count_collectives, inject, world_sizes

SHAPES = {"embed": (300, 64), "norm": (64,), "head": (64, 300), "bias": (7,), "step": ()}


def weights() -> dict[str, torch.Tensor]:
    """The trainer's fp32 weights, the same on every process (computed independently)."""
    gen = torch.Generator().manual_seed(0)
    return {n: torch.randn(s, generator=gen) for n, s in SHAPES.items()}


@world_sizes(2, 3)
def test_bf16_into_filled_in_place(ctx):
    """Receivers' bf16 into (one non-contiguous) gets the source's fp32 weights cast, in place."""
    src = ctx.world_size - 1
    mine = weights()
    into = {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in SHAPES.items()}
    into["head"] = torch.zeros(300, 64, dtype=torch.bfloat16).t()  # non-contiguous
    before = {n: t.data_ptr() for n, t in into.items()}
    tensors = mine if ctx.rank == src else None
    # Small buckets: packed buckets and chunked large tensors both happen.
    out = pdist.broadcast_weights(ctx, tensors, src=src, into=into, bucket_bytes=16 << 10)
    assert out is into
    for n, t in into.items():
        assert t.data_ptr() == before[n]
        torch.testing.assert_close(t, mine[n].to(torch.bfloat16), rtol=0, atol=0)


@world_sizes(2, 3)
def test_new_dict_without_into(ctx):
    """Without into every member gets a new dict equal to the source's tensors."""
    mine = weights()
    out = pdist.broadcast_weights(ctx, mine if ctx.rank == 0 else None, bucket_bytes=4096)
    assert list(out) == list(SHAPES)
    for n, t in out.items():
        assert t.dtype == torch.float32
        assert torch.equal(t, mine[n])
        if ctx.rank != 0:
            assert t.data_ptr() != mine[n].data_ptr()
    # A non-contiguous source in many chunks (flattened once, not once per chunk).
    wide = torch.arange(64 * 300.0).view(64, 300)
    out = pdist.broadcast_weights(ctx, {"w": wide.t()} if ctx.rank == 0 else None, bucket_bytes=512)
    assert torch.equal(out["w"], wide.t())


MISMATCHES = [
    (lambda into: into.pop("norm"), r"'norm' \(shape \[64\] on the source.*missing"),
    (lambda into: into.update(head=torch.zeros(64, 301)), r"'head'.*\[64, 300\].*\[64, 301\]"),
    (lambda into: into.update(extra=torch.zeros(2)), r"'extra' \(shape \[2\]"),
]


@world_sizes(3)
def test_mismatch_raises_everywhere_and_leaves_into_alone(ctx):
    """A name missing from / extra in one receiver's into, or another shape, raises everywhere."""
    for change, match in MISMATCHES:
        into = {n: torch.full(s, 5.0) for n, s in SHAPES.items()}
        if ctx.rank == 2:
            change(into)
        kept = {n: t.clone() for n, t in into.items()}
        with pytest.raises(pdist.PdistError, match=match):
            pdist.broadcast_weights(ctx, weights() if ctx.rank == 0 else None, into=into)
        for n, t in into.items():
            assert torch.equal(t, kept[n])
        assert pdist.all_reduce(ctx, torch.ones(1)).item() == 3.0  # the group still works


@world_sizes(2)
def test_bad_source_raises_everywhere(ctx):
    """A source that passes no mapping: every member raises naming the argument."""
    with pytest.raises(pdist.PdistError, match="tensors=None on the source"):
        pdist.broadcast_weights(ctx, None, into={} if ctx.rank else None)


@world_sizes(3)
def test_different_src_raises_everywhere(ctx):
    """Members that pass different src all raise, naming each member's, and the group goes on."""
    src = 1 if ctx.rank == 2 else 0
    with pytest.raises(
        pdist.RankMismatchError, match=r"rank 0: src=0, rank 1: src=0, rank 2: src=1"
    ):
        pdist.broadcast_weights(ctx, weights(), src=src, into=weights())
    assert pdist.all_reduce(ctx, torch.ones(1)).item() == 3.0


@world_sizes(2, 3)
def test_many_names_past_the_first_chunk(ctx):
    """Metadata longer than the agreement's first chunk (400 names) still arrives whole."""
    mine = {
        f"model.layers.{i}.mlp.experts.weight": torch.full((i % 5,), float(i)) for i in range(400)
    }
    into = {n: torch.zeros_like(t, dtype=torch.float64) for n, t in mine.items()}
    out = pdist.broadcast_weights(ctx, mine if ctx.rank == 0 else None, into=into)
    for n, t in out.items():
        assert torch.equal(t, mine[n].double())


BIG = {f"w{i}": torch.full((1 << 18,), float(i)) for i in range(3)}  # 1 MiB each: alone


def _count(ctx, into) -> int:
    with count_collectives() as calls:
        pdist.broadcast_weights(ctx, BIG if ctx.rank == 0 else None, into=into)
    return sum(calls.values())


@world_sizes(3)
def test_an_into_that_takes_every_tensor_straight_skips_a_round(ctx):
    """Receivers whose into matches exactly spare the status round that a cast into needs."""
    exact = {n: torch.zeros_like(t) for n, t in BIG.items()}
    cast = {n: torch.zeros_like(t, dtype=torch.bfloat16) for n, t in BIG.items()}
    straight = _count(ctx, exact if ctx.rank else None)
    assert _count(ctx, cast if ctx.rank else None) == straight + 1
    for n, t in BIG.items():
        if ctx.rank:
            assert torch.equal(exact[n], t)
            assert torch.equal(cast[n], t.bfloat16())


def _pack_fails(index: int) -> None:
    if index == 1:
        raise RuntimeError("simulated packing failure")


@world_sizes(3)
def test_a_source_that_fails_midway_raises_everywhere_on_the_straight_path(ctx):
    """No status before the move: a failure while the source sends still raises on all."""
    into = None if ctx.rank == 0 else {n: torch.zeros_like(t) for n, t in BIG.items()}
    failing = inject(pack=_pack_fails if ctx.rank == 0 else None)
    with failing, pytest.raises(pdist.PdistError, match="simulated packing failure"):
        pdist.broadcast_weights(ctx, BIG if ctx.rank == 0 else None, into=into)
    assert pdist.all_reduce(ctx, torch.ones(1)).item() == 3.0


@world_sizes(2)
def test_a_source_into_that_differs_raises_everywhere(ctx):
    """The source's own into lacking a name: every member raises, before any byte moves."""
    mine = {n: torch.zeros(s) for n, s in SHAPES.items()}
    if ctx.rank == 0:
        mine.pop("bias")
    with pytest.raises(pdist.PdistError, match=r"'bias'.*missing"):
        pdist.broadcast_weights(ctx, weights() if ctx.rank == 0 else None, into=mine)


@world_sizes(3)
def test_a_source_into_that_cannot_take_the_copy_raises_everywhere(ctx):
    """The source's own into that cannot take the copy (expanded): every member raises up front."""
    src = 1
    into = {"w": torch.zeros(1).expand(4) if ctx.rank == src else torch.zeros(4)}
    tensors = {"w": torch.arange(4.0)} if ctx.rank == src else None
    match = r"failed on rank 1: ValueError: into\['w'\] on rank 1 is an expanded view"
    with pytest.raises(pdist.PdistError, match=match):
        pdist.broadcast_weights(ctx, tensors, src=src, into=into)
    assert pdist.all_reduce(ctx, torch.ones(1)).item() == 3.0


@world_sizes(2)
def test_conjugate_and_negative_views(ctx):
    """Conjugate and negative views travel by value, as sources and as into (packed, chunked)."""
    z = torch.tensor([1 + 2j, 3 - 4j, -5 + 0.5j], dtype=torch.complex64)
    expected = {
        "conj": torch.tensor([1 - 2j, 3 + 4j, -5 - 0.5j]),
        "neg": torch.tensor([-2, 4, -0.5]),
    }
    tensors = {"conj": z.conj(), "neg": z.conj().imag} if ctx.rank == 0 else None
    for bucket_bytes in (256 << 20, 8):
        out = pdist.broadcast_weights(ctx, tensors, bucket_bytes=bucket_bytes)
        for name, want in expected.items():
            assert torch.equal(out[name], want)
        into = {"conj": torch.zeros(3, dtype=torch.complex64).conj(), "neg": torch.zeros(3)}
        pdist.broadcast_weights(ctx, tensors, into=into, bucket_bytes=bucket_bytes)
        for name, want in expected.items():
            assert torch.equal(into[name], want)


@world_sizes(3)
def test_nothing_to_send(ctx):
    """An empty mapping, and a zero-size tensor, arrive as such (into or a new dict)."""
    source = ctx.rank == 0
    assert pdist.broadcast_weights(ctx, {} if source else None, into=None if source else {}) == {}
    assert pdist.broadcast_weights(ctx, {} if source else None) == {}
    into = {"z": torch.ones(0, 3)}
    out = pdist.broadcast_weights(ctx, {"z": torch.zeros(0, 3)} if source else None, into=into)
    assert list(out) == ["z"]
    assert out["z"].shape == (0, 3)


DEAD_SOURCE = """
    import os, time
    import torch
    import pdist

    rank = int(os.environ["RANK"])
    with pdist.link(os.environ["LINK"], rank=rank, world_size=3, timeout=10) as g:
        pdist.barrier(g)  # the link is up
        if rank == 0:
            os._exit(3)  # the source goes away before sending
        start = time.monotonic()
        try:
            pdist.broadcast_weights(g, into={"w": torch.zeros(4)})
        except pdist.PdistError as exc:
            print(f"RAISED after {time.monotonic() - start:.1f}s: {type(exc).__name__}: {exc}")
    print("OK")
"""


def test_source_exits_before_sending() -> None:
    """The source (the store's host) exits before sending: both receivers raise naming it."""
    results = run_ranks(DEAD_SOURCE, 3, timeout=90, env={"LINK": f"127.0.0.1:{free_port()}"})
    for r in results[1:]:
        assert r.returncode == 0, r.output
        assert "RAISED after" in r.output, r.output
        assert "store's host (link rank 0)" in r.output, r.output
        assert "launcher's agent" not in r.output, r.output  # a link has none
        assert float(r.output.split("RAISED after ")[1].split("s")[0]) < 10 + 15


MEMORY = """
    import os, resource
    import torch
    import pdist

    def peak_mib():
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    rank = int(os.environ["RANK"])
    n = 64  # 64 x 4 MiB fp32 = 256 MiB, plus 512 small tensors (2 MiB)
    with pdist.link(os.environ["LINK"], rank=rank, world_size=2, timeout=60) as g:
        if rank == 0:
            tensors = {f"w{i}": torch.full((1 << 20,), float(i)) for i in range(n)}
            tensors.update({f"s{i}": torch.full((1024,), float(i % 100)) for i in range(512)})
            into = None
        else:
            tensors = None
            into = {f"w{i}": torch.zeros(1 << 20) for i in range(n)}
            into.update({f"s{i}": torch.zeros(1024, dtype=torch.bfloat16) for i in range(512)})
        pdist.barrier(g)
        base = peak_mib()
        pdist.broadcast_weights(g, tensors, into=into, bucket_bytes=16 << 20)
        grown = peak_mib() - base
        if rank == 1:
            assert all(into[f"w{i}"][0].item() == i for i in range(n))
            assert all(into[f"s{i}"][-1].item() == i % 100 for i in range(512))
        print(f"GREW {grown:.1f} MiB")
        assert grown < 100, grown
    print("OK")
"""


def test_peak_memory_stays_within_buckets() -> None:
    """256 MiB of weights in 16 MiB buckets: peak RSS grows well under 100 MiB on both sides."""
    passed(run_ranks(MEMORY, 2, timeout=120, env={"LINK": f"127.0.0.1:{free_port()}"}), 2)


DEAD_RECEIVER = """
    import os, time
    import torch
    import pdist

    rank = int(os.environ["RANK"])
    with pdist.link(os.environ["LINK"], rank=rank, world_size=3, timeout=10) as g:
        pdist.barrier(g)
        if rank == 2:
            os._exit(3)  # a receiver goes away while the source sends
        weights = {f"w{i}": torch.ones(1 << 18) for i in range(8)}  # 8 MiB
        start = time.monotonic()
        try:
            pdist.broadcast_weights(g, weights if rank == 0 else None, bucket_bytes=1 << 20)
        except pdist.PdistError as exc:
            print(f"RAISED after {time.monotonic() - start:.1f}s: {type(exc).__name__}: {exc}")
    print("OK")
"""


def test_receiver_exits_while_the_source_sends() -> None:
    """A receiver goes away: the source and the other receiver raise naming it, neither hangs."""
    results = run_ranks(DEAD_RECEIVER, 3, timeout=90, env={"LINK": f"127.0.0.1:{free_port()}"})
    for r in results[:2]:
        assert r.returncode == 0, r.output
        assert "RAISED after" in r.output, r.output
        assert "link rank 2 went away without a word" in r.output, r.output
        assert float(r.output.split("RAISED after ")[1].split("s")[0]) < 10 + 15


UNFILLABLE = [
    (lambda: torch.empty(64, device="meta"), "on the meta device"),
    (lambda: torch.zeros(1).expand(64), "expanded view"),
]


@world_sizes(1, 3)
def test_an_into_that_cannot_be_filled_raises_everywhere_before_any_byte_moves(ctx):
    """A meta (or expanded) into on one receiver: every member raises naming it, nothing moves."""
    last = ctx.world_size - 1
    for make, match in UNFILLABLE:
        into = {n: torch.full(s, 5.0) for n, s in SHAPES.items()}
        into["norm"] = make() if ctx.rank == last else into["norm"]
        kept = {n: t.clone() for n, t in into.items() if n != "norm" or ctx.rank != last}
        with pytest.raises(pdist.PdistError, match=rf"into\['norm'\] on rank {last} .*{match}"):
            pdist.broadcast_weights(ctx, weights() if ctx.rank == 0 else None, into=into)
        for n, t in kept.items():
            assert torch.equal(into[n], t)  # untouched: no byte moved
        assert pdist.all_reduce(ctx, torch.ones(1)).item() == ctx.world_size


class Unsendable(torch.Tensor):
    """A tensor of its own dispatch, as a DTensor is: aten ops keep it wrapped, c10d ops raise."""

    @staticmethod
    def __new__(cls, data: torch.Tensor) -> Unsendable:  # noqa: D102
        t = torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=data.dtype)
        t.inner = data
        return t

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func.namespace != "aten":
            raise NotImplementedError(f"{func} has no rule for Unsendable")
        unwrap = lambda t: t.inner if isinstance(t, Unsendable) else t  # noqa: E731
        wrap = lambda t: Unsendable(t) if isinstance(t, torch.Tensor) else t  # noqa: E731
        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))
        return tree_map(wrap, out)


@world_sizes(2, 3)
def test_a_local_error_on_the_source_is_raised_as_itself_everywhere(ctx):
    """A tensor whose bytes cannot go on the wire: its error raises on all, no peer named gone."""
    source = ctx.world_size - 1
    tensors = {"w": Unsendable(torch.arange(8.0)), "b": torch.ones(3)}
    into = None if ctx.rank == source else {"w": torch.zeros(8), "b": torch.zeros(3)}
    match = rf"failed on rank {source}: TypeError: .*Unsendable"
    sent = tensors if ctx.rank == source else None
    # In chunks (a bucket of 16 bytes), the source's tensor would be the wire itself.
    with pytest.raises((TypeError, pdist.PdistError), match=match) as info:
        pdist.broadcast_weights(ctx, sent, src=source, into=into, bucket_bytes=16)
    assert isinstance(info.value, TypeError)  # not a member named as gone
    if ctx.rank == source:  # its own error, as the cause
        assert type(info.value.__cause__) is TypeError
    assert pdist.all_reduce(ctx, torch.ones(1)).item() == ctx.world_size


@world_sizes(2)
def test_a_permuted_into_is_filled_in_place_chunk_by_chunk(ctx):
    """A 3-d permuted source into a permuted bf16 into, in 64-byte chunks cutting rows anywhere."""
    source = torch.arange(5 * 6 * 7.0).view(6, 7, 5).permute(1, 2, 0)  # [7, 5, 6]
    into = {"w": torch.zeros(5, 6, 7, dtype=torch.bfloat16).permute(2, 0, 1)}
    pdist.broadcast_weights(
        ctx, {"w": source} if ctx.rank == 0 else None, into=into, bucket_bytes=64
    )
    assert torch.equal(into["w"], source.bfloat16())


TRANSPOSED = """
    import os, resource
    import torch
    import pdist

    def peak_mib():
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    rank = int(os.environ["RANK"])
    with pdist.link(os.environ["LINK"], rank=rank, world_size=2, timeout=60) as g:
        weight = torch.arange(4096 * 4096, dtype=torch.float32).view(4096, 4096)  # 64 MiB
        into = {"w": torch.zeros(4096, 4096).t()}  # transposed: no chunk lands straight
        pdist.barrier(g)
        base = peak_mib()
        pdist.broadcast_weights(g, {"w": weight.t()} if rank == 0 else None, into=into,
                                bucket_bytes=1 << 20)
        grown = peak_mib() - base
        print(f"GREW {grown:.1f} MiB")
        if rank == 1:
            assert torch.equal(into["w"], weight.t())
        assert grown < 32, grown  # about a 1 MiB bucket (and allocator slack), not 64 MiB
    print("OK")
"""


def test_a_transposed_into_grows_the_receiver_by_a_bucket_not_the_tensor() -> None:
    """A transposed 64 MiB source and into in 1 MiB buckets: neither side copies it whole."""
    passed(run_ranks(TRANSPOSED, 2, timeout=120, env={"LINK": f"127.0.0.1:{free_port()}"}), 2)
