"""Exhaustive checks of the pure rank arithmetic."""

from __future__ import annotations

import itertools

import attrs
import pytest

from pdist._env import resolve_layout
from pdist._group import DistContext
from pdist._layout import CONTEXT_GROUPS, consecutive_groups, make_axes_layout, make_layout

AXES = ("dp", "sp", "tp")  # the seeds' keyword layout with pp = cp = 1


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
    with pytest.raises(ValueError, match="axis='cfg'"):
        make_layout(4).size("cfg")
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


# --------------------------------------------------------------------------- any layout

# (world_size, keywords or None, axes or None): every layout the arithmetic is checked on.
LAYOUTS = [
    (8, {"pp": 2, "tp": 2}, None),
    (8, {"cp": 2, "sp": 2}, None),
    (8, {"pp": 2, "ep": 2, "tp": 2}, None),
    (8, {"ep": 4}, None),
    (8, {"pp": 4, "ep": 2}, None),
    (16, {"pp": 2, "cp": 2, "sp": 2, "tp": 2, "ep": 4}, None),
    (12, {"pp": 3, "tp": 2, "ep": 2}, None),
    (12, {"cp": 3, "sp": 2}, None),
    (8, None, {"dp": -1, "cfg": 2, "sp": 2}),
    (8, None, {"dp": 2, "pp": 2, "tp": 2}),
    (8, None, {"dp": 2, "pp": 2, "tp": 2, "ep": 4}),
    (16, None, {"dp_replicate": 2, "dp_shard": -1, "cp": 2, "tp": 2}),
    (12, None, {"tp": 3, "pp": 2, "dp": -1, "ep": 3}),
    (6, None, {"cfg": 2, "sp": 3, "ep": 3}),
    (1, None, {"dp": -1}),
    (1, {}, None),
]


def _build(world_size, keywords, axes):
    if axes is None:
        return make_layout(world_size, **keywords)
    axes = dict(axes)
    return make_axes_layout(
        world_size, {k: v for k, v in axes.items() if k != "ep"}, ep=axes.get("ep", 1)
    )


