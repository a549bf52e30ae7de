"""The command line: doctor, bench, and bad input."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest
import torch

from pdist._compat import FEATURES
from pdist.cli import bench, doctor, main
from pdist.cli.bench import Case, run_cases
from pdist.testing import world_sizes


def test_doctor_on_two_spawned_ranks(capsys):
    """doctor --nproc 2 reports the topology, every check and a healthy verdict."""
    assert main(["doctor", "--nproc", "2"]) == 0
    out = capsys.readouterr().out
    assert "pdist doctor: 2 ranks on 1 host(s), 2 per host; backend gloo" in out
    for name, _ in doctor.CHECKS:
        assert f"check {name:<20} ok" in out
    assert "verdict: healthy" in out
    assert f"torch {torch.__version__} supports:" in out
    for line in doctor.torch_support():  # what this torch offers, as _compat probed it
        assert f"  {line}\n" in out
    for internal in ("tensor_collective_names", "store_clone", "destroy_wait_sec", "*_single"):
        assert internal not in out


def test_doctor_names_the_failing_check():
    """A failed check makes the verdict unhealthy, naming the check and ranks; exit code 1."""
    me = {"rank": 0, "host": "h", "device": "cpu", "gpu": "-", "cpus": [0, 1, 2, 5], "node": [0, 1]}
    ok = [(name, None) for name, _ in doctor.CHECKS]
    bad = [
        (name, "AssertionError: got [1.0]" if name == "all_gather" else None)
        for name, _ in doctor.CHECKS
    ]
    report = {
        "world_size": 2,
        "backend": "gloo",
        "torch": ["2.6.0", "devices: CUDA only", "device_mesh(): yes, over pdist's groups"],
        "timeout": 30.0,
        "subgroup_timeout": 30.0,
        "guard_timeout": None,
        "ranks": [{"me": me, "results": ok}, {"me": {**me, "rank": 1}, "results": bad}],
    }
    text, code = doctor.render(report)
    assert code == 1
    assert "check all_gather           FAILED" in text
    assert (
        "verdict: UNHEALTHY: check 'all_gather' failed on ranks [1]: AssertionError: got [1.0]"
        in text
    )
    assert "0-2,5" in text
    assert "start-up guard forever" in text
    assert "torch 2.6.0 supports:\n  devices: CUDA only\n  device_mesh(): yes" in text


@pytest.mark.parametrize(
    "argv",
    [
        ["doctor", "--nproc", "0"],
        ["doctor", "--nproc", "-3"],
        ["doctor", "--nproc", "two"],
        ["bench", "--nproc", "0"],
        ["bench", "--stall-overhead"],
        ["bench", "--simulate-world", "default"],
        ["frobnicate"],
        ["bench", "--fast"],
        [],
    ],
)
def test_bad_input_exits_2_with_usage(argv, capsys):
    """Unknown subcommands or flags and non-positive counts: usage and exit code 2."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert "usage: pdist" in capsys.readouterr().err


QUICK_TENSOR_CASES = {
    # case: the torch baseline it must have
    "all_reduce 1 MiB": "torch",
    "all_gather 1 MiB": "torch",
    "all_reduce_ 1 MiB": "torch",
    "all_reduce async 1 MiB": "torch_functional",
    # torch's reduce_scatter_tensor where gloo has one (2.13 does), always the gloo equivalent
    "reduce_scatter 1 MiB": "torch_all_to_all_then_sum",
    "all_gather dim=-1 1 MiB": "torch",
}


def test_bench_quick_writes_every_figure(tmp_path, capsys):
    """bench --quick --json records the set-up and every case with medians and ratios."""
    path = tmp_path / "bench.json"
    assert main(["bench", "--quick", "--nproc", "2", "--json", str(path)]) == 0
    report = json.loads(path.read_text())
    assert report["torch_version"] == torch.__version__
    assert report["backend"] == "gloo"
    assert report["device"] == "cpu"
    assert report["world_size"] == 2
    assert report["quick"] is True
    records = report["records"]
    names = [r["name"] for r in records]
    assert "structured broadcast (c) tiny dict" in names
    assert "collate_batches 32 x [5000, 8]" in names
    for name, baseline in QUICK_TENSOR_CASES.items():
        record = records[names.index(name)]
        assert baseline in record["ratios"], (name, record["ratios"])
    for record in records:
        assert record["world_size"] == 2
        assert record["bytes"] > 0
        assert record["seconds"]["pdist"] > 0
        baselines = [k for k in record["seconds"] if k != "pdist"]
        assert baselines
        for name in baselines:
            expected = record["seconds"]["pdist"] / record["seconds"][name]
            assert record["ratios"][name] == pytest.approx(expected)
    out = capsys.readouterr().out
    assert "pdist bench: 2 ranks, gloo on cpu, torch " in out
    assert "quick run" in out


