"""Pure rank arithmetic for the ``dp, sp, tp`` layout (no torch.distributed calls).

Axes go from slowest- to fastest-varying: ``dp, sp, tp``, so tensor-parallel
ranks are adjacent. A rank's coordinates ``(d, s, t)`` satisfy
``rank == (d * sp + s) * tp + t``. With ``tp == 1`` sequence-parallel groups
are consecutive blocks and data-parallel groups are strided by ``sp``.
``dp_sp`` joins the ``dp`` and ``sp`` axes: the ranks sharing a tp index.

Every group of an axis is an arithmetic progression of ranks, so a partition
is built from ``range`` objects in O(W) time and memory, whatever the sizes.
"""

from __future__ import annotations

import attrs

__all__ = ["AXES", "GROUP_AXES", "Layout", "consecutive_groups", "make_layout"]

AXES = ("dp", "sp", "tp")
"""The mesh axes, slowest- to fastest-varying."""

GROUP_AXES = (*AXES, "dp_sp")
"""Every axis a context holds a group for: the mesh axes and the flattened ``dp_sp``."""

Ranks = tuple[int, ...]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _check_size(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        msg = f"{name}={value!r} must be an int"
        raise TypeError(msg)
    if value < 1:
        msg = f"{name}={value!r} must be a positive integer"
        raise ValueError(msg)
    return value


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

    def _progression(self, axis: str, first: int) -> range:
        """The ``axis`` group whose first member is ``first``, as a range of ranks."""
        tp, sp = self.tp, self.sp
        if axis == "tp":
            return range(first, first + tp)
        if axis == "sp":
            return range(first, first + sp * tp, tp)
        if axis == "dp":
            return range(first, self.world_size, sp * tp)
        return range(first, self.world_size, tp)  # dp_sp

    def _first(self, axis: str, rank: int) -> int:
        """The first member of the ``axis`` group holding ``rank``."""
        d, s, t = self.coords(rank)
        if axis == "tp":
            return self.rank_of(d, s, 0)
        if axis == "sp":
            return self.rank_of(d, 0, t)
        if axis == "dp":
            return self.rank_of(0, s, t)
        return t  # dp_sp

    def _firsts(self, axis: str) -> list[int]:
        """The first member of every ``axis`` group, increasing."""
        tp, sp, world = self.tp, self.sp, self.world_size
        if axis == "tp":
            return list(range(0, world, tp))
        if axis == "sp":
            return [block + t for block in range(0, world, sp * tp) for t in range(tp)]
        if axis == "dp":
            return list(range(sp * tp))
        return list(range(tp))  # dp_sp

    def group_of(self, axis: str, rank: int) -> Ranks:
        """The ranks of the ``axis`` group that contains ``rank``, in axis order."""
        self.size(axis)  # validates the axis
        return tuple(self._progression(axis, self._first(axis, rank)))

    def groups(self, axis: str) -> tuple[Ranks, ...]:
        """Every ``axis`` group, ordered by its first rank; together they partition the world."""
        self.size(axis)
        return tuple(tuple(self._progression(axis, first)) for first in self._firsts(axis))


def make_layout(world_size: int, *, tp: int = 1, sp: int = 1) -> Layout:
    """Validate the axis sizes and infer ``dp = world_size // (tp * sp)``.

    Raises:
        TypeError: A size is not an int.
        ValueError: A size is not positive, or does not divide what is left of
            the world; the message names the axis, its value, the world size and
            valid choices.
    """
    world_size = _check_size("world_size", world_size)
    tp = _check_size("tp", tp)
    sp = _check_size("sp", sp)
    if world_size % tp:
        msg = (
            f"tp={tp} does not divide world_size={world_size}; "
            f"choose one of {_divisors(world_size)}"
        )
        raise ValueError(msg)
    rest = world_size // tp
    if rest % sp:
        msg = (
            f"sp={sp} does not divide world_size // tp = {rest} "
            f"(world_size={world_size}, tp={tp}); choose one of {_divisors(rest)}"
        )
        raise ValueError(msg)
    return Layout(world_size=world_size, dp=rest // sp, sp=sp, tp=tp)


def consecutive_groups(world_size: int, size: int, *, name: str = "size") -> tuple[Ranks, ...]:
    """Blocks of ``size`` consecutive ranks covering the world.

    Raises:
        ValueError: ``size`` is not a positive divisor of ``world_size``.
    """
    size = _check_size(name, size)
    if world_size % size:
        msg = (
            f"{name}={size} does not divide world_size={world_size}; "
            f"choose one of {_divisors(world_size)}"
        )
        raise ValueError(msg)
    return tuple(tuple(range(i, i + size)) for i in range(0, world_size, size))
