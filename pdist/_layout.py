"""Pure rank arithmetic for any parallel layout (no torch.distributed calls).

A layout is an ordered list of axes, slowest- to fastest-varying, whose sizes multiply
to the world size: ``rank = sum(coord[a] * stride[a])`` with the last axis's stride 1.
In the keyword form tp is fastest: its ranks are adjacent, so they share the fastest links.

Every group is "the ranks sharing every coordinate but those of some axes" (a
*flattening*: one axis, ``dp_sp``, [`pdist.flatten`][pdist.flatten]), or an expert group (``ep``,
``edp``: blocks of consecutive ranks within a pipeline stage). A partition into such
groups is built from two sorted offset lists in O(W) time and memory, never W x W.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping, Sequence

import attrs

__all__ = [
    "CANONICAL",
    "CONTEXT_GROUPS",
    "DERIVED",
    "EXPERT",
    "GROUPS",
    "KEYWORDS",
    "GroupSpec",
    "Layout",
    "consecutive_groups",
    "make_axes_layout",
    "make_layout",
]


@attrs.frozen
class GroupSpec:
    """One group every context holds: a canonical axis of the keyword form, or a derived group.

    Attributes:
        name: The ``DistContext`` field (a derived group's name is one ``axes=`` refuses).
        kind: ``"axis"``: a canonical axis, at its position (slowest first); ``"flat"``: the
            ranks sharing every coordinate but those of ``flattens``; ``"expert"``: ``ep``
            blocks of a pipeline stage, or the ranks at one place in them; ``"world"``;
            ``"node"``: the ranks of one host (found at start-up, not by arithmetic).
        keyword: A ``distributed()`` keyword sets its size (the axis without one is the rest).
        always: In every keyword layout, size 1 allowed; otherwise only when > 1.
        flattens: The axes a ``"flat"`` group varies.
    """

    name: str
    kind: str
    keyword: bool = False
    always: bool = False
    flattens: tuple[str, ...] = ()


# The one place an axis is declared: the context's fields (in this order), the keyword form
# of distributed(), the groups built at start-up, device_mesh and the stall watch read it.
GROUPS = (
    GroupSpec("world", "world"),
    GroupSpec("node", "node"),
    GroupSpec("pp", "axis", keyword=True),
    GroupSpec("dp", "axis", always=True),
    GroupSpec("cp", "axis", keyword=True),
    GroupSpec("sp", "axis", keyword=True, always=True),
    GroupSpec("tp", "axis", keyword=True, always=True),
    # data-parallel gradients average over it
    GroupSpec("dp_sp", "flat", flattens=("dp", "cp", "sp")),
    GroupSpec("ep", "expert"),
    GroupSpec("edp", "expert"),
)
_SPECS = {spec.name: spec for spec in GROUPS}
CONTEXT_GROUPS = tuple(_SPECS)  # the groups every context holds as fields
CANONICAL = tuple(s.name for s in GROUPS if s.kind == "axis")  # the keyword form, slowest first
KEYWORDS = tuple(s.name for s in reversed(GROUPS) if s.keyword)  # fastest first: tp, sp, cp, pp
_INFERRED = next(s.name for s in GROUPS if s.kind == "axis" and not s.keyword)  # dp
EXPERT = tuple(s.name for s in GROUPS if s.kind == "expert")
DERIVED = tuple(s.name for s in GROUPS if s.kind != "axis")  # names a user-named axis may not take
_BUILT = tuple(s.name for s in GROUPS if s.kind in ("flat", "expert"))  # after the axes

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
    """The axes of a world, slowest first; build it with ``make_layout``.

    Attributes:
        world_size: The number of ranks.
        axes: ``(name, size)`` pairs, slowest- to fastest-varying.
        ep: The expert-parallel size (blocks of ``ep`` consecutive ranks of a stage).
        inferred: The axis whose size was inferred (``"dp"`` in the keyword form).
        keyword: Whether the keyword form (``tp=``, ``sp=``, ...) made it, not ``axes=``.
    """

    world_size: int
    axes: tuple[tuple[str, int], ...]
    ep: int = 1
    inferred: str | None = None
    keyword: bool = False

    @property
    def names(self) -> tuple[str, ...]:
        """The axis names, slowest first."""
        return tuple(name for name, _ in self.axes)

    def axis_size(self, name: str) -> int:
        """The size of layout axis ``name``, 1 where the layout lacks it."""
        return dict(self.axes).get(name, 1)

    def __getattr__(self, name: str) -> int:
        """``layout.tp`` and the like: a canonical axis's size, 1 where the layout lacks it."""
        if name in CANONICAL:
            return self.axis_size(name)
        raise AttributeError(name)

    @property
    def group_names(self) -> tuple[str, ...]:
        """Every group a context holds but ``world`` and ``node``: the axes, then the rest."""
        absent = tuple(a for a in CANONICAL if a not in self.names)
        return (*self.names, *absent, *_BUILT)

    @property
    def context_groups(self) -> tuple[str, ...]:
        """Every group a context holds: ``world``, ``node``, then ``group_names``."""
        return (*(s.name for s in GROUPS if s.kind in ("world", "node")), *self.group_names)

    def describe(self) -> str:
        """The layout as its arguments were (what all ranks must agree on)."""
        shown = [a for a in KEYWORDS if _SPECS[a].always or self.axis_size(a) > 1]
        sizes = [f"{a}={self.axis_size(a)}" for a in shown]
        sizes = sizes if self.keyword else [f"axes={dict(self.axes)!r}"]
        return ", ".join(sizes + ([f"ep={self.ep}"] if self.ep > 1 else []))

    def _strides(self) -> dict[str, int]:
        strides, stride = {}, 1
        for name, size in reversed(self.axes):
            strides[name] = stride
            stride *= size
        return strides

    def flattened(self, axis: str) -> tuple[str, ...]:
        """The layout axes a group kind varies: an axis itself, ``dp_sp``'s, none when absent."""
        kind = _SPECS[axis].kind if axis in _SPECS else None
        if kind == "flat":
            return tuple(a for a in self.names if a in _SPECS[axis].flattens)
        if kind == "world":
            return self.names
        if axis in self.names:
            return (axis,)
        if kind == "axis":
            return ()  # a canonical axis the layout lacks: one-rank groups
        msg = f"axis={axis!r} is not one of {self.group_names}"
        raise ValueError(msg)

    def size(self, axis: str) -> int:
        """The size of the groups of ``axis`` (a layout axis, a canonical one, or derived)."""
        if axis == "ep":
            return self.ep
        if axis == "edp":
            return self.world_size // self.axis_size("pp") // self.ep
        return math.prod(self.axis_size(a) for a in self.flattened(axis))

    def coords(self, rank: int) -> tuple[int, ...]:
        """The coordinates of ``rank``, one per axis, slowest first."""
        if not 0 <= rank < self.world_size:
            msg = f"rank={rank!r} is outside the world of size {self.world_size}"
            raise ValueError(msg)
        out = []
        for _, size in reversed(self.axes):
            rank, c = divmod(rank, size)
            out.append(c)
        return tuple(reversed(out))

    def rank_of(self, *coords: int) -> int:
        """The rank at ``coords`` (one per axis, slowest first)."""
        rank = 0
        for (_, size), c in zip(self.axes, coords, strict=True):
            rank = rank * size + c
        return rank

    def _base(self, rank: int, varied: Iterable[str]) -> int:
        """The rank with ``rank``'s coordinates, but 0 on the ``varied`` axes."""
        strides, varied = self._strides(), set(varied)
        coords = zip(self.names, self.coords(rank), strict=True)
        return rank - sum(c * strides[a] for a, c in coords if a in varied)

    def _offsets(self, varied: Iterable[str]) -> list[int]:
        """Sorted rank offsets spanned by the ``varied`` axes from a rank with their coords 0."""
        strides, sizes, varied = self._strides(), dict(self.axes), set(varied)
        chosen = [a for a in self.names if a in varied]
        spans = [range(0, sizes[a] * strides[a], strides[a]) for a in chosen]
        return sorted(sum(combo) for combo in itertools.product(*spans))

    def _flat_groups(self, varied: Sequence[str]) -> tuple[Ranks, ...]:
        offsets = self._offsets(varied)
        bases = self._offsets(a for a in self.names if a not in varied)
        return tuple(tuple(b + o for o in offsets) for b in bases)

    def _expert_groups(self, axis: str) -> tuple[Ranks, ...]:
        ep = self.ep
        stages = self._flat_groups(self._stage_axes())
        if axis == "ep":
            found = [stage[i : i + ep] for stage in stages for i in range(0, len(stage), ep)]
        else:
            found = [stage[j::ep] for stage in stages for j in range(ep)]
        return tuple(sorted(found))

    def groups(self, axis: str) -> tuple[Ranks, ...]:
        """Every ``axis`` group, ordered by its first rank; together they partition the world.

        Each group lists its ranks in increasing order (torch's order for a group).
        """
        if axis in EXPERT:
            return self._expert_groups(axis)
        return self._flat_groups(self.flattened(axis))

    def flatten_names(self, axes: tuple[object, ...]) -> tuple[str, ...]:
        """``axes`` in layout order; TypeError/ValueError: none, a non-str, unknown, repeated."""
        if not axes:
            first = self.names[0]
            msg = f"flatten() names no axis; pass axes of the layout, e.g. flatten(ctx, {first!r})"
            raise ValueError(msg)
        for axis in axes:
            if not isinstance(axis, str):
                msg = f"axes={axes!r}: {axis!r} is not an axis name (a str)"
                raise TypeError(msg)
            if axis not in self.names:
                msg = f"axes={axes!r}: {axis!r} is not an axis of the layout; "
                msg += f"choose from {self.names}"
                raise ValueError(msg)
        if len(set(axes)) != len(axes):
            msg = f"axes={axes!r} names an axis twice"
            raise ValueError(msg)
        return tuple(a for a in self.names if a in axes)

    def flatten(self, axes: Sequence[str]) -> tuple[Ranks, ...]:
        """The partition into the ranks sharing every coordinate but those of ``axes``."""
        return self._flat_groups(self.flatten_names(tuple(axes)))

    def _stage_axes(self) -> list[str]:
        """The axes of one pipeline stage: all but ``pp``."""
        return [a for a in self.names if a != "pp"]

    def group_of(self, axis: str, rank: int) -> Ranks:
        """The ranks of the ``axis`` group that contains ``rank``, in increasing order."""
        self.coords(rank)  # a rank outside the world raises
        return next(group for group in self.groups(axis) if rank in group)

    def mesh_names(self, axes: object) -> tuple[str, ...]:
        """``device_mesh``'s ``axes`` checked against the layout: None means every axis.

        Raises:
            TypeError: ``axes`` is not None or a non-empty tuple.
            ValueError: An unknown or repeated name, ``dp_sp`` beside an axis it holds,
                an expert group beside a dense axis, or names out of order.
        """
        if axes is None:
            return self.names
        if isinstance(axes, str) or not isinstance(axes, tuple) or not axes:
            msg = f"axes={axes!r} must be None or a non-empty tuple of axis names such as ('dp',)"
            raise TypeError(msg)
        valid = (*self.names, *_BUILT)  # not the one-rank groups of absent axes
        for axis in axes:
            if axis not in valid:
                msg = f"axes={axes!r}: {axis!r} is not one of {valid}"
                raise ValueError(msg)
        if len(set(axes)) != len(axes):
            msg = f"axes={axes!r} names an axis twice"
            raise ValueError(msg)
        if any(a in EXPERT for a in axes):
            order = ("pp", "edp", "ep")
            if not set(axes) <= set(order) or list(axes) != [a for a in order if a in axes]:
                msg = (
                    f"axes={axes!r}: the expert groups make a mesh with each other and pp only, "
                    f"in the order {order}, e.g. ('edp', 'ep') for FSDP2's expert weights"
                )
                raise ValueError(msg)
            return axes
        for flat in (s for s in GROUPS if s.kind == "flat" and s.name in axes):
            held = self.flattened(flat.name)
            if len(axes) > 1 and set(axes) & {*held, *flat.flattens}:
                holds = " and ".join(map(repr, held or flat.flattens))
                msg = (
                    f"axes={axes!r}: {flat.name!r} already holds {holds}; "
                    f"use ({flat.name!r}, ...) alone"
                )
                raise ValueError(msg)
        firsts = [self.names.index(self.flattened(a)[0]) for a in axes if self.flattened(a)]
        if firsts != sorted(firsts):
            msg = (
                f"axes={axes!r} must go from slowest to fastest axis: "
                f"{', '.join(self.names)} (dp_sp where its axes are)"
            )
            raise ValueError(msg)
        return axes

    def mesh(self, names: Sequence[str], rank: int) -> tuple[tuple[int, ...], Ranks]:
        """The caller's sub-mesh over the group kinds ``names``: its shape and ranks, row-major.

        ``names`` passed ``mesh_names``. Along each dim lie the caller's group of that
        kind; the caller's other coordinates stay fixed.
        """
        if any(n in EXPERT for n in names):
            return self._expert_mesh(names, rank)
        base = self._base(rank, {a for n in names for a in self.flattened(n)})
        dims = [self._offsets(self.flattened(n)) for n in names]
        ranks = tuple(base + sum(combo) for combo in itertools.product(*dims))
        return tuple(len(d) for d in dims), ranks

    def _expert_mesh(self, names: Sequence[str], rank: int) -> tuple[tuple[int, ...], Ranks]:
        stages = self._flat_groups(self._stage_axes())  # ordered by pp coordinate
        p = next(q for q, stage in enumerate(stages) if rank in stage)
        i = stages[p].index(rank)
        here = {"pp": p, "edp": i // self.ep, "ep": i % self.ep}
        spans = {n: range(self.size(n)) if n in names else (c,) for n, c in here.items()}
        ranks = tuple(
            stages[q][j * self.ep + e]
            for q, j, e in itertools.product(spans["pp"], spans["edp"], spans["ep"])
        )
        return tuple(self.size(n) for n in names), ranks


def _keyword_axes(world_size: int, sizes: Mapping[str, int]) -> list[tuple[str, int]]:
    """Check the keyword sizes fastest first (each names the valid choices); dp is the rest."""
    rest, done = world_size, list[tuple[str, int]]()
    for name in KEYWORDS:
        value = sizes[name]
        if not done:
            _check_divides(name, value, world_size)
        elif rest % value:
            over = " * ".join(n for n, _ in done)
            over = over if len(done) == 1 else f"({over})"
            given = ", ".join(f"{n}={v}" for n, v in done)
            msg = (
                f"{name}={value} does not divide world_size // {over} = {rest} "
                f"(world_size={world_size}, {given}); choose one of {_divisors(rest)}"
            )
            raise ValueError(msg)
        rest //= value
        done.append((name, value))
    full = {**sizes, _INFERRED: rest}
    return [(a, full[a]) for a in CANONICAL if _SPECS[a].always or full[a] > 1]


def _check_ep(ep: object, world_size: int, pp: int) -> int:
    ep = _check_size("ep", ep)
    stage = world_size // pp
    if stage % ep:
        msg = (
            f"ep={ep} does not divide world_size // pp = {stage} (world_size={world_size}, "
            f"pp={pp}): expert blocks lie within a pipeline stage; choose one of "
            f"{_divisors(stage)}"
        )
        raise ValueError(msg)
    return ep


def make_layout(world_size: int, *, ep: int = 1, **sizes: int) -> Layout:
    """The keyword form: ``pp, dp, cp, sp, tp`` with ``dp`` inferred; ``pp``/``cp`` when > 1.

    ``sizes``: the keyword axes' (``tp=``, ``sp=``, ``cp=``, ``pp=``), 1 where absent.

    Raises:
        TypeError: A size is not an int (or is a bool), or a keyword names no keyword axis.
        ValueError: A size below 1, or one that does not divide what the faster axes
            leave of the world (the message names the valid choices).
    """
    for name in sizes:
        if name not in KEYWORDS:
            msg = f"make_layout() got an unexpected keyword argument {name!r}"
            raise TypeError(msg)
    world_size = _check_size("world_size", world_size)
    checked = {n: _check_size(n, sizes.get(n, 1)) for n in KEYWORDS}
    axes = _keyword_axes(world_size, checked)
    ep = _check_ep(ep, world_size, dict(axes).get("pp", 1))
    return Layout(world_size=world_size, axes=tuple(axes), ep=ep, inferred=_INFERRED, keyword=True)


def _check_axes(axes: object) -> list[tuple[str, int]]:
    if not isinstance(axes, Mapping):
        msg = f"axes={axes!r} must be a dict of axis name -> size, e.g. {{'dp': -1, 'tp': 2}}"
        raise TypeError(msg)
    if not axes:
        msg = "axes={} names no axis; pass e.g. {'dp': -1} or leave axes=None"
        raise ValueError(msg)
    out = []
    for name, size in axes.items():
        if not isinstance(name, str) or not name.isidentifier():
            msg = f"axes={dict(axes)!r}: the name {name!r} must be a str identifier"
            raise (ValueError if isinstance(name, str) else TypeError)(msg)
        if name in DERIVED:
            msg = (
                f"axes={dict(axes)!r}: {name!r} is a group every context derives "
                f"({', '.join(DERIVED)}); give the axis another name"
            )
            raise ValueError(msg)
        if isinstance(size, bool) or not isinstance(size, int):
            msg = f"axes[{name!r}]={size!r} must be an int (a positive size, or -1: inferred)"
            raise TypeError(msg)
        if size < 1 and size != -1:
            msg = f"axes[{name!r}]={size!r} must be a positive integer, or -1 (inferred)"
            raise ValueError(msg)
        out.append((name, size))
    return out


def make_axes_layout(world_size: int, axes: object, *, ep: int = 1) -> Layout:
    """User-named axes in the given order, slowest first; one size may be -1 (inferred).

    Raises:
        TypeError: ``axes`` is not a mapping of str to int, or a size is a bool.
        ValueError: A name that is no identifier or is a derived group's, a size of 0,
            two sizes of -1, sizes whose product is not the world size, or an ``ep``
            that does not divide a pipeline stage.
    """
    world_size = _check_size("world_size", world_size)
    pairs = _check_axes(axes)
    unknown = [n for n, s in pairs if s == -1]
    if len(unknown) > 1:
        msg = (
            f"axes={dict(pairs)!r} gives {len(unknown)} sizes of -1 "
            f"({', '.join(map(repr, unknown))}); at most one axis may be inferred"
        )
        raise ValueError(msg)
    known = math.prod(s for _, s in pairs if s != -1)
    if world_size % known or (not unknown and known != world_size):
        fix = (
            f"choose sizes that multiply to {world_size}"
            if not unknown
            else f"the other sizes must divide {world_size}"
        )
        msg = (
            f"axes={dict(pairs)!r}: the sizes multiply to {known}, but world_size={world_size}; "
            f"{fix}"
        )
        raise ValueError(msg)
    sized = tuple((n, world_size // known if s == -1 else s) for n, s in pairs)
    ep = _check_ep(ep, world_size, dict(sized).get("pp", 1))
    return Layout(
        world_size=world_size, axes=sized, ep=ep, inferred=unknown[0] if unknown else None
    )


def consecutive_groups(world_size: int, size: int, *, name: str = "size") -> tuple[Ranks, ...]:
    """Blocks of ``size`` (a positive divisor of ``world_size``) consecutive ranks."""
    _check_divides(name, _check_size(name, size), world_size)
    return tuple(tuple(range(i, i + size)) for i in range(0, world_size, size))
