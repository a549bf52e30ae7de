"""Run every documentation snippet marked runnable, the way the guide says to run it.

A snippet is marked by an HTML comment (invisible in the built page) on the line before
its fence, naming how it runs: plain ``python`` (a one-rank world) and/or ``torchrun N``
(``N`` ranks on this host)::

    <!-- runnable: python, torchrun 2 -->
    ```python
    ...
    ```

Each snippet is written to a file of its own in a fresh directory and run there, with
this checkout on ``PYTHONPATH``, under each named launcher; any failure (or a run past
``--timeout`` seconds) is reported with the page and line, and the exit status is 1.
``nox -s docs`` runs it after the build: ``python tools/run_snippets.py [docs]``.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
MARK = re.compile(r"^<!--\s*runnable:\s*(?P<how>[^>]*?)\s*-->\s*$")
FENCE = re.compile(r"^```python\b")


class Snippet(NamedTuple):
    """One marked snippet: where it is, how it runs, its code."""

    page: Path
    line: int  # 1-based line of the opening fence
    launchers: tuple[str, ...]  # "python" or "torchrun N"
    code: str


def launchers(how: str, where: str) -> tuple[str, ...]:
    """Parse ``python, torchrun 2``; refuse anything else, naming the page and line."""
    found = tuple(part.strip() for part in how.split(",") if part.strip())
    for part in found:
        if part != "python" and not re.fullmatch(r"torchrun [1-9]\d*", part):
            msg = f"{where}: unknown launcher {part!r} (say 'python' or 'torchrun N')"
            raise ValueError(msg)
    if not found:
        msg = f"{where}: a runnable mark names no launcher (say 'python' or 'torchrun N')"
        raise ValueError(msg)
    return found


def snippets(docs: Path) -> list[Snippet]:
    """Every marked snippet under ``docs``, in page order."""
    out = []
    for page in sorted(docs.rglob("*.md")):
        lines = page.read_text().splitlines()
        for i, text in enumerate(lines):
            mark = MARK.match(text)
            if mark is None:
                continue
            where = f"{page}:{i + 1}"
            if i + 1 >= len(lines) or not FENCE.match(lines[i + 1]):
                msg = f"{where}: a runnable mark must sit right above a ```python fence"
                raise ValueError(msg)
            end = next((j for j in range(i + 2, len(lines)) if lines[j] == "```"), None)
            if end is None:
                raise ValueError(f"{where}: the snippet's fence is never closed")
            code = "\n".join(lines[i + 2 : end]) + "\n"
            out.append(Snippet(page, i + 2, launchers(mark["how"], where), code))
    return out


def command(launcher: str, script: str) -> list[str]:
    """The command line that runs ``script`` under ``launcher``."""
    if launcher == "python":
        return [sys.executable, script]
    nproc = launcher.split()[1]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    return [*torchrun, "--nproc-per-node", nproc, script]


def run(snippet: Snippet, launcher: str, timeout: float) -> str | None:
    """Run one snippet under one launcher in a fresh directory; the failure's text, or None."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    with tempfile.TemporaryDirectory(prefix="pdist-snippet-") as tmp:
        script = Path(tmp) / f"{snippet.page.stem}.py"
        script.write_text(snippet.code)
        try:
            done = subprocess.run(
                command(launcher, script.name),
                cwd=tmp,
                env=env,
                capture_output=True,
                text=True,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired:
            return f"ran past {timeout:g} s"
    if done.returncode != 0:
        return f"exit status {done.returncode}:\n{(done.stdout + done.stderr)[-3000:]}"
    return None


def main(argv: list[str] | None = None) -> int:
    """Run the marked snippets; exit 1 naming each one that failed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("docs", nargs="?", default=str(ROOT / "docs"))
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds per run")
    parser.add_argument("--list", action="store_true", help="list the snippets, run none")
    args = parser.parse_args(argv)
    found = snippets(Path(args.docs))
    failed = 0
    for snippet in found:
        for launcher in snippet.launchers:
            where = f"{snippet.page}:{snippet.line} ({launcher})"
            error = None if args.list else run(snippet, launcher, args.timeout)
            print(f"{'FAILED' if error else 'ok'}: {where}" + (f": {error}" if error else ""))
            failed += error is not None
    print(f"{len(found)} runnable snippets, {failed} failed")
    return 1 if failed or not found else 0


if __name__ == "__main__":
    sys.exit(main())
