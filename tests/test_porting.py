"""The porting guide covers every seed entry point, fits pdist's API and tells the true layout."""

from __future__ import annotations

import ast
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest

import pdist
import pdist.testing
from pdist._layout import consecutive_groups, make_layout
from pdist.testing import spawn

ROOT = Path(__file__).parent.parent
GUIDE = ROOT / "docs" / "guide" / "porting.md"

COSMOS_ENTRY_POINTS = [
    "init",
    "ensure_world_communicator",
    "parallel_model_wrapper",
    "ddp_sync_grad",
    "collate_batches",
    "sync_model_states",
    "broadcast_object_list_optimized",
    "dist_reduce_tensor",
    "rank0_first",
    "is_local_rank0",
]
FASTVIDEO_ENTRY_POINTS = [
    "GroupCoordinator",
    "init_distributed_environment",
    "initialize_model_parallel",
    "init_model_parallel_group",
    "patch_tensor_parallel_group",
    "get_sp_group",
    "get_dp_group",
    "get_tp_group",
    "get_local_torch_device",
    "maybe_init_distributed_environment_and_model_parallel",
    "cleanup_dist_env_and_memory",
    "get_same_node_ranks",
    "initialize_sequence_parallel_group",
    "all_to_all_4D",
    "broadcast_tensor_dict",
    "graph_capture",
]
GROUP_COORDINATOR_METHODS = [
    "all_reduce",
    "all_gather",
    "gather",
    "all_to_all_4D",
    "broadcast",
    "broadcast_object",
    "broadcast_object_list",
    "send_object",
    "recv_object",
    "broadcast_tensor_dict",
    "send_tensor_dict",
    "recv_tensor_dict",
    "barrier",
    "send",
    "recv",
    "graph_capture",
    "destroy",
]
SEED_ENVIRONMENT = [
    "COSMOS_WORLD_COMM_TIMEOUT_SEC",
    "COSMOS_NCCL_SUBGROUP_TIMEOUT_SEC",
    "COSMOS_DEVICE",
    "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC",
    "TORCH_NCCL_BLOCKING_WAIT",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
]


# Named by the guide and added with the keyword-only tensor options (issue 17, item 5), on
# another branch; drop each from this set once pdist exports it.
def _guide() -> str:
    return GUIDE.read_text()


def _sections(text: str) -> dict[str, str]:
    """Each ``###`` heading's line, mapped to the text up to the next heading."""
    parts = re.split(r"^(#{2,3} .*)$", text, flags=re.MULTILINE)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts) - 1, 2)}


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", text, flags=re.MULTILINE | re.DOTALL)


@pytest.mark.parametrize("name", COSMOS_ENTRY_POINTS + FASTVIDEO_ENTRY_POINTS)
def test_every_seed_entry_point_has_an_entry_with_before_and_after(name):
    """Each listed seed entry point has a heading and a before/after example."""
    sections = _sections(_guide())
    mine = [body for heading, body in sections.items() if f"`{name}`" in heading]
    assert mine, f"no heading names `{name}`"
    blocks = _python_blocks(mine[0])
    assert any("# before" in b and "# after" in b for b in blocks), name


def test_every_group_coordinator_method_is_mapped():
    """The GroupCoordinator entry maps each of its methods."""
    body = _sections(_guide())["### `GroupCoordinator`"]
    for method in GROUP_COORDINATOR_METHODS:
        assert f"`{method}(" in body, method


def test_seed_and_pdist_environment_variables_are_mapped():
    """The guide names the seeds' variables and every PDIST_* setting pdist reads."""
    text = _guide()
    env_source = (ROOT / "pdist" / "_env.py").read_text()
    settings = set(re.findall(r"PDIST_[A-Z_]+", env_source))
    assert {"PDIST_BACKEND", "PDIST_TIMEOUT_SEC", "PDIST_WORLD_COMM_TIMEOUT_SEC"} <= settings
    for name in SEED_ENVIRONMENT + sorted(settings):
        assert f"`{name}`" in text, name


def test_the_guide_is_in_the_nav():
    """mkdocs.yml lists the guide."""
    assert "guide/porting.md" in (ROOT / "mkdocs.yml").read_text()


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def _resolve(dotted: str) -> object:
    obj: object = pdist
    for part in dotted.split(".")[1:]:
        obj = getattr(obj, part)
    return obj


def _code_snippets(text: str) -> list[str]:
    """The python blocks, and the inline code spans that parse as Python."""
    snippets = list(_python_blocks(text))
    for span in re.findall(r"`([^`\n]*pdist\.[^`\n]*)`", text):
        try:
            ast.parse(span)
        except SyntaxError:
            continue
        snippets.append(span)
    return snippets


def test_every_pdist_name_in_the_guide_exists():
    """Every ``pdist.x`` the guide mentions is public (or listed as pending)."""
    for name in set(re.findall(r"\bpdist\.(\w+)", _guide())):
        assert name in pdist.__all__ or name == "testing", name