def test_stall_overhead_table():
    """--stall-overhead prints each case's medians, the median pair ratio and the watch's CPU."""
    from benchmarks.stall import format_overhead

    report = {
        "world_size": 2,
        "runs": 2,
        "torch_version": "2.13.0",
        "cases": {"all_reduce 1 MiB": {"on": [1e-3, 3e-3], "off": [1e-3, 2e-3], "ratio": 1.25}},
        "watch_cpu_per_second": [2e-4, 4e-4],
        "hook_seconds_per_call": {"record on": 2e-6, "record off": 5e-7},
        "recorder_sees_gloo": True,
    }
    text = format_overhead(report)
    assert "2 watched and 2 unwatched worlds, alternated" in text
    assert "all_reduce 1 MiB" in text
    assert "2000us     1500us   1.250  (1.00, 1.50)" in text
    assert "used 0.30 ms of CPU per second" in text
    assert "record (gloo p2p only): 2000 ns per call while the watch is on, 500 ns" in text


class _Stream(io.StringIO):
    def __init__(self, tty):
        super().__init__()
        self.tty = tty

    def isatty(self):
        return self.tty


@world_sizes(1)
def test_bench_progress_only_on_a_terminal(ctx):
    """Progress goes to stderr on a TTY only; piped stderr gets no progress lines."""
    case = Case("noop", 1, lambda ctx, stack: {"pdist": lambda: None, "base": lambda: None})
    for tty in (False, True):
        stream = _Stream(tty)
        saved, sys.stderr = sys.stderr, stream
        try:
            records = list(run_cases(ctx, [case], quick=True, progress=True))
        finally:
            sys.stderr = saved
        assert [r.name for r in records] == ["noop"]
        assert ("[1/1] noop" in stream.getvalue()) == tty
        assert (stream.getvalue() == "") == (not tty)


def test_bench_synchronizes_accelerators_before_reading_the_clock(monkeypatch):
    """On a non-CPU device every timer read follows a device synchronize; on CPU none is needed."""
    calls = []
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda device=None: calls.append(device))
    assert bench._synchronizer(torch.device("cpu"))() is None
    assert calls == []
    sync = bench._synchronizer(torch.device("cuda", 1))
    bench._batch(lambda: None, 3, sync)
    assert calls == [torch.device("cuda", 1)] * 2


def test_python_dash_m_pdist_runs_the_command_line():
    """``python -m pdist`` is the same command line (here: usage and exit code 2)."""
    out = subprocess.run(
        [sys.executable, "-m", "pdist", "frobnicate"], capture_output=True, text=True, check=False
    )
    assert out.returncode == 2
    assert "usage: pdist" in out.stderr


def test_the_library_never_imports_the_command_line():
    """The CLI sits on top: importing pdist (and pdist.testing) loads no pdist.cli module."""
    code = "import sys, pdist, pdist.testing; print(sorted(m for m in sys.modules if 'cli' in m))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "pdist.cli" not in out.stdout


def test_doctor_says_in_plain_words_what_an_older_torch_lacks():
    """A torch without split_group, a flight recorder or FSDP2 on CPU: said as such."""
    import attrs

    old = attrs.evolve(
        FEATURES,
        split_group=False,
        flight_recorder=None,
        fsdp2_on_cpu=False,
        accelerator_api=False,
        destroy_wait_sec=0.5,
    )
    lines = doctor.torch_support(old)
    assert "subgroups (patch_tp, new_group, layouts): each a new communicator" in lines
    assert "stall reports read pdist's own record (this torch has no flight recorder)" in lines
    assert "FSDP2 (fully_shard) with grad_sync: on GPU only (CPU needs torch 2.7+)" in lines
    assert "devices: CUDA only" in lines
    assert "leaving a block waits 0.5s for gloo's threads (a torch bug)" in lines


def _bench_record(name: str, ratios: dict[str, float], spreads: dict[str, list[float]]) -> dict:
    return {
        "name": name,
        "bytes": 1 << 20,
        "seconds": {"pdist": 1e-3},
        "ratios": ratios,
        "spreads": spreads,
        "algbw_gbps": 1.05,
        "busbw_gbps": 2.1,
    }


def test_bench_table_shows_spreads_units_cases_and_aligns_long_names():
    """Each ratio with its spread, GB/s in the header, (a)-(c) explained, long rows aligned."""
    from pdist.cli import _format

    records = [
        _bench_record("structured broadcast (a) 128 MiB + meta", {"raw": 1.1}, {"raw": [1.0, 1.2]}),
        _bench_record("moe_dispatch+combine 8 experts top-2 4096 x 256", {"torch": 0.9}, {}),
    ]
    text = _format(records, quick=True)
    lines = text.splitlines()
    assert "quick run: 3 batches per figure" in text
    assert "algbw GB/s" in text
    assert "busbw GB/s" in text
    assert "GB " not in text.replace("GB/s", "")
    assert "raw 1.10x [1.00-1.20]" in text
    assert "torch 0.90x" in text
    assert "(a) one 128 MiB tensor with metadata, against a raw broadcast" in text
    assert "(b) 1000 tensors" not in text  # only the cases the run had
    rows = [line for line in lines if " 1048576 " in line]
    assert len(rows) == 2
    assert len({row.index(" 1048576 ") for row in rows}) == 1, rows  # the bytes column lines up
    assert "quick run: " not in _format(records, quick=False)
