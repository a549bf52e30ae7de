"""The stall watch: settings, the report's rules on plain records, and real stalled gloo worlds.

The multi-rank tests use a stall_timeout of 2 s and a shorter answer wait
(``PDIST_STALL_ANSWER_SEC``, how long a report waits for the ranks' answers;
10 s by default). A round ends as soon as every rank answered, so where all
answer the wait is generous (6 s, for a loaded machine); where a rank is
frozen, the whole wait passes (3 s).
"""

from __future__ import annotations

import json
import logging
import os
import re
import textwrap
import threading
import time
from datetime import timedelta

import pytest
import torch
from launcher import run_ranks

import pdist
from pdist import _compat, _env
from pdist._stall import _read_answers
from pdist._stall_report import format_ranks, format_report, picture, stalled
from pdist.testing import spawn

pytestmark = pytest.mark.serial  # stall reports and deadlines, seconds apart: run alone

SEES_GLOO = _compat.recorder_sees_gloo()
FAST = {"PDIST_STALL_ANSWER_SEC": "6"}

# --------------------------------------------------------------------------- settings

TIMEOUT_TABLE = [
    # raw PDIST_STALL_TIMEOUT_SEC, expected, warns
    (None, 300.0, False),
    ("", 300.0, False),
    ("abc", 300.0, True),
    ("nan", 300.0, True),
    ("inf", 300.0, True),
    ("-5", 300.0, True),
    ("0", None, False),
    ("7.5", 7.5, False),
]


@pytest.mark.parametrize(("raw", "expected", "warns"), TIMEOUT_TABLE)
def test_stall_timeout_from_the_environment(raw, expected, warns, caplog):
    """PDIST_STALL_TIMEOUT_SEC: default 300 s, 0 is off, garbage warns and keeps 300 s."""
    env = {} if raw is None else {"PDIST_STALL_TIMEOUT_SEC": raw}
    with caplog.at_level(logging.WARNING, logger="pdist"):
        seconds, mode, answer = _env.stall_settings(None, environ=env)
    assert (seconds, mode, answer) == (expected, "report", 10.0)
    assert bool(caplog.records) == warns
    if warns:
        assert "PDIST_STALL_TIMEOUT_SEC" in caplog.records[0].getMessage()
        assert "default 300s" in caplog.records[0].getMessage()


def test_stall_arguments_win_and_are_checked():
    """Seconds or a timedelta; 0 is off; bad values raise naming stall_timeout or on_stall."""
    env = {"PDIST_STALL_TIMEOUT_SEC": "9", "PDIST_ON_STALL": "exit", "PDIST_STALL_ANSWER_SEC": "3"}
    assert _env.stall_settings(4, environ=env) == (4.0, "exit", 3.0)
    assert _env.stall_settings(timedelta(minutes=1), "report", env) == (60.0, "report", 3.0)
    assert _env.stall_settings(0, environ=env)[0] is None
    assert _env.stall_settings(timedelta(0), environ=env)[0] is None
    with pytest.raises(ValueError, match=r"stall_timeout=-1 must be a finite positive"):
        _env.stall_settings(-1, environ={})
    with pytest.raises(ValueError, match=r"stall_timeout=nan must be a finite positive"):
        _env.stall_settings(float("nan"), environ={})
    with pytest.raises(TypeError, match=r"stall_timeout='5' must be a number of seconds"):
        _env.stall_settings("5", environ={})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"on_stall='abort' is not one of \('report', 'exit'\)"):
        _env.stall_settings(None, "abort", {})


def test_pdist_on_stall_sets_the_default_only():
    """PDIST_ON_STALL replaces the default; a bad value is a ValueError naming the variable."""
    assert _env.stall_settings(None, environ={"PDIST_ON_STALL": " EXIT "})[1] == "exit"
    assert _env.stall_settings(None, "report", {"PDIST_ON_STALL": "exit"})[1] == "report"
    with pytest.raises(ValueError, match=r"PDIST_ON_STALL='quit' is not one of"):
        _env.stall_settings(None, environ={"PDIST_ON_STALL": "quit"})
    torchrun = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}
    request = _env.Request(stall_timeout=5)
    s = _env.resolve_settings(request, environ={**torchrun, "PDIST_ON_STALL": "exit"})
    assert (s.stall_timeout, s.on_stall, s.stall_answer) == (5.0, "exit", 10.0)


