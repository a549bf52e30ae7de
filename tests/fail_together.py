"""The one-bad-rank (fail together) tests' shared pieces: a case, its runner, its assertions.

A case names the call every rank makes (one rank gets the bad input, or a
fault injected through ``pdist.testing.inject``), the world size, the bad
rank, the error type every rank must raise and a pattern of its message.
"""

from __future__ import annotations

import json
import re
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass

import pdist

HEADER = struct.Struct("<Bq")  # a framed message's status and body length
OK = 1


@dataclass(frozen=True)
class Outcome:
    """How one rank's call ended (plain data, so that ``spawn`` can return it)."""

    type: str  # the class name of what the call raised, or "returned"
    message: str
    seconds: float  # from the call until it raised or returned
    pdist: bool  # a PdistError (every RemoteError is one)
    expected: bool  # an instance of the type the test expects
    after: list[int]  # an all_gather_object of the ranks right after the call


def outcome_of(
    ctx: pdist.DistContext, call: Callable[[], object], expected: type[BaseException] = Exception
) -> Outcome:
    """Run ``call`` on this rank, then one all-gather on the world.

    The all-gather returns every rank only when no rank was left inside a
    collective of the call: ``after == list(range(world))`` is the test's
    "nobody is left waiting".
    """
    start = time.monotonic()
    try:
        call()
    except Exception as exc:
        kind, message = type(exc).__name__, str(exc)
        is_pdist, is_expected = isinstance(exc, pdist.PdistError), isinstance(exc, expected)
    else:
        kind, message, is_pdist, is_expected = "returned", "", False, False
    seconds = time.monotonic() - start
    after = pdist.all_gather_object(ctx, ctx.rank)
    return Outcome(kind, message, seconds, is_pdist, is_expected, after)


@dataclass(frozen=True)
class Case:
    """One rank goes wrong; every rank must raise ``expected`` matching ``pattern``, quickly."""

    call: Callable[[pdist.DistContext], object]
    world: int
    bad: int
    expected: type[BaseException]
    pattern: str  # a regular expression found in every rank's message
    names_the_rank: bool = True  # the message says "failed on rank <bad>"


def run_case(case: Case) -> Outcome:
    """A rank's side of ``case`` (runs inside ``spawn``), under a 30 s collective timeout."""
    with pdist.distributed(timeout=30) as ctx:
        return outcome_of(ctx, lambda: case.call(ctx), case.expected)


def assert_failed_together(case: Case, outcomes: list[Outcome]) -> None:
    """Every rank raised a pdist error of the expected type within 10 s; nobody is left waiting.

    The peers raise one type; the bad rank may raise its own error's type too.
    """
    for rank, out in enumerate(outcomes):
        assert out.type != "returned", (rank, outcomes)
        assert out.pdist, (rank, out)
        assert out.expected, (rank, out)
        assert re.search(case.pattern, out.message), (rank, out)
        if case.names_the_rank:
            assert f"failed on rank {case.bad}" in out.message, (rank, out)
        assert out.seconds < 10, (rank, out)
        assert out.after == list(range(case.world)), (rank, out)
    peers = {o.type for r, o in enumerate(outcomes) if r != case.bad}
    assert len(peers) == 1, outcomes


def out_of_memory(from_bytes: int) -> Callable[[int], None]:
    """An ``allocate`` hook: every buffer of ``from_bytes`` or more fails on this rank."""

    def allocate(nbytes: int) -> None:
        if nbytes >= from_bytes:
            raise RuntimeError("simulated out of memory")

    return allocate


def fails(text: str, *, from_index: int = 0) -> Callable[[int], None]:
    """A ``pack`` hook: packing bucket ``from_index`` and later ones raises ``text``."""

    def pack(index: int) -> None:
        if index >= from_index:
            raise RuntimeError(text)

    return pack


def rewriting(field: str, value: object) -> Callable[[bytes], bytes]:
    """An ``outgoing`` hook: every JSON record this rank sends gets ``field`` set to ``value``.

    A framed message is a header (a status byte, a little-endian int64 body
    length) and its body; messages that are not JSON records holding
    ``field`` leave unchanged.
    """

    def outgoing(message: bytes) -> bytes:
        try:
            record = json.loads(message[HEADER.size :])
        except ValueError:
            return message
        if not isinstance(record, dict) or field not in record:
            return message
        body = json.dumps({**record, field: value}).encode()
        return HEADER.pack(OK, len(body)) + body

    return outgoing
