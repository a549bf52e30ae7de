"""Which ranks share a host (O(W) host records, verified through shared memory) and CPU affinity.

Host detection gathers one fixed-size record per rank (the kernel's boot id, the
device and inode of ``/dev/shm``, the hostname and a probe name). Ranks with equal
``(boot id, /dev/shm device, inode)`` see the same tmpfs, which is what sharing memory
on one host means (containers with private ``/dev/shm`` mounts differ in the device).
That is verified among the candidates only: every rank creates a probe segment, opens
those of its same-host candidates, and one small all-reduce agrees on the verdict.
Three collectives of fixed size per rank, no W x W structure anywhere.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import struct
import tempfile
import uuid
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from . import _agree
from ._compat import all_gather_into
from ._errors import PdistError
from ._group import DistContext, Group, as_group

__all__ = [
    "RECORD_BYTES",
    "apply_gpu_affinity",
    "gpu_cpu_affinity",
    "host_blocks",
    "node_partition",
    "nvml_handle",
    "same_node_ranks",
    "set_cpu_affinity",
    "shm_dir",
]

logger = logging.getLogger("pdist")

# magic, version, status, /dev/shm device, /dev/shm inode, boot id, hostname, probe name
_RECORD = struct.Struct("<4sHHQQ36s64s32s4x")
RECORD_BYTES = _RECORD.size

_MAGIC = b"PDHR"
_VERSION = 1
_OK, _NO_SHM = 0, 1
_PROBE_PREFIX = "pdist-probe-"


def shm_dir() -> str:
    """The directory two ranks on one host share: ``/dev/shm`` (one per mount namespace)."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def _boot_id() -> bytes:
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            return f.read().strip()[:36]
    except OSError:
        return b""


def _my_record(probe: str) -> bytes:
    try:
        st = os.stat(shm_dir())
        status, dev, ino = _OK, st.st_dev, st.st_ino
    except OSError:
        status, dev, ino = _NO_SHM, 0, 0
    host = socket.gethostname().encode(errors="replace")[:64]
    return _RECORD.pack(_MAGIC, _VERSION, status, dev, ino, _boot_id(), host, probe.encode())


def _gather_records(group: Group, mine: bytes) -> bytes:
    """Every member's record, rank-major."""
    if group.world_size == 1:
        return mine
    out = torch.empty(group.world_size * RECORD_BYTES, dtype=torch.uint8)
    all_gather_into(out, torch.frombuffer(bytearray(mine), dtype=torch.uint8), group.cpu_group)
    return bytes(out.tolist())  # not .numpy(): pdist does not need numpy (38 ms at 8192 ranks)


def _parse_cpu_list(group: Group, data: bytes) -> list[tuple[bytes, str, str]]:
    """Per member: ``(host key, hostname, probe name)``; the same verdict on every rank."""
    out = []
    for i, (magic, version, status, dev, ino, boot, host, probe) in enumerate(
        _RECORD.iter_unpack(data)
    ):
        rank = group.ranks[i]
        if magic != _MAGIC or version != _VERSION:
            msg = (
                f"host detection on group {group.name!r}: rank {rank} sent a malformed record "
                "(the communicator is broken, or ranks run different pdist versions)"
            )
            raise PdistError(msg)
        hostname = host.rstrip(b"\0").decode(errors="replace")
        if status != _OK:
            msg = (
                f"host detection on group {group.name!r}: rank {rank} on host {hostname!r} "
                f"cannot stat its shared-memory directory; check that /dev/shm is mounted"
            )
            raise PdistError(msg)
        boot = boot.rstrip(b"\0") or host  # no boot id (not Linux): the hostname
        key = struct.pack("<QQ", dev, ino) + boot
        out.append((key, hostname, probe.rstrip(b"\0").decode(errors="replace")))
    return out