# --------------------------------------------------------------------------- the report


def _op(seq, op="gloo:all_reduce", sizes=((1024,),), dtypes=("Float",), age=12.0):
    return {"seq": seq, "op": op, "sizes": [list(s) for s in sizes], "dtypes": list(dtypes),
            "age": age}  # fmt: skip


def _record(rank, stack, *, inflight=None, enqueued=7, completed=6, key="0", label="world"):
    last = _op(completed, age=30.0)
    group = {"key": key, "label": label, "source": "flight recorder", "enqueued": enqueued,
             "completed": completed, "inflight": inflight, "last": last}  # fmt: skip
    return {"rank": rank, "host": "h", "stack": stack, "site": f"{stack[0][0]}:{stack[0][1]} in "
            f"{stack[0][2]}", "groups": [group]}  # fmt: skip


WAITING = [["train.py", 40, "step"], ["train.py", 90, "main"]]
LOADING = [["data.py", 12, "load_batch"], ["train.py", 88, "main"]]


def test_format_ranks_writes_ranges():
    """Ranks become sorted ranges; past the limit a count ends the list."""
    assert format_ranks([3, 0, 1, 2, 8, 5, 6, 7]) == "0-3, 5-8"
    assert format_ranks([4]) == "4"
    assert format_ranks([]) == "none"
    assert format_ranks(range(0, 100, 2), limit=3) == "0, 2, 4, ... (50 ranks in all)"


def test_report_says_who_waits_where_and_who_is_elsewhere():
    """Ranks in the collective, the rank that has not entered it, each stack once, no answer."""
    records = [_record(r, WAITING, inflight=_op(7)) for r in (0, 1)]
    records.append(_record(2, LOADING, enqueued=6))
    text = format_report(records, world_size=4, stall_timeout=5, round_no=1)
    assert "waited 12.0s, past stall_timeout=5s; 3 of 4 ranks answered" in text
    assert "group world (pg 0, flight recorder), ranks 0-2:" in text
    assert "ranks 0-1 in gloo:all_reduce #7 [1024] Float, waiting 12.0s" in text
    assert "called from train.py:40 in step" in text
    assert "rank 2 not entered #7; last completed gloo:all_reduce #6 [1024] Float" in text
    assert text.count("train.py:90 in main") == 1  # ranks 0 and 1 share one stack
    assert "rank 2 on h:\n      data.py:12 in load_batch" in text
    assert text.endswith("did not answer (dead, stopped, or holding the GIL): 3")
    assert stalled(records, 5)
    assert not stalled(records, 13)


def test_report_flags_a_desync():
    """Ranks at one sequence number in different collectives are called out."""
    records = [
        _record(0, WAITING, inflight=_op(7)),
        _record(1, LOADING, inflight=_op(7, op="gloo:broadcast", sizes=[(8,)], dtypes=["Long"])),
    ]
    text = format_report(records, world_size=2, stall_timeout=5)
    assert (
        "DESYNC at #7: rank 0: gloo:all_reduce #7 [1024] Float | rank 1: gloo:broadcast #7 [8] Long"
    ) in text


def test_report_at_8192_ranks_is_short():
    """8192 ranks: ranges, merged stacks and capped sections keep it to a few dozen lines."""
    records = []
    for r in range(8192):
        if r == 7 or r == 5000:
            continue  # did not answer
        if r % 1024 == 3:
            records.append(_record(r, [["data.py", r, "load"]], enqueued=6))  # distinct stacks
        else:
            records.append(_record(r, WAITING, inflight=_op(7, age=300.0 + r % 3)))
    text = format_report(records, world_size=8192, stall_timeout=300)
    lines = text.splitlines()
    assert len(lines) < 80, text
    assert max(len(line) for line in lines) < 400
    assert "8190 of 8192 ranks answered" in text
    assert "did not answer (dead, stopped, or holding the GIL): 7, 5000" in text
    assert "ranks 0-2, 4-6, 8-1026, 1028-2050" in text
    assert "... 3 more distinct stacks on ranks 5123, 6147, 7171" in text
    assert "ranks 3, 1027, 2051, 3075, 4099, 5123, 6147, 7171 not entered #7" in text


