"""Exception types raised by pdist."""

from __future__ import annotations

__all__ = ["PdistError", "RankMismatchError"]


class PdistError(RuntimeError):
    """Base class of every error pdist raises on purpose (besides bad-argument errors)."""


class RankMismatchError(PdistError):
    """Ranks of a group disagree about something that must agree.

    Raised identically on every rank of the group, after a metadata exchange,
    so that no rank is left waiting in a collective.
    """
