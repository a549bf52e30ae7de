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
2. **Plan** (``_transfer.plan``, a pure function of the metadata, so every member issues
   the same broadcasts): tensors under ``DIRECT_BYTES`` are packed into buckets of at
   most ``bucket_bytes``; larger ones travel alone, in chunks of at most ``bucket_bytes``.
3. **Move** (``_transfer``). A large tensor is received straight into its destination when
   that is contiguous, of the wire's dtype and on the group's device (no copy); otherwise
   each chunk lands in one staging buffer (at most ``bucket_bytes``) and is cast into
   place (``_transfer.take``), as ``load_state_dict``'s ``copy_`` would (a transposed one
   too: no copy of the whole). Staging is never handed to a caller.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import NamedTuple, cast

import torch

from . import _agree, _check, _compat, _departures, _plain, _seams, _transfer, _wire
from ._buffers import allocate, tensor_bytes
from ._errors import HEADER, PdistError, RankMismatchError
from ._group import DistContext, Group, ProcessGroup, as_group
from ._serialize import dtype_name, dtype_of
from ._transfer import Planned, chunk_bytes, direct, plan, straight, take
from ._weight_tensors import (
    Entry,
    Gathered,
    check_into,
    entries_of,
    gather_along,
    plain_wire,
    sources,
)

__all__ = [
    "DIRECT_BYTES",
    "SYNC_BUCKET_BYTES",
    "Entry",
    "WeightsMove",
    "broadcast_weights",
    "states_of",
]

logger = logging.getLogger("pdist")

SYNC_BUCKET_BYTES = 64 << 20  # sync_model_states' buckets
DIRECT_BYTES = 1 << 20  # tensors this large (or larger than a bucket) travel alone
_VERSION = 1


def _alone_bytes(bucket_bytes: int) -> int:
    """Tensors this large travel alone, in chunks (the rest packed): ``DIRECT_BYTES`` at most."""
    return min(DIRECT_BYTES, bucket_bytes)


class WeightsMove:
    """A planned broadcast of ``tensors`` from ``src`` (``_transfer.plan``), staged, to ``run``.

    Every member passes ``entries`` (the same everywhere, agreed) and one tensor per entry
    of that shape: the source's to send, a receiver's to fill (of any dtype and device:
    it is cast, as ``copy_`` does). ``copies``: ``(destination, source)`` pairs a member
    copies once the data moved, before the closing status, so that a failure raises on
    every member (the source filling its own ``into``). Extra memory: at most one staging
    buffer of ``bucket_bytes`` (a non-contiguous tensor in chunks is read or written in
    place, a chunk at a time). Make it inside the prepare step (``_transfer.prepare``: its
    staging is allocated here, so that a failure raises on all); then ``run``.
    """

    def __init__(
        self,
        group: Group,
        entries: list[Entry],
        tensors: Sequence[torch.Tensor],
        src: int,
        bucket_bytes: int,
        *,
        what: str,
        copies: Iterable[tuple[torch.Tensor, torch.Tensor]] = (),
    ) -> None:
        self.group, self.entries, self.tensors, self.src = group, entries, tensors, src
        self.what, self.copies, self.alone = what, list(copies), _alone_bytes(bucket_bytes)
        sizes = [e.nbytes for e in entries]
        self.steps = plan(sizes, bucket_bytes, kinds=["device"] * len(sizes), alone=self.alone)
        self.is_src = group.rank_in_group == src
        need = [
            s.nbytes
            for s in self.steps
            if not self._chunk(s) or (not self.is_src and not self._direct(s))
        ]
        # Allocated before the members agree to go on, so that a failure here raises on all.
        self.staging = allocate(max(need), group.device, what=what) if need else None
        self._flat: tuple[int, torch.Tensor] | None = None  # the source's chunked tensor
        self.offsets = {p.tensor: p.offset for s in self.steps for p in s.parts}
        self.ahead: set[int] = set()  # packed when gathered, before their bucket's turn
        if isinstance(tensors, Gathered):
            tensors.ahead = self._pack_ahead

    def _chunk(self, step: Planned) -> bool:
        return self.entries[step.parts[0].tensor].nbytes >= self.alone

    def _direct(self, step: Planned) -> bool:
        """Whether a receiver's tensor takes this chunk in its own memory (no staging)."""
        i = step.parts[0].tensor
        return direct(self.tensors[i], self.entries[i].dtype, self.group.device)

    def run(self) -> None:
        """Move every step; a local failure lets the others finish, then raises on every member.

        After a failure every step still moves (with whatever the source's staging holds),
        so that no member waits; the receivers' tensors then hold undefined bytes.
        """
        failure: BaseException | None = None
        for index, step in enumerate(self.steps):
            wire: torch.Tensor | None = None
            try:
                if self.is_src:
                    _seams.packing(index)
                wire = plain_wire(self._wire(step, failure is None), step.nbytes, self.group.device)
            except Exception as exc:
                failure = failure or exc
            if wire is None:  # the step could not be prepared: move the staging's bytes
                wire = self._fallback(step)
            _transfer.broadcast_buckets(self.group, ["device"], [wire], self.src, what=self.what)
            if not self.is_src and failure is None:
                try:
                    self._unpack(step, wire)
                except Exception as exc:
                    failure = exc
        try:
            if failure is None:
                for dest, source in self.copies:
                    dest.copy_(source)
        except Exception as exc:
            failure = exc
        _agree.status(self.group, failure, what=self.what)

    def _pack_ahead(self, i: int, full: torch.Tensor) -> None:
        """Pack a DTensor gathered before its bucket goes (its staging is free till then)."""
        n, offset = self.entries[i].nbytes, self.offsets[i]
        wire = cast("torch.Tensor", self.staging)[offset : offset + n]
        wire.copy_(chunk_bytes(full, 0, n, self.group.device))
        self.ahead.add(i)

    def _fallback(self, step: Planned) -> torch.Tensor:
        if self.staging is None:
            return torch.empty(step.nbytes, dtype=torch.uint8, device=self.group.device)
        return self.staging[: step.nbytes]

    def _wire(self, step: Planned, pack: bool) -> torch.Tensor:
        """The bytes this member sends or receives into for ``step`` (packed on the source)."""
        device, staging = self.group.device, self.staging
        if not self._chunk(step):
            self._flat = None  # a chunked tensor is done with: dropped before the next gather
            wire = cast("torch.Tensor", staging)[: step.nbytes]
            if self.is_src and pack:
                for i, off, _, n in step.parts:
                    if i not in self.ahead:
                        wire[off : off + n].copy_(chunk_bytes(self.tensors[i], 0, n, device))
            return wire
        i, _, start, stop = step.parts[0]
        if self.is_src:  # read once per tensor (a DTensor gathered), then chunk by chunk
            if self._flat is None or self._flat[0] != i:
                self._flat = None  # dropped before the next gather
                self._flat = (i, self.tensors[i])
            return chunk_bytes(self._flat[1], start, stop, device)
        if self._direct(step):
            return tensor_bytes(self.tensors[i])[start:stop]
        return cast("torch.Tensor", staging)[: stop - start]

    def _unpack(self, step: Planned, wire: torch.Tensor) -> None:
        """A receiver's part after ``step`` moved: cast the staged bytes into place."""
        if self._chunk(step) and self._direct(step):
            return  # it landed in place
        for part in step.parts:
            take(part, wire, self.tensors[part.tensor], self.entries[part.tensor].dtype)


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
        if isinstance(into, Mapping) and all(straight(t, device) for t in into.values()):
            return _digest((n, tuple(t.shape), t.dtype) for n, t in into.items())
    except Exception:  # not tensors, or names that are not str: the checks name it later
        pass
    return ""


