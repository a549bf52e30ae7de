"""Pure rank arithmetic for the ``dp, sp, tp`` layout (no torch.distributed calls).

Axes go from slowest- to fastest-varying: ``dp, sp, tp``, so tensor-parallel
ranks are adjacent. A rank's coordinates ``(d, s, t)`` satisfy
``rank == (d * sp + s) * tp + t``. With ``tp == 1`` sequence-parallel groups
are consecutive blocks and data-parallel groups are strided by ``sp``.
"""

from __future__ import annotations

import attrs

__all__ = ["AXES", "Layout", "consecutive_groups", "make_layout"]

AXES = ("dp", "sp", "tp")

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
        """The size of ``axis`` (``"dp"``, ``"sp"`` or ``"tp"``)."""
        if axis not in AXES:
            msg = f"axis={axis!r} is not one of {AXES}"
            raise ValueError(msg)
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

    def group_of(self, axis: str, rank: int) -> Ranks:
        """The ranks of the ``axis`` group that contains ``rank``, in axis order."""
        coords = list(self.coords(rank))
        index = AXES.index(axis)
        members = []
        for i in range(self.size(axis)):
            coords[index] = i
            members.append(self.rank_of(*coords))
        return tuple(members)

    def groups(self, axis: str) -> tuple[Ranks, ...]:
        """Every ``axis`` group, ordered by its first rank; together they partition the world."""
        seen: dict[Ranks, None] = {}
        for rank in range(self.world_size):
            seen.setdefault(self.group_of(axis, rank), None)
        return tuple(seen)


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
