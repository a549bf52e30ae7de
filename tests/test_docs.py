"""The docs as a newcomer meets them: the README's set-up, runnable snippets, the API page."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _tool(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # NamedTuple and dataclass machinery look the module up
    spec.loader.exec_module(module)
    return module


run_snippets = _tool("run_snippets")
check_api_page = _tool("check_api_page")
SNIPPETS = run_snippets.snippets(ROOT / "docs")


def _commands(lines: list[str]) -> list[str]:
    return [line for line in lines if line.strip() and not line.lstrip().startswith("#")]


def test_the_readme_set_up_is_two_commands_and_ci_runs_exactly_them():
    """'Two commands on a fresh machine' is followed by a block of two; .ci/run runs them."""
    readme = (ROOT / "README.md").read_text()
    after = readme[readme.index("Two commands on a fresh machine") :]
    block = re.search(r"```bash\n(.*?)```", after, re.DOTALL)
    assert block is not None
    commands = _commands(block[1].splitlines())
    assert len(commands) == 2, commands
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    ci = [c for c in _commands(ci) if not c.startswith(("set ", "cd ", "#!"))]
    assert ci == commands


def test_the_guides_have_runnable_snippets_that_compile():
    """The recipe and six guides each mark a complete program."""
    pages = {s.page.name for s in SNIPPETS}
    guides = {"recipe-data-parallel.md", "experts.md", "layouts.md", "evaluation.md"}
    assert guides | {"collectives.md", "objects.md", "sequence.md"} <= pages
    for s in SNIPPETS:
        compile(s.code, f"{s.page}:{s.line}", "exec")
        assert "__name__" in s.code or "with pdist.distributed(" in s.code


@pytest.mark.parametrize(
    ("page", "line", "launcher"),
    [(s.page.name, s.line, how) for s in SNIPPETS for how in s.launchers],
)
def test_a_runnable_snippet_runs_as_its_mark_says(page, line, launcher):
    """Each marked snippet exits 0 under plain python and under torchrun, as marked."""
    (snippet,) = [s for s in SNIPPETS if s.page.name == page and s.line == line]
    assert run_snippets.run(snippet, launcher, timeout=240) is None


def test_a_runnable_mark_must_sit_above_a_python_fence(tmp_path):
    """A mark away from its snippet, or naming an unknown launcher, names page and line."""
    (tmp_path / "a.md").write_text("<!-- runnable: python -->\ntext\n```python\npass\n```\n")
    with pytest.raises(ValueError, match=r"a\.md:1: a runnable mark must sit right above"):
        run_snippets.snippets(tmp_path)
    (tmp_path / "a.md").write_text("<!-- runnable: srun 2 -->\n```python\npass\n```\n")
    with pytest.raises(ValueError, match="unknown launcher 'srun 2'"):
        run_snippets.snippets(tmp_path)


def _page(tmp_path: Path, body: str) -> str:
    (tmp_path / "api").mkdir(exist_ok=True)
    (tmp_path / "api" / "index.html").write_text(f"<html><body>{body}</body></html>")
    return str(tmp_path)


@pytest.mark.parametrize(
    "raw",
    [
        "Returns a :class:<code>Routed</code>.",
        "as in :func:<code>all_reduce</code>",
        "<p>Example::</p><pre>x = 1</pre>",
        "<p>Example (on 2 ranks)::</p>",
    ],
)
def test_check_api_page_refuses_raw_rest(tmp_path, raw, capsys):
    """Sphinx roles and literal-block 'Example::' headers fail the check, named."""
    assert check_api_page.main(_page(tmp_path, raw)) == 1
    assert "the API page shows internals" in capsys.readouterr().out
    assert check_api_page.main(_page(tmp_path, "<p>Example:</p><pre>x = 1</pre>")) == 0


def test_the_built_api_page_passes_its_check(tmp_path):
    """The real page: no raw roles, no Example::, and on_stall shows its value."""
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings")
    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        check=True,
        capture_output=True,
        timeout=240,
    )
    assert check_api_page.main(str(site)) == 0
    page = (site / "api" / "index.html").read_text()
    assert "DEFAULT_ON_STALL" not in page
    assert 'id="pdist._moe.Routed"' in page


def test_weight_sync_without_a_role_runs_both_jobs():
    """Plain ``python examples/weight_sync.py`` starts the inference job itself; exits 0."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "weight_sync.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "trainer: step 2" in done.stdout
    assert "inference: step 2" in done.stdout
