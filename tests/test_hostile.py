"""A hostile peer writing raw frames with torch.distributed: safe=True receivers run no code.

Rank 0 plays the attacker: it speaks pdist's framing by hand (``dist.broadcast``,
``dist.send``, ``dist.all_gather`` and ``dist.gather`` of crafted uint8 tensors)
and sends, one after the other, messages that try to make the receiver run
code (a pickle in an error marker, in the header, in the skeleton) or read
out of bounds (bad persistent ids, dtypes, layouts, an out-of-range sparse
index). Rank 1 calls one receive path with ``safe=True`` for each message;
every call must raise :class:`~pdist.PdistError` and no marker file may
appear. Every crafted message announces no buckets, so the receiver takes
exactly the collectives the attacker issues.
"""

from __future__ import annotations

import collections
import contextlib
import io
import json
import os
import pickle
import struct
import tempfile

import pytest
import torch
import torch.distributed as dist
from fail_together import rewriting

import pdist
from pdist import _agree, _buffers, _payload, _wire
from pdist._errors import RemoteError
from pdist.testing import spawn

FIRST = 4096  # pdist's first-chunk size: every crafted message fits it
OK, ERROR = 1, 2


def _outcome(fn, *args, **kwargs) -> str:
    """What the victim's ``fn(*args, **kwargs)`` did: a PdistError, another error, or returned."""
    try:
        fn(*args, **kwargs)
    except pdist.PdistError as exc:
        return f"PdistError: {exc}"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "returned"


class Evil:
    """Unpickling it creates a marker file (were it ever unpickled)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


class _BadPid(pickle.Pickler):
    def persistent_id(self, obj):
        return ("storage", "t", 7) if isinstance(obj, Evil) else None


class _Storage:
    """Stands for the storage entry 0 in a crafted skeleton."""


class _TensorOfStorage:
    """Pickles as torch's own rebuild of a 1000-element float32 tensor from storage entry 0."""

    def __reduce__(self):
        args = (_Storage(), 0, (1000,), (1,), False, collections.OrderedDict())
        return (torch._utils._rebuild_tensor_v2, args)


class _StoragePid(pickle.Pickler):
    def __init__(self, file, pid):
        super().__init__(file, protocol=2)
        self.pid = pid

    def persistent_id(self, obj):
        return self.pid if isinstance(obj, _Storage) else None


def _skeleton_with_pid(pid) -> bytes:
    buf = io.BytesIO()
    _StoragePid(buf, pid).dump({"t": _TensorOfStorage()})
    return buf.getvalue()


def _prefix_body(header: bytes, skeleton: bytes = b"", blob: bytes = b"", count: int = 0) -> bytes:
    return struct.pack("<4sII", b"pdP1", len(header), count) + header + skeleton + blob


def _json_body(header: dict, skeleton: bytes, blob: bytes = b"", count: int = 0) -> bytes:
    return _prefix_body(json.dumps(header).encode(), skeleton, blob, count)


def _sparse_body() -> bytes:
    """A well-formed payload of a sparse tensor whose index is then pushed out of range."""
    t = torch.sparse_coo_tensor([[0, 2]], [3.0, 4.0], (3,), check_invariants=True)
    body = _payload.encode({"s": t}, torch.device("cpu")).body  # everything inline
    at = body.rfind(struct.pack("<q", 2))
    return body[:at] + struct.pack("<q", 1 << 40) + body[at + 8 :]


