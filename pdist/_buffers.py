"""Staging memory: every buffer pdist sends from or receives into, and tensors as bytes.

All come from ``allocate``, so that a failed allocation is one kind of
failure everywhere (a [`PdistError`][pdist.PdistError]), and tests can make one fail.
"""

from __future__ import annotations

import ctypes
import mmap
from collections.abc import Sequence

import torch

from . import _seams
from ._errors import PdistError

__all__ = [
    "ALIGN",
    "aligned",
    "allocate",
    "bytes_of",
    "filled",
    "offsets",
    "resolved",
    "slab",
    "tensor_bytes",
]

ALIGN = 64  # byte alignment of the parts of a slab, so that every dtype can view its slice
_CPU = torch.device("cpu")
_HUGE_MIN_BYTES = 32 << 20  # glibc's largest mapping threshold
_HUGE_PAGES = hasattr(mmap, "MADV_HUGEPAGE")


def aligned(n: int) -> int:
    """``n`` rounded up to a multiple of ``ALIGN``."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


def offsets(sizes: Sequence[int]) -> tuple[list[int], int]:
    """Byte offsets of consecutive parts of ``sizes`` bytes (each aligned), and the total."""
    out, total = [], 0
    for n in sizes:
        out.append(total)
        total = aligned(total + n)
    return out, total


def allocate(nbytes: int, device: torch.device = _CPU, *, what: str = "data") -> torch.Tensor:
    """A fresh uninitialized uint8 buffer of ``nbytes`` on ``device``, or a ``PdistError``.

    Large CPU ones are backed by transparent huge pages: glibc maps large blocks fresh, and
    their first write faults per 4 KiB page (as costly as the transfer, ``pdist bench``).
    Never memory pdist wrote before: a result may view it for as long as it lives.
    """
    try:
        _seams.allocating(nbytes)
        if device.type != "cpu" or nbytes < _HUGE_MIN_BYTES or not _HUGE_PAGES:
            return torch.empty(nbytes, dtype=torch.uint8, device=device)
        region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        region.madvise(mmap.MADV_HUGEPAGE)
        return torch.frombuffer(region, dtype=torch.uint8)  # the tensor keeps it alive
    except Exception as exc:  # RuntimeError (out of memory), OverflowError, OSError (mmap)
        msg = (
            f"could not allocate {nbytes} bytes on {device} for {what} ({type(exc).__name__}: "
            f"{str(exc)[:200]}); free memory or send less in one call"
        )
        raise PdistError(msg) from exc


def slab(
    sizes: Sequence[int], device: torch.device, *, what: str
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One allocation (``allocate``), and buffers of ``sizes`` bytes carved from it."""
    starts, total = offsets(sizes)
    whole = allocate(total, device, what=what)
    return whole, [whole[o : o + n] for o, n in zip(starts, sizes, strict=True)]


def filled(
    data: bytes | bytearray | memoryview, size: int = 0, *, what: str | None
) -> torch.Tensor:
    """``data`` in a uint8 CPU tensor of ``size`` bytes or more (``what=None``: not allocated)."""
    n = len(data)
    total = max(n, size)
    if what is None:  # one copy into fresh zeros
        return torch.frombuffer(bytearray(bytes(data).ljust(total, b"\0")), dtype=torch.uint8)
    out = allocate(total, what=what)
    if n:
        ctypes.memmove(out.data_ptr(), bytes(data), n)
    out[n:].zero_()  # the padding goes on the wire: never this process's stale memory
    return out


def bytes_of(t: torch.Tensor, n: int | None = None, offset: int = 0) -> bytes:
    """``n`` bytes (default: all) of a contiguous CPU tensor, from byte ``offset``."""
    count = t.numel() * t.element_size() - offset if n is None else n
    if count <= 0:
        return b""
    return ctypes.string_at(t.data_ptr() + offset, count)


def resolved(t: torch.Tensor) -> torch.Tensor:
    """``t`` detached, a pending conjugation or negation applied: such views have no bytes."""
    flat = t.detach()
    if flat.is_conj():
        flat = flat.resolve_conj()
    if flat.is_neg():
        flat = flat.resolve_neg()
    return flat


def tensor_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s data as a flat contiguous uint8 tensor on its own device (a view when possible)."""
    flat = resolved(t)
    flat = flat.view(-1) if flat.is_contiguous() else flat.contiguous().view(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)
