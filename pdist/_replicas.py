"""``fault_tolerant()``: replicas that survive each other, and a run that stays exact.

Each replica is its own job; the replicas meet through a coordinator (``python -m pdist
coordinator``), a process that hosts a ``TCPStore`` and decides, one step at a time, who
is in (the quorum) and whether the step committed. Every decision is written once in its
store and read by every rank of every member, so all of them see the same one.

The store's keys, under ``pdist/ft/`` (plain JSON and integers; nothing runs as code):

- ``reg`` (a counter) and ``reg/<n>``: the replica ids seen so far;
- ``hb/<id>``: a counter the replica's rank 0 bumps every ``BEAT_SEC`` (its heartbeat);
- ``ask/<id>``: the replica's request to join the next quorum (its token, request number,
  step, whether it is new, ``min_replicas``, ranks); ``gone/<id>``: its token, as it leaves;
- ``answer/<token>/<n>``: the quorum a request got, ``round/<q>`` that quorum (its step,
  members, their tokens and ranks, the healing source and the healed);
- ``done/<q>`` (a counter) and ``fail/<q>``: how each rank's block went; ``commit/<q>``: the
  coordinator's verdict, written once; ``live``: the replicas it hears now.

A quorum's Group is rebuilt under ``q/<q>/c<rank>/`` whenever the members' processes change
or a step failed (gloo on CPU; on CUDA also NCCL, aborted when a member fails), outside
torch's registry as [`link`][pdist.link]'s are.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
import traceback
import uuid
from collections.abc import Iterator, Mapping
from datetime import timedelta
from typing import Any, Protocol

import attrs
import torch
import torch.distributed as dist

from . import _compat, _env
from ._compat import PrefixStore, Store, TCPStore
from ._departures import PeerLeftError, summary
from ._errors import PdistError, RankMismatchError, RemoteError
from ._group import DistContext, Group, ProcessGroup, standalone_group
from ._objects import broadcast_object
from ._p2p import recv_object, send_object

__all__ = ["BEAT_SEC", "PREFIX", "FaultTolerant", "Quorum", "fault_tolerant", "order"]

PREFIX = "pdist/ft/"
BEAT_SEC = 0.1  # a replica's heartbeat; the coordinator leaves it out after about 1 s without
_POLL_SEC = 0.005
_COMMUNICATING = (os.path.dirname(dist.__file__) + os.sep, os.path.dirname(__file__) + os.sep)


class Stateful(Protocol):
    """What ``state`` holds: a model, an optimizer, anything torch can save and load."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state_dict: Any, /) -> Any: ...


def order(replica_id: str) -> tuple[int, int, str]:
    """Members' order: numeric ids by value (``"2"`` before ``"10"``), then the others."""
    return (0, int(replica_id), "") if replica_id.isdigit() else (1, 0, replica_id)


@attrs.define
class Quorum:
    """One step's membership, seen from this rank (``committed`` is set after the block).

    Attributes:
        group: One member per live replica: the rank with this rank's coordinate in each.
        index: This replica's position among the members (ordered by replica id).
        size: The number of members.
        replicas: The members' ids, in order.
        step: The step this quorum runs (every member's ``ft.step``).
        healed: Whether this replica received its state before the block.
        committed: After the block: whether the step committed on every member.
    """

    group: Group
    index: int
    size: int
    replicas: tuple[str, ...]
    step: int
    healed: bool
    committed: bool = False


def _communication(exc: BaseException) -> bool:
    """Whether ``exc`` is the quorum's communication failing (a member died, raised, stalled)."""
    if isinstance(exc, RankMismatchError):  # the members' own disagreement: the user's to fix
        return False
    if isinstance(exc, PeerLeftError | RemoteError | dist.DistError):
        return True
    # A backend's own error (gloo's "Connection reset by peer") raised where a communicator
    # is waited on: in torch.distributed, or in pdist's calls into it.
    frames = traceback.extract_tb(exc.__traceback__)
    where = frames[-1].filename if frames else ""
    return isinstance(exc, RuntimeError) and where.startswith(_COMMUNICATING)


def _state_difference(mine: Any, theirs: Any, path: str) -> str | None:
    """Where two state dicts differ in the shape or dtype of a tensor they both have."""
    if isinstance(mine, torch.Tensor) and isinstance(theirs, torch.Tensor):
        if mine.shape != theirs.shape or mine.dtype != theirs.dtype:
            return (
                f"{path} is {tuple(mine.shape)} {mine.dtype} here but "
                f"{tuple(theirs.shape)} {theirs.dtype} on the source"
            )
    elif isinstance(mine, Mapping) and isinstance(theirs, Mapping):
        for key in (k for k in mine if k in theirs):  # in order: the first difference
            if (found := _state_difference(mine[key], theirs[key], f"{path}[{key!r}]")) is not None:
                return found
    return None