def _messages(marker: str) -> list[tuple[str, int, bytes]]:
    """``(name, status, body)`` of every crafted message."""
    evil = pickle.dumps(Evil(marker), protocol=2)
    bad_pid = __import__("io").BytesIO()
    _BadPid(bad_pid, protocol=2).dump({"x": Evil(marker)})
    empty = {"s": len(evil), "d": [], "b": [], "t": [], "k": 1, "p": 0}
    oob = _skeleton_with_pid(("storage", 3))  # no entries travelled
    next_oob = _skeleton_with_pid(("storage",))  # the next tensor, of none
    typed = _skeleton_with_pid(("storage", "s", 0, "float32"))
    record = [0, 0, -1, 0, [1]]
    return [
        ("pickled error marker", ERROR, evil),
        ("raw pickle body", OK, evil),
        ("pickled header", OK, _prefix_body(evil)),
        ("pickled skeleton", OK, _json_body(empty, evil)),
        (
            "bad persistent id",
            OK,
            _json_body({**empty, "s": len(bad_pid.getvalue())}, bad_pid.getvalue()),
        ),
        ("unknown dtype", OK, _json_body({**empty, "d": ["os.system"], "t": [record]}, evil)),
        (
            "bad record",
            OK,
            _json_body({**empty, "d": ["float32"], "t": [["0", 0, -1, 0, [1]]]}, evil),
        ),
        (
            "bucket not announced",
            OK,
            _json_body({**empty, "d": ["float32"], "t": [[0, 0, 0, 0, [1]]]}, evil),
        ),
        (
            "inline past the end",
            OK,
            _json_body({**empty, "d": ["float32"], "t": [[0, 0, -1, 0, [1 << 20]]]}, evil),
        ),
        (
            "grad on an int",
            OK,
            _json_body({**empty, "d": ["int64"], "t": [[0, 1, -1, 0, [1]]]}, evil, b"\0" * 8),
        ),
        (
            # The same shape as the record before, but for its type: a bool is no dimension.
            "a bool dim after an int one",
            OK,
            _json_body(
                {**empty, "d": ["float32"], "t": [[0, 0, -1, 0, [1]], [0, 0, -1, 4, [True]]]},
                evil,
                b"\0" * 8,
            ),
        ),
        ("sparse index out of range", OK, _sparse_body()),
        (
            "persistent id out of range",
            OK,
            _json_body({**empty, "s": len(oob)}, oob),
        ),
        ("next tensor of none", OK, _json_body({**empty, "s": len(next_oob)}, next_oob)),
        (
            "storage of the wrong size",
            OK,
            # A 3-byte storage (inline) that the skeleton rebuilds as 1000 float32 elements.
            _json_body(
                {**empty, "s": len(typed), "d": ["uint8"], "t": [[0, 8, -1, 0, [3]]]},
                typed,
                b"abc",
            ),
        ),
        ("header nested too deeply", OK, _prefix_body(b"[" * 1500 + b"]" * 1500)),
        # The lean form (a skeleton alone, as a tensorless object travels): the same checks.
        ("lean pickled skeleton", OK, b"pdP0" + evil),
        ("lean bad persistent id", OK, b"pdP0" + bad_pid.getvalue()),
        (
            "dims past int64",
            OK,
            _json_body({**empty, "d": ["float32"], "t": [[0, 0, -1, 0, [0, 1 << 64]]]}, evil),
        ),
    ]


def _frame(status: int, body: bytes) -> torch.Tensor:
    message = struct.pack("<Bq", status, len(body)) + body
    assert len(message) <= FIRST
    out = torch.zeros(FIRST, dtype=torch.uint8)
    out[: len(message)] = torch.frombuffer(bytearray(message), dtype=torch.uint8)
    return out


def _attack(ctx, path: str, status: int, body: bytes) -> None:
    """Rank 0's side of one receive path, by hand."""
    pg = ctx.world.cpu_group
    chunk = _frame(status, body)
    if path in ("broadcast_object", "broadcast_object_list", "broadcast_tensor_dict"):
        dist.broadcast(chunk, src=0, group=pg)
    elif path in ("recv_object", "recv_tensor_dict"):
        dist.send(chunk, dst=1, group=pg)
    elif path == "all_gather_object":
        dist.all_gather([torch.empty(FIRST, dtype=torch.uint8) for _ in range(2)], chunk, group=pg)
    elif path == "gather_object":
        failed = status != OK
        row = torch.tensor([int(failed), len(body), 0, 0], dtype=torch.int64)
        dist.all_gather([torch.empty(4, dtype=torch.int64) for _ in range(2)], row, group=pg)
        if failed:  # the markers then travel in an all-gather of framed messages
            dist.all_gather(
                [torch.empty(FIRST, dtype=torch.uint8) for _ in range(2)], chunk, group=pg
            )
        else:
            # Bodies travel unframed here (the status rode in the record), padded to the longest.
            raw = torch.frombuffer(bytearray(body), dtype=torch.uint8)
            dist.gather(raw, None, dst=1, group=pg)
    elif path == "message_queue":
        # The writer's ring slot gets the raw message (error frames included), not a framing of it.
        raw = struct.pack("<Bq", status, len(body)) + body
        with pdist.testing.inject(outgoing=lambda message: raw):
            ctx.mq_group.header_transport.broadcast_bytes(ctx.mq_group, b"", 0, what="attack")


