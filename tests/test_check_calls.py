"""Check mode cannot be half on: start-up agrees on the settings that change the wire."""

from __future__ import annotations

import os

import pytest

import pdist
from pdist.testing import spawn


def _check_on_one_rank() -> str:
    """PDIST_CHECK=1 on rank 1 only (as one node's environment would have it)."""
    os.environ["PDIST_CHECK"] = "1" if os.environ["RANK"] == "1" else "0"
    with pytest.raises(pdist.RankMismatchError) as info, pdist.distributed():
        pass
    return str(info.value)


def test_check_mode_on_one_rank_only_raises_at_start_up_on_every_rank():
    """The layout's agreement carries check mode: every rank names rank 1's setting."""
    for message in spawn(_check_on_one_rank, 3, timeout=90):
        assert "distributed(): ranks passed different arguments" in message, message
        assert "ranks [0, 2]: tp=1, sp=1, check=False, backend=gloo, device=cpu" in message
        assert "ranks [1]: tp=1, sp=1, check=True, backend=gloo, device=cpu" in message
