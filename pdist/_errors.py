"""Exception types raised by pdist, and a failure's plain-data form on the wire (a leaf).

A rank that fails while preparing its part of a collective sends an *error
marker*: a struct (its rank, the error's type name) and the error's text, never
a pickle. Every peer raises a ``RemoteError`` naming that rank; the failing
rank raises one that is also of its own error's type, chained to it, so code
that catches the original type (as it would with torch) still does.
"""

from __future__ import annotations

import functools
import struct
from typing import Any, cast

__all__ = [
    "ERROR",
    "HEADER",
    "OK",
    "PdistError",
    "RankMismatchError",
    "RemoteError",
    "RemoteTypeError",
    "RemoteValueError",
    "decode_marker",
    "encode_marker",
    "failure",
    "kind_name",
    "raised_as_is",
]


class PdistError(RuntimeError):
    """Base class of every error pdist raises on purpose (besides bad-argument errors)."""


class RankMismatchError(PdistError):
    """Ranks of a group disagree about something that must agree (raised on every rank)."""


class RemoteError(PdistError):
    """A rank failed while preparing its part of a collective; every rank raises this."""


class RemoteTypeError(RemoteError, TypeError):
    """A rank's ``TypeError`` (a bad argument), raised on every rank of the collective."""


class RemoteValueError(RemoteError, ValueError):
    """A rank's ``ValueError`` (a bad argument), raised on every rank of the collective."""


# A bad argument on one rank stays a TypeError/ValueError on every rank, as it would locally.
_PEER_TYPES: dict[str, type[RemoteError]] = {
    "TypeError": RemoteTypeError,
    "ValueError": RemoteValueError,
    "RemoteTypeError": RemoteTypeError,
    "RemoteValueError": RemoteValueError,
}

HEADER = struct.Struct("<Bq")  # a framed message's header: status (OK or ERROR), body length
OK, ERROR = 1, 2

_MARKER = struct.Struct("<qI")  # failing rank, length of the error's type name (then the text)
MAX_MARKER_TEXT = 16 << 10


def kind_name(error: BaseException) -> str:
    """The type name a failure travels under (a joined ``RemoteX`` error: the one it stands as)."""
    return str(getattr(type(error), "_pdist_kind", type(error).__name__))


def encode_marker(rank: int, error: BaseException) -> bytes:
    """The plain-data form of ``error`` on ``rank``."""
    kind = kind_name(error).encode()
    text = str(error).encode(errors="replace")[:MAX_MARKER_TEXT]
    return _MARKER.pack(rank, len(kind)) + kind + text


def decode_marker(body: bytes, ranks: tuple[int, ...]) -> tuple[int, str, str] | None:
    """``(rank, type name, text)`` of a marker from one of ``ranks``; None when malformed."""
    if len(body) < _MARKER.size:
        return None
    rank, kind_len = _MARKER.unpack_from(body)
    if kind_len > len(body) - _MARKER.size or rank not in ranks:
        return None
    kind = body[_MARKER.size : _MARKER.size + kind_len].decode(errors="replace")
    return rank, kind, body[_MARKER.size + kind_len :].decode(errors="replace")


@functools.cache
def _join(first: Any, second: Any, name: str, kind: str) -> type | None:
    """A class that is both ``first`` and ``second``, travelling as ``kind`` (None: impossible)."""
    if issubclass(second, first):
        return cast("type", second)
    try:
        return type(name, (first, second), {"__module__": __name__, "_pdist_kind": kind})
    except TypeError:  # a layout conflict (an exception type implemented in C with its own)
        return None


def _made(cls: Any, message: str) -> BaseException | None:
    """``cls(message)``, or None when it cannot be made or does not print as ``message``."""
    try:
        error: BaseException = cls(message)
    except Exception:  # a type whose constructor wants other arguments
        return None
    return error if str(error) == message else None  # KeyError, for one, quotes its text


def raised_as_is(error: BaseException) -> BaseException:
    """Mark ``error`` to be raised unchanged on its own rank (its peers still raise a RemoteError).

    For a failure whose type is the user's contract, as pickle's errors are.
    """
    error._pdist_as_is = True  # type: ignore[attr-defined]
    return error


def failure(message: str, kind: str, own: BaseException | None) -> BaseException:
    """The error for a collective that failed on some rank (``own``: this rank's, if it failed)."""
    if own is None:
        return _PEER_TYPES.get(kind, RemoteError)(message)
    if isinstance(own, RemoteError) or getattr(own, "_pdist_as_is", False):
        return own
    kind_of: Any = type(own)  # hashable, whatever typeshed says
    joined = (
        _PEER_TYPES[kind_of.__name__]
        if kind_of in (TypeError, ValueError)
        else _join(RemoteError, kind_of, f"Remote{kind_of.__name__}", kind_name(own))
    )
    error = None if joined is None else _made(joined, message)
    if error is None:
        if hasattr(own, "add_note"):  # Python 3.11 and later
            own.add_note(message)
        return own
    error.__cause__ = own
    return error