class _Agreed(NamedTuple):
    entries: list[Entry]
    bucket: int
    ready: bool  # every receiver's into takes every tensor straight: nothing can fail


def _agree_metadata(
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
    ``into`` (see ``_ready``), and the source's metadata when it fits the gather's
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
    packed = any(0 < e.nbytes < _alone_bytes(bucket) for e in entries)
    return _Agreed(entries, bucket, ready and not packed)


def broadcast_weights(
    group: Group | DistContext | None,
    tensors: Mapping[str, torch.Tensor] | None = None,
    *,
    src: int = 0,
    into: Mapping[str, torch.Tensor] | None = None,
    bucket_bytes: int = 256 << 20,
) -> dict[str, torch.Tensor]:
    """Broadcast the source's mapping of name -> tensor to every member of ``group``.

    Made for weight sync (a trainer's weights into a running inference engine over a
    [`link`][pdist.link]), and works on any Group. Names, shapes and dtypes are agreed
    before any byte moves: a name missing from or extra in a member's ``into``, or a
    shape that differs, raises on every member (the source included) naming the tensor
    and both shapes, and leaves every ``into`` untouched. Small tensors travel packed in
    buckets of at most ``bucket_bytes`` (the source's value counts); large ones straight
    into their destination when it is contiguous, of the source's dtype and on the
    group's device. Extra memory on every member: about one bucket.

    The source's tensors may be DTensors (an FSDP2 trainer's ``state_dict()``): each is
    gathered to its full tensor when its turn comes, one at a time, so the source's extra
    memory is one bucket and one gathered tensor; receivers get plain tensors. Every
    rank of the trainer's mesh takes part in each gather: its ranks that are not the
    link's member call ``broadcast_weights(None, state_dict)``.

    Note:
        All members of the group must call it, with the same ``src``.

    Args:
        group: The group (a context means its world); None on a sharded trainer's rank
            that is not a member: it gathers each DTensor of ``tensors`` with the member
            (in the mapping's order, the same ``state_dict``), sends nothing and returns
            an empty dict; when the member raised, it raises a ``PdistError`` saying so.
        tensors: On the source, name -> tensor (on any device; DTensors gathered);
            ignored on the other members.
        src: Group index of the source.
        into: name -> tensor to fill in place, as ``load_state_dict`` does (same shapes;
            each cast to its own dtype and device: a bf16 model takes fp32 weights). None
            on a source whose tensors are DTensors.
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
    if group is None:  # a sharded trainer's rank that is not the link member
        gather_along(tensors)
        return {}
    g = as_group(group)
    _check.agree_name(g, "broadcast_weights")  # check mode: the call is named
    what = "broadcast_weights"
    error: BaseException | None = None
    entries: list[Entry] = []
    mine: Sequence[torch.Tensor] = []
    try:
        _check_args(g, src, bucket_bytes)
        if g.rank_in_group == src:
            mine = sources(tensors)  # first: whatever fails next, the mesh gathers along
            entries = entries_of(tensors)
            if isinstance(mine, Gathered) and into is not None:
                msg = f"into on the source (rank {g.rank}) holds DTensors; pass into=None there"
                raise ValueError(msg)
    except Exception as exc:
        error = exc
    try:
        if g.world_size > 1:
            with _member_lost(g, what):
                out = _broadcast_members(g, mine, src, into, bucket_bytes, entries, error, what)
        else:
            out = _one_member(g, entries, mine, into, error, src)
    except BaseException:
        if isinstance(mine, Gathered):  # the mesh gathers every tensor, and learns of it
            with contextlib.suppress(Exception):  # this rank's own error matters more
                mine.finish(failed=True)
        raise
    if isinstance(mine, Gathered):
        mine.finish(failed=False)
    return out


def _broadcast_members(
    g: Group,
    sources: Sequence[torch.Tensor],
    src: int,
    into: Mapping[str, torch.Tensor] | None,
    bucket_bytes: int,
    entries: list[Entry],
    error: BaseException | None,
    what: str,
) -> dict[str, torch.Tensor]:
    """[`broadcast_weights`][pdist.broadcast_weights] on a group of two or more members."""
    entries, bucket, ready = _agree_metadata(g, src, entries, bucket_bytes, into, error, what)
    is_src = g.rank_in_group == src
    targets: Sequence[torch.Tensor] = []

    def make() -> WeightsMove:
        nonlocal targets
        if into is not None:
            check_into(into, entries, g, src)
        targets = sources if is_src else _targets(g, entries, into)
        mine = [into[e.name] for e in entries] if is_src and into is not None else []
        copies = zip(mine, targets, strict=False)  # the source fills its own into
        return WeightsMove(g, entries, targets, src, bucket, what=what, copies=copies)

    # Receivers that take every tensor straight allocate nothing and cannot differ from
    # the source (their digests matched): no member can fail here, so no status either.
    move, _ = _transfer.prepare(g, make, together=not ready, what=what)
    with torch.no_grad():
        move.run()
    if into is not None:
        return dict(into) if not isinstance(into, dict) else into
    own = targets.tensors if isinstance(targets, Gathered) else targets  # the source's own
    return {e.name: t for e, t in zip(entries, own, strict=True)}


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
        with _departures.naming(g, what):  # who left, where pdist can tell
            yield
    except RuntimeError as exc:
        gone = not isinstance(exc, PdistError) or isinstance(exc, _departures.PeerLeftError)
        if stuck is not None and gone:
            _abort(stuck, g, what)
        if isinstance(exc, PdistError):
            raise
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
    """The tensors each entry moves into (receivers): ``into``'s, or new ones."""
    if given is not None:
        return [given[e.name] for e in entries]
    return [torch.empty(e.shape, dtype=e.dtype, device=g.device) for e in entries]


def _one_member(
    g: Group,
    entries: list[Entry],
    sources: Sequence[torch.Tensor],
    into: Mapping[str, torch.Tensor] | None,
    error: BaseException | None,
    src: int,
) -> dict[str, torch.Tensor]:
    """A one-member group: ``into`` (checked by ``check_into``) filled, or a new dict."""
    if error is not None:
        raise error
    try:
        if into is not None:
            check_into(into, entries, g, src)
    except Exception as exc:  # raised as the members of a larger group would
        _agree.raise_own(g, exc, "broadcast_weights", wrap_pdist=True)
    if into is None:  # a DTensor's full tensor (gathered with the mesh), else the tensor
        return {e.name: sources[i] for i, e in enumerate(entries)}
    with torch.no_grad():
        for i, e in enumerate(entries):
            into[e.name].copy_(sources[i])
    return dict(into) if not isinstance(into, dict) else into


def states_of(named: Iterable[tuple[str, torch.Tensor]]) -> list[Entry]:
    """Entries of named tensors (what ``sync_model_states`` moves)."""
    return [Entry(n, tuple(t.shape), t.dtype) for n, t in named]
