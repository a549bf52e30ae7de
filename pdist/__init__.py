"""pdist: functional, stateless PyTorch distributed helpers.

``with pdist.distributed(tp=2) as ctx:`` yields a frozen [`DistContext`][pdist.DistContext];
pure functions take the context or one of its [`Group`][pdist.Group] values.
"""

from ._collate import EvalSampler as EvalSampler
from ._collate import collate_batches as collate_batches
from ._collectives import all_gather as all_gather
from ._collectives import all_gather_tensor as all_gather_tensor
from ._collectives import all_reduce as all_reduce
from ._collectives import all_reduce_ as all_reduce_
from ._collectives import all_to_all_4d as all_to_all_4d
from ._collectives import broadcast as broadcast
from ._collectives import broadcast_ as broadcast_
from ._collectives import gather as gather
from ._collectives import recv as recv
from ._collectives import reduce as reduce
from ._collectives import reduce_scatter as reduce_scatter
from ._collectives import send as send
from ._collectives import shard as shard
from ._context import distributed as distributed
from ._errors import PdistError as PdistError
from ._errors import PeerLeftError as PeerLeftError
from ._errors import RankMismatchError as RankMismatchError
from ._errors import RemoteError as RemoteError
from ._errors import RemoteRankMismatchError as RemoteRankMismatchError
from ._errors import RemoteTypeError as RemoteTypeError
from ._errors import RemoteValueError as RemoteValueError
from ._gathers import all_gather_object as all_gather_object
from ._gathers import gather_object as gather_object
from ._graph import graph_capture as graph_capture
from ._group import DistContext as DistContext
from ._group import Group as Group
from ._guard import WORLD_COMM_TIMEOUT_EXIT_CODE as WORLD_COMM_TIMEOUT_EXIT_CODE
from ._guard import world_comm_guard as world_comm_guard
from ._guard import world_comm_timeout as world_comm_timeout
from ._links import link as link
from ._moe import moe_combine as moe_combine
from ._moe import moe_dispatch as moe_dispatch
from ._mq import message_queue as message_queue
from ._objects import broadcast_object as broadcast_object
from ._objects import broadcast_object_list as broadcast_object_list
from ._objects import broadcast_tensor_dict as broadcast_tensor_dict
from ._p2p import recv_object as recv_object
from ._p2p import recv_tensor_dict as recv_tensor_dict
from ._p2p import send_object as send_object
from ._p2p import send_tensor_dict as send_tensor_dict
from ._ranks import barrier as barrier
from ._ranks import is_local_rank0 as is_local_rank0
from ._ranks import is_rank0 as is_rank0
from ._ranks import rank0_first as rank0_first
from ._ranks import rank0_only as rank0_only
from ._replicas import fault_tolerant as fault_tolerant
from ._sequence import ulysses_attention as ulysses_attention
from ._stall import STALL_EXIT_CODE as STALL_EXIT_CODE
from ._subgroups import device_mesh as device_mesh
from ._subgroups import flatten as flatten
from ._subgroups import new_group as new_group
from ._subgroups import new_sp_group as new_sp_group
from ._subgroups import new_tp_group as new_tp_group
from ._subgroups import patch_sp as patch_sp
from ._subgroups import patch_tp as patch_tp
from ._topology import gpu_cpu_affinity as gpu_cpu_affinity
from ._topology import same_node_ranks as same_node_ranks
from ._topology import set_cpu_affinity as set_cpu_affinity
from ._training import DistributedDataParallel as DistributedDataParallel
from ._training import grad_sync as grad_sync
from ._training import sync_model_states as sync_model_states
from ._training import wrap_ddp as wrap_ddp
from ._uneven import all_to_all as all_to_all
from ._weights import broadcast_weights as broadcast_weights

__version__ = "0.1.0"

__all__ = [
    "STALL_EXIT_CODE",
    "WORLD_COMM_TIMEOUT_EXIT_CODE",
    "DistContext",
    "DistributedDataParallel",
    "EvalSampler",
    "Group",
    "PdistError",
    "PeerLeftError",
    "RankMismatchError",
    "RemoteError",
    "RemoteRankMismatchError",
    "RemoteTypeError",
    "RemoteValueError",
    "all_gather",
    "all_gather_object",
    "all_gather_tensor",
    "all_reduce",
    "all_reduce_",
    "all_to_all",
    "all_to_all_4d",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_object",
    "broadcast_object_list",
    "broadcast_tensor_dict",
    "broadcast_weights",
    "collate_batches",
    "device_mesh",
    "distributed",
    "fault_tolerant",
    "flatten",
    "gather",
    "gather_object",
    "gpu_cpu_affinity",
    "grad_sync",
    "graph_capture",
    "is_local_rank0",
    "is_rank0",
    "link",
    "message_queue",
    "moe_combine",
    "moe_dispatch",
    "new_group",
    "new_sp_group",
    "new_tp_group",
    "patch_sp",
    "patch_tp",
    "rank0_first",
    "rank0_only",
    "recv",
    "recv_object",
    "recv_tensor_dict",
    "reduce",
    "reduce_scatter",
    "same_node_ranks",
    "send",
    "send_object",
    "send_tensor_dict",
    "set_cpu_affinity",
    "shard",
    "sync_model_states",
    "ulysses_attention",
    "world_comm_guard",
    "world_comm_timeout",
    "wrap_ddp",
]
