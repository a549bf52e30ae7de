"""Check mode cannot be half on, and covers every pdist call that communicates.

Start-up agrees on the settings that change the wire; send/recv swap what they pass;
the object functions, barrier and broadcast_weights join the agreement under their
names; the differentiable collectives compare requires_grad. Without check mode, a
count that overstates what a peer sends leaves zeros, never this process's old memory.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

import pdist
from pdist.testing import count_collectives, spawn


def _check_on_one_rank() -> str:
    """PDIST_CHECK=1 on rank 1 only (as one node's environment would have it)."""
    os.environ["PDIST_CHECK"] = "1" if os.environ["RANK"] == "1" else "0"
    with pytest.raises(pdist.RankMismatchError) as info, pdist.distributed():
        pass
    return str(info.value)


def test_check_mode_on_one_rank_only_raises_at_start_up_on_every_rank():
    """The layout's agreement carries check mode: every rank names rank 1's setting."""
    for message in spawn(_check_on_one_rank, 3, timeout=90):
        assert "distributed(): ranks passed different arguments" in message, message
        assert "ranks [0, 2]: tp=1, sp=1, check=False, backend=gloo, device=cpu" in message
        assert "ranks [1]: tp=1, sp=1, check=True, backend=gloo, device=cpu" in message


def _one_end(
    ctx: pdist.DistContext, x: torch.Tensor | None, shape: tuple[int, ...], dtype: object
) -> None:
    """Rank 0 sends ``x`` (None: an object), rank 1 receives ``shape`` and ``dtype``."""
    if ctx.rank == 0 and x is None:
        pdist.send_object(ctx, {"a": 1}, dst=1)
    elif ctx.rank == 0:
        pdist.send(ctx, x, dst=1)
    elif ctx.rank == 1:
        pdist.recv(ctx, shape, dtype, src=0)  # type: ignore[arg-type]
    else:
        raise pdist.PdistError("nothing to send")


def _send_recv(check: bool) -> list[tuple[str, str, float]]:
    """Rank 0 sends, rank 1 receives something else, rank 2 sends nothing: what each raised."""
    os.environ["PDIST_CHECK"] = "0"
    with pdist.distributed(check=check) as ctx:
        r = ctx.rank
        cases = {
            "length and dtype": (torch.tensor([1.0, 2.0, 3.0, 4.0]), (2,), torch.float64),
            "transposed": (torch.ones(2, 3), (3, 2), torch.float32),
            "bad dtype": (torch.ones(2), (2,), "float32"),
            "object": (None, (2,), torch.float32),
        }
        seen = []
        for name, (x, shape, dtype) in cases.items():
            start = time.monotonic()
            with pytest.raises((pdist.PdistError, TypeError)) as info:
                _one_end(ctx, x, shape, dtype)
            seen.append(
                (name, f"{type(info.value).__name__}: {info.value}", time.monotonic() - start)
            )
        # The pair is still usable, and a matching send/recv passes.
        if r == 0:
            pdist.send(ctx, torch.arange(6.0).view(2, 3), dst=1)
        elif r == 1:
            got = pdist.recv(ctx, (2, 3), torch.float32, src=0)
            torch.testing.assert_close(got, torch.arange(6.0).view(2, 3))
        pdist.barrier(ctx)
        return seen


def test_send_and_recv_that_differ_raise_on_both_ends_in_check_mode():
    """float32 (4,) against float64 (2,); (2, 3) against (3, 2); a bad dtype; an object."""
    rank0, rank1, _ = spawn(_send_recv, 3, True, timeout=90)
    expected = {
        "length and dtype": "rank 0 calls send: a tensor of shape (4,) float32, but rank 1 "
        "calls recv: a tensor of shape (2,) float64",
        "transposed": "rank 0 calls send: a tensor of shape (2, 3) float32, but rank 1 calls "
        "recv: a tensor of shape (3, 2) float32",
        "object": "rank 0 calls send_object: an object, but rank 1 calls recv: a tensor",
    }
    for end in (rank0, rank1):
        assert [name for name, _, _ in end] == [*list(expected)[:2], "bad dtype", "object"]
        for name, message, seconds in end:
            assert seconds < 10, (name, seconds)
            if name == "bad dtype":
                assert "TypeError" in message, message
                assert "dtype='float32' must be a torch.dtype" in message, message
                assert "failed on rank 1" in message or rank1 is end, message
            else:
                assert message.startswith("RankMismatchError: "), message
                assert expected[name] in message, message


def _p2p_collectives(check: bool) -> int:
    os.environ["PDIST_CHECK"] = "0"
    with pdist.distributed(check=check) as ctx:
        with count_collectives() as calls:
            if ctx.rank == 0:
                pdist.send(ctx, torch.ones(3), dst=1)
            else:
                pdist.recv(ctx, 3, torch.float32, src=0)
        return sum(calls.values())


def test_send_and_recv_cost_nothing_more_without_check_mode():
    """Off: the one transfer; on: the two small messages of the swap before it."""
    assert spawn(_p2p_collectives, 2, False, timeout=60) == [1, 1]
    on = spawn(_p2p_collectives, 2, True, timeout=60)
    assert on[0] == on[1] > 1


def _different_calls() -> list[tuple[str, str, float]]:
    """Rank 1 calls something else than the others: each case raises on every rank."""
    os.environ["PDIST_CHECK"] = "0"
    with pdist.distributed(check=True) as ctx:
        r, x = ctx.rank, torch.ones(4)
        others = {
            "all_gather_object": lambda: pdist.all_gather_object(ctx, {"rank": r}),
            "broadcast_object": lambda: pdist.broadcast_object(ctx, [1, 2], src=0),
            "broadcast_object_list": lambda: pdist.broadcast_object_list(ctx, [1], src=0),
            "gather_object": lambda: pdist.gather_object(ctx, r),
            "broadcast_tensor_dict": lambda: pdist.broadcast_tensor_dict(ctx, {"x": x}),
            "barrier": lambda: pdist.barrier(ctx),
            "broadcast_weights": lambda: pdist.broadcast_weights(ctx, {"w": torch.ones(2048)}),
        }
        cases = {
            # Six rows on rank 0, three elsewhere: each would send and expect N / 3 of each.
            "even all_to_all rows": lambda: pdist.all_to_all(
                ctx, torch.ones(6 if r == 0 else 3, 2)
            ),
            # A gradient on rank 1 only: its backward would wait for the others forever.
            "requires_grad": lambda: pdist.all_reduce(ctx, x.clone().requires_grad_(r == 1)),
            **{
                name: (call if r == 1 else lambda: pdist.all_reduce(ctx, x))
                for name, call in others.items()
            },
        }
        seen = []
        for name, call in cases.items():
            start = time.monotonic()
            with pytest.raises(pdist.RankMismatchError) as info:
                call()
            seen.append((name, str(info.value), time.monotonic() - start))
        pdist.barrier(ctx)  # the group is still usable
        return seen


def test_a_different_call_on_one_rank_raises_on_every_rank_in_check_mode():
    """Even all_to_all rows, requires_grad, and object calls/barrier/weights against all_reduce."""
    for rank, seen in enumerate(spawn(_different_calls, 3, timeout=120)):
        assert len(seen) == 9, seen
        for name, message, seconds in seen:
            assert "(check mode): ranks passed different arguments" in message, message
            assert seconds < 10, (name, seconds)
            if name == "even all_to_all rows":
                assert "ranks [0]: all_to_all: shape (6, 2)" in message, message
            elif name == "requires_grad":
                assert "ranks [1]: all_reduce: shape (4,) float32 on cpu, op='sum', " in message
                assert "requires_grad=True" in message, message
            else:
                assert f"ranks [1]: {name}" in message, (rank, message)
                assert "ranks [0, 2]: all_reduce: shape (4,)" in message, message


def _overstated(call: str) -> list[float]:
    """Without check mode, rank 2 states one row more from rank 0 than rank 0 sends."""
    os.environ["PDIST_CHECK"] = "0"
    with pdist.distributed() as ctx:
        r = ctx.rank
        outs = []
        for _ in range(20):
            garbage = torch.full((64,), 7.5e30)  # freed memory the output may reuse
            del garbage
            if call == "all_to_all":
                send = [[1, 1, 1], [0, 0, 0], [1, 1, 1]][r]  # rank 1 has nothing to send
                recv = [[1, 0, 1], [1, 0, 1], [2, 0, 1]][r]  # rank 2 says 2 from rank 0
                outs.append(pdist.all_to_all(ctx, torch.ones(sum(send), 3), send, recv))
            else:
                sizes = [2, 0, 1] if r < 2 else [3, 0, 1]  # rank 2 says 3 rows on rank 0
                x = torch.ones([2, 0, 1][r], 3)
                outs.append(pdist.all_gather(ctx, x, dim=0, sizes=sizes))
        pdist.barrier(ctx)
        return sorted({float(v) for out in outs for v in out.flatten().tolist()})


@pytest.mark.parametrize("call", ["all_to_all", "all_gather"])
def test_an_overstated_count_leaves_zeros_not_old_memory(call):
    """The rows no peer sends are written (zero); the stated counts are the caller's to vouch."""
    rank0, rank1, rank2 = spawn(_overstated, 3, call, timeout=90)
    assert rank0 == rank1 == [1.0]
    assert rank2 == [0.0, 1.0]
