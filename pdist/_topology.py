"""Which ranks share a host (a shared-memory probe) and NVML CPU affinity."""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import uuid
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from ._context import DistContext, Group, as_group
from ._errors import PdistError

__all__ = [
    "apply_gpu_affinity",
    "gpu_cpu_affinity",
    "node_partition",
    "nvml_handle",
    "same_host_matrix",
    "same_node_ranks",
    "set_cpu_affinity",
]

logger = logging.getLogger("pdist")

_NAME_BYTES = 128


def _shm_dir() -> str:
    # /dev/shm is per host (per mount namespace); it is what two ranks on one host share.
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def _segment_readable(name: str) -> bool:
    path = os.path.join(_shm_dir(), name.split(":")[0])
    token = name.split(":")[1] if ":" in name else ""
    try:
        with open(path, "rb") as f:
            return f.read().decode() == token
    except OSError:
        return False


def same_host_matrix(group: Group) -> list[list[bool]]:
    """``m[i][j]``: whether group member ``i`` could open member ``j``'s shared-memory segment.

    Every member creates a small segment holding a random token, the names
    are all-gathered, each member opens every other's, and the rows are
    all-gathered: two collectives of fixed size on the CPU group. Each
    segment is unlinked before returning, also when a collective fails.

    .. note:: All ranks of the group must call it.
    """
    n = group.world_size
    name = f"pdist-probe-{uuid.uuid4().hex}"
    token = uuid.uuid4().hex
    path = os.path.join(_shm_dir(), name)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(token.encode())
        if n == 1:
            return [[True]]
        label = f"{name}:{token}".encode().ljust(_NAME_BYTES)
        mine = torch.frombuffer(bytearray(label), dtype=torch.uint8)
        names = [torch.empty(_NAME_BYTES, dtype=torch.uint8) for _ in range(n)]
        dist.all_gather(names, mine, group=group.cpu_group)
        labels = [bytes(t.tolist()).decode().strip() for t in names]
        row = torch.tensor(
            [j == group.rank_in_group or _segment_readable(labels[j]) for j in range(n)],
            dtype=torch.uint8,
        )
        rows = [torch.empty(n, dtype=torch.uint8) for _ in range(n)]
        # Doubles as the barrier after which no member opens our segment any more.
        dist.all_gather(rows, row, group=group.cpu_group)
        return [[bool(v) for v in r.tolist()] for r in rows]
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def same_node_ranks(group: Group | DistContext, source_rank: int = 0) -> list[int]:
    """Global ranks of ``group`` that share a host with member ``source_rank`` (group-relative).

    Found through shared memory, not hostnames: a rank that cannot open the
    source's segment counts as another host.

    .. note:: All ranks of the group must call it; all get the same list.

    Raises:
        ValueError: ``source_rank`` is outside the group.
    """
    g = as_group(group)
    g.global_rank(source_rank, name="source_rank")
    matrix = same_host_matrix(g)
    return [g.ranks[i] for i in range(g.world_size) if matrix[i][source_rank]]


def node_partition(group: Group) -> list[tuple[int, ...]]:
    """The hosts of ``group`` as blocks of global ranks, checked to be uniform.

    Raises:
        PdistError: On every rank, when hosts hold different numbers of ranks
            or the probe saw an inconsistent picture.
    """
    matrix = same_host_matrix(group)
    blocks: dict[tuple[int, ...], None] = {}
    for i in range(group.world_size):
        members = tuple(
            group.ranks[j] for j in range(group.world_size) if matrix[i][j] and matrix[j][i]
        )
        blocks.setdefault(members, None)
    partition = list(blocks)
    seen = sorted(r for block in partition for r in block)
    if seen != sorted(group.ranks):
        msg = f"the shared-memory probe gave overlapping hosts {partition}; check /dev/shm"
        raise PdistError(msg)
    sizes = {len(block) for block in partition}
    if len(sizes) > 1:
        msg = (
            f"hosts hold different numbers of ranks: {partition}; launch the same number of "
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


def _cpus_from_masks(masks: Iterable[int], bits: int = 64) -> frozenset[int]:
    return frozenset(
        word * bits + bit
        for word, mask in enumerate(masks)
        for bit in range(bits)
        if mask >> bit & 1
    )


@contextlib.contextmanager
def nvml_handle(device_index: int) -> Iterator[tuple[Any, Any]]:
    """``(pynvml, handle)`` of torch's CUDA device ``device_index``, NVML initialized meanwhile.

    The index is mapped through ``CUDA_VISIBLE_DEVICES`` (indices or UUIDs).

    Raises:
        ValueError: ``device_index`` is beyond ``CUDA_VISIBLE_DEVICES``.
        PdistError: NVML is not available or does not know the device.
    """
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

    The index is mapped through ``CUDA_VISIBLE_DEVICES`` (indices or UUIDs) to
    the physical device.

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
    """
    allowed = frozenset(os.sched_getaffinity(0))
    wanted = frozenset(cpus) & allowed
    if not wanted:
        logger.warning(
            "pdist: none of the CPUs %s is allowed for this process (allowed: %s); "
            "keeping the current affinity",
            sorted(frozenset(cpus)),
            sorted(allowed),
        )
        return allowed
    os.sched_setaffinity(0, wanted)
    return wanted


def apply_gpu_affinity(device: torch.device) -> None:
    """Pin to the CPUs near ``device`` when NVML can tell; otherwise a debug log."""
    if device.type != "cuda" or device.index is None:
        return
    try:
        cpus = gpu_cpu_affinity(device.index)
    except (PdistError, ValueError) as exc:
        logger.debug("pdist: skipping CPU affinity for %s: %s", device, exc)
        return
    set_cpu_affinity(cpus)
