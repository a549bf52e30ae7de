"""Reading FSDP2's own per-module flags, for tests that check what grad_sync set."""

from __future__ import annotations

from typing import Any

import pytest
import torch

# torch 2.6's CPU streams cannot record events, which FSDP2 does in every forward.
needs_fsdp2_on_cpu = pytest.mark.skipif(
    not hasattr(torch.cpu.Stream, "record_event"),
    reason="FSDP2 on CPU needs torch >= 2.7 (pdist refuses it there: test_training)",
)


def param_groups(module: Any) -> list[Any]:
    """The FSDP parameter groups of one ``fully_shard`` module (torch < 2.7 keeps one)."""
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        groups = [] if group is None else [group]
    return list(groups)