def test_the_guides_code_parses_and_its_pdist_calls_fit_the_signatures():
    """Every python block parses, and each pdist call binds to the real signature."""
    checked = 0
    for snippet in _code_snippets(_guide()):
        tree = ast.parse(snippet)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            name = _dotted(node.func)
            if name is None or not name.startswith("pdist."):
                continue
            if any(isinstance(a, ast.Starred) for a in node.args) or any(
                k.arg is None for k in node.keywords
            ):
                continue
            signature = inspect.signature(_resolve(name))  # type: ignore[arg-type]
            try:
                signature.bind(*node.args, **{k.arg: k.value for k in node.keywords})
            except TypeError as exc:
                pytest.fail(f"{ast.unparse(node)}: {exc}")
            checked += 1
    assert checked > 40


# --------------------------------------------------------------------------- FastVideo's layout


def _fastvideo(world: int, tp: int, sp: int) -> dict[str, list[list[int]]]:
    """The seed's groups, as initialize_model_parallel builds them."""
    return {
        "tp": [list(range(i * tp, (i + 1) * tp)) for i in range(world // tp)],
        "sp": [list(range(i * sp, (i + 1) * sp)) for i in range(world // sp)],
        "dp": [list(range(i, world, sp)) for i in range(sp)],
    }


def _pdist_fastvideo(world: int, tp: int, sp: int) -> dict[str, list[list[int]]]:
    """distributed(sp=sp) plus new_tp_group(ctx, tp), as pure rank arithmetic."""
    layout = make_layout(world, sp=sp)
    return {
        "tp": [list(g) for g in consecutive_groups(world, tp)],
        "sp": [list(g) for g in layout.groups("sp")],
        "dp": [list(g) for g in layout.groups("dp")],
    }


@pytest.mark.parametrize("world", [1, 2, 4, 6, 8, 12])
def test_sp_plus_new_tp_group_is_fastvideos_layout(world):
    """For every tp and sp dividing the world, pdist's groups are FastVideo's."""
    for tp in range(1, world + 1):
        for sp in range(1, world + 1):
            if world % tp == 0 and world % sp == 0:
                assert _pdist_fastvideo(world, tp, sp) == _fastvideo(world, tp, sp), (tp, sp)


def _table_rows() -> list[tuple[int, int, int, list[list[int]], list[list[int]], list[list[int]]]]:
    row = re.compile(r"^\| (\d+) \| (\d+) \| (\d+) \| `([^`]*)` \| `([^`]*)` \| `([^`]*)` \|$")

    def groups(cell: str) -> list[list[int]]:
        return [[int(r) for r in g.split(",")] for g in re.findall(r"\[([^\]]*)\]", cell)]

    return [
        (int(m[1]), int(m[2]), int(m[3]), groups(m[4]), groups(m[5]), groups(m[6]))
        for m in (row.match(line) for line in _guide().splitlines())
        if m
    ]


def test_the_guides_layout_table_is_true():
    """The table's rows for worlds 4 and 8 are the groups FastVideo and pdist build."""
    rows = _table_rows()
    assert {world for world, *_ in rows} == {4, 8}
    for world, sp, tp, sp_groups, tp_groups, dp_groups in rows:
        expected = _fastvideo(world, tp, sp)
        assert expected == _pdist_fastvideo(world, tp, sp)
        assert (sp_groups, tp_groups, dp_groups) == (
            expected["sp"],
            expected["tp"],
            expected["dp"],
        ), (world, sp, tp)


def _fastvideo_on_ranks(sp: int, tp_size: int) -> dict[str, object]:
    import torch

    with pdist.distributed(sp=sp) as ctx:
        tp = pdist.new_tp_group(ctx, tp_size)
        with pdist.patch_tp(ctx, tp) as enc:
            patched = enc.tp.ranks
        mine = torch.tensor([float(ctx.rank)])
        return {
            "groups": {"sp": ctx.sp.ranks, "tp": tp.ranks, "dp": ctx.dp.ranks},
            "sums": {
                name: pdist.all_reduce(group, mine, op="sum").item()
                for name, group in (("sp", ctx.sp), ("tp", tp), ("dp", ctx.dp))
            },
            "patched": patched,
            "own_tp": ctx.tp.ranks,
        }


WORLD4_ROWS = [(sp, tp) for world, sp, tp, *_ in _table_rows() if world == 4]


def test_the_table_has_three_world4_rows():
    """The rows the next test runs on real processes are there."""
    assert WORLD4_ROWS == [(2, 2), (4, 2), (2, 4)]


@pytest.mark.parametrize(("sp", "tp"), WORLD4_ROWS)
def test_fastvideo_layout_on_four_real_ranks(sp, tp):
    """The guide's world-4 rows on real processes: the groups, and an all-reduce over each."""
    expected = _fastvideo(4, tp, sp)
    for rank, got in enumerate(spawn(_fastvideo_on_ranks, 4, sp, tp, timeout=240)):
        for axis in ("sp", "tp", "dp"):
            group = next(g for g in expected[axis] if rank in g)
            assert list(got["groups"][axis]) == group, (rank, axis)
            assert got["sums"][axis] == sum(group), (rank, axis)
        assert list(got["patched"]) == next(g for g in expected["tp"] if rank in g)
        assert tuple(got["own_tp"]) == (rank,)


# --------------------------------------------------------------------------- the docs build


def test_the_docs_build_strictly(tmp_path):
    """mkdocs build --strict succeeds with the guide (skipped without the docs extra)."""
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "guide" / "porting" / "index.html").exists()
