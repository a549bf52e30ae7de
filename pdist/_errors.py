"""Exception types raised by pdist, and a failure's plain-data form on the wire (a leaf).

A rank that fails while preparing its part of a collective sends an *error
marker*: a struct (its rank, the error's type name) and the error's text, never
a pickle. Every rank that did not fail raises a ``RemoteError`` naming the
first rank that did; a rank that failed raises its own error, as one that is
also of its type, chained to it, so code that catches the original type (as it
would with torch) still does. One failure is one class on every rank where the
type is known to all (pdist's own, ``TypeError``, ``ValueError``). Every class
here is public as ``pdist.X`` and prints so.
"""

from __future__ import annotations

import functools
import os
import struct
from types import TracebackType
from typing import Any, cast

__all__ = [
    "ERROR",
    "HEADER",
    "OK",
    "PdistError",
    "PeerLeftError",
    "RankMismatchError",
    "RemoteError",
    "RemoteRankMismatchError",
    "RemoteTypeError",
    "RemoteValueError",
    "decode_marker",
    "encode_marker",
    "failure",
    "kind_name",
    "raised_as_is",
    "trim_traceback",
]


class PdistError(RuntimeError):
    """Base class of every error pdist raises on purpose (besides bad-argument errors).

    Catch it to handle any of pdist's own failures; each subclass below narrows it.
    """

    __module__ = "pdist"


class RankMismatchError(PdistError):
    """Ranks of a group disagree about something that must agree (raised on every rank)."""

    __module__ = "pdist"


class PeerLeftError(PdistError):
    """A collective failed because a peer left its block; the message names the peer.

    Chained (``__cause__``) to the backend's error. ``store_gone``: the rendezvous
    store did not answer either, so no rank could be named (its host most likely exited).
    ``ranks``: the ranks it names as the cause (gone without a word, or failed on their
    own), root cause first; a rank that leaves through it records them as whom it followed.
    """

    __module__ = "pdist"

    def __init__(
        self, message: str, *, store_gone: bool = False, ranks: tuple[int, ...] = ()
    ) -> None:
        super().__init__(message)
        self.store_gone = store_gone
        self.ranks = ranks


class RemoteError(PdistError):
    """Some rank failed while preparing its part of a collective; the message names it.

    Every rank that did not fail raises this (or a subclass that is also of the
    failure's type); a rank that failed raises its own error.
    """

    __module__ = "pdist"


class RemoteTypeError(RemoteError, TypeError):
    """A rank's ``TypeError`` (a bad argument), raised on every rank of the collective."""

    __module__ = "pdist"


class RemoteValueError(RemoteError, ValueError):
    """A rank's ``ValueError`` (a bad argument), raised on every rank of the collective."""

    __module__ = "pdist"


class RemoteRankMismatchError(RemoteError, RankMismatchError):
    """A ``RankMismatchError`` one rank found, raised on every rank of the collective."""

    __module__ = "pdist"


# One failure raises one class on every rank: a bad argument stays a TypeError/ValueError,
# as it would locally, and a disagreement one rank found is a RankMismatchError everywhere.
_REMOTE: dict[type, type[RemoteError]] = {
    TypeError: RemoteTypeError,
    ValueError: RemoteValueError,
    RankMismatchError: RemoteRankMismatchError,
    PdistError: RemoteError,
}
_SHARED = {cls.__name__: cls for cls in (*_REMOTE, PeerLeftError)}  # known to every rank


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


def _rejoined(second: Any, name: str, kind: str, args: tuple[Any, ...]) -> BaseException:
    """A joined ``RemoteX`` error made again from its parts (how pickle rebuilds one)."""
    joined: Any = _join(RemoteError, second, name, kind)
    return cast("BaseException", joined(*args))


def _reduce_joined(self: BaseException) -> tuple[Any, ...]:
    cls: Any = type(self)
    return _rejoined, (cls.__bases__[1], cls.__name__, cls._pdist_kind, self.args), self.__dict__


@functools.cache
def _join(first: Any, second: Any, name: str, kind: str) -> type | None:
    """A class that is both ``first`` and ``second``, travelling as ``kind`` (None: impossible)."""
    if issubclass(second, first):
        return cast("type", second)
    body = {"__module__": "pdist", "_pdist_kind": kind, "__reduce__": _reduce_joined}
    try:
        return type(name, (first, second), body)
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


def _remote(kind_of: Any, kind: str) -> type | None:
    """The class a failure of type ``kind_of`` raises as (None: no class can be both)."""
    return _REMOTE.get(kind_of) or _join(RemoteError, kind_of, f"Remote{kind_of.__name__}", kind)


def failure(message: str, kind: str, own: BaseException | None) -> BaseException:
    """The error for a collective that failed on some rank (``own``: this rank's, if it failed).

    Every rank raises the same class for one failure: a rank that did not fail makes the
    failing rank's class from ``kind`` where it knows that type (pdist's own, ``TypeError``
    and ``ValueError``), else a plain ``RemoteError``.
    """
    if own is None:
        shared = _SHARED.get(kind.removeprefix("Remote"))
        peer: Any = RemoteError if shared is None else _remote(shared, shared.__name__)
        return cast("BaseException", peer(message))
    if isinstance(own, RemoteError) or getattr(own, "_pdist_as_is", False):
        return own
    kind_of: Any = type(own)  # hashable, whatever typeshed says
    joined = _remote(kind_of, kind_name(own))
    error = None if joined is None else _made(joined, message)
    if error is None:
        if hasattr(own, "add_note"):  # Python 3.11 and later
            own.add_note(message)
        return own
    error.__cause__ = own
    return error


_PACKAGE = os.path.dirname(__file__) + os.sep
_PLUMBING = (os.sep + "contextlib.py", os.sep + "functools.py")  # frames between pdist's own


def trim_traceback(error: BaseException) -> None:
    """Drop pdist's inner frames from ``error``'s traceback, so it reads from the user's call.

    Of each run of pdist frames (with the ``contextlib`` frames inside it) only the first,
    the public function the user called, stays, and the last frame, where it was raised.
    The chained ``__cause__`` keeps its own traceback (the backend call that failed).
    Takes effect where the interpreter re-raises an exception's own traceback (Python 3.11+).
    """
    kept: list[TracebackType] = []
    inside = False
    tb = error.__traceback__
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename
        ours = name.startswith(_PACKAGE)
        if tb.tb_next is None or not (inside and (ours or name.endswith(_PLUMBING))):
            kept.append(tb)
        inside = ours or (inside and name.endswith(_PLUMBING))
        tb = tb.tb_next
    rebuilt = None
    for tb in reversed(kept):
        rebuilt = TracebackType(rebuilt, tb.tb_frame, tb.tb_lasti, tb.tb_lineno)
    error.__traceback__ = rebuilt