def _probe_matches(name: str) -> bool:
    path = os.path.join(shm_dir(), _PROBE_PREFIX + name)
    try:
        with open(path, "rb") as f:
            return f.read(64) == name.encode()
    except OSError:
        return False


def host_blocks(group: Group) -> list[tuple[int, ...]]:
    """The members of ``group`` by host, as blocks of global ranks ordered by first rank.

    All ranks of the group must call it; all get the same blocks, or the same PdistError.
    """
    probe = uuid.uuid4().hex
    records = _parse_cpu_list(group, _gather_records(group, _my_record(probe)))
    mine = records[group.rank_in_group][0]
    candidates = {p for key, _, p in records if key == mine and p != probe}
    path = os.path.join(shm_dir(), _PROBE_PREFIX + probe)
    created = False
    try:
        error = None
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
            created = True
            with os.fdopen(fd, "wb") as f:
                f.write(probe.encode())
        except OSError as exc:
            error = exc
        bad = _agree.first_failing(group, error is not None)  # doubles as "every probe exists"
        if bad is not None:
            msg = (
                f"host detection on group {group.name!r}: rank {group.ranks[bad]} could not "
                f"create its probe in {shm_dir()} (full, read-only or not permitted?)"
                + (f": {error}" if bad == group.rank_in_group and error is not None else "")
            )
            raise PdistError(msg)
        unreadable = [p for p in candidates if not _probe_matches(p)]
        bad = _agree.first_failing(group, bool(unreadable))
        if bad is not None:
            msg = (
                f"host detection on group {group.name!r}: rank {group.ranks[bad]} shares a "
                f"boot id and {shm_dir()} with other ranks but cannot open their probe "
                "segments; check that the ranks of a host run as one user with one /dev/shm"
            )
            raise PdistError(msg)
    finally:
        if created:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
    blocks: dict[bytes, list[int]] = {}
    for rank, (key, _, _) in zip(group.ranks, records, strict=True):
        blocks.setdefault(key, []).append(rank)
    return [tuple(b) for b in blocks.values()]


def same_node_ranks(group: Group | DistContext, source_rank: int = 0) -> list[int]:
    """Global ranks of ``group`` that share a host with member ``source_rank`` (group-relative).

    Found through shared memory, not hostnames or environment variables.

    Note:
        All ranks of the group must call it; all get the same list.

    Args:
        group: The group (a context means its world).
        source_rank: Group index of the member whose host is asked for (an index into
            ``group.ranks``, not a global rank).

    Raises:
        ValueError: ``source_rank`` is outside the group.
        PdistError: On every rank, when host detection fails (a rank cannot use ``/dev/shm``,
            or ranks that report one host cannot open each other's probe).
    """
    g = as_group(group)
    wanted = g.global_rank(source_rank, name="source_rank")
    return next(list(block) for block in host_blocks(g) if wanted in block)


def node_partition(group: Group) -> list[tuple[int, ...]]:
    """The hosts of ``group`` as blocks of global ranks, checked to hold equal numbers of ranks."""
    partition = host_blocks(group)
    sizes = {len(block) for block in partition}
    if len(sizes) > 1:
        shown = partition if len(partition) <= 8 else [*partition[:8], "..."]
        msg = (
            f"hosts hold different numbers of ranks: {shown}; launch the same number of "
            "processes on every host"
        )
        raise PdistError(msg)
    return partition


def _nvml_device_id(device_index: int, environ: Mapping[str, str]) -> int | str:
    """The NVML index (int) or UUID (str) of torch's CUDA device ``device_index``."""
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None or not visible.strip():
        return device_index
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    if device_index >= len(entries):
        msg = (
            f"device_index={device_index} is beyond CUDA_VISIBLE_DEVICES={visible!r} "
            f"({len(entries)} device(s))"
        )
        raise ValueError(msg)
    entry = entries[device_index]
    return int(entry) if entry.isdigit() else entry


