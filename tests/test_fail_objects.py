"""Fail together on the object paths: one bad rank, and every rank raises within seconds.

Each case runs on real gloo ranks inside ``distributed(timeout=30)``; one rank
gets a bad argument or a failure injected into a local step (packing,
allocating, decoding) while the others are correct. Every rank must raise the
same error type, naming the failing rank, within 10 s (measured inside the
ranks), instead of waiting for the 30 s timeout.
"""

from __future__ import annotations

import functools
import re
import sys

import pytest
import torch
from fail_together import Case, assert_failed_together, fails, out_of_memory, outcome_of, run_case

import pdist
from pdist.testing import inject, spawn, world_sizes

BIG = 8192  # elements: tensors of 32 KiB and more travel in buckets


class Shipped:
    """A class the receiver will pretend not to have."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


def _payload_with_buckets():
    return {"w": torch.arange(float(BIG)), "step": 3}


LARGE = b"x" * (2 << 20)  # a skeleton whose rest (past the first 4 KiB chunk) is over 1 MiB
BUCKETS = 16 << 10  # buffers this large or more: the buckets, not the framing's first chunks


def _large_allocations_fail():
    """Every buffer of 1 MiB or more fails on this rank (the framing's own rests)."""
    return inject(allocate=out_of_memory(1 << 20))


def _buckets_cannot_allocate():
    """The buffers of the tensors (and the gathers' regions) fail on this rank."""
    return inject(allocate=out_of_memory(BUCKETS))


def _packing_fails(from_index: int = 0, text: str = "simulated packing failure"):
    return inject(pack=fails(text, from_index=from_index))


# --------------------------------------------------------------------------- cases
# Each takes the context; the bad rank is the one the case names in CASES.


def _bol_pack_fails(ctx):
    objs = [_payload_with_buckets()] if ctx.rank == 0 else [None]
    if ctx.rank == 0:
        with _packing_fails():
            pdist.broadcast_object_list(ctx, objs)
    else:
        pdist.broadcast_object_list(ctx, objs)


def _bol_late_pack_fails(ctx, numels=(9 << 18, 9 << 18, 512), from_index=1):
    """Packing bucket ``from_index`` (default: the second, 9 MiB and 2 KiB) fails on the source."""
    objs = [[torch.ones(n) for n in numels]] if ctx.rank == 0 else [None]
    if ctx.rank != 0:
        pdist.broadcast_object_list(ctx, objs)
        return
    with _packing_fails(from_index=from_index, text="simulated late packing failure"):
        pdist.broadcast_object_list(ctx, objs)


def _send_late_pack_fails(ctx, numels=(9 << 18, 9 << 18, 512), from_index=1):
    """As :func:`_bol_late_pack_fails`, from a sender to its receiver."""
    if ctx.rank == 1:
        pdist.recv_object(ctx, src=0)
        return
    with _packing_fails(from_index=from_index, text="simulated late packing failure"):
        pdist.send_object(ctx, [torch.ones(n) for n in numels], dst=1)


def _mq_tensor_dict_pack_fails(ctx):
    with pdist.message_queue(ctx.world) as group:
        if ctx.rank == 0:
            with _packing_fails():
                pdist.broadcast_tensor_dict(group, _payload_with_buckets())
        else:
            pdist.broadcast_tensor_dict(group)


def _send_tensor_dict_pack_fails(ctx):
    if ctx.rank == 0:
        with _packing_fails():
            pdist.send_tensor_dict(ctx, _payload_with_buckets(), dst=1)
    elif ctx.rank == 1:
        pdist.recv_tensor_dict(ctx, src=0)


def _send_tensor_dict_not_a_dict(ctx):
    if ctx.rank == 0:
        pdist.send_tensor_dict(ctx, [torch.ones(BIG)], dst=1)
    elif ctx.rank == 1:
        pdist.recv_tensor_dict(ctx, src=0)


def _bol_receiver_passes_none(ctx):
    objs = [_payload_with_buckets()] if ctx.rank == 0 else [None]
    pdist.broadcast_object_list(ctx, None if ctx.rank == 1 else objs)


def _bol_receiver_bad_safe(ctx):
    objs = [_payload_with_buckets()] if ctx.rank == 0 else [None]
    pdist.broadcast_object_list(ctx, objs, safe=123 if ctx.rank == 1 else False)


def _bol_receiver_bad_min_bytes(ctx):
    objs = [_payload_with_buckets()] if ctx.rank == 0 else [None]
    pdist.broadcast_object_list(ctx, objs, min_tensor_bytes=-5 if ctx.rank == 1 else 1024)


def _bol_receiver_allocation_fails(ctx):
    objs = [_payload_with_buckets()] if ctx.rank == 0 else [None]
    if ctx.rank == 1:
        with _buckets_cannot_allocate():
            pdist.broadcast_object_list(ctx, objs)
    else:
        pdist.broadcast_object_list(ctx, objs)


def _tensor_dict_receiver_allocation_fails(ctx):
    if ctx.rank == 1:
        with _buckets_cannot_allocate():
            pdist.broadcast_tensor_dict(ctx)
    else:
        pdist.broadcast_tensor_dict(ctx, _payload_with_buckets() if ctx.rank == 0 else None)


def _all_gather_allocation_fails(ctx):
    if ctx.rank == 1:
        with _buckets_cannot_allocate():
            pdist.all_gather_object(ctx, _payload_with_buckets())
    else:
        pdist.all_gather_object(ctx, _payload_with_buckets())


def _all_gather_bad_safe(ctx):
    pdist.all_gather_object(ctx, _payload_with_buckets(), safe="yes" if ctx.rank == 1 else False)


def _gather_allocation_fails(ctx):
    if ctx.rank == 1:
        with _buckets_cannot_allocate():
            pdist.gather_object(ctx, _payload_with_buckets(), dst=1)
    else:
        pdist.gather_object(ctx, _payload_with_buckets(), dst=1)


def _gather_bad_safe(ctx):
    pdist.gather_object(ctx, _payload_with_buckets(), dst=0, safe=[1] if ctx.rank == 1 else False)


def _recv_object_allocation_fails(ctx):
    if ctx.rank == 0:
        pdist.send_object(ctx, _payload_with_buckets(), dst=1)
    elif ctx.rank == 1:
        with _buckets_cannot_allocate():
            pdist.recv_object(ctx, src=0)


def _recv_object_bad_safe(ctx):
    if ctx.rank == 0:
        pdist.send_object(ctx, _payload_with_buckets(), dst=1)
    elif ctx.rank == 1:
        pdist.recv_object(ctx, src=0, safe=None)


def _recv_tensor_dict_allocation_fails(ctx):
    if ctx.rank == 0:
        pdist.send_tensor_dict(ctx, _payload_with_buckets(), dst=1)
    elif ctx.rank == 1:
        with _buckets_cannot_allocate():
            pdist.recv_tensor_dict(ctx, src=0)


def _staged_receiver_allocation_fails(ctx):
    """Two pipeline stages of 2 (ranks 0,1 -> 2,3); receiver rank 3 cannot allocate."""
    tp = pdist.new_tp_group(ctx, 2)
    if ctx.rank < 2:
        pdist.send_tensor_dict(ctx, _payload_with_buckets(), dst=ctx.rank + 2, all_gather_group=tp)
    elif ctx.rank == 3:
        with _buckets_cannot_allocate():
            pdist.recv_tensor_dict(ctx, src=1, all_gather_group=tp)
    else:
        pdist.recv_tensor_dict(ctx, src=0, all_gather_group=tp)


def _broadcast_large_receiver_cannot_allocate(ctx):
    if ctx.rank == 1:
        with _large_allocations_fail():
            pdist.broadcast_object(ctx, None)
    else:
        pdist.broadcast_object(ctx, LARGE if ctx.rank == 0 else None)


def _broadcast_large_source_cannot_allocate(ctx):
    if ctx.rank == 0:
        with _large_allocations_fail():
            pdist.broadcast_object(ctx, LARGE)
    else:
        pdist.broadcast_object(ctx, None)


def _mq_large_receiver_cannot_allocate(ctx):
    """A message larger than a slot goes over the CPU group; a reader cannot allocate it."""
    with pdist.message_queue(ctx.world, chunk_bytes=1 << 16) as group:
        if ctx.rank == 1:
            with _large_allocations_fail():
                pdist.broadcast_object(group, None)
        else:
            pdist.broadcast_object(group, LARGE if ctx.rank == 0 else None)


def _all_gather_large_cannot_allocate(ctx):
    if ctx.rank == 1:
        with _large_allocations_fail():
            pdist.all_gather_object(ctx, LARGE)
    else:
        pdist.all_gather_object(ctx, LARGE)


def _gather_large_destination_cannot_allocate(ctx):
    if ctx.rank == 1:
        with _large_allocations_fail():
            pdist.gather_object(ctx, LARGE, dst=1)
    else:
        pdist.gather_object(ctx, LARGE, dst=1)


def _recv_large_cannot_allocate(ctx):
    if ctx.rank == 0:
        pdist.send_object(ctx, LARGE, dst=1)
    elif ctx.rank == 1:
        with _large_allocations_fail():
            pdist.recv_object(ctx, src=0)


def _send_large_cannot_allocate(ctx):
    if ctx.rank == 0:
        with _large_allocations_fail():
            pdist.send_object(ctx, LARGE, dst=1)
    elif ctx.rank == 1:
        pdist.recv_object(ctx, src=0)


def _oom(fn, world_size: int, bad_rank: int) -> Case:
    """A case whose bad rank fails to allocate (the allocate seam's simulated OOM)."""
    return Case(fn, world_size, bad_rank, RuntimeError, re.escape("simulated out of memory"))


def _late(fn, world_size: int, **payload) -> Case:
    """A case whose rank 0 fails to pack a bucket after the first (``payload``: which)."""
    call = functools.partial(fn, **payload)
    return Case(call, world_size, 0, RuntimeError, re.escape("simulated late packing failure"))


CASES = {
    # name: the call, world size, the bad rank, the error type on every rank, the text
    "broadcast_large_receiver_cannot_allocate": _oom(
        _broadcast_large_receiver_cannot_allocate, 3, 1
    ),
    "broadcast_large_source_cannot_allocate": _oom(_broadcast_large_source_cannot_allocate, 3, 0),
    "mq_large_receiver_cannot_allocate": _oom(_mq_large_receiver_cannot_allocate, 3, 1),
    "all_gather_large_cannot_allocate": _oom(_all_gather_large_cannot_allocate, 3, 1),
    "gather_large_destination_cannot_allocate": _oom(
        _gather_large_destination_cannot_allocate, 3, 1
    ),
    "recv_large_cannot_allocate": _oom(_recv_large_cannot_allocate, 2, 1),
    "send_large_cannot_allocate": _oom(_send_large_cannot_allocate, 2, 0),
    "bol_pack_fails": Case(
        _bol_pack_fails, 3, 0, RuntimeError, re.escape("simulated packing failure")
    ),
    "bol_late_pack_fails": _late(_bol_late_pack_fails, 3),
    "send_late_pack_fails": _late(_send_late_pack_fails, 2),
    "mq_tensor_dict_pack_fails": Case(
        _mq_tensor_dict_pack_fails, 3, 0, RuntimeError, re.escape("simulated packing failure")
    ),
    "send_tensor_dict_pack_fails": Case(
        _send_tensor_dict_pack_fails, 2, 0, RuntimeError, re.escape("simulated packing failure")
    ),
    "send_tensor_dict_not_a_dict": Case(
        _send_tensor_dict_not_a_dict,
        2,
        0,
        TypeError,
        re.escape("tensor_dict must be a dict, got list"),
    ),
    "bol_receiver_passes_none": Case(
        _bol_receiver_passes_none,
        3,
        1,
        TypeError,
        re.escape("object_list=None on rank 1 must be a list"),
    ),
    "bol_receiver_bad_safe": Case(
        _bol_receiver_bad_safe, 3, 1, TypeError, re.escape("safe=123 on rank 1")
    ),
    "bol_receiver_bad_min_bytes": Case(
        _bol_receiver_bad_min_bytes, 3, 1, ValueError, re.escape("min_tensor_bytes=-5 on rank 1")
    ),
    "bol_receiver_allocation_fails": _oom(_bol_receiver_allocation_fails, 3, 1),
    "tensor_dict_receiver_allocation_fails": _oom(_tensor_dict_receiver_allocation_fails, 3, 1),
    "all_gather_allocation_fails": _oom(_all_gather_allocation_fails, 3, 1),
    "all_gather_bad_safe": Case(
        _all_gather_bad_safe, 2, 1, TypeError, re.escape("safe='yes' on rank 1")
    ),
    "gather_allocation_fails": _oom(_gather_allocation_fails, 3, 1),
    "gather_bad_safe": Case(
        _gather_bad_safe, 2, 1, TypeError, re.escape("safe= on rank 1 lists 1")
    ),
    "recv_object_allocation_fails": _oom(_recv_object_allocation_fails, 2, 1),
    "recv_object_bad_safe": Case(
        _recv_object_bad_safe, 2, 1, TypeError, re.escape("safe=None on rank 1")
    ),
    "recv_tensor_dict_allocation_fails": _oom(_recv_tensor_dict_allocation_fails, 2, 1),
    "staged_receiver_allocation_fails": _oom(_staged_receiver_allocation_fails, 4, 3),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_one_bad_rank_makes_every_rank_raise_quickly(name):
    """Every participating rank raises the expected error, naming the bad rank, within 10 s."""
    case = CASES[name]
    assert_failed_together(case, spawn(run_case, case.world, case, timeout=120))


def _split_mismatch():
    """Senders split buckets over a TP group of 2; their receivers pass no all_gather_group."""
    with pdist.distributed(timeout=30) as ctx:
        tp = pdist.new_tp_group(ctx, 2)

        def transfer() -> None:
            if ctx.rank < 2:
                pdist.send_tensor_dict(
                    ctx, _payload_with_buckets(), dst=ctx.rank + 2, all_gather_group=tp
                )
            else:
                pdist.recv_tensor_dict(ctx, src=ctx.rank - 2)

        return outcome_of(ctx, transfer, ValueError)


def test_all_gather_group_sizes_that_differ_fail_on_both_sides():
    """all_gather_group sizes that differ across a send raise on both sides, early."""
    outcomes = spawn(_split_mismatch, 4, timeout=120)
    for rank, out in enumerate(outcomes):
        assert out.pdist, (rank, out)
        assert "sent each bucket in 2 part(s)" in out.message, (rank, out)
        assert f"failed on rank {rank if rank >= 2 else rank + 2}" in out.message, (rank, out)
        assert out.expected, (rank, out)
        assert out.seconds < 10
        assert out.after == [0, 1, 2, 3]


# --------------------------------------------------------------------------- only the bad rank


def _tiny_receiver_passes_none():
    with pdist.distributed(timeout=30) as ctx:
        objs = None if ctx.rank == 1 else [{"step": 3}]
        return outcome_of(ctx, lambda: pdist.broadcast_object_list(ctx, objs), TypeError)


def test_tiny_payload_bad_receiver_raises_alone_and_nobody_waits():
    """Without buckets the bad receiver raises alone; the others return and nobody waits."""
    source, bad, other = spawn(_tiny_receiver_passes_none, 3, timeout=120)
    assert source.type == "returned"
    assert other.type == "returned"
    assert bad.pdist, bad
    assert "failed on rank 1: TypeError: object_list=None on rank 1" in bad.message
    assert bad.expected
    assert all(o.seconds < 10 for o in (source, bad, other))
    assert all(o.after == [0, 1, 2] for o in (source, bad, other))


def _class_missing_on_receiver():
    with pdist.distributed(timeout=30) as ctx:
        module = sys.modules[__name__]
        objs = [Shipped(torch.ones(BIG))] if ctx.rank == 0 else [None]

        def receive() -> None:
            saved = module.Shipped
            if ctx.rank == 1:
                del module.Shipped  # this rank cannot find the class when unpickling
            try:
                pdist.broadcast_object_list(ctx, objs)
            finally:
                module.Shipped = saved

        return outcome_of(ctx, receive)


def test_class_missing_on_a_receiver_fails_there_after_the_transfer():
    """A receiver lacking the class raises PdistError after the transfer; nobody waits."""
    outcomes = spawn(_class_missing_on_receiver, 3, timeout=120)
    assert outcomes[0].type == "returned"
    assert outcomes[2].type == "returned"
    assert outcomes[1].type == "PdistError", outcomes[1]
    assert outcomes[1].message.startswith("the received object could not be rebuilt")
    assert "Shipped" in outcomes[1].message
    assert all(o.seconds < 10 for o in outcomes)
    assert all(o.after == [0, 1, 2] for o in outcomes)


# --------------------------------------------------------------------------- conj and neg


def _views():
    big = torch.randn(BIG, dtype=torch.complex64, generator=torch.Generator().manual_seed(1))
    return {"conj": big.conj(), "neg": big.conj().imag, "small_conj": big[:4].conj()}


def _check_views(out) -> None:
    expected = _views()
    for key, t in expected.items():
        assert torch.equal(out[key], t.resolve_conj().resolve_neg()), key


@world_sizes(2)
def test_conjugate_and_negative_views_travel(ctx):
    """Complex .conj() and .neg() views of 64 KiB pack without failing on every path."""
    objs = [_views()] if ctx.rank == 0 else [None]
    pdist.broadcast_object_list(ctx, objs)
    _check_views(objs[0])
    for obj in pdist.all_gather_object(ctx, _views()):
        _check_views(obj)
    if ctx.rank == 0:
        pdist.send_tensor_dict(ctx, _views(), dst=1)
    else:
        _check_views(pdist.recv_tensor_dict(ctx, src=0))
    with pdist.message_queue(ctx.world) as group:
        got = pdist.broadcast_tensor_dict(group, _views() if ctx.rank == 0 else None)
        _check_views(got)