def test_picture_ignores_ages_but_not_moves():
    """The digest deciding whether to report again ignores ages; a moved stack changes it."""
    a = [_record(0, WAITING, inflight=_op(7, age=5.0))]
    b = [_record(0, WAITING, inflight=_op(7, age=50.0))]
    c = [_record(0, LOADING, inflight=_op(7, age=50.0))]
    assert picture(a, 2) == picture(b, 2) != picture(c, 2)


def test_a_malformed_answer_counts_as_no_answer():
    """A peer's answer that is not a record is left out, as if that rank had not answered.

    Not JSON, nested past the interpreter's recursion limit, the wrong shape, another
    rank's: the report goes on with the answers that are records.
    """
    store = torch.distributed.HashStore()
    answers = [
        json.dumps(_record(0, WAITING, inflight=_op(7))),
        "[" * 1500 + "]" * 1500,  # past the recursion limit: refused, not raised
        "not json",
        json.dumps({**_record(3, WAITING), "stack": [["train.py", 40]]}),
        json.dumps(_record(0, WAITING)),  # under rank 4's key
    ]
    for rank, raw in enumerate(answers):
        store.set(f"answer/1/{rank}", raw)
    assert [r["rank"] for r in _read_answers(store, 1, 6)] == [0]


# --------------------------------------------------------------------------- real stalls

OTHER_PATH = """
    import logging, time, torch, pdist
    logging.basicConfig(format="%(created).3f %(message)s")

    def load_data():
        time.sleep(9)  # rank 2: past stall_timeout, in a function of the script

    def step(ctx):
        return pdist.all_reduce(ctx, torch.ones(256 * 1024))

    with pdist.distributed(stall_timeout=2, on_stall=ON_STALL) as ctx:
        pdist.barrier(ctx)
        print(f"T0 {time.time():.3f}", flush=True)
        if ctx.rank == 2:
            load_data()
        step(ctx)
    print("DONE", flush=True)
"""


def _line_of(code: str, needle: str) -> int:
    return next(i for i, line in enumerate(textwrap.dedent(code).splitlines(), 1) if needle in line)


def _report(output: str) -> str:
    """The report a rank logged: from its header to the did-not-answer line."""
    match = re.search(r"pdist: stall report .*?did not answer[^\n]*", output, flags=re.DOTALL)
    assert match is not None, output
    return match.group(0)


def _reported_within(output: str, seconds: float) -> None:
    start = float(re.search(r"T0 ([\d.]+)", output).group(1))
    logged = float(re.search(r"([\d.]+) pdist: stall report", output).group(1))
    assert logged - start < seconds, (logged - start, output)


@pytest.mark.timeout(90)
def test_a_rank_on_another_path_is_named_with_its_frame():
    """Ranks 0-1 wait in all_reduce, rank 2 sleeps in load_data: one report says so."""
    results = run_ranks(OTHER_PATH.replace("ON_STALL", '"report"'), 3, timeout=60, env=FAST)
    for r in results:
        assert r.returncode == 0, r.output
        assert "DONE" in r.output
    out = results[0].output
    report = _report(out)
    _reported_within(out, 2 + 15)
    assert re.search(
        r"ranks 0-1 in (gloo:)?all_reduce #\d+ \[262144\] (Float|float32), waiting", report
    )
    assert f"rank.py:{_line_of(OTHER_PATH, 'return pdist.all_reduce')} in step" in report
    assert re.search(
        rf"rank 2 on .*:\n +\S+rank\.py:{_line_of(OTHER_PATH, 'sleep(9)')} in load_data", report
    )
    assert re.search(r"rank 2 not entered #\d+; last completed", report), report
    assert "3 of 3 ranks answered" in report
    assert report.endswith("did not answer (dead, stopped, or holding the GIL): none")
    # Still stalled 2 s after the report, but nothing moved: no second report.
    assert out.count("pdist: stall report") == 1, out
    for r in results[1:]:
        assert "rank 0 logged the stall report (round 1)" in r.output
        assert "pdist: stall report" not in r.output


DDP = """
    import time, torch, pdist

    def load_batch(rank, step):
        if rank == 1 and step == 2:  # after DDP rebuilt its buckets (step 1)
            time.sleep(9)
        return torch.randn(8, 16)

    def train(ctx):
        net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 1))
        model = pdist.wrap_ddp(ctx, net)
        for step in range(3):
            x = load_batch(ctx.rank, step)
            model(x).sum().backward()

    with pdist.distributed(stall_timeout=2) as ctx:
        train(ctx)
    print("DONE", flush=True)
"""


