"""Developer sessions: tests, floor, lint, typecheck, docs, bench, scale, examples, gpu."""

from __future__ import annotations

import os
import shlex
from pathlib import Path

import nox

nox.options.default_venv_backend = "virtualenv"
nox.options.sessions = ["tests", "lint", "typecheck", "docs"]

# The torch we test against. Where no CPU wheel of it is on local disk, pip resolves
# torch==2.13.0 to PyPI's default CUDA build (several GB with its nvidia-* wheels).
# PDIST_TORCH replaces it with pip arguments, split as a shell would split them, e.g.
# PDIST_TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu".
TORCH = shlex.split(os.environ.get("PDIST_TORCH", "torch==2.13.0"))
# The floor of the declared range (pyproject.toml's torch>=2.6): CI runs the suite there too.
# PDIST_TORCH_FLOOR replaces its pip arguments as PDIST_TORCH does TORCH's (a CPU index, a wheel).
FLOOR = shlex.split(os.environ.get("PDIST_TORCH_FLOOR", "torch==2.6.0"))
EXAMPLES = sorted(p.stem for p in Path("examples").glob("*.py"))
# Examples whose layout needs more than the default 2 ranks (pp x dp: 2 stages x 2).
NPROC = {"pipeline_fsdp": 4}


def _install(session: nox.Session, extras: str = "", torch: list[str] = TORCH) -> None:
    session.install(*torch)
    # Without numpy torch warns "Failed to initialize NumPy" in every process it starts, and
    # its own object collectives fail; pdist does not need it. From the default index, apart
    # from the torch arguments, which may name another one.
    session.install("numpy")
    session.install("-e", f".[{extras}]" if extras else ".")


def _pytest(session: nox.Session) -> None:
    """The suite: 4 pytest-xdist workers (PDIST_TEST_WORKERS), then the ``serial`` tests alone.

    A multi-rank test spends most of its time waiting (a deadline, a roll call, a peer's
    start-up), so 4 workers share 2 cores well; the tests marked ``serial`` assert what a
    rank sees within seconds of a stall or a deadline, and run after the others, one at a
    time, as a user's job would. Arguments after ``--`` run as given, in one process;
    PDIST_TEST_WORKERS=0 runs everything in one process.
    """
    workers = os.environ.get("PDIST_TEST_WORKERS", "4")
    if session.posargs or workers == "0":
        session.run("pytest", *session.posargs)
        return
    session.run("pytest", "-n", workers, "-m", "not serial")
    session.run("pytest", "-m", "serial")


@nox.session
def tests(session: nox.Session) -> None:
    """Run the test suite (multi-rank tests on real gloo processes).

    The docs extra too: a test builds the docs strictly (the porting guide's links).
    """
    _install(session, "test,docs")
    _pytest(session)


@nox.session
def floor(session: nox.Session) -> None:
    """Run the test suite on the oldest torch pdist supports (2.6.0; or PDIST_TORCH_FLOOR's)."""
    _install(session, "test,docs", torch=FLOOR)
    _pytest(session)


@nox.session
def lint(session: nox.Session) -> None:
    """Check lint and formatting with ruff."""
    session.install("ruff>=0.6")
    paths = ["pdist", "tests", "examples", "benchmarks", "tools", "noxfile.py"]
    session.run("ruff", "check", *paths)
    session.run("ruff", "format", "--check", *paths)


@nox.session
def typecheck(session: nox.Session) -> None:
    """Type-check pdist/ with mypy --strict."""
    _install(session, "lint")
    session.run("mypy", *session.posargs)


@nox.session
def docs(session: nox.Session) -> None:
    """Build the docs strictly, check the API page, run the snippets marked runnable.

    The API page must show no private name and no raw reST (Sphinx roles, ``Example::``);
    every snippet marked ``<!-- runnable: ... -->`` runs as its mark says (``python``,
    ``torchrun N``): see tools/run_snippets.py.
    """
    _install(session, "docs")
    session.run("mkdocs", "build", "--strict", "--site-dir", "site")
    session.run("python", "tools/check_api_page.py", "site")
    session.run("python", "tools/run_snippets.py", env={"OMP_NUM_THREADS": "1"})


@nox.session
def bench(session: nox.Session) -> None:
    """Run the benchmark (e.g. -- --quick --json bench.json; -- --stall-overhead: the watch's)."""
    _install(session, "bench")
    if "--stall-overhead" in session.posargs:
        args = [a for a in session.posargs if a != "--stall-overhead"]
        session.run("python", "-m", "benchmarks.stall", *args)
        return
    session.run("python", "-m", "pdist", "bench", *session.posargs)


def _torchrun(script: str, *args: str, nproc: int = 2) -> list[str]:
    return [
        "torchrun",
        "--nproc-per-node",
        str(nproc),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        "localhost:0",
        script,
        *args,
    ]


@nox.session
def examples(session: nox.Session) -> None:
    """Run the examples on CPU ranks under torchrun, 2 unless NPROC says (pass names to pick).

    ``weight_sync`` is two jobs: run without ``--role``, its trainer starts the inference job.
    """
    _install(session)
    for name in session.posargs or EXAMPLES:
        command = _torchrun(f"examples/{name}.py", nproc=NPROC.get(name, 2))
        session.run(*command, env={"OMP_NUM_THREADS": "1"})


@nox.session
def gpu(session: nox.Session) -> None:
    """On a CUDA machine: the CUDA-marked tests, then a 1-rank NCCL bench (quick)."""
    _install(session, "test")
    session.run("pytest", "-m", "cuda", "-ra", *session.posargs)
    session.run("python", "-m", "pdist", "bench", "--quick", "--nproc", "1")


@nox.session
def scale(session: nox.Session) -> None:
    """Start-up cost on simulated worlds of 512..16384 ranks, next to init_device_mesh."""
    _install(session)
    session.run("python", "-m", "benchmarks.scale", *(session.posargs or ["default"]))
