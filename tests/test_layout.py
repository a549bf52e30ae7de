"""Exhaustive checks of the pure rank arithmetic."""

from __future__ import annotations

import itertools

import pytest

from pdist._layout import AXES, consecutive_groups, make_layout


def _valid(world_size: int):
    for tp in range(1, world_size + 1):
        for sp in range(1, world_size + 1):
            if world_size % (tp * sp) == 0:
                yield tp, sp


CASES = [(w, tp, sp) for w in range(1, 17) for tp, sp in _valid(w)]


@pytest.mark.parametrize(("world_size", "tp", "sp"), CASES)
def test_axes_partition_the_world_and_are_orthogonal(world_size, tp, sp):
    """Every axis partitions the world; two ranks share at most one axis group pair-wise."""
    layout = make_layout(world_size, tp=tp, sp=sp)
    assert layout.dp * layout.sp * layout.tp == world_size
    for axis in AXES:
        groups = layout.groups(axis)
        flat = sorted(itertools.chain.from_iterable(groups))
        assert flat == list(range(world_size))
        assert all(len(g) == layout.size(axis) for g in groups)
    # Orthogonal: a dp group and an sp group (or any two different axes) meet in one rank at most.
    for a, b in itertools.combinations(AXES, 2):
        for ga in layout.groups(a):
            for gb in layout.groups(b):
                assert len(set(ga) & set(gb)) <= 1


@pytest.mark.parametrize(("world_size", "tp", "sp"), CASES)
def test_coordinates_round_trip(world_size, tp, sp):
    """rank -> (dp, sp, tp) -> rank is the identity, and tp is the fastest axis."""
    layout = make_layout(world_size, tp=tp, sp=sp)
    seen = set()
    for rank in range(world_size):
        coords = layout.coords(rank)
        assert layout.rank_of(*coords) == rank
        seen.add(coords)
        for axis, index in zip(AXES, coords, strict=False):
            assert layout.group_of(axis, rank)[index] == rank
    assert len(seen) == world_size
    assert layout.group_of("tp", 0) == tuple(range(tp))


def test_reference_layout_with_tp_1():
    """With tp=1, sp groups are consecutive blocks and dp groups are strided by sp."""
    layout = make_layout(4, sp=2)
    assert layout.groups("sp") == ((0, 1), (2, 3))
    assert layout.groups("dp") == ((0, 2), (1, 3))
    layout = make_layout(8, sp=4)
    assert layout.groups("sp") == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert layout.groups("dp") == ((0, 4), (1, 5), (2, 6), (3, 7))


def test_design_example_tp2_sp2():
    """World 4, tp=2, sp=2: tp [0,1] [2,3], sp [0,2] [1,3], dp singletons."""
    layout = make_layout(4, tp=2, sp=2)
    assert layout.groups("tp") == ((0, 1), (2, 3))
    assert layout.groups("sp") == ((0, 2), (1, 3))
    assert layout.groups("dp") == ((0,), (1,), (2,), (3,))


def test_errors_name_axis_value_world_and_choice():
    """Bad sizes raise with the axis, its value, the world size and valid choices."""
    with pytest.raises(
        ValueError, match=r"tp=3 does not divide world_size=4; choose one of \[1, 2, 4\]"
    ):
        make_layout(4, tp=3)
    with pytest.raises(
        ValueError, match=r"sp=3 does not divide world_size // tp = 4 .*\[1, 2, 4\]"
    ):
        make_layout(8, tp=2, sp=3)
    with pytest.raises(ValueError, match=r"tp=0 must be a positive integer"):
        make_layout(4, tp=0)
    with pytest.raises(ValueError, match=r"sp=-2 must be a positive integer"):
        make_layout(4, sp=-2)
    with pytest.raises(TypeError, match=r"tp=2.0 must be an int"):
        make_layout(4, tp=2.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="axis='pp'"):
        make_layout(4).size("pp")
    with pytest.raises(ValueError, match="rank=4 is outside"):
        make_layout(4).coords(4)


def test_consecutive_groups():
    """Consecutive blocks cover the world; a non-divisor is refused."""
    assert consecutive_groups(6, 3) == ((0, 1, 2), (3, 4, 5))
    assert consecutive_groups(6, 6) == ((0, 1, 2, 3, 4, 5),)
    with pytest.raises(ValueError, match=r"size=4 does not divide world_size=6"):
        consecutive_groups(6, 4)


class _OldLayout:
    """The arithmetic before the O(W) rewrite: every rank's group rebuilt from coordinates."""

    def __init__(self, world_size: int, tp: int, sp: int) -> None:
        self.world_size, self.tp, self.sp = world_size, tp, sp
        self.dp = world_size // (tp * sp)

    def group_of(self, axis: str, rank: int) -> tuple[int, ...]:
        rest, t = divmod(rank, self.tp)
        d, s = divmod(rest, self.sp)
        coords = [d, s, t]
        index = AXES.index(axis)
        members = []
        for i in range(getattr(self, axis)):
            coords[index] = i
            members.append((coords[0] * self.sp + coords[1]) * self.tp + coords[2])
        return tuple(members)

    def groups(self, axis: str) -> tuple[tuple[int, ...], ...]:
        seen: dict[tuple[int, ...], None] = {}
        for rank in range(self.world_size):
            seen.setdefault(self.group_of(axis, rank), None)
        return tuple(seen)


def test_layout_matches_the_old_arithmetic():
    """Every axis partition and every rank's group equal the old per-rank arithmetic (W <= 64)."""
    for world_size in range(1, 65):
        for tp, sp in _valid(world_size):
            new, old = make_layout(world_size, tp=tp, sp=sp), _OldLayout(world_size, tp, sp)
            for axis in AXES:
                assert new.groups(axis) == old.groups(axis), (world_size, tp, sp, axis)
                for rank in range(world_size):
                    assert new.group_of(axis, rank) == old.group_of(axis, rank)


@pytest.mark.parametrize(("world_size", "tp", "sp"), CASES)
def test_dp_sp_holds_the_ranks_sharing_a_tp_index(world_size, tp, sp):
    """dp_sp = the ranks with the caller's tp coordinate: dp x sp of them, dp itself when sp=1."""
    layout = make_layout(world_size, tp=tp, sp=sp)
    assert layout.size("dp_sp") == layout.dp * layout.sp
    for rank in range(world_size):
        group = layout.group_of("dp_sp", rank)
        assert group == tuple(r for r in range(world_size) if r % tp == rank % tp)
        assert set(layout.group_of("dp", rank)) <= set(group)
        assert set(layout.group_of("sp", rank)) <= set(group)
        if sp == 1:
            assert group == layout.group_of("dp", rank)
    flat = sorted(itertools.chain.from_iterable(layout.groups("dp_sp")))
    assert flat == list(range(world_size))