@pytest.mark.timeout(90)
@pytest.mark.skipif(
    not SEES_GLOO,
    reason="DDP's bucket all-reduce runs in C++ and this torch's flight recorder records no gloo",
)
def test_a_stall_inside_ddp_shows_the_bucket_all_reduce_and_the_loader():
    """Ranks 0 and 2 wait in DDP's bucket all-reduce under backward; rank 1 is in its loader."""
    results = run_ranks(DDP, 3, timeout=60, env=FAST)
    for r in results:
        assert r.returncode == 0, r.output
    report = _report(results[0].output)
    assert re.search(r"ranks 0, 2 in gloo:all_reduce #\d+ \[577\] Float", report), report
    assert "torch/autograd/__init__.py" in report
    assert f"rank.py:{_line_of(DDP, 'backward()')} in train" in report
    assert f"rank.py:{_line_of(DDP, 'sleep(9)')} in load_batch" in report
    assert re.search(r"rank 1 not entered #\d+; last completed gloo:all_reduce", report)


@pytest.mark.timeout(90)
def test_on_stall_exit_ends_every_answering_rank_with_94():
    """With on_stall="exit", all three ranks (the sleeping one too) exit 94 after the report."""
    results = run_ranks(OTHER_PATH.replace("ON_STALL", '"exit"'), 3, timeout=60, env=FAST)
    for r in results:
        assert r.returncode == pdist.STALL_EXIT_CODE, r.output
        assert "DONE" not in r.output
    _reported_within(results[0].output, 2 + 15)
    assert "3 of 3 ranks answered" in _report(results[0].output)


FROZEN = """
    import os, signal, torch, pdist
    with pdist.distributed(stall_timeout=2, on_stall="exit") as ctx:
        pdist.barrier(ctx)
        if ctx.rank == 2:
            os.kill(os.getpid(), signal.SIGSTOP)
        pdist.all_reduce(ctx, torch.ones(4))
"""


@pytest.mark.timeout(90)
def test_a_frozen_rank_is_reported_as_not_answering():
    """A SIGSTOPped rank cannot answer: the report names it; the others exit 94."""
    results = run_ranks(FROZEN, 3, timeout=60, env={"PDIST_STALL_ANSWER_SEC": "3"}, wait_for=[0, 1])
    for r in results[:2]:
        assert r.returncode == pdist.STALL_EXIT_CODE, r.output
    report = _report(results[0].output)
    assert "2 of 3 ranks answered" in report
    assert report.endswith("did not answer (dead, stopped, or holding the GIL): 2")
    assert results[2].returncode is None  # still stopped when the run was ended


def _watch_quietly() -> list[str]:
    """Compute, then sleep, past stall_timeout between collectives: nothing is reported."""
    seen: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("pdist").addHandler(handler)
    try:
        with pdist.distributed(stall_timeout=2) as ctx:
            assert any(t.name == "pdist-stall" for t in threading.enumerate())
            pdist.all_reduce(ctx, torch.ones(4))
            x, start = torch.randn(64, 64), time.monotonic()
            while time.monotonic() - start < 3.5:
                x = torch.tanh(x @ x)
            pdist.all_reduce(ctx, torch.ones(4))
            time.sleep(3.5)
            pdist.broadcast_object(ctx, {"step": 1})
            pdist.barrier(ctx)
    finally:
        logging.getLogger("pdist").removeHandler(handler)
    return seen


@pytest.mark.timeout(90)
def test_no_false_alarm_between_collectives():
    """A block that computes or sleeps longer than stall_timeout between collectives is quiet."""
    assert spawn(_watch_quietly, 2, timeout=60) == [[], []]


def _keys() -> int:
    return int(_compat.default_store().num_keys())


# A store call bounded by pdist (_departures.bounded) that outlives its bound is left to end
# in its own thread: here, one new TCP store connection in about 25 takes 5 s to connect.
_BOUNDED = "pdist-exit-records"


def _pdist_threads() -> list[str]:
    names = (t.name for t in threading.enumerate() if t.name.startswith("pdist"))
    return sorted(n for n in names if n != _BOUNDED)


def _threads() -> tuple[int, list[str]]:
    bounded = sum(t.name == _BOUNDED for t in threading.enumerate())
    return threading.active_count() - bounded, _pdist_threads()