def _receive(ctx, path: str) -> None:
    """Rank 1's side: the public call, with safe=True."""
    if path == "broadcast_object":
        pdist.broadcast_object(ctx, None, safe=True)
    elif path == "broadcast_object_list":
        pdist.broadcast_object_list(ctx, [None], safe=True)
    elif path == "broadcast_tensor_dict":
        pdist.broadcast_tensor_dict(ctx, None, safe=True)
    elif path == "recv_object":
        pdist.recv_object(ctx, src=0, safe=True)
    elif path == "recv_tensor_dict":
        pdist.recv_tensor_dict(ctx, src=0, safe=True)
    elif path == "all_gather_object":
        pdist.all_gather_object(ctx, {"mine": 1}, safe=True)
    elif path == "gather_object":
        pdist.gather_object(ctx, {"mine": 1}, dst=1, safe=True)
    elif path == "message_queue":
        pdist.broadcast_object(ctx.mq_group, None, safe=True)


class _Ctx:
    def __init__(self, ctx, mq_group=None) -> None:
        self.world = ctx.world
        self.rank = ctx.rank
        self.mq_group = mq_group


def _hostile_rank(path: str, marker: str) -> list[tuple[str, str]]:
    outcomes = []
    os.environ["PDIST_CHECK"] = "0"  # the attacker writes raw frames: no check-mode agreement
    with pdist.distributed(timeout=30) as ctx:
        for name, status, body in _messages(marker):
            # A refused slot poisons a queue (by design): each message gets a fresh one.
            with contextlib.ExitStack() as stack:
                group = None
                if path == "message_queue":
                    group = stack.enter_context(pdist.message_queue(ctx.world))
                c = _Ctx(ctx, group)
                if ctx.rank == 0:
                    _attack(c, path, status, body)
                    continue
                outcomes.append((name, _outcome(_receive, ctx if group is None else c, path)))
        pdist.barrier(ctx)
    return outcomes


# What each refusal says, so that the test shows which check caught the message.
EXPECTED = {
    "pickled error marker": "malformed error marker",
    "raw pickle body": "unknown payload magic",
    "pickled header": "the header is not JSON",
    "pickled skeleton": "safe unpickling refused",
    "bad persistent id": "unexpected persistent id",
    "unknown dtype": "unknown dtype 'os.system'",
    "bad record": "tensor record",
    "bucket not announced": "tensor record",
    "inline past the end": "past the end of the body",
    "grad on an int": "requires_grad on a torch.int64",
    "a bool dim after an int one": "tensor record",
    "sparse index out of range": "sparse tensor is invalid",
    "persistent id out of range": "unexpected persistent id ('storage', 3)",
    "next tensor of none": "unexpected persistent id ('storage',)",
    "storage of the wrong size": "needs 4000 bytes of a storage of which 3 travelled",
    "dims past int64": "tensor record",
    "header nested too deeply": "the header nests too deeply",
    "lean pickled skeleton": "safe unpickling refused",
    "lean bad persistent id": "unexpected persistent id",
}

PATHS = [
    "broadcast_object",
    "broadcast_object_list",
    "broadcast_tensor_dict",
    "recv_object",
    "recv_tensor_dict",
    "all_gather_object",
    "gather_object",
    "message_queue",
]


@pytest.mark.parametrize("path", PATHS)
def test_hostile_peer_runs_no_code(path):
    """Every crafted message raises PdistError on the safe receiver; no marker appears."""
    marker = os.path.join(tempfile.mkdtemp(prefix="pdist-hostile-"), "pwned")
    _, outcomes = spawn(_hostile_rank, 2, path, marker, timeout=120)
    assert not os.path.exists(marker)
    assert outcomes, path
    for name, outcome in outcomes:
        assert outcome.startswith("PdistError: "), (name, outcome)
        assert EXPECTED[name] in outcome, (name, outcome)


# --------------------------------------------------------------------------- sizes and layouts
# The attacker now follows pdist's protocol after its crafted message (the status steps), so
# that the victim's refusal shows as an error rather than a wait.

HUGE = 1 << 60  # bytes: no machine allocates this


