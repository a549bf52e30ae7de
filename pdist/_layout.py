"""Pure rank arithmetic for the ``dp, sp, tp`` layout (no torch.distributed calls).

Axes go from slowest- to fastest-varying, so tensor-parallel ranks are adjacent:
``rank == (d * sp + s) * tp + t``, and ``dp_sp`` holds the ranks sharing a tp
index. Every group of an axis is an arithmetic progression of ranks, so a
partition is built from ``range`` objects in O(W) time and memory.
"""

from __future__ import annotations

import attrs

__all__ = ["AXES", "GROUP_AXES", "Layout", "consecutive_groups", "make_layout"]

AXES = ("dp", "sp", "tp")  # the mesh axes, slowest- to fastest-varying
GROUP_AXES = (*AXES, "dp_sp")  # every axis a context holds a group for

Ranks = tuple[int, ...]


def _check_size(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        msg = f"{name}={value!r} must be an int"
        raise TypeError(msg)
    if value < 1:
        msg = f"{name}={value!r} must be a positive integer"
        raise ValueError(msg)
    return value


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _check_divides(name: str, value: int, world_size: int) -> None:
    if world_size % value:
        msg = (
            f"{name}={value} does not divide world_size={world_size}; "
            f"choose one of {_divisors(world_size)}"
        )
        raise ValueError(msg)


@attrs.frozen(kw_only=True)
class Layout:
    """Sizes of the three axes over a world; build it with :func:`make_layout`."""

    world_size: int
    dp: int
    sp: int
    tp: int

    def size(self, axis: str) -> int:
        """The size of ``axis`` (``"dp"``, ``"sp"``, ``"tp"`` or ``"dp_sp"``)."""
        if axis not in GROUP_AXES:
            msg = f"axis={axis!r} is not one of {GROUP_AXES}"
            raise ValueError(msg)
        if axis == "dp_sp":
            return self.dp * self.sp
        return int(getattr(self, axis))

    def coords(self, rank: int) -> tuple[int, int, int]:
        """The ``(dp, sp, tp)`` coordinates of ``rank``."""
        if not 0 <= rank < self.world_size:
            msg = f"rank={rank!r} is outside the world of size {self.world_size}"
            raise ValueError(msg)
        rest, t = divmod(rank, self.tp)
        d, s = divmod(rest, self.sp)
        return d, s, t

    def rank_of(self, d: int, s: int, t: int) -> int:
        """The rank at coordinates ``(d, s, t)``."""
        return (d * self.sp + s) * self.tp + t

    def _stride(self, axis: str) -> int:
        return {"tp": 1, "sp": self.tp, "dp": self.sp * self.tp, "dp_sp": self.tp}[axis]

    def group_of(self, axis: str, rank: int) -> Ranks:
        """The ranks of the ``axis`` group that contains ``rank``, in axis order."""
        size = self.size(axis)
        self.coords(rank)  # validates the rank
        stride = self._stride(axis)
        first = rank - rank // stride % size * stride
        return tuple(range(first, first + size * stride, stride))

    def groups(self, axis: str) -> tuple[Ranks, ...]:
        """Every ``axis`` group, ordered by its first rank; together they partition the world."""
        size, stride = self.size(axis), self._stride(axis)
        firsts = (r for r in range(self.world_size) if r // stride % size == 0)
        return tuple(tuple(range(first, first + size * stride, stride)) for first in firsts)


def make_layout(world_size: int, *, tp: int = 1, sp: int = 1) -> Layout:
    """Validate the axis sizes (an error names the valid choices) and infer ``dp``."""
    world_size = _check_size("world_size", world_size)
    tp = _check_size("tp", tp)
    sp = _check_size("sp", sp)
    _check_divides("tp", tp, world_size)
    rest = world_size // tp
    if rest % sp:
        msg = (
            f"sp={sp} does not divide world_size // tp = {rest} "
            f"(world_size={world_size}, tp={tp}); choose one of {_divisors(rest)}"
        )
        raise ValueError(msg)
    return Layout(world_size=world_size, dp=rest // sp, sp=sp, tp=tp)


def consecutive_groups(world_size: int, size: int, *, name: str = "size") -> tuple[Ranks, ...]:
    """Blocks of ``size`` (a positive divisor of ``world_size``) consecutive ranks."""
    _check_divides(name, _check_size(name, size), world_size)
    return tuple(tuple(range(i, i + size)) for i in range(0, world_size, size))
