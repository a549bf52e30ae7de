"""pdist: functional, stateless PyTorch distributed helpers.

``with pdist.distributed(tp=2) as ctx:`` yields a frozen :class:`DistContext`;
pure functions take the context or one of its :class:`Group` values.
"""

from __future__ import annotations

from ._context import DistContext as DistContext
from ._context import Group as Group
from ._context import device_mesh as device_mesh
from ._context import distributed as distributed
from ._context import new_sp_group as new_sp_group
from ._context import new_tp_group as new_tp_group
from ._context import patch_tp as patch_tp
from ._errors import PdistError as PdistError
from ._errors import RankMismatchError as RankMismatchError
from ._ranks import barrier as barrier
from ._ranks import is_rank0 as is_rank0
from ._ranks import rank0_first as rank0_first
from ._ranks import rank0_only as rank0_only
from ._topology import gpu_cpu_affinity as gpu_cpu_affinity
from ._topology import same_node_ranks as same_node_ranks
from ._topology import set_cpu_affinity as set_cpu_affinity

__version__ = "0.1.0"

__all__ = [
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
]
