"""CPU affinity (pure) and NVML mapping; NVML itself only with a GPU."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import types

import pytest
import torch

import pdist
from pdist import _topology
from pdist.testing import world_sizes


def test_set_cpu_affinity_intersects_with_the_allowed_set(monkeypatch):
    """Only CPUs this process may use are applied."""
    applied = []
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(os, "sched_setaffinity", lambda pid, cpus: applied.append(set(cpus)))
    assert pdist.set_cpu_affinity({2, 3, 4, 5}) == frozenset({2, 3})
    assert applied == [{2, 3}]


def test_set_cpu_affinity_none_allowed_warns_and_keeps(monkeypatch, caplog):
    """With no allowed CPU in the request, the current set stays and a warning says why."""
    applied = []
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(os, "sched_setaffinity", lambda pid, cpus: applied.append(cpus))
    with caplog.at_level(logging.WARNING, logger="pdist"):
        assert pdist.set_cpu_affinity({8, 9}) == frozenset({0, 1})
    assert applied == []
    assert "none of the CPUs [8, 9] is allowed" in caplog.records[0].getMessage()


def test_set_cpu_affinity_for_real():
    """Applying the current set is accepted by the kernel and round-trips."""
    current = os.sched_getaffinity(0)
    assert pdist.set_cpu_affinity(current) == frozenset(current)
    assert os.sched_getaffinity(0) == current


def test_gpu_affinity_the_kernel_refuses_warns_and_keeps(monkeypatch, caplog):
    """A CPU set the kernel refuses (offline CPUs, a cgroup) is a warning, not a failed start-up."""

    def refuse(pid, cpus):
        raise OSError(22, "Invalid argument")

    fake_nvml = types.SimpleNamespace(  # NVML as a driver answers: CPUs 0 and 1 are near GPU 0
        nvmlInit=lambda: None,
        nvmlShutdown=lambda: None,
        nvmlDeviceGetHandleByIndex=lambda index: index,
        nvmlDeviceGetCpuAffinity=lambda handle, words: [0b11] + [0] * (words - 1),
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(os, "sched_setaffinity", refuse)
    with caplog.at_level(logging.WARNING, logger="pdist"):
        assert _topology.apply_gpu_affinity(torch.device("cuda", 0)) is None
    assert "not pinning CPU affinity for cuda:0" in caplog.text
    assert "Invalid argument" in caplog.text


@pytest.mark.parametrize(
    ("visible", "index", "expected"),
    [
        (None, 1, 1),
        ("", 1, 1),
        ("3,1", 0, 3),
        ("3, 1", 1, 1),
        ("GPU-aaaa,GPU-bbbb", 1, "GPU-bbbb"),
        ("MIG-1234", 0, "MIG-1234"),
    ],
)
def test_cuda_visible_devices_mapping(visible, index, expected):
    """torch's device index maps through CUDA_VISIBLE_DEVICES (indices and UUIDs)."""
    env = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    assert _topology._nvml_device_id(index, env) == expected


def test_cuda_visible_devices_out_of_range():
    """An index beyond the visible list is a clear error."""
    with pytest.raises(ValueError, match=r"device_index=2 is beyond CUDA_VISIBLE_DEVICES='0,1'"):
        _topology._nvml_device_id(2, {"CUDA_VISIBLE_DEVICES": "0,1"})


def test_cpu_masks_to_cpu_sets():
    """NVML's 64-bit affinity words become CPU indices."""
    assert _topology._cpus_from_masks([0b101, 0b1]) == frozenset({0, 2, 64})
    assert _topology._cpus_from_masks([0]) == frozenset()


def test_gpu_cpu_affinity_without_nvml_raises_clearly():
    """Without a GPU driver, gpu_cpu_affinity raises PdistError (distributed() skips instead)."""
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(pdist.PdistError, match="NVML"):
        pdist.gpu_cpu_affinity(0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_cpu_affinity_on_a_gpu():
    """On a GPU machine NVML reports a non-empty CPU set for device 0."""
    cpus = pdist.gpu_cpu_affinity(0)
    assert cpus
    assert all(isinstance(c, int) for c in cpus)


@world_sizes(2, 3)
def test_same_node_ranks_on_one_host(ctx):
    """On one host every rank shares the source's host; the probe leaves no /dev/shm entry."""
    before = set(os.listdir("/dev/shm"))
    for source in range(ctx.world_size):
        assert pdist.same_node_ranks(ctx, source_rank=source) == list(range(ctx.world_size))
    pdist.barrier(ctx)
    leftovers = {n for n in set(os.listdir("/dev/shm")) - before if n.startswith("pdist-probe")}
    assert leftovers == set()
    with pytest.raises(ValueError, match="source_rank=9 is outside"):
        pdist.same_node_ranks(ctx, source_rank=9)


NO_NUMPY_SITE = 'import sys\nsys.modules["numpy"] = None  # any `import numpy` raises ImportError\n'

NO_NUMPY_RANKS = """
import sys
import torch
import pdist
from pdist.testing import spawn


def ranks():
    assert sys.modules["numpy"] is None  # this rank's interpreter cannot import numpy
    with pdist.distributed() as ctx:
        got = pdist.all_gather_object(ctx, {"rank": ctx.rank, "t": torch.full((3,), ctx.rank)})
        assert [g["rank"] for g in got] == [0, 1]
        assert torch.equal(got[1]["t"], torch.full((3,), 1))
        assert pdist.broadcast_object(ctx, "hello" if ctx.rank == 0 else None) == "hello"
        assert pdist.gather_object(ctx, ctx.rank, dst=0) == ([0, 1] if ctx.rank == 0 else None)
        return ctx.world_size


if __name__ == "__main__":
    print(spawn(ranks, 2, timeout=60))
"""


def test_distributed_and_object_collectives_need_no_numpy(tmp_path):
    """Two ranks whose interpreters cannot import numpy start pdist and move objects."""
    (tmp_path / "sitecustomize.py").write_text(NO_NUMPY_SITE)  # runs in every rank's process
    script = tmp_path / "no_numpy.py"
    script.write_text(NO_NUMPY_RANKS)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), root])}
    out = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[2, 2]"
