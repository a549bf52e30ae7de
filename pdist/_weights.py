"""``broadcast_weights``: a mapping of name -> tensor from one member to every member of a Group.

The weight sync of reinforcement learning (trainer -> inference engine over a link), and
``sync_model_states`` within a job, move the same thing: many named tensors whose layout
the receivers already know or can check. Three steps:

1. **Agree.** One all-gather carries every member's argument errors and ``src``, a digest
   of each receiver's ``into``, and the source's metadata (names, shapes, dtypes, its
   ``bucket_bytes``: plain JSON, never pickle) when short, else a broadcast follows; each
   receiver checks its ``into`` against it, and one status makes a difference raise on
   every member before any byte moves. That status is skipped when every digest shows
   an ``into`` that takes each tensor straight (same names, shapes and dtypes,
   contiguous, on the group's device) and nothing travels packed: then no member
   allocates, and none can fail. With the closing status, a weight sync into a
   running engine costs two small collectives besides the data; other calls three.
2. **Plan** (a pure function of the metadata, so every member issues the same
   broadcasts): tensors under :data:`DIRECT_BYTES` are packed into buckets of at most
   ``bucket_bytes``; larger ones travel alone, in chunks of at most ``bucket_bytes``.
3. **Move.** A large tensor is received straight into its destination when that is
   contiguous, of the wire's dtype and on the group's device (no copy); otherwise each chunk
   lands in one staging buffer (at most ``bucket_bytes``) and is cast into place, as
   ``load_state_dict``'s ``copy_`` would. Staging is never handed to a caller.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import math
import threading
from collections.abc import Iterable, Iterator, Mapping
from typing import NamedTuple, cast

import torch

from . import _agree, _compat, _departures, _plain, _rooted, _seams, _wire
from ._buffers import allocate, resolved
from ._errors import HEADER, PdistError, RankMismatchError
from ._group import DistContext, Group, ProcessGroup, as_group
from ._serialize import dtype_name, dtype_of

__all__ = [
    "DIRECT_BYTES",
    "SYNC_BUCKET_BYTES",
    "Entry",
    "Move",
    "broadcast_weights",
    "states_of",
]

logger = logging.getLogger("pdist")

SYNC_BUCKET_BYTES = 64 << 20  # sync_model_states' buckets
DIRECT_BYTES = 1 << 20  # tensors this large (or larger than a bucket) travel alone
_ALIGN = 64  # bytes: every packed tensor starts aligned for any dtype's view
_VERSION = 1


class Entry(NamedTuple):
    """One tensor as the metadata describes it."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class _Packed(NamedTuple):
    """A bucket: ``(entry index, byte offset)`` per tensor, and its length."""

    parts: tuple[tuple[int, int], ...]
    nbytes: int


class _Chunk(NamedTuple):
    """Bytes ``[start, stop)`` of one large tensor."""

    entry: int
    start: int
    stop: int