def _refused(fn) -> None:
    """Run the attacker's part of a status step the victim fails (its RemoteError expected)."""
    try:
        fn()
    except RemoteError:
        return
    raise AssertionError("the victim reported no failure")


def _announce(ctx, path: str, length: int) -> None:
    """Rank 0: a first chunk announcing ``length`` body bytes, then the status step if any."""
    world, pg = ctx.world, ctx.world.cpu_group
    chunk = torch.zeros(FIRST, dtype=torch.uint8)
    head = struct.pack("<Bq", OK, length)
    chunk[: len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
    if path == "broadcast_object":
        dist.broadcast(chunk, src=0, group=pg)
    elif path == "recv_object":
        dist.send(chunk, dst=1, group=pg)
    elif path == "all_gather_object":
        dist.all_gather([torch.empty(FIRST, dtype=torch.uint8) for _ in range(2)], chunk, group=pg)
    elif path == "gather_object":
        row = torch.tensor([0, length, 0, 0], dtype=torch.int64)
        dist.all_gather([torch.empty(4, dtype=torch.int64) for _ in range(2)], row, group=pg)
    if length < 0:
        return  # refused on sight
    if path == "recv_object":
        _refused(lambda: _agree.recv_status(world, 1, what="attack"))  # the victim's status reply
    else:
        _refused(lambda: _agree.status(world, None, what="attack"))


SIZE_PATHS = ["broadcast_object", "recv_object", "all_gather_object", "gather_object"]


def _sizes_rank(path: str) -> list[tuple[int, str]]:
    outcomes = []
    os.environ["PDIST_CHECK"] = "0"  # the attacker writes raw frames: no check-mode agreement
    with pdist.distributed(timeout=30) as ctx:
        lengths = [HUGE, (1 << 63) - 1] + ([-100] if path == "all_gather_object" else [])
        for length in lengths:
            if ctx.rank == 0:
                _announce(ctx, path, length)
                continue
            outcomes.append((length, _outcome(_receive, ctx, path)))
        pdist.barrier(ctx)
    return outcomes


@pytest.mark.parametrize("path", SIZE_PATHS)
def test_absurd_lengths_raise_pdist_errors(path):
    """A length no buffer can hold is a PdistError after the status step; negative is corrupt."""
    _, outcomes = spawn(_sizes_rank, 2, path, timeout=120)
    assert outcomes
    for length, outcome in outcomes:
        assert outcome.startswith("PdistError: "), (length, outcome)
        if length < 0:
            assert "truncated message" in outcome, outcome
        else:
            assert "failed on rank 1" in outcome, outcome
            assert "could not allocate" in outcome, outcome


def _layouts() -> list[tuple[str, bytes, int | None, str]]:
    """``(name, body, bucket bytes the attacker then sends or None, expected text)``."""
    skeleton = pickle.dumps({"x": 1}, protocol=2)
    base = {"s": len(skeleton), "d": ["float32"], "b": [], "t": [], "k": 1, "p": 0}

    def body(header: dict, count: int | None = None) -> bytes:
        n = len(header["b"]) if count is None else count
        return _json_body(header, skeleton, count=n)

    return [
        (
            "bucket count that disagrees with the header",
            body(base, count=1),
            None,
            "does not hold the 1 buckets announced",
        ),
        (
            "bucket larger than its tensors",
            body({**base, "b": [["cpu", 1 << 40]], "t": [[0, 0, 0, 0, [1]]]}),
            None,
            "bucket 0 of 1099511627776 bytes for tensors ending at 4",
        ),
        (
            "bucket without tensors",
            body({**base, "b": [["cpu", 64]]}),
            None,
            "bucket 0 of 64 bytes for tensors ending at -1",
        ),
        (
            "a field pdist does not write",
            body({**base, "b": [["cpu", 4]], "t": [[0, 0, 0, 0, [1]]], "z": 1}),
            None,
            "does not have the fields s, d, b, t, k, p",
        ),
        (
            "a part past the parts",
            body({**base, "b": [["cpu", 64]], "t": [[0, 0, 0, 0, [1]]], "k": 2, "p": 2}),
            None,
            "split 2 part 2",
        ),
        (
            "overlapping places",
            body({**base, "b": [["cpu", 12]], "t": [[0, 0, 0, 0, [2]], [0, 0, 0, 4, [2]]]}),
            12,
            "corrupt bucket layout",
        ),
        (
            "unaligned offset",
            body({**base, "b": [["cpu", 6]], "t": [[0, 0, 0, 2, [1]]]}),
            6,
            "corrupt bucket layout",
        ),
    ]


def _layouts_rank(safe: bool) -> list[tuple[str, str]]:
    outcomes = []
    os.environ["PDIST_CHECK"] = "0"  # the attacker writes raw frames: no check-mode agreement
    with pdist.distributed(timeout=30) as ctx:
        pg = ctx.world.cpu_group
        for name, message, nbytes, _ in _layouts():
            if ctx.rank == 0:
                dist.broadcast(_frame(OK, message), src=0, group=pg)
                if nbytes is None:  # the victim refuses the header: its status says so
                    _refused(lambda: _agree.status(ctx.world, None, what="attack"))
                else:
                    _agree.status(ctx.world, None, what="attack")
                    dist.broadcast(torch.zeros(nbytes, dtype=torch.uint8), src=0, group=pg)
                continue
            outcomes.append((name, _outcome(pdist.broadcast_object, ctx, None, safe=safe)))
        pdist.barrier(ctx)
    return outcomes


@pytest.mark.parametrize("safe", [True, False])
def test_corrupt_bucket_layouts_raise_pdist_errors(safe):
    """Headers whose buckets cannot be right are refused before allocating, with either safe."""
    _, outcomes = spawn(_layouts_rank, 2, safe, timeout=120)
    expected = {name: text for name, _, _, text in _layouts()}
    assert [name for name, _ in outcomes] == list(expected)
    for name, outcome in outcomes:
        assert outcome.startswith("PdistError: "), (name, outcome)
        assert expected[name] in outcome, (name, outcome)


def test_padding_on_the_wire_is_zeros():
    """The padding of a framed chunk is zeros, never this process's stale heap memory."""
    for _ in range(3):
        stale = torch.full((FIRST,), 0xAB, dtype=torch.uint8)
        del stale  # the allocator hands this block out again
        chunk = _buffers.filled(b"ab", FIRST, what="a test")
        assert bytes(chunk[:2].tolist()) == b"ab"
        assert not chunk[2:].any()


# --------------------------------------------------------------------------- metadata records


def _sync_victim(record):
    os.environ["PDIST_CHECK"] = "0"  # the attacker writes raw frames: no check-mode agreement
    with pdist.distributed(timeout=30) as ctx:
        if ctx.rank == 0:  # a digest that differs, then its record instead of [src, entries]
            _agree.status(ctx.world, None, what="attack", summary="not the victim's")
            raw = record if isinstance(record, bytes) else json.dumps(record).encode()
            _wire.all_gather_bytes(ctx.world, raw, what="attack")
            return None
        return _outcome(pdist.sync_model_states, ctx, torch.nn.Linear(2, 2))


DEEP = b"[" * 1500 + b"]" * 1500  # JSON nested past Python's recursion limit


@pytest.mark.parametrize(
    "record",
    [5, ["0", "digest"], [0, ["not", "hashable"]], {"a": 1}, DEEP],
    ids=["int", "str src", "list digest", "dict", "nested too deeply"],
)
def test_malformed_sync_records_raise_pdist_errors(record):
    """sync_model_states refuses a peer's record that is not [src, digest] (or not JSON)."""
    _, outcome = spawn(_sync_victim, 2, record, timeout=120)
    assert outcome.startswith("PdistError: "), outcome
    if record is DEEP:
        assert "rank 0 sent a record that is not JSON" in outcome, outcome
    else:
        assert "rank 0 sent a malformed record" in outcome, outcome


def _odd_namespace_queue():
    with pdist.distributed(timeout=30) as ctx:
        odd = pdist.testing.inject(outgoing=rewriting("pid_namespace", ["a", "list"]))
        with (
            odd if ctx.rank == 1 else contextlib.nullcontext(),
            pdist.message_queue(ctx.world) as group,
        ):
            return pdist.broadcast_object(group, {"step": 3} if ctx.rank == 0 else None)


def test_a_set_up_record_with_an_odd_namespace_is_no_crash():
    """A peer's pid namespace that is not a string means "unknown": the queue still works."""
    assert spawn(_odd_namespace_queue, 2, timeout=120) == [{"step": 3}, {"step": 3}]
