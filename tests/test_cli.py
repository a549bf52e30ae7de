"""The command line: doctor, bench, and bad input."""

from __future__ import annotations

import json

import pytest

from pdist import _doctor
from pdist.__main__ import main


def test_doctor_on_two_spawned_ranks(capsys):
    """doctor --nproc 2 reports the topology, every check and a healthy verdict."""
    assert main(["doctor", "--nproc", "2"]) == 0
    out = capsys.readouterr().out
    assert "pdist doctor: 2 ranks on 1 host(s), 2 per host; backend gloo" in out
    for name, _ in _doctor.CHECKS:
        assert f"check {name:<20} ok" in out
    assert "verdict: healthy" in out


def test_doctor_names_the_failing_check():
    """A failed check makes the verdict unhealthy, naming the check and ranks; exit code 1."""
    me = {"rank": 0, "host": "h", "device": "cpu", "gpu": "-", "cpus": [0, 1, 2, 5], "node": [0, 1]}
    ok = [(name, None) for name, _ in _doctor.CHECKS]
    bad = [
        (name, "AssertionError: got [1.0]" if name == "all_gather" else None)
        for name, _ in _doctor.CHECKS
    ]
    report = {
        "world_size": 2,
        "backend": "gloo",
        "timeout": 30.0,
        "subgroup_timeout": 30.0,
        "guard_timeout": None,
        "ranks": [{"me": me, "results": ok}, {"me": {**me, "rank": 1}, "results": bad}],
    }
    text, code = _doctor.render(report)
    assert code == 1
    assert "check all_gather           FAILED" in text
    assert (
        "verdict: UNHEALTHY: check 'all_gather' failed on ranks [1]: AssertionError: got [1.0]"
        in text
    )
    assert "0-2,5" in text
    assert "start-up guard forever" in text


@pytest.mark.parametrize(
    "argv",
    [
        ["doctor", "--nproc", "0"],
        ["doctor", "--nproc", "-3"],
        ["doctor", "--nproc", "two"],
        ["bench", "--nproc", "0"],
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


def test_bench_quick_writes_every_figure(tmp_path, capsys):
    """bench --quick --json records every case with medians and ratios against baselines."""
    path = tmp_path / "bench.json"
    assert main(["bench", "--quick", "--nproc", "2", "--json", str(path)]) == 0
    records = json.loads(path.read_text())
    names = [r["name"] for r in records]
    assert "structured broadcast (c) tiny dict" in names
    assert "collate_batches 32 x [5000, 8]" in names
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
    assert "pdist bench: 2 ranks, quick run" in out