def _expected_axes(world_size, keywords, axes):
    """The axes the layout must have: (name, size), slowest first."""
    if axes is not None:
        named = {k: v for k, v in axes.items() if k != "ep"}
        known = 1
        for v in named.values():
            known *= v if v != -1 else 1
        return [(k, world_size // known if v == -1 else v) for k, v in named.items()]
    sizes = {"pp": 1, "cp": 1, "sp": 1, "tp": 1, **{k: v for k, v in keywords.items() if k != "ep"}}
    sizes["dp"] = world_size // (sizes["pp"] * sizes["cp"] * sizes["sp"] * sizes["tp"])
    return [
        (a, sizes[a]) for a in ("pp", "dp", "cp", "sp", "tp") if a in "dp sp tp" or sizes[a] > 1
    ]


def _reference(world_size, pairs, ep):
    """Every group kind's group of every rank, from coordinates (rank r = r-th in product order)."""
    names = [n for n, _ in pairs]
    coords = list(itertools.product(*(range(s) for _, s in pairs)))
    assert len(coords) == world_size

    def sharing(rank, varied):
        fixed = [i for i, n in enumerate(names) if n not in varied]
        return tuple(
            r for r in range(world_size) if all(coords[r][i] == coords[rank][i] for i in fixed)
        )

    kinds = {n: (n,) for n in names}
    kinds["dp_sp"] = tuple(n for n in names if n in ("dp", "cp", "sp"))
    for n in ("pp", "dp", "cp", "sp", "tp"):
        kinds.setdefault(n, ())
    ref = {kind: [sharing(r, varied) for r in range(world_size)] for kind, varied in kinds.items()}
    ref["ep"], ref["edp"] = [], []
    for r in range(world_size):
        stage = sharing(r, [n for n in names if n != "pp"])
        i = stage.index(r)
        ref["ep"].append(stage[i // ep * ep : i // ep * ep + ep])
        ref["edp"].append(tuple(s for k, s in enumerate(stage) if k % ep == i % ep))
    for subset in itertools.chain.from_iterable(
        itertools.combinations(names, k) for k in range(1, len(names) + 1)
    ):
        ref[subset] = [sharing(r, subset) for r in range(world_size)]
    return ref, coords


@pytest.mark.parametrize(("world_size", "keywords", "axes"), LAYOUTS)
def test_any_layout_matches_coordinates(world_size, keywords, axes):
    """Every group kind (axes, dp_sp, ep, edp, any flatten) equals the coordinates' groups."""
    layout = _build(world_size, keywords, axes)
    pairs = _expected_axes(world_size, keywords, axes)
    assert list(layout.axes) == pairs
    ep = (keywords or axes or {}).get("ep", 1)
    ref, coords = _reference(world_size, pairs, ep)
    for r in range(world_size):
        assert layout.coords(r) == coords[r]
        assert layout.rank_of(*coords[r]) == r
    for kind, per_rank in ref.items():
        partition = tuple(sorted(set(per_rank)))
        if isinstance(kind, tuple):
            assert layout.flatten(kind) == partition, kind
            continue
        assert layout.groups(kind) == partition, kind
        assert layout.size(kind) == len(per_rank[0]), kind
        for r in range(world_size):
            assert layout.group_of(kind, r) == per_rank[r], (kind, r)
    assert set(layout.group_names) == {k for k in ref if isinstance(k, str)}


@pytest.mark.parametrize(("world_size", "keywords", "axes"), LAYOUTS)
def test_sub_meshes_hold_the_callers_groups(world_size, keywords, axes):
    """Each dim of a sub-mesh is the caller's group of that kind; the mesh holds the caller once."""
    layout = _build(world_size, keywords, axes)
    choices = [layout.names, layout.names[-2:], ("dp_sp", layout.names[-1]), ("edp", "ep")]
    if layout.pp > 1:
        choices.append(("pp", "edp", "ep"))
    for names in choices:
        try:
            names = layout.mesh_names(tuple(names))
        except ValueError:
            continue  # dp_sp beside an axis it holds
        for r in range(world_size):
            shape, ranks = layout.mesh(names, r)
            assert len(ranks) == len(set(ranks)) == _prod(shape)
            assert ranks.count(r) == 1
            index = ranks.index(r)
            at = []
            for size in reversed(shape):
                index, c = divmod(index, size)
                at.append(c)
            at.reverse()
            for d, name in enumerate(names):  # along dim d through the caller: its group
                stride = _prod(shape[d + 1 :])
                start = ranks.index(r) - at[d] * stride
                line = tuple(ranks[start + k * stride] for k in range(shape[d]))
                assert line == layout.group_of(name, r), (names, name, r)


def _prod(values):
    out = 1
    for v in values:
        out *= v
    return out


def test_design_examples():
    """DESIGN's examples: pp=2, tp=2 on 8 ranks; the expert grid with pp in the middle."""
    layout = make_layout(8, pp=2, tp=2)
    assert layout.names == ("pp", "dp", "sp", "tp")
    assert layout.groups("pp") == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert layout.groups("dp") == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert layout.groups("edp") == ((0, 1, 2, 3), (4, 5, 6, 7))  # ep = 1: the stage
    assert make_layout(8, tp=2, sp=2).names == ("dp", "sp", "tp")
    assert make_layout(8, cp=2).names == ("dp", "cp", "sp", "tp")
    named = make_axes_layout(8, {"dp": 2, "pp": 2, "tp": 2}, ep=4)
    assert named.groups("pp") == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert named.groups("ep") == ((0, 1, 4, 5), (2, 3, 6, 7))  # a stage: 0, 1, 4, 5
    assert named.mesh(("edp", "ep"), 6) == ((1, 4), (2, 3, 6, 7))


BAD = [
    # (world_size, keywords, error, message)
    (4, {"pp": 3}, ValueError, r"pp=3 does not divide .* = 4 .*choose one of \[1, 2, 4\]"),
    (4, {"ep": 3}, ValueError, r"ep=3 does not divide world_size // pp = 4 .*\[1, 2, 4\]"),
    (8, {"pp": 2, "ep": 8}, ValueError, r"ep=8 does not divide world_size // pp = 4 .*\[1, 2, 4\]"),
    (8, {"cp": 3}, ValueError, r"cp=3 does not divide world_size // \(tp \* sp\) = 8"),
    (4, {"cp": 0}, ValueError, r"cp=0 must be a positive integer"),
    (4, {"pp": True}, TypeError, r"pp=True must be an int"),
    (4, {"ep": 0}, ValueError, r"ep=0 must be a positive integer"),
    (4, {"axes": {"dp": -1, "sp": -1}}, ValueError, r"2 sizes of -1 \('dp', 'sp'\)"),
    (4, {"axes": {"dp": -1}, "tp": 2}, ValueError, r"axes= excludes .* tp=2"),
    (4, {"axes": {"dp": -1}, "pp": 2}, ValueError, r"axes= excludes .* pp=2"),
    (4, {"axes": {"dp": -1}, "tp": 1.0}, ValueError, r"axes= excludes .* tp=1.0"),
    (4, {"axes": {"dp": 2, "ep": 2}}, ValueError, r"'ep' is a group every context derives"),
    (4, {"axes": {"world": 4}}, ValueError, r"'world' is a group every context derives"),
    (4, {"axes": {"dp_sp": 4}}, ValueError, r"'dp_sp' is a group"),
    (4, {"axes": {"node": 4}}, ValueError, r"'node' is a group"),
    (4, {"axes": {"edp": 4}}, ValueError, r"'edp' is a group"),
    (8, {"axes": {"dp": 2, "cfg": 2}}, ValueError, r"multiply to 4, but world_size=8"),
    (8, {"axes": {"dp": -1, "cfg": 3}}, ValueError, r"multiply to 3, but world_size=8"),
    (4, {"axes": {"dp": 0, "cfg": 4}}, ValueError, r"axes\['dp'\]=0 must be a positive"),
    (4, {"axes": {"dp": True}}, TypeError, r"axes\['dp'\]=True must be an int"),
    (4, {"axes": {"dp": 2.0}}, TypeError, r"axes\['dp'\]=2.0 must be an int"),
    (4, {"axes": {"my axis": 4}}, ValueError, r"'my axis' must be a str identifier"),
    (4, {"axes": {3: 4}}, TypeError, r"the name 3 must be a str"),
    (4, {"axes": [("dp", 4)]}, TypeError, r"must be a dict"),
    (4, {"axes": {}}, ValueError, r"names no axis"),
    (8, {"axes": {"dp": 2, "pp": 2, "tp": 2}, "ep": 8}, ValueError, r"ep=8 does not divide"),
]


@pytest.mark.parametrize(("world_size", "keywords", "error", "message"), BAD)
def test_bad_layouts_are_refused_before_any_communicator(world_size, keywords, error, message):
    """Bad sizes and names raise a ValueError/TypeError naming the parameter, value and choices."""
    with pytest.raises(error, match=message):
        resolve_layout(world_size, **keywords)


def test_large_layouts_stay_linear():
    """W = 8192 with pp=4, cp=2, tp=8, ep=8: every partition built, no group twice."""
    layout = make_layout(8192, pp=4, cp=2, tp=8, ep=8)
    for kind in layout.group_names:
        flat = sorted(itertools.chain.from_iterable(layout.groups(kind)))
        assert flat == list(range(8192)), kind


def test_the_context_has_one_group_field_per_table_entry():
    """``DistContext``'s group fields are the axis table's groups, in the table's order."""
    fields = tuple(f.name for f in attrs.fields(DistContext) if f.type == "Group")
    assert fields == CONTEXT_GROUPS