def _cpus_from_masks(masks: Iterable[int]) -> frozenset[int]:
    return frozenset(
        word * 64 + bit for word, mask in enumerate(masks) for bit in range(64) if mask >> bit & 1
    )


@contextlib.contextmanager
def nvml_handle(device_index: int) -> Iterator[tuple[Any, Any]]:
    """``(pynvml, handle)`` of torch's CUDA device ``device_index``, NVML initialized meanwhile."""
    try:
        import pynvml
    except ImportError as exc:
        msg = "NVML needs the nvidia-ml-py package (module pynvml)"
        raise PdistError(msg) from exc
    ident = _nvml_device_id(device_index, os.environ)
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # pynvml raises its own NVMLError types
        msg = f"NVML could not be initialized ({exc}); is an NVIDIA driver installed?"
        raise PdistError(msg) from exc
    try:
        try:
            if isinstance(ident, int):
                handle = pynvml.nvmlDeviceGetHandleByIndex(ident)
            else:
                handle = pynvml.nvmlDeviceGetHandleByUUID(ident)
        except Exception as exc:
            msg = f"NVML does not know CUDA device {device_index} ({ident!r}): {exc}"
            raise PdistError(msg) from exc
        yield pynvml, handle
    finally:
        pynvml.nvmlShutdown()


def gpu_cpu_affinity(device_index: int) -> frozenset[int]:
    """The CPUs NVML reports as close to torch's CUDA device ``device_index``.

    The index is mapped through ``CUDA_VISIBLE_DEVICES`` (indices or UUIDs).

    Raises:
        ValueError: ``device_index`` is beyond ``CUDA_VISIBLE_DEVICES``.
        PdistError: NVML is not available or does not know the device.
    """
    with nvml_handle(device_index) as (pynvml, handle):
        try:
            words = ((os.cpu_count() or 64) + 63) // 64
            masks = pynvml.nvmlDeviceGetCpuAffinity(handle, words)
        except Exception as exc:
            msg = f"NVML has no CPU affinity for CUDA device {device_index}: {exc}"
            raise PdistError(msg) from exc
        return _cpus_from_masks(int(m) for m in masks)


def set_cpu_affinity(cpus: Iterable[int]) -> frozenset[int]:
    """Pin this process to ``cpus``, restricted to the CPUs it is allowed to use.

    When none of ``cpus`` is allowed it logs a warning and keeps the current set.

    Returns:
        The CPUs the process is pinned to afterwards.

    Raises:
        TypeError: ``cpus`` holds something that is not an int.
    """
    requested = frozenset(cpus)
    for cpu in requested:
        if isinstance(cpu, bool) or not isinstance(cpu, int):
            msg = f"cpus holds {cpu!r}; CPU indices are ints"
            raise TypeError(msg)
    allowed = frozenset(os.sched_getaffinity(0))
    wanted = requested & allowed
    if not wanted:
        msg = (
            "pdist: none of the CPUs %s is allowed for this process (allowed: %s); "
            "keeping the current affinity"
        )
        logger.warning(msg, sorted(requested), sorted(allowed))
        return allowed
    os.sched_setaffinity(0, wanted)
    return wanted


def apply_gpu_affinity(device: torch.device) -> frozenset[int] | None:
    """Pin to the CPUs near ``device``; returns the affinity before (None: nothing changed)."""
    if device.type != "cuda" or device.index is None:
        return None
    try:
        cpus = gpu_cpu_affinity(device.index)
        before = frozenset(os.sched_getaffinity(0))
        # The kernel may refuse the set (offline CPUs, a cpuset); this rank alone would
        # then fail after the others entered the block, so it is a warning like NVML's.
        set_cpu_affinity(cpus)
    except (PdistError, ValueError, OSError) as exc:
        msg = (
            "pdist: not pinning CPU affinity for %s: %s (pass cpu_affinity=False to "
            "distributed() to skip this)"
        )
        logger.warning(msg, device, exc)
        return None
    return before
