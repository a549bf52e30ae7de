"""``link()``: a Group of members of separate jobs, joined at an address, outside torch's registry.

Member 0 hosts a ``TCPStore`` at ``address``; every member connects, checks in, and
waits for the others with a deadline. Then the communicators are built straight from
the store (``_compat.unregistered_group``), so torch's registry never sees them
(principle 13).

The store's keys, under ``pdist/link/<name>/``:

- ``joined`` (a counter) and ``joined/<r>``: who checked in;
- ``verdict``: member 0's list of missing ranks when it gave up (every member raises it);
- ``closed`` and ``bye`` (a counter): the goodbye. Member 0 marks its store closed as it
  leaves; the others leave once they see it, so that a member that re-links at once (20
  links in a row on one address) never mistakes the old store for the new one.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import cast

import torch

from . import _compat, _departures, _env
from ._compat import PrefixStore, Store, TCPStore
from ._context import probe_accelerator
from ._errors import PdistError
from ._group import Group, ProcessGroup, standalone_group

__all__ = ["link"]

logger = logging.getLogger("pdist")

_POLL_SEC = 0.02
_VERDICT_WAIT_SEC = 5.0  # how long member 0 lingers so the others read its verdict
_DEVICE_MARGIN_SEC = 60.0  # the tensor communicator's timeout beyond the link's
_CLOSE_WAIT_SEC = 5.0  # how long member 0 waits for goodbyes (and the others, after a failure)


def _parse_address(address: object) -> tuple[str, int]:
    if isinstance(address, str):
        host, sep, port = address.rpartition(":")
        if sep and host and port.isdigit() and 0 < int(port) < 65536:
            return host.strip("[]"), int(port)
    msg = f"address={address!r} must be a string 'host:port' (member 0 hosts the store there)"
    raise ValueError(msg)


def _check_ranks(rank: object, world_size: object) -> tuple[int, int]:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        msg = f"world_size={world_size!r} must be a positive int (the link's number of members)"
        raise ValueError(msg)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        msg = f"rank={rank!r} must be an int in 0..{world_size - 1} (this member's link rank)"
        raise ValueError(msg)
    return rank, world_size


class _Join:
    """One member's side of the store protocol (check in, wait for all, say goodbye)."""

    def __init__(self, label: str, rank: int, size: int, prefix: str, seconds: float) -> None:
        self.label, self.rank, self.size, self.prefix = label, rank, size, prefix
        self.seconds, self.deadline = seconds, time.monotonic() + seconds
        self.store: Store | None = None  # member 0's: the server
        self.ended = ""  # what a closed store at the address said (a member that came late)

    def key(self, name: str) -> str:
        return self.prefix + name

    def connect(self, host: str, port: int) -> Store:
        """Member 0: host the store; others: connect to a store not marked ``closed``.

        Both retry until the deadline: the previous link's store on this address may be
        going away (its port not yet free, a connection reset in the handshake).
        """
        why = ""
        while True:
            try:
                store = self._attempt(host, port)
            except Exception as exc:
                store, why = None, str(exc)
            if store is not None:
                self.store = store
                return store
            if time.monotonic() > self.deadline:
                if self.rank == 0:
                    msg = f"{self.label}: member 0 cannot host the store ({why})"
                    raise PdistError(msg)
                if self.ended:
                    raise PdistError(f"{self.label}: {self.ended}")
                why = (
                    f"no open store answered at {host}:{port}: member 0 has not started, or it "
                    f"gave up or ended its link before this member came (not known here; {why})"
                )
                self._raise_missing([0], why)
            time.sleep(_POLL_SEC * 5)

    def _attempt(self, host: str, port: int) -> Store | None:
        """A store, or None where the previous link's store answered (about to go)."""
        wait = timedelta(seconds=min(max(self.deadline - time.monotonic(), 0.1), 30.0))
        if self.rank == 0:
            return TCPStore(host, port, None, True, wait, wait_for_workers=False)
        store = TCPStore(host, port, None, False, wait)
        if not store.check([self.key("closed")]):
            return store
        self.ended = self._closed_because(store)  # or the previous link's, about to go: retry
        return None

    def _closed_because(self, store: Store) -> str:
        """What a closed store says to a member that came after it closed."""
        if store.check([self.key("verdict")]):
            missing = _parse_ranks(store.get(self.key("verdict")).decode())
            store.add(self.key("verdict_seen"), 1)
            return (
                f"member 0 gave up waiting for link rank(s) {missing} and closed the link before "
                f"link rank {self.rank} came; start every member within timeout of the others"
            )
        return (
            f"a link at this address formed and ended before link rank {self.rank} came (member "
            f"0 closed it): this member is late, or a second process with rank {self.rank}; give "
            "each member its own rank and join within timeout of the others"
        )

    def _raise_missing(self, missing: list[int], why: str = "") -> None:
        msg = (
            f"{self.label}: link rank(s) {missing} did not join within {self.seconds:g}s "
            f"(this is link rank {self.rank} of {self.size})" + (f"; {why}" if why else "")
        )
        raise PdistError(msg)

    def _missing(self, store: Store) -> list[int]:
        return [r for r in range(self.size) if not store.check([self.key(f"joined/{r}")])]

    def join(self) -> None:
        """Check in and wait until every member has; raise naming the missing ranks."""
        store = cast("Store", self.store)
        if self.rank == 0:
            store.set(self.key("size"), str(self.size))
        elif (theirs := int(store.get(self.key("size")))) != self.size:  # member 0 sets it first
            msg = (
                f"{self.label}: world_size={self.size} on link rank {self.rank}, but member 0 "
                f"passed world_size={theirs}; pass the same world_size on every member"
            )
            raise PdistError(msg)
        if store.add(self.key(f"joined/{self.rank}"), 1) > 1:
            msg = f"{self.label}: link rank {self.rank} joined twice; give each member its own rank"
            raise PdistError(msg)
        store.add(self.key("joined"), 1)
        seen = list(range(self.size))
        try:
            while store.add(self.key("joined"), 0) < self.size:
                if store.check([self.key("verdict")]):
                    verdict = store.get(self.key("verdict")).decode()
                    store.add(self.key("verdict_seen"), 1)
                    self._raise_missing(_parse_ranks(verdict), "member 0 gave up waiting")
                if time.monotonic() > self.deadline:
                    self._give_up(store)
                seen = self._missing(store) if self.rank else seen
                time.sleep(_POLL_SEC)
        except PdistError:
            raise
        except Exception as exc:  # member 0's store went away: name who had not joined
            self._raise_missing(seen, f"member 0's store went away ({exc})")

    def _give_up(self, store: Store) -> None:
        missing = self._missing(store)
        if self.rank == 0:
            store.set(self.key("verdict"), ",".join(map(str, missing)))
            store.set(self.key("closed"), "1")
            # Every other member reads the verdict: those that joined, and a late one that
            # comes in the next few seconds (else it could not tell that member 0 was here).
            end = time.monotonic() + _VERDICT_WAIT_SEC
            while store.add(self.key("verdict_seen"), 0) < self.size - 1 and time.monotonic() < end:
                time.sleep(_POLL_SEC)
        self._raise_missing(missing)

    def communicators(
        self, backend: str, device: torch.device, wait: timedelta
    ) -> tuple[ProcessGroup, ProcessGroup]:
        """The link's gloo group, and its tensor group (the same one on a CPU gloo link)."""

        def make(kind: str, backend: str, device: torch.device, wait: timedelta) -> ProcessGroup:
            store = PrefixStore(f"{self.prefix}{kind}/", cast("Store", self.store))
            return _compat.unregistered_group(store, self.rank, self.size, backend, device, wait)

        try:
            cpu = make("cpu", "gloo", torch.device("cpu"), wait)
            if device.type == "cpu" and backend == "gloo":
                return cpu, cpu
            # Later than the gloo group's: pdist's watchdog aborts a stuck NCCL communicator
            # and raises naming the member that left, before torch's own ends the process.
            later = wait + timedelta(seconds=_DEVICE_MARGIN_SEC)
            try:
                return cpu, make("device", backend, device, later)
            except Exception:
                _compat.shutdown_group(cpu)
                raise
        except Exception as exc:  # every member had joined: one went away since, or the network
            msg = (
                f"{self.label}: building the communicators failed on link rank {self.rank} ({exc})"
            )
            raise PdistError(msg) from exc

    def leave(self, failed: bool) -> None:
        """Say goodbye: the others wait for member 0 to mark its store closed (bounded).

        Member 0 marks the store closed as it leaves, then lingers (a few seconds at most)
        for the others' goodbyes, so that none of them re-links into the store about to go.
        """
        store = self.store
        if store is None:
            return
        try:
            if self.rank == 0:
                store.set(self.key("closed"), "1")
                end = time.monotonic() + _CLOSE_WAIT_SEC
                while store.add(self.key("bye"), 0) < self.size - 1 and time.monotonic() < end:
                    time.sleep(_POLL_SEC)
            else:
                end = time.monotonic() + (_CLOSE_WAIT_SEC if failed else self.seconds)
                while not store.check([self.key("closed")]) and time.monotonic() < end:
                    time.sleep(_POLL_SEC)
                store.add(self.key("bye"), 1)
        except Exception:  # a peer (or the store's host) is gone: nothing left to tell
            logger.debug("pdist: %s: leaving without goodbye", self.label, exc_info=True)
        finally:
            self.store = None