def _plan(entries: list[Entry], bucket_bytes: int) -> list[_Packed | _Chunk]:
    """The broadcasts, in order: the same on every member (a function of the metadata only)."""
    steps: list[_Packed | _Chunk] = []
    parts: list[tuple[int, int]] = []
    used = 0
    chunk = max(bucket_bytes // _ALIGN * _ALIGN, _ALIGN)
    for i, e in enumerate(entries):
        n = e.nbytes
        if n == 0:
            continue
        if n >= min(DIRECT_BYTES, bucket_bytes):
            steps += [_Chunk(i, a, min(a + chunk, n)) for a in range(0, n, chunk)]
            continue
        offset = -(-used // _ALIGN) * _ALIGN
        if parts and offset + n > bucket_bytes:
            steps.append(_Packed(tuple(parts), used))
            parts, offset = [], 0
        parts.append((i, offset))
        used = offset + n
    if parts:
        steps.append(_Packed(tuple(parts), used))
    return steps


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 view."""
    return t.reshape(-1).view(torch.uint8)


def _flat_source(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements as a flat tensor of its dtype: a view when ``t`` is contiguous.

    A conjugate or negative view is resolved first: its memory does not hold its values.
    """
    return resolved(t).reshape(-1)


def _source_bytes(flat: torch.Tensor, start: int, stop: int, device: torch.device) -> torch.Tensor:
    """Bytes ``[start, stop)`` of a :func:`_flat_source` on ``device``.

    Sliced in its own dtype first, so that only that part moves to ``device`` (a chunk,
    never the whole tensor) and devices that cannot view bytes (torch's lazy) still work.
    """
    size = flat.element_size()
    part = flat[start // size : stop // size]
    if part.device != device:
        part = part.to(device)
    return _flat_bytes(part.contiguous())


def _plain_wire(wire: torch.Tensor, step: _Packed | _Chunk, device: torch.device) -> torch.Tensor:
    """``wire`` if it is a plain contiguous tensor of the step's bytes on ``device``, else raise.

    A tensor of its own dispatch (a DTensor, say) would make the broadcast itself raise on
    this member alone while the others wait in theirs: caught here, it is a local failure
    that the closing status raises on every member.
    """
    n = step.nbytes if isinstance(step, _Packed) else step.stop - step.start
    if type(wire) is not torch.Tensor or wire.dtype != torch.uint8 or wire.numel() != n:
        msg = (
            f"a tensor's bytes came out as a {type(wire).__name__} of {wire.dtype}, not a "
            f"plain tensor of {n} bytes: broadcast_weights moves plain tensors and DTensors"
        )
        raise TypeError(msg)
    if wire.device != device or not wire.is_contiguous():
        msg = f"a tensor's bytes came out on {wire.device}, not contiguous on {device}"
        raise TypeError(msg)
    return wire


def _straight(t: torch.Tensor, device: torch.device) -> bool:
    """Whether ``t``'s own memory holds its values in order on ``device`` (a wire as is)."""
    return t.is_contiguous() and t.device == device and not (t.is_conj() or t.is_neg())


def _direct(t: torch.Tensor, e: Entry, device: torch.device) -> bool:
    """Whether ``t``'s own memory can be the wire for ``e`` (no staging)."""
    return t.dtype == e.dtype and _straight(t, device)


class Move:
    """A planned transfer of ``tensors`` from ``src``, staged and ready to :meth:`run`.

    Every member passes ``entries`` (the same everywhere, agreed) and one tensor per entry
    of that shape: the source's to send, a receiver's to fill (of any dtype and device:
    it is cast, as ``copy_`` does). ``copies``: ``(destination, source)`` pairs a member
    copies once the data moved, before the closing status, so that a failure raises on
    every member (the source filling its own ``into``). Extra memory: at most one staging
    buffer of ``bucket_bytes`` (and, for a non-contiguous tensor that travels in chunks,
    a contiguous copy of it). Make it before the status that lets every member go on (its
    staging is allocated here, so that a failure raises on all); then :meth:`run`.
    """

    def __init__(
        self,
        group: Group,
        entries: list[Entry],
        tensors: list[torch.Tensor],
        src: int,
        bucket_bytes: int,
        *,
        what: str,
        copies: Iterable[tuple[torch.Tensor, torch.Tensor]] = (),
    ) -> None:
        self.group, self.entries, self.tensors, self.src, self.what = (
            group,
            entries,
            tensors,
            src,
            what,
        )
        self.copies = list(copies)
        self.steps = _plan(entries, bucket_bytes)
        self.is_src = group.rank_in_group == src
        device = group.device
        need = [
            s.nbytes if isinstance(s, _Packed) else s.stop - s.start
            for s in self.steps
            if isinstance(s, _Packed)
            or (not self.is_src and not _direct(tensors[s.entry], entries[s.entry], device))
        ]
        # Allocated before the members agree to go on, so that a failure here raises on all.
        self.staging = allocate(max(need), device, what=what) if need else None
        self.contiguous: dict[int, torch.Tensor] = {}  # non-contiguous destinations
        self._flat: tuple[int, torch.Tensor] | None = None  # the source's chunked tensor

    def run(self) -> None:
        """Move every step; a local failure lets the others finish, then raises on every member.

        After a failure every step still moves (with whatever the source's staging holds),
        so that no member waits; the receivers' tensors then hold undefined bytes.
        """
        failure: BaseException | None = None
        pg = self.group.device_group
        for index, step in enumerate(self.steps):
            wire: torch.Tensor | None = None
            try:
                if self.is_src:
                    _seams.packing(index)
                wire = _plain_wire(self._wire(step, failure is None), step, self.group.device)
            except Exception as exc:
                failure = failure or exc
            if wire is None:  # the step could not be prepared: move the staging's bytes
                wire = self._fallback(step)
            _rooted.broadcast_from(wire, pg, self.src)
            if not self.is_src and failure is None:
                try:
                    self._unpack(step, wire)
                except Exception as exc:
                    failure = exc
        try:
            if failure is None:
                for i, dest in self.contiguous.items():
                    self.tensors[i].copy_(dest)
                for dest, source in self.copies:
                    dest.copy_(source)
        except Exception as exc:
            failure = exc
        _agree.status(self.group, failure, what=self.what)

    def _fallback(self, step: _Packed | _Chunk) -> torch.Tensor:
        n = step.nbytes if isinstance(step, _Packed) else step.stop - step.start
        if self.staging is None:
            return torch.empty(n, dtype=torch.uint8, device=self.group.device)
        return self.staging[:n]

    def _wire(self, step: _Packed | _Chunk, pack: bool) -> torch.Tensor:
        """The bytes this member sends or receives into for ``step`` (packed on the source)."""
        device, staging = self.group.device, self.staging
        if isinstance(step, _Packed):
            wire = cast("torch.Tensor", staging)[: step.nbytes]
            if self.is_src and pack:
                for i, off in step.parts:
                    n = self.entries[i].nbytes
                    flat = _flat_source(self.tensors[i])
                    wire[off : off + n].copy_(_source_bytes(flat, 0, n, device))
            return wire
        t, e = self.tensors[step.entry], self.entries[step.entry]
        if self.is_src:  # flattened once per tensor (a copy if need be), not once per chunk
            if self._flat is None or self._flat[0] != step.entry:
                self._flat = (step.entry, _flat_source(t))
            return _source_bytes(self._flat[1], step.start, step.stop, device)
        if _direct(t, e, device):
            return _flat_bytes(t)[step.start : step.stop]
        return cast("torch.Tensor", staging)[: step.stop - step.start]

    def _unpack(self, step: _Packed | _Chunk, wire: torch.Tensor) -> None:
        """A receiver's part after ``step`` moved: cast the staged bytes into place."""
        if isinstance(step, _Packed):
            for i, off in step.parts:
                e = self.entries[i]
                self.tensors[i].copy_(wire[off : off + e.nbytes].view(e.dtype).view(e.shape))
            return
        t, e = self.tensors[step.entry], self.entries[step.entry]
        if _direct(t, e, self.group.device):
            return
        dest = self.contiguous.get(step.entry, t)
        if not _straight(dest, dest.device):  # filled whole by the chunks, copied in at the end
            dest = torch.empty(t.shape, dtype=t.dtype, device=t.device)
            self.contiguous[step.entry] = dest
        size = e.dtype.itemsize
        dest.view(-1)[step.start // size : step.stop // size].copy_(wire.view(e.dtype))


def _entries_of(tensors: object) -> list[Entry]:
    """The source's entries, or a TypeError naming what is wrong."""
    if not isinstance(tensors, Mapping):
        msg = f"tensors={tensors!r:.80} on the source must be a mapping of name -> tensor"
        raise TypeError(msg)
    out = []
    for name, t in tensors.items():
        if not isinstance(name, str) or not isinstance(t, torch.Tensor):
            msg = f"tensors[{name!r}] must map a str name to a torch.Tensor, not {type(t)!r}"
            raise TypeError(msg)
        if t.layout != torch.strided:
            msg = f"tensors[{name!r}] is a {t.layout} tensor; broadcast_weights moves dense ones"
            raise TypeError(msg)
        out.append(Entry(name, tuple(t.shape), t.dtype))
    return out


def _check_into(into: object, entries: list[Entry], g: Group, src: int) -> None:
    """Raise (on this member) what differs between ``into`` and the source's tensors."""
    if not isinstance(into, Mapping) or not all(isinstance(t, torch.Tensor) for t in into.values()):
        msg = f"into={into!r:.80} must be a mapping of name -> tensor (or None)"
        raise TypeError(msg)
    where = f"into on rank {g.rank}"
    names = {e.name for e in entries}
    for e in entries:
        if e.name not in into:
            msg = (
                f"tensor {e.name!r} (shape {list(e.shape)} on the source, rank "
                f"{g.ranks[src]}) is missing from {where} (shape: none)"
            )
            raise RankMismatchError(msg)
        got = tuple(into[e.name].shape)
        if got != e.shape:
            msg = (
                f"tensor {e.name!r} has shape {list(e.shape)} on the source (rank "
                f"{g.ranks[src]}) but {list(got)} in {where}; shapes must be equal"
            )
            raise RankMismatchError(msg)
        if why := _unfillable(into[e.name]):
            msg = f"into[{e.name!r}] on rank {g.rank} {why}"
            raise ValueError(msg)
    extra = [n for n in into if n not in names]
    if extra:
        name = extra[0]
        msg = (
            f"tensor {name!r} (shape {list(into[name].shape)} in {where}) is not sent by the "
            f"source (rank {g.ranks[src]}, shape: none); {len(extra)} name(s) only in into"
        )
        raise RankMismatchError(msg)


def _unfillable(t: torch.Tensor) -> str:
    """Why ``copy_`` into ``t`` would not fill it (``""``: it would), said before any byte moves.

    A ``meta`` tensor takes a copy without a word and holds nothing after it.
    """
    if t.device.type == "meta":
        return (
            "is on the meta device and has no memory to fill; materialize the model first "
            "(model.to_empty(device=...))"
        )
    if type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
        return f"is a {type(t).__name__}; pass plain tensors (a DTensor's: its to_local())"
    if t.is_inference() and not torch.is_inference_mode_enabled():
        return "is an inference tensor; call broadcast_weights inside torch.inference_mode()"
    if any(stride == 0 and size > 1 for stride, size in zip(t.stride(), t.shape, strict=True)):
        return "is an expanded view (one element stands for several); pass a tensor of its own"
    return ""


def _metadata(entries: list[Entry], bucket_bytes: int) -> bytes:
    rows = [[e.name, list(e.shape), dtype_name(e.dtype)] for e in entries]
    return json.dumps({"v": _VERSION, "bucket": bucket_bytes, "t": rows}).encode()


def _parse_metadata(data: bytes, g: Group, what: str) -> tuple[list[Entry], int]:
    try:
        record = _plain.loads(data)
        entries = [
            Entry(str(n), tuple(int(d) for d in shape), dtype_of(dt))
            for n, shape, dt in record["t"]
        ]
        bucket = int(record["bucket"])
    except (ValueError, TypeError, KeyError, PdistError, UnicodeDecodeError):
        msg = f"{what} on group {g.name!r}: the source sent malformed metadata"
        raise PdistError(msg) from None
    return entries, bucket


def _check_args(g: Group, src: int, bucket_bytes: object) -> None:
    g.global_rank(src)
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        msg = f"bucket_bytes={bucket_bytes!r} must be a positive int (bytes per bucket)"
        raise ValueError(msg)


def _digest(rows: Iterable[tuple[str, tuple[int, ...], torch.dtype]]) -> str:
    text = json.dumps(sorted([n, list(shape), dtype_name(d)] for n, shape, d in rows))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _ready(into: object, device: torch.device) -> str:
    """A receiver's promise that its ``into`` takes every tensor as is: their digest, or ""."""
    try:
        if isinstance(into, Mapping) and all(_straight(t, device) for t in into.values()):
            return _digest((n, tuple(t.shape), t.dtype) for n, t in into.items())
    except Exception:  # not tensors, or names that are not str: the checks name it later
        pass
    return ""


class _Agreed(NamedTuple):
    entries: list[Entry]
    bucket: int
    ready: bool  # every receiver's into takes every tensor straight: nothing can fail


def _agreed(
    g: Group,
    src: int,
    entries: list[Entry],
    bucket_bytes: int,
    into: object,
    error: BaseException | None,
    what: str,
) -> _Agreed:
    """The source's entries, once every member is known to pass the same ``src``.

    One all-gather carries every member's ``src``, argument error and the digest of its
    ``into`` (see :func:`_ready`), and the source's metadata when it fits the gather's
    first chunk (a few dozen tensors); longer metadata follows in a broadcast, which is
    safe only once ``src`` is agreed: members that pass different roots would pair
    broadcasts that never match.
    """
    is_src = g.rank_in_group == src
    meta, payload = b"", None
    try:
        if error is None:  # else src may be anything: the error travels instead
            mine = "-" if is_src and into is None else _ready(into, g.device)  # "-": none
            head = json.dumps([src, mine]).encode() + b"\n"
            meta = _metadata(entries, bucket_bytes) if is_src else b""
            inline = len(head) + len(meta) <= _wire.FIRST_MESSAGE_BYTES - HEADER.size
            payload = head + (meta if inline else b"")
    except Exception as exc:  # a dtype the metadata cannot name, say: raise on all
        error = exc
    gathered = _wire.all_gather_bytes(g, payload, error=error, what=what)
    heads, carried = zip(*(d.partition(b"\n")[::2] for d in gathered), strict=True)
    try:
        srcs, digests = zip(*(_plain.loads(h) for h in heads), strict=True)
    except (ValueError, TypeError, UnicodeDecodeError, PdistError):
        msg = f"{what} on group {g.name!r}: a member sent a malformed agreement"
        raise PdistError(msg) from None
    if len(set(map(repr, srcs))) > 1:
        shown = ", ".join(f"rank {r}: src={s!r}" for r, s in zip(g.ranks, srcs, strict=True))
        msg = f"{what}: the members passed different src ({shown}); pass the same src everywhere"
        raise RankMismatchError(msg)
    data = carried[src] or _wire.broadcast_bytes(g, meta if is_src else None, src, what=what)
    entries, bucket = _parse_metadata(data, g, what)
    expected = _digest(entries)
    ready = all(d == expected or (i == src and d == "-") for i, d in enumerate(digests))
    packed = any(isinstance(step, _Packed) for step in _plan(entries, bucket))
    return _Agreed(entries, bucket, ready and not packed)


def broadcast_weights(
    group: Group | DistContext,
    tensors: Mapping[str, torch.Tensor] | None = None,
    *,
    src: int = 0,
    into: Mapping[str, torch.Tensor] | None = None,
    bucket_bytes: int = 256 << 20,
) -> dict[str, torch.Tensor]:
    """Broadcast the source's mapping of name -> tensor to every member of ``group``.

    Made for weight sync (a trainer's weights into a running inference engine over a
    :func:`~pdist.link`), and works on any Group. Names, shapes and dtypes are agreed
    before any byte moves: a name missing from or extra in a member's ``into``, or a
    shape that differs, raises on every member (the source included) naming the tensor
    and both shapes, and leaves every ``into`` untouched. Small tensors travel packed in
    buckets of at most ``bucket_bytes`` (the source's value counts); large ones straight
    into their destination when it is contiguous, of the source's dtype and on the
    group's device. Extra memory on every member: about one bucket.

    Note:
        All members of the group must call it, with the same ``src``.

    Args:
        group: The group (a context means its world).
        tensors: On the source, name -> tensor (on any device); ignored elsewhere.
        src: Group index of the source.
        into: name -> tensor to fill in place, as ``load_state_dict`` does (same shapes;
            each cast to its own dtype and device: a bf16 model takes fp32 weights).
        bucket_bytes: The most bytes one broadcast carries.

    Returns:
        ``into`` once filled; without it, a new dict of tensors on the group's device (on
        the source: a new dict of its own tensors).

    Raises:
        PdistError: On every member, when a member passed a bad argument (also a
            ``TypeError``/``ValueError``: an ``into`` that cannot be filled, such as a
            ``meta`` tensor, raises before any byte moves) or its ``into`` differs from
            the source's tensors (naming the tensor and both shapes), when preparing the
            source's tensors failed (that error, not a member named as gone), or a member
            went away.
        RankMismatchError: On every member, when members passed different ``src``.
    """
    g = as_group(group)
    what = "broadcast_weights"
    error: BaseException | None = None
    entries: list[Entry] = []
    try:
        _check_args(g, src, bucket_bytes)
        if g.rank_in_group == src:
            entries = _entries_of(tensors)
    except Exception as exc:
        error = exc
    if g.world_size == 1:
        if error is not None:
            raise error
        try:
            if into is not None:
                _check_into(into, entries, g, src)
        except Exception as exc:  # raised as the members of a larger group would
            _agree.raise_own(g, exc, what, wrap_pdist=True)
        return _local(entries, tensors, into)
    with _member_lost(g, what):
        return _broadcast(g, tensors, src, into, bucket_bytes, entries, error, what)


def _broadcast(
    g: Group,
    tensors: Mapping[str, torch.Tensor] | None,
    src: int,
    into: Mapping[str, torch.Tensor] | None,
    bucket_bytes: int,
    entries: list[Entry],
    error: BaseException | None,
    what: str,
) -> dict[str, torch.Tensor]:
    """:func:`broadcast_weights` on a group of two or more members."""
    entries, bucket, ready = _agreed(g, src, entries, bucket_bytes, into, error, what)
    is_src = g.rank_in_group == src
    failure: BaseException | None = None
    targets: list[torch.Tensor] = []
    move: Move | None = None
    try:
        if into is not None:
            _check_into(into, entries, g, src)
        targets = _targets(g, entries, tensors if is_src else into)
        mine = [into[e.name] for e in entries] if is_src and into is not None else []
        copies = zip(mine, targets, strict=False)  # the source fills its own into
        move = Move(g, entries, targets, src, bucket, what=what, copies=copies)
    except Exception as exc:
        failure = exc
    # Receivers that take every tensor straight allocate nothing and cannot differ from
    # the source (their digests matched): no member can fail here, so no status either.
    if not ready:
        _agree.status(g, failure, what=what)
    elif failure is not None:
        raise failure
    with torch.no_grad():
        cast("Move", move).run()
    if into is not None:
        return dict(into) if not isinstance(into, dict) else into
    return {e.name: t for e, t in zip(entries, targets, strict=True)}


@contextlib.contextmanager
def _member_lost(g: Group, what: str) -> Iterator[None]:
    """Raise a communicator's failure (a member went away) as a PdistError saying so.

    Where tensors travel on a communicator of their own (NCCL), its kernels would wait
    on the GPU for a dead peer for good, and a copy to the host behind them with them:
    a watchdog aborts that communicator once the call outlives the group's timeout, and
    a communicator failure seen on the CPU group aborts it at once. An error the members
    raised together (a mismatched ``into``, a bad argument) leaves it alone: the group
    is healthy and goes on.
    """
    stuck = g.device_group if g.device_group is not g.cpu_group else None
    watchdog = None
    if stuck is not None:
        abort = functools.partial(_abort, stuck, g, what)
        watchdog = threading.Timer(g.timeout.total_seconds(), abort)
        watchdog.daemon = True
        watchdog.start()
    try:
        yield
    except RuntimeError as exc:
        gone = not isinstance(exc, PdistError) or isinstance(exc, _departures.PeerLeftError)
        if stuck is not None and gone:
            _abort(stuck, g, what)
        if isinstance(exc, PdistError):
            raise
        named = _departures.explained(g, what, exc)  # who left, where pdist can tell
        if named is not None:
            raise named from exc
        msg = (
            f"{what} on group {g.name!r}: the communicator failed on rank {g.rank}, most "
            f"likely because a member went away; rebuild the group without it ({exc})"
        )
        raise PdistError(msg) from exc
    finally:
        if watchdog is not None:
            watchdog.cancel()


def _abort(pg: ProcessGroup, g: Group, what: str) -> None:
    logger.warning("pdist: %s on group %r: aborting its %s communicator", what, g.name, g.device)
    try:
        _compat.abort_group(pg, g.device)
    except Exception:  # already torn down: nothing is left waiting on it
        logger.debug("pdist: aborting the communicator failed", exc_info=True)


def _targets(
    g: Group, entries: list[Entry], given: Mapping[str, torch.Tensor] | None
) -> list[torch.Tensor]:
    """The tensors each entry moves from (source) or into (receivers)."""
    if given is not None:
        return [given[e.name] for e in entries]
    return [torch.empty(e.shape, dtype=e.dtype, device=g.device) for e in entries]


def _local(
    entries: list[Entry],
    tensors: Mapping[str, torch.Tensor] | None,
    into: Mapping[str, torch.Tensor] | None,
) -> dict[str, torch.Tensor]:
    """A one-member group: ``into`` (checked by :func:`_check_into`) filled, or a new dict."""
    assert tensors is not None
    if into is None:
        return dict(tensors)
    with torch.no_grad():
        for e in entries:
            into[e.name].copy_(tensors[e.name])
    return dict(into) if not isinstance(into, dict) else into


def states_of(named: Iterable[tuple[str, torch.Tensor]]) -> list[Entry]:
    """Entries of named tensors (what ``sync_model_states`` moves)."""
    return [Entry(n, tuple(t.shape), t.dtype) for n, t in named]