class FaultTolerant:
    """A replica's handle (see [`fault_tolerant`][pdist.fault_tolerant]); ``step``: steps done."""

    def __init__(self, ctx: DistContext, address: str, rid: str, minimum: int, seconds: float):
        self.ctx, self.address, self.replica_id = ctx, address, rid
        self.min_replicas, self.seconds = minimum, seconds
        self.step = 0
        self._new, self._asks, self._token = True, 0, ""
        self._store: Store | None = None
        self._group: Group | None = None
        self._members: tuple[str, ...] = ()
        self._reuse = False  # the last quorum committed: its Group serves the same members
        self._stop = threading.Event()

    @property
    def store(self) -> Store:
        """The connection to the coordinator's store (open inside the block only)."""
        if self._store is None:
            msg = "fault_tolerant: use ft.quorum() inside its `with pdist.fault_tolerant()` block"
            raise PdistError(msg)
        return self._store

    def _fail(self, why: str) -> PdistError:
        return PdistError(
            f"fault_tolerant: replica {self.replica_id!r} (rank {self.ctx.rank}): the "
            f"coordinator at {self.address} {why}; start `python -m pdist coordinator` there, "
            "or pass its address"
        )

    def _call(self, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as exc:
            raise self._fail(f"does not answer ({exc})") from exc

    def _wait(self, key: str, what: str) -> bytes:
        deadline = time.monotonic() + self.seconds
        store = self.store
        while not self._call(store.check, [PREFIX + key]):
            if time.monotonic() > deadline:
                live = self._call(store.get, PREFIX + "live").decode()
                msg = (
                    f"fault_tolerant: replica {self.replica_id!r} (rank {self.ctx.rank}) waited "
                    f"{self.seconds:g}s for {what}; live replicas: [{live}], "
                    f"min_replicas={self.min_replicas}; start more replicas or lower min_replicas"
                )
                raise PdistError(msg)
            time.sleep(_POLL_SEC)
        return bytes(self._call(store.get, PREFIX + key))

    def _beat(self, store: Store) -> None:
        """Rank 0's heartbeat, on a connection of its own, until the replica leaves."""
        while not self._stop.wait(BEAT_SEC):
            try:
                store.add(f"{PREFIX}hb/{self.replica_id}", 1)
            except Exception:  # the main thread names a coordinator that is gone, when it asks
                continue

    def open(self, host: str, port: int) -> None:
        """Connect, agree on this process's token, register and start the heartbeat."""
        wait = timedelta(seconds=self.seconds)
        self._store = self._call(TCPStore, host, port, None, False, wait)
        token = uuid.uuid4().hex if self.ctx.rank == 0 else None
        if self.ctx.world_size > 1:
            token = broadcast_object(self.ctx.world, token)
        self._token = str(token)
        if self.ctx.rank == 0:
            # A first beat before registering: the coordinator hears it live from the start.
            self._call(self.store.add, f"{PREFIX}hb/{self.replica_id}", 1)
            n = self._call(self.store.add, PREFIX + "reg", 1)
            self._call(self.store.set, f"{PREFIX}reg/{n}", self.replica_id)
            beats = self._call(TCPStore, host, port, None, False, timedelta(seconds=5))
            threading.Thread(target=self._beat, args=(beats,), daemon=True, name="pdist-ft").start()

    def close(self) -> None:
        """Stop the heartbeat, tell the coordinator (best effort) and drop the Group."""
        self._stop.set()
        if self.ctx.rank == 0 and self._store is not None:
            with contextlib.suppress(Exception):
                self.store.set(f"{PREFIX}gone/{self.replica_id}", self._token)
        self._drop()
        self._store = None

    def _drop(self) -> None:
        group, self._group, self._reuse = self._group, None, False
        if group is None:
            return
        pgs = {id(pg): pg for pg in group.lifetime.process_groups()}.values()
        group.lifetime.close()
        for pg in pgs:
            with contextlib.suppress(Exception):
                if group.device.type == "cuda":  # NCCL kernels wait on a dead peer until aborted
                    _compat.abort_group(pg, group.device)
                _compat.shutdown_group(pg)

    def _build(self, q: int, info: dict[str, Any]) -> Group:
        """The quorum's Group: one communicator per coordinate, rebuilt per membership.

        The same members are the same processes (a replica restarted under its old id has
        another token), after a step that committed: their Group serves again.
        """
        members = tuple(info["replicas"])
        same = (*members, *info["tokens"]) == self._members
        if self._reuse and self._group is not None and same:
            return self._group
        self._drop()
        index, size = members.index(self.replica_id), len(members)
        device, wait = self.ctx.device, timedelta(seconds=self.seconds)
        store = PrefixStore(f"{PREFIX}q/{q}/c{self.ctx.rank}/", self.store)
        self._arrive(q, store, size)
        try:
            cpu = _compat.unregistered_group(store, index, size, "gloo", torch.device("cpu"), wait)
            tensors: ProcessGroup = cpu
            if device.type != "cpu":
                tensors = _compat.unregistered_group(
                    PrefixStore("nccl/", store), index, size, self.ctx.backend, device, wait
                )
        except Exception as exc:  # a member went away between the decision and here
            raise PeerLeftError(
                f"fault_tolerant: building quorum {q}'s group failed ({exc})"
            ) from exc
        self._group = standalone_group(
            name=f"ft/c{self.ctx.rank}",
            rank=index,
            size=size,
            device=device,
            timeout=wait,
            device_group=tensors,
            cpu_group=cpu,
        )
        self._members = (*members, *info["tokens"])
        return self._group

    def _arrive(self, q: int, store: Store, size: int) -> None:
        """Wait for every member's counterpart before building (gloo would wait ``timeout``).

        A member that died since the quorum was decided never arrives; the coordinator then
        decides the quorum did not commit, and this raises at once.
        """
        self._call(store.add, "arrived", 1)
        deadline = time.monotonic() + self.seconds
        while self._call(store.add, "arrived", 0) < size:
            if self._call(self.store.check, [f"{PREFIX}commit/{q}"]) or time.monotonic() > deadline:
                msg = f"fault_tolerant: a member of quorum {q} left before its group was built"
                raise PeerLeftError(msg)
            time.sleep(_POLL_SEC)

    def _ask(self) -> tuple[int, dict[str, Any]]:
        """Ask to join the next quorum (rank 0 asks; every rank reads the answer)."""
        self._asks += 1
        if self.ctx.rank == 0:
            ask = {"token": self._token, "n": self._asks, "step": self.step, "new": self._new}
            ask |= {"min": self.min_replicas, "ranks": self.ctx.world_size}
            self._call(self.store.set, f"{PREFIX}ask/{self.replica_id}", json.dumps(ask))
        q = int(self._wait(f"answer/{self._token}/{self._asks}", "a quorum"))
        return q, json.loads(self._wait(f"round/{q}", f"quorum {q}"))

    def _report(self, q: int, error: BaseException | None) -> None:
        if error is None:
            self._call(self.store.add, f"{PREFIX}done/{q}", 1)
        else:
            line = f"replica {self.replica_id!r} rank {self.ctx.rank}: {summary(error)}"
            key = f"{PREFIX}fail/{q}"
            with contextlib.suppress(PdistError):  # its own error matters more
                if _communication(error):  # an echo: the first report stays
                    self._call(self.store.compare_set, key, "", line)
                else:  # a root cause (the user's error, a state that does not fit)
                    self._call(self.store.set, key, line)
            self._drop()  # its peers still in a collective with it fail at once

    def _heal(self, group: Group, info: dict[str, Any], state: Mapping[str, Stateful]) -> bool:
        """The healed members receive ``state`` from the source, each rank from its counterpart."""
        members, healed, source = info["replicas"], info["healed"], info["source"]
        if group.rank_in_group == source:
            sent = {name: obj.state_dict() for name, obj in state.items()}
            for i, member in enumerate(members):
                if member in healed:
                    send_object(group, sent, i)
        if self.replica_id not in healed:
            return False
        received = recv_object(group, source)
        for name, obj in state.items():
            if name not in received:
                msg = f"state[{name!r}] is missing on the source replica {members[source]!r}"
                raise RankMismatchError(self._mismatch(msg))
            mine = obj.state_dict()
            if (found := _state_difference(mine, received[name], f"state[{name!r}]")) is not None:
                raise RankMismatchError(self._mismatch(found))
            try:
                obj.load_state_dict(received[name])
            except Exception as exc:
                msg = f"state[{name!r}].load_state_dict failed ({exc})"
                raise RankMismatchError(self._mismatch(msg)) from exc
        return True

    def _mismatch(self, what: str) -> str:
        return (
            f"fault_tolerant: replica {self.replica_id!r} (rank {self.ctx.rank}) cannot be "
            f"healed: {what}; every replica must build the same model, optimizer and layout"
        )

    def _commit(self, q: int) -> bool:
        return self._wait(f"commit/{q}", f"quorum {q}'s commit") == b"1"

    def _enter(self, state: Mapping[str, Stateful]) -> tuple[int, Quorum]:
        """Join a quorum and heal; a quorum that fails while healing is reported and retried."""
        while True:
            q, info = self._ask()
            members = tuple(info["replicas"])
            try:
                group = self._build(q, info)
                healed = self._heal(group, info, state)
            except BaseException as exc:
                self._report(q, exc)
                if not _communication(exc):
                    raise
                self._commit(q)
                continue
            self.step, self._new = int(info["step"]), False
            index = members.index(self.replica_id)
            return q, Quorum(group, index, len(members), members, self.step, healed)

    @contextlib.contextmanager
    def quorum(self, state: Mapping[str, Stateful]) -> Iterator[Quorum]:
        """One step among the live replicas: join, heal if behind, run the block, commit.

        Note:
            Every rank of the replica calls it, once per step.

        Args:
            state: name -> object with ``state_dict()``/``load_state_dict()`` (the model,
                the optimizer): what a new or lagging replica receives before the block.

        Yields:
            The ``Quorum``; ``q.committed`` is set once the block is over.

        Raises:
            PdistError: Fewer than ``min_replicas`` live replicas for ``timeout``, or the
                coordinator does not answer.
            RankMismatchError: This replica's state does not fit the source's (on this
                replica; the others go on without it).
        """
        _ = self.store  # refuses outside the block
        q, quorum = self._enter(state)
        try:
            yield quorum
        except BaseException as exc:
            self._report(q, exc)
            if not _communication(exc):
                raise
        else:
            self._report(q, None)
        quorum.committed = self._reuse = self._commit(q)
        if quorum.committed:
            self.step += 1


@contextlib.contextmanager
def fault_tolerant(
    ctx: DistContext,
    address: str,
    *,
    replica_id: str | int,
    min_replicas: int = 1,
    timeout: float | timedelta | None = None,
) -> Iterator[FaultTolerant]:
    """Make this job one replica among several that survive each other, exactly.

    Replicas meet through the coordinator at ``address`` (``python -m pdist coordinator
    --port P``). Each ``ft.quorum(state)`` block is one step among the replicas alive then:
    a replica that died or stopped answering (about a second without a heartbeat) is left
    out, a new or lagging one first receives ``state`` and ``ft.step`` from the lowest-indexed
    member at the highest step, and a block whose communication fails (a member died,
    raised or timed out) ends with ``q.committed`` False on every member, to be redone.

    Note:
        Every rank of the replica's job calls it (the replica's rank 0 talks for it).

    Args:
        ctx: This replica's own context (any layout).
        address: ``"host:port"`` of the coordinator.
        replica_id: This replica's id, unique among the replicas; a restarted replica
            takes its old id back. Members are ordered by it.
        min_replicas: The fewest members a step runs with.
        timeout: Seconds (or a ``timedelta``) to wait for a quorum, a commit, or a member
            in a collective; None: ``PDIST_TIMEOUT_SEC`` (default 1800).

    Yields:
        The replica's handle: ``ft.step`` (committed steps) and ``ft.quorum(state)``.

    Raises:
        ValueError: A bad ``address``, ``replica_id`` or ``min_replicas``.
        PdistError: The coordinator does not answer (naming its address).
    """
    host, _, port = address.rpartition(":") if isinstance(address, str) else ("", "", "")
    if not host or not port.isdigit():
        msg = f"address={address!r} must be 'host:port' (where the coordinator listens)"
        raise ValueError(msg)
    rid = str(replica_id)
    if isinstance(replica_id, bool) or not rid or "/" in rid or "," in rid:
        msg = f"replica_id={replica_id!r} must be a non-empty str or int without '/' or ','"
        raise ValueError(msg)
    if isinstance(min_replicas, bool) or not isinstance(min_replicas, int) or min_replicas < 1:
        msg = f"min_replicas={min_replicas!r} must be a positive int"
        raise ValueError(msg)
    ft = FaultTolerant(ctx, address, rid, min_replicas, _env.collective_seconds(timeout))
    try:
        ft.open(host.strip("[]"), int(port))
        yield ft
    finally:
        ft.close()
