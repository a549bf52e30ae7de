"""The public surface: __all__ is sorted and complete; importing pdist does not import pytest."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pdist

PUBLIC = {
    # context
    "distributed",
    "DistContext",
    "Group",
    "patch_tp",
    "patch_sp",
    "new_tp_group",
    "new_sp_group",
    "new_group",
    "device_mesh",
    "flatten",
    # ranks
    "is_rank0",
    "is_local_rank0",
    "rank0_only",
    "rank0_first",
    "barrier",
    # tensors
    "all_reduce",
    "all_reduce_",
    "all_gather",
    "all_gather_tensor",
    "gather",
    "reduce",
    "reduce_scatter",
    "broadcast",
    "broadcast_",
    "all_to_all",
    "all_to_all_4d",
    "shard",
    "moe_dispatch",
    "moe_combine",
    "send",
    "recv",
    # objects
    "broadcast_object",
    "broadcast_object_list",
    "all_gather_object",
    "gather_object",
    "send_object",
    "recv_object",
    "broadcast_tensor_dict",
    "send_tensor_dict",
    "recv_tensor_dict",
    # evaluation
    "EvalSampler",
    "collate_batches",
    # training
    "grad_sync",
    "wrap_ddp",
    "DistributedDataParallel",
    "sync_model_states",
    # sequence parallelism
    "ulysses_attention",
    # start-up
    "world_comm_guard",
    "world_comm_timeout",
    "WORLD_COMM_TIMEOUT_EXIT_CODE",
    # stalls
    "STALL_EXIT_CODE",
    # links and weights
    "link",
    "broadcast_weights",
    # replicas
    "fault_tolerant",
    # same host
    "message_queue",
    "graph_capture",
    # topology
    "same_node_ranks",
    "gpu_cpu_affinity",
    "set_cpu_affinity",
    # errors
    "PdistError",
    "RankMismatchError",
    "PeerLeftError",
    "RemoteError",
    "RemoteTypeError",
    "RemoteValueError",
    "RemoteRankMismatchError",
}


def test_all_is_sorted_and_complete():
    """__all__ lists exactly the public names, sorted, and each one exists."""

    # isort-style order, as ruff keeps it: CONSTANTS, then Classes, then functions.
    def key(name: str) -> tuple[int, str]:
        return (0 if name.isupper() else 1 if name[0].isupper() else 2, name)

    assert pdist.__all__ == sorted(pdist.__all__, key=key)
    assert set(pdist.__all__) == PUBLIC
    for name in pdist.__all__:
        assert getattr(pdist, name) is not None
    exported = {n for n in dir(pdist) if not n.startswith("_") and n not in {"testing", "cli"}}
    assert exported == PUBLIC


def test_every_public_name_is_in_the_api_reference():
    """docs/api.md documents every name of __all__ (and nothing that is gone)."""
    api = (Path(__file__).parent.parent / "docs" / "api.md").read_text()
    documented = set(re.findall(r"^::: pdist\.(\w+)$", api, flags=re.MULTILINE))
    assert documented == set(pdist.__all__)


def test_importing_pdist_does_not_import_pytest():
    """pytest is an optional dependency."""
    code = "import sys, pdist, pdist.testing; print('pytest' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_errors_hierarchy():
    """PdistError is a RuntimeError; RankMismatchError is a PdistError."""
    assert issubclass(pdist.PdistError, RuntimeError)
    assert issubclass(pdist.RankMismatchError, pdist.PdistError)


NO_NUMPY = """
import sys
sys.modules["numpy"] = None  # any `import numpy` now raises ImportError
import torch
from pdist import _payload
obj = {"t": torch.arange(5.0), "nested": [torch.ones(2, dtype=torch.bool), "x"]}
encoded = _payload.encode(obj, torch.device("cpu"), min_tensor_bytes=8)
decoded = _payload.decode(encoded.body)
buffers = [encoded.pack(i) for i in range(len(encoded.buckets))]
out = _payload.materialize(decoded, buffers, torch.device("cpu"))
assert torch.equal(out["t"], obj["t"]) and out["nested"][1] == "x"
print("ok")
"""


def test_object_transport_needs_no_numpy():
    """pdist's object encoding works where numpy cannot be imported."""
    out = subprocess.run(
        [sys.executable, "-c", NO_NUMPY], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "ok"