def _blocks(n: int) -> dict[str, object]:
    os.environ.update(FAST)
    fr = _compat.FEATURES.flight_recorder_env
    user_set = fr in os.environ
    threads, keys, inside = [], [], []
    for stall in [2] * n + [0]:
        with pdist.distributed(stall_timeout=stall) as ctx:
            pdist.barrier(ctx)
            keys.append(_keys())
            inside.append((_pdist_threads(), os.environ.get(fr)))
            pdist.barrier(ctx)
        threads.append(_threads())
    # A block with a real stall round (rank 1 sleeps past stall_timeout), then a healthy one.
    for stall in (1, 1):
        with pdist.distributed(stall_timeout=stall) as ctx:
            pdist.barrier(ctx)
            keys.append(_keys())
            if ctx.rank == 1 and len(keys) == n + 2:
                time.sleep(3)
            pdist.all_reduce(ctx, torch.ones(1))
            pdist.barrier(ctx)
        threads.append(_threads())
    ends = time.monotonic() + 15  # the bounded store calls end too
    while any(t.name == _BOUNDED for t in threading.enumerate()) and time.monotonic() < ends:
        time.sleep(0.1)
    threads.append((threading.active_count(), _pdist_threads()))
    return {"threads": threads, "keys": keys, "inside": inside, "user_set": user_set}


@pytest.mark.timeout(120)
def test_threads_and_store_keys_stay_flat_over_blocks():
    """20 watched blocks leave no pdist thread and no watch key; stall_timeout=0 starts no thread.

    Each block adds the same few keys of its own start-up (check-ins, torch's group
    rendezvous, the roll call's) whatever the watch does: the count must stay on one line,
    also across a block where ranks answered a stall round.
    """
    n = 20
    for out in spawn(_blocks, 2, n, timeout=100):
        assert all(t == out["threads"][0] for t in out["threads"]), out["threads"]
        assert out["threads"][0][1] == []  # no pdist thread outlives its block
        # The other rank's next start-up may add its keys before this rank counts: a count
        # may run ahead of the line by a block's keys, never away from it.
        keys = out["keys"]
        step = (keys[n - 1] - keys[0]) // (n - 1)  # the watched blocks' growth
        line = all(abs(k - keys[0] - i * step) <= step for i, k in enumerate(keys[:n]))
        assert line, str(keys)
        # An unwatched block adds fewer (no roll call of the watch's), a stall round no more.
        assert all(0 < b - a <= step for a, b in zip(keys[n - 1 :], keys[n:], strict=False)), str(
            keys
        )
        fr = None if out["user_set"] else str(2000)
        for names, env in out["inside"][:n]:  # the roll-call thread answers for the rank
            assert names == ["pdist-roll-call", "pdist-stall", "pdist-stall-answer"]
            assert out["user_set"] or env == fr
        unwatched = (["pdist-roll-call"], None if not out["user_set"] else out["inside"][n][1])
        assert out["inside"][n] == unwatched


def test_stall_exit_code_is_public():
    """STALL_EXIT_CODE is 94, next to the start-up guard's 93."""
    assert pdist.STALL_EXIT_CODE == 94 == pdist.WORLD_COMM_TIMEOUT_EXIT_CODE + 1


def test_report_hints_check_mode_only_under_a_desync():
    """A rank that never entered the collective: no check-mode hint; a desync: the hint."""
    behind = [_record(0, WAITING, inflight=_op(7)), _record(1, LOADING, enqueued=6)]
    assert "check mode" not in format_report(behind, world_size=2, stall_timeout=5)
    desync = [
        _record(0, WAITING, inflight=_op(7)),
        _record(1, LOADING, inflight=_op(7, op="gloo:broadcast", sizes=[(8,)], dtypes=["Long"])),
    ]
    assert "rerun with check mode" in format_report(desync, world_size=2, stall_timeout=5)


def test_report_says_the_exit_code_when_it_exits():
    """on_stall="exit": the report ends saying the ranks exit with 94, as start-up says 93."""
    records = [_record(0, WAITING, inflight=_op(7)), _record(1, LOADING, enqueued=6)]
    text = format_report(records, world_size=2, stall_timeout=5, exit_code=pdist.STALL_EXIT_CODE)
    assert text.splitlines()[-1].startswith("  on_stall='exit': exiting with code 94 on every rank")
    assert "exiting with code" not in format_report(records, world_size=2, stall_timeout=5)