def _parse_ranks(text: str) -> list[int]:
    """The ranks of a verdict (``"1,2"``); plain data, never code."""
    return [int(r) for r in text.split(",") if r.strip().isdigit()]


@contextlib.contextmanager
def link(
    address: str,
    *,
    rank: int,
    world_size: int,
    backend: str | None = None,
    device: str | torch.device | int | None = None,
    timeout: float | timedelta | None = None,
    name: str | None = None,
) -> Iterator[Group]:
    """Join ``world_size`` members of separate jobs into one Group, outside torch's default group.

    Member 0 hosts a store at ``address``; the others connect to it. Every pdist
    collective and object function, ``barrier``, ``same_node_ranks`` and
    ``broadcast_weights`` take the yielded Group. Its ranks are the link's own
    (``ranks == (0, ..., world_size - 1)``), whatever the members' ranks in their jobs.
    ``torch.distributed.is_initialized()`` and each job's own groups are untouched.

    Exiting the block waits for member 0 to exit its own (up to ``timeout``; 5 s after a
    failure), so that the address is free for the next link as soon as the block ends.

    Args:
        address: ``"host:port"`` where member 0 hosts the store.
        rank: This member's link rank, ``0 <= rank < world_size``.
        world_size: Number of members.
        backend: Backend of the tensor group (``"gloo"``, ``"nccl"``); None: NCCL on CUDA,
            gloo on CPU (``PDIST_BACKEND`` overrides).
        device: The device of this member's tensors; None: the current CUDA device, or CPU.
        timeout: Seconds (or a ``timedelta``) to wait for every member to join, and the
            collectives' timeout; None: ``PDIST_TIMEOUT_SEC`` (default 1800).
        name: What the link is for (the Group's name; default ``"link"``). Links with
            different names may share one address's store only one at a time.

    Yields:
        The link's Group, seen from this member.

    Raises:
        ValueError: A bad ``address``, ``rank`` or ``world_size``.
        PdistError: Some member did not join within ``timeout`` (on every member that
            did, naming the missing link ranks), member 0 could not host the store, or
            this member's ``world_size`` differs from member 0's (on this member, at once).
    """
    host, port = _parse_address(address)
    rank, size = _check_ranks(rank, world_size)
    label = f"link {name or 'link'!r} at {address}"
    index = torch.cuda.current_device() if torch.cuda.is_available() else 0
    resolved, backend_name = _env.device_and_backend(device, backend, index, probe_accelerator())
    seconds = _env.collective_seconds(timeout)
    if resolved.type == "cuda":
        torch.cuda.set_device(resolved)
    join = _Join(label, rank, size, f"{_departures.LINK_PREFIX}{name or 'link'}/", seconds)
    group: Group | None = None
    pgs: list[ProcessGroup] = []
    failed = True
    try:
        join.connect(host, port)
        join.join()
        store: Store | None = join.store
        wait = timedelta(seconds=seconds)
        cpu, device_pg = join.communicators(backend_name, resolved, wait)
        pgs += [cpu] if device_pg is cpu else [cpu, device_pg]
        # Members that leave through an exception say so in the link's store, and the
        # survivors of a failed collective name them (or find them by a roll call).
        group = standalone_group(
            name=name or "link",
            rank=rank,
            size=size,
            device=resolved,
            timeout=wait,
            device_group=device_pg,
            cpu_group=cpu,
            exit_records=(cast("Store", store), f"{join.prefix}exits"),
        )
        try:
            yield group
        except (Exception, SystemExit) as exc:
            _departures.record(group.lifetime, rank, exc)
            raise
        failed = False
    finally:
        if group is not None:
            _departures.stop_listening(group.lifetime)
            group.lifetime.close()  # drops its store: member 0's server goes with the last one
        store = None  # and frees the port
        join.leave(failed)
        for pg in reversed(pgs):
            try:
                _compat.shutdown_group(pg)
            except Exception:  # teardown goes on; the block's own error matters more
                logger.warning("pdist: %s: shutting a communicator down failed", label)
