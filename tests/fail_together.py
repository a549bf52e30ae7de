"""How each rank's call ended: the shared runner of the one-bad-rank (fail together) tests."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import pdist


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
