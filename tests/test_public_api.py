"""The public surface: __all__ is sorted and complete; importing pdist does not import pytest."""

from __future__ import annotations

import subprocess
import sys

import pdist

PUBLIC = {
    "DistContext",
    "Group",
    "PdistError",
    "RankMismatchError",
    "barrier",
    "device_mesh",
    "distributed",
    "gpu_cpu_affinity",
    "is_rank0",
    "new_sp_group",
    "new_tp_group",
    "patch_tp",
    "rank0_first",
    "rank0_only",
    "same_node_ranks",
    "set_cpu_affinity",
}


def test_all_is_sorted_and_complete():
    """__all__ lists exactly the public names, sorted, and each one exists."""
    assert pdist.__all__ == sorted(pdist.__all__)
    assert set(pdist.__all__) == PUBLIC
    for name in pdist.__all__:
        assert getattr(pdist, name) is not None
    exported = {
        n for n in dir(pdist) if not n.startswith("_") and n not in {"testing", "annotations"}
    }
    assert exported == PUBLIC


def test_importing_pdist_does_not_import_pytest():
    """pytest is an optional dependency."""
    code = "import sys, pdist, pdist.testing; print('pytest' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_errors_hierarchy():
    """PdistError is a RuntimeError; RankMismatchError is a PdistError."""
    assert issubclass(pdist.PdistError, RuntimeError)
    assert issubclass(pdist.RankMismatchError, pdist.PdistError)
