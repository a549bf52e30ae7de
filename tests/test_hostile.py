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

import json
import os
import pickle
import struct
import tempfile

import pytest
import torch
import torch.distributed as dist

import pdist
from pdist import _payload
from pdist.testing import spawn

FIRST = 4096  # pdist's first-chunk size: every crafted message fits it
OK, ERROR = 1, 2


class Evil:
    """Unpickling it creates a marker file (were it ever unpickled)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


class _BadPid(pickle.Pickler):
    def persistent_id(self, obj):
        return ("storage", "t", 7) if isinstance(obj, Evil) else None


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
    empty = {"s": len(evil), "d": [], "b": [], "t": [], "z": 0, "k": 1}
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
        ("sparse index out of range", OK, _sparse_body()),
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
        ctx.mq_group.header_transport.broadcast_bytes(ctx.mq_group, body, 0)


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
    with pdist.distributed(timeout=30) as ctx:
        mq = pdist.message_queue(ctx.world) if path == "message_queue" else None
        group = mq.__enter__() if mq is not None else None
        try:
            c = _Ctx(ctx, group)
            for name, status, body in _messages(marker):
                if path == "message_queue" and status != OK:
                    continue  # the queue frames what it is given: no raw error frames
                if ctx.rank == 0:
                    _attack(c, path, status, body)
                    continue
                try:
                    _receive(ctx if group is None else c, path)
                except pdist.PdistError as exc:
                    outcomes.append((name, f"PdistError: {exc}"))
                except Exception as exc:
                    outcomes.append((name, f"{type(exc).__name__}: {exc}"))
                else:
                    outcomes.append((name, "returned"))
            pdist.barrier(ctx)
        finally:
            if mq is not None:
                mq.__exit__(None, None, None)
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
    "sparse index out of range": "sparse tensor is invalid",
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
