"""Every torch private or version-dependent API pdist uses, probed once at import (a leaf).

What differs across the supported torch range is decided here, once:
``FEATURES`` says what this torch offers (``python -m pdist doctor`` prints
it), and the functions below take the branch that works on it. Where a probe
would have to call the API to learn whether it works (a call that crashes the
process on an older torch), the decision is by version, and the comment names
what breaks there.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import os
import pickle
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any

import attrs
import torch
import torch.distributed as dist
from torch.distributed import (  # type: ignore[attr-defined]  # exported, but not to mypy
    HashStore,
    PrefixStore,
    Store,
    TCPStore,
)

from ._errors import PdistError

__all__ = [
    "FEATURES",
    "MIN_TORCH",
    "TORCH",
    "Features",
    "HashStore",
    "PrefixStore",
    "Store",
    "TCPStore",
    "abort_group",
    "accelerator",
    "all_gather_into",
    "backend_name",
    "before_destroying_groups",
    "connected",
    "default_store",
    "device_mesh_from_group",
    "dtensor_type",
    "dump_flight_recorder",
    "fsdp_module_type",
    "fsdp_param_groups",
    "funcol",
    "functional_ops",
    "gloo_lazy_init",
    "is_async_tensor",
    "l2_fetch_granularity",
    "parse_version",
    "recorder_sees_gloo",
    "reduce_scatter_into",
    "register_fake_backend",
    "register_work",
    "registered",
    "safe_load",
    "set_l2_fetch_granularity",
    "shutdown_group",
    "sparse_tensors_to_validate",
    "split_group",
    "store_connection",
    "synchronize",
    "tcp_client",
    "unregistered_group",
    "unsupported",
    "validate_sparse",
    "work_from_future",
]


def parse_version(text: str) -> tuple[int, int]:
    """``(major, minor)`` of a version string such as ``"2.6.0+cu124"`` or ``"2.13.0a0"``."""
    parts = text.split("+")[0].split(".")
    digits = ["".join(c for c in p if c.isdigit()) or "0" for p in parts[:2]]
    return int(digits[0]), int(digits[1]) if len(digits) > 1 else 0


TORCH = parse_version(torch.__version__)
MIN_TORCH = (2, 6)  # the oldest torch pdist supports (the floor its CI runs on)

_FUNCOL_MODULE = "torch.distributed._functional_collectives"
_c10d: Any = torch._C._distributed_c10d

# Before torch 2.13 the binding of _register_work casts the work to torch's Python work
# class without checking, and dereferences null for a C++ work (gloo's, NCCL's): SIGSEGV.
# A work implemented in Python is what it expects; pdist wraps the others in one there.
_REGISTER_NEEDS_PY_WORK = TORCH < (2, 13)
# Up to torch 2.8 (the fix, pytorch/pytorch#154976, landed near its branch cut) a gloo
# group's destructor joins its worker threads holding the GIL, while a worker that drops the
# last reference to a tensor with a Python object takes the GIL: destroy_process_group right
# after a collective deadlocks now and then: 7 in 272 runs of a one-rank script on torch 2.6
# (2 cores, 4 at once), none in 160 with this wait first.
_DESTROY_HOLDS_GIL = TORCH < (2, 9)
_WORKER_GRACE_SEC = 0.02  # long enough for a descheduled worker to drop its last work


@attrs.frozen(kw_only=True)
class Features:
    """What this torch offers, as probed at import (by ``_probe``)."""

    torch: tuple[int, int]
    async_results: str  # "native", or "python work": each work wrapped in a Python Work first
    tensor_collective_names: str
    split_group: bool
    device_mesh_from_group: bool
    accelerator_api: bool
    # "_dump_fr_trace" (every backend, gloo included), "_dump_nccl_trace" (NCCL only) or None
    flight_recorder: str | None
    flight_recorder_env: str  # the variable that sizes the recorder's buffer
    store_clone: bool  # a second connection to the store
    sparse_check_pinning: bool
    fsdp2_on_cpu: bool
    destroy_wait_sec: float  # how long a block waits before destroying its groups

    def summary(self) -> list[str]:
        """One ``name: value`` line per feature (what ``pdist doctor`` prints)."""
        return [f"{f.name}: {getattr(self, f.name)}" for f in attrs.fields(type(self))]


def _sparse_takes_check_pinning() -> bool:
    indices, values = torch.zeros(1, 0, dtype=torch.long), torch.zeros(0)
    try:
        torch._validate_sparse_coo_tensor_args(indices, values, (1,), check_pinning=False)
    except TypeError:
        return False
    return True


def _probe() -> Features:
    from torch.distributed.device_mesh import DeviceMesh

    recorder = next((n for n in ("_dump_fr_trace", "_dump_nccl_trace") if hasattr(_c10d, n)), None)
    # torch renamed TORCH_NCCL_TRACE_BUFFER_SIZE when the recorder learned other backends.
    env = "TORCH_FR_BUFFER_SIZE" if recorder == "_dump_fr_trace" else "TORCH_NCCL_TRACE_BUFFER_SIZE"
    return Features(
        torch=TORCH,
        async_results="python work" if _REGISTER_NEEDS_PY_WORK else "native",
        tensor_collective_names="*_single" if hasattr(dist, "all_gather_single") else "*_tensor",
        split_group=hasattr(dist, "split_group"),
        device_mesh_from_group=hasattr(DeviceMesh, "from_group"),
        accelerator_api=hasattr(torch, "accelerator"),
        flight_recorder=recorder,
        flight_recorder_env=env,
        store_clone=hasattr(Store, "clone"),
        sparse_check_pinning=_sparse_takes_check_pinning(),
        # FSDP2 records events on its streams; torch 2.6's CPU stream cannot.
        fsdp2_on_cpu=hasattr(torch.cpu.Stream, "record_event"),
        destroy_wait_sec=_WORKER_GRACE_SEC if _DESTROY_HOLDS_GIL else 0.0,
    )


FEATURES = _probe()


def unsupported(feature: str, minimum: tuple[int, int] | None = None) -> PdistError:
    """The error of a feature this torch lacks: names it, this torch and the first that has it."""
    have = ".".join(map(str, TORCH))
    need = "a newer torch" if minimum is None else "torch >= " + ".".join(map(str, minimum))
    msg = f"{feature} needs {need}; this is torch {have} ({torch.__version__})"
    return PdistError(msg)


# torch 2.13 renamed the tensor-in/tensor-out collectives (the old names warn there).
_ALL_GATHER = (
    "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
)
_REDUCE_SCATTER = (
    "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
)


def all_gather_into(
    out: torch.Tensor, mine: torch.Tensor, pg: dist.ProcessGroup, *, async_op: bool = False
) -> Any:
    """All-gather ``mine`` from every rank into the contiguous ``out`` (rank-major)."""
    # Looked up per call: the scale simulation counts these calls by wrapping torch's function.
    return getattr(dist, _ALL_GATHER)(out, mine, group=pg, async_op=async_op)


def reduce_scatter_into(
    out: torch.Tensor, full: torch.Tensor, op: Any, pg: dist.ProcessGroup, *, async_op: bool
) -> Any:
    """Reduce-scatter the contiguous ``full`` into ``out`` (this rank's chunk)."""
    return getattr(dist, _REDUCE_SCATTER)(out, full, op=op, group=pg, async_op=async_op)


def funcol() -> Any:
    """The functional collectives module of torch (imported on first use: it pulls in dynamo)."""
    return importlib.import_module(_FUNCOL_MODULE)


def functional_ops() -> Any:
    """Torch's functional collective ops, which trace (not funcol's wrappers: they wait again)."""
    return torch.ops._c10d_functional


def is_async_tensor(x: torch.Tensor) -> bool:
    """Whether ``x`` is torch's ``AsyncCollectiveTensor`` (no import when none can exist)."""
    fc = sys.modules.get(_FUNCOL_MODULE)
    return fc is not None and isinstance(x, fc.AsyncCollectiveTensor)


class _PyWork(dist._Work):  # type: ignore[misc,name-defined]  # torch's Work is untyped
    """A work implemented in Python around torch's own (what older ``_register_work`` needs)."""

    def __init__(self, work: Any) -> None:
        super().__init__()
        self._work = work

    def wait(self, timeout: Any = None) -> bool:
        return bool(self._work.wait() if timeout is None else self._work.wait(timeout))

    def is_completed(self) -> bool:
        return bool(self._work.is_completed())

    def get_future(self) -> Any:
        return self._work.get_future()


def register_work(tensor: torch.Tensor, work: Any) -> None:
    """Make ``tensor``'s first use as an ``AsyncCollectiveTensor`` wait on ``work``."""
    _c10d._register_work(tensor, _PyWork(work) if _REGISTER_NEEDS_PY_WORK else work)


def work_from_future(future: Any) -> Any:
    """A work that completes with ``future`` (torch's ``_create_work_from_future``)."""
    return _c10d._create_work_from_future(future)


def before_destroying_groups() -> None:
    """Let gloo's worker threads drop their last works first, where that avoids a deadlock."""
    if FEATURES.destroy_wait_sec:
        time.sleep(FEATURES.destroy_wait_sec)  # releases the GIL


def split_group(
    parent: dist.ProcessGroup, blocks: Sequence[Sequence[int]], *, timeout: Any, name: str
) -> dist.ProcessGroup | None:
    """``torch.distributed.split_group`` of ``parent`` into ``blocks`` (every rank in one)."""
    if not FEATURES.split_group:  # callers ask first; a PdistError, never an AttributeError
        raise unsupported("torch.distributed.split_group")
    return dist.split_group(
        parent_pg=parent, split_ranks=[list(b) for b in blocks], timeout=timeout, group_desc=name
    )


def unregistered_group(
    store: Store, rank: int, size: int, backend: str, device: torch.device, timeout: Any
) -> dist.ProcessGroup:
    """A process group built straight from ``store``, never entered in torch's group registry.

    What vLLM's ``StatelessProcessGroup`` does: the ``ProcessGroup`` carries one backend for
    ``device``'s type, so ``torch.distributed`` calls take it (with group-relative
    ``group_src``/``group_dst``) while ``dist.is_initialized()`` and the job's own groups
    stay as they were.
    """
    pg = dist.ProcessGroup(store, rank, size)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options.is_high_priority_stream = False
        options._timeout = timeout
        impl: Any = dist.ProcessGroupNCCL(store, rank, size, options)
        kind = dist.ProcessGroup.BackendType.NCCL
    else:
        impl = dist.ProcessGroupGloo(store, rank, size, timeout)
        kind = dist.ProcessGroup.BackendType.GLOO
    pg._set_default_backend(kind)
    pg._register_backend(device, kind, impl)
    if device.type != "cpu" and backend == "gloo":
        pg._register_backend(torch.device("cpu"), kind, impl)
    return pg


def registered(pg: dist.ProcessGroup) -> bool:
    """Whether ``pg`` is in torch's group registry (a link's groups never are)."""
    from torch.distributed.distributed_c10d import GroupMember, _world

    return pg is GroupMember.WORLD or pg in _world.pg_group_ranks


def backend_name(pg: dist.ProcessGroup) -> str:
    """The backend of ``pg`` (``"gloo"``, ``"nccl"``): also for a group outside the registry."""
    try:
        return str(dist.get_backend(pg))
    except (ValueError, RuntimeError):  # not in torch's registry (a link's)
        return str(pg.name())


def shutdown_group(pg: dist.ProcessGroup) -> None:
    """Release an unregistered group's communicator (``destroy_process_group`` cannot)."""
    before_destroying_groups()
    shutdown = getattr(pg, "shutdown", None)
    if shutdown is not None:
        shutdown()


def abort_group(pg: dist.ProcessGroup, device: torch.device) -> bool:
    """Abort ``pg``'s communicator for ``device``: a collective stuck on a dead peer returns.

    NCCL kernels wait on the GPU for a peer that went away until the communicator is
    aborted; gloo's time out on their own. ``ProcessGroup.abort`` (newer torch) or the
    backend's own ``abort``/``_abort`` (older); False where neither exists.
    """
    for target in (pg, _pg_backend(pg, device)):
        for name in ("abort", "_abort"):
            method = getattr(target, name, None)
            if callable(method):
                method()
                return True
    return False


def _pg_backend(pg: dist.ProcessGroup, device: torch.device) -> Any:
    try:
        return pg._get_backend(device)
    except (RuntimeError, AttributeError):
        return None


def bound_device(pg: dist.ProcessGroup) -> Any:
    """The device an eagerly initialized group is bound to (``device_id=``), or None."""
    return getattr(pg, "bound_device_id", None)


@contextlib.contextmanager
def gloo_lazy_init() -> Iterator[None]:
    """Create gloo groups that connect pairs on first use (unless the user chose a mode)."""
    if "TORCH_GLOO_LAZY_INIT" in os.environ:
        yield
        return
    os.environ["TORCH_GLOO_LAZY_INIT"] = "1"
    try:
        yield
    finally:
        os.environ.pop("TORCH_GLOO_LAZY_INIT", None)


def device_mesh_from_group(
    groups: dist.ProcessGroup | list[dist.ProcessGroup],
    device_type: str,
    mesh: torch.Tensor,
    names: tuple[str, ...],
) -> Any:
    """``DeviceMesh.from_group`` over existing groups (no new communicator)."""
    from torch.distributed.device_mesh import DeviceMesh

    if not FEATURES.device_mesh_from_group:
        raise unsupported("device_mesh (DeviceMesh.from_group)")
    return DeviceMesh.from_group(groups, device_type, mesh=mesh, mesh_dim_names=names)


def accelerator() -> tuple[str, int] | None:
    """The machine's accelerator type and device count (None: none), through ``torch.accelerator``.

    A torch without that API: CUDA alone, through ``torch.cuda``.
    """
    if not FEATURES.accelerator_api:
        return ("cuda", torch.cuda.device_count()) if torch.cuda.is_available() else None
    api = torch.accelerator
    current = api.current_accelerator() if api.is_available() else None
    return None if current is None else (current.type, int(api.device_count()))


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (none on the CPU)."""
    if device.type == "cpu":
        return
    if FEATURES.accelerator_api:
        torch.accelerator.synchronize(device)
    else:
        torch.cuda.synchronize(device)


def default_store() -> Store | None:
    """The default process group's store, or None (no default group)."""
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except Exception:  # no default group
        return None


def register_fake_backend() -> None:
    """Register torch's ``"fake"`` backend (a test helper of torch's), for simulated worlds."""
    importlib.import_module("torch.testing._internal.distributed.fake_pg")


def dtensor_type() -> type | None:
    """The ``DTensor`` class of torch, if it was imported (a model holding one imported it)."""
    module = sys.modules.get("torch.distributed.tensor")
    found = getattr(module, "DTensor", None)
    return found if isinstance(found, type) else None


def fsdp_module_type() -> type | None:
    """FSDP2's ``FSDPModule`` class (``torch.distributed.fsdp`` since 2.6)."""
    try:
        found = getattr(importlib.import_module("torch.distributed.fsdp"), "FSDPModule", None)
    except ImportError:
        return None
    return found if isinstance(found, type) else None


def fsdp_param_groups(module: Any) -> list[Any]:
    """The parameter groups of one FSDP2 module (torch < 2.7 keeps at most one)."""
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        groups = [] if group is None else [group]
    return list(groups)


def dump_flight_recorder(*, collectives: bool = True, stacks: bool = True) -> dict[str, Any] | None:
    """This process's flight recorder (``pg_status``, and ``entries`` with ``collectives``).

    None where this torch cannot dump every backend (2.6: NCCL only) or the dump fails.
    ``stacks`` symbolizes frames through ``torch._dynamo``, imported by the first such dump
    (seconds): polls leave it off.
    """
    name = FEATURES.flight_recorder
    if name is None:
        return None
    dump = getattr(_c10d, name)
    try:
        raw = dump(includeCollectives=collectives, includeStackTraces=stacks, onlyActive=False)
    except Exception:  # no recorder armed, or a backend the dump does not know
        return None
    data = pickle.loads(raw)  # the process's own recorder: data this process wrote
    return data if isinstance(data, dict) else None


def recorder_sees_gloo() -> bool:
    """Whether torch's flight recorder records gloo collectives (its ``_dump_fr_trace``, 2.7+)."""
    return FEATURES.flight_recorder == "_dump_fr_trace"


def connected(connect: Callable[[], Store]) -> Store:
    """``connect()``, tried once more if it fails (a new TCP store connection, bounded).

    One new connection in 25 or so to a torch TCP store does not connect within its timeout
    (torch 2.6 to 2.13: every 25th of a burst, here); the next one connects at once.
    """
    try:
        return connect()
    except RuntimeError:  # torch's DistNetworkError
        return connect()


def tcp_client(host: str, port: int, timeout: timedelta | None = None) -> TCPStore:
    """A new client connection to the TCP store at ``host:port`` (``connected``)."""
    kwargs: dict[str, Any] = {} if timeout is None else {"timeout": timeout}

    def connect() -> TCPStore:
        return TCPStore(host, port, is_master=False, wait_for_workers=False, **kwargs)

    client = connected(connect)
    assert isinstance(client, TCPStore)
    return client


def store_connection(store: Store, timeout: timedelta | None = None) -> Store | None:
    """A store that reaches ``store``'s keys without sharing its connection, or None.

    A thread blocked in ``wait`` on a TCP store blocks every other call on that connection.
    A hash store (in-process) is safe to share. None for a file store, whose ``wait`` polls
    its file, and for a ``PrefixStore`` without ``clone`` (its prefix cannot be read back).
    ``timeout`` bounds every call on the new connection (a store whose host is gone without
    closing it answers nothing: a thread of pdist's must not wait on it for the store's own).
    """
    if isinstance(store, _c10d.FileStore):
        return None
    conn: Store | None = None
    if FEATURES.store_clone:
        with contextlib.suppress(Exception):  # a store type without clone
            conn = connected(store.clone)  # type: ignore[attr-defined]
    if conn is None and isinstance(store, TCPStore):
        wait: Any = timeout or getattr(store, "timeout", None)
        conn = tcp_client(store.host, store.port, wait)
    if conn is None:
        return None if isinstance(store, PrefixStore) else store
    if timeout is not None:
        conn.set_timeout(timeout)
    return conn


def safe_load(data: bytes, persistent_load: Any, extra: list[Any]) -> Any:
    """Unpickle ``data`` through torch's ``weights_only`` allow-list plus the ``extra`` classes."""
    import io

    from torch import _weights_only_unpickler

    unpickler = _weights_only_unpickler.Unpickler(io.BytesIO(data), encoding="utf-8")
    unpickler.persistent_load = persistent_load  # type: ignore[method-assign]
    with torch.serialization.safe_globals(extra):
        return unpickler.load()  # type: ignore[no-untyped-call]


def sparse_tensors_to_validate() -> list[torch.Tensor]:
    """The list where torch queues every sparse tensor it unpickles, to validate later."""
    return torch._utils._sparse_tensors_to_validate


def validate_sparse(t: torch.Tensor) -> None:
    """Check a sparse tensor's invariants (indices in range...); raises torch's error."""
    pin = {"check_pinning": False} if FEATURES.sparse_check_pinning else {}
    if t.layout is torch.sparse_coo:
        torch._validate_sparse_coo_tensor_args(
            t._indices(), t._values(), t.size(), t.is_coalesced(), **pin
        )
        return
    if t.layout in (torch.sparse_csr, torch.sparse_bsr):
        compressed, plain = t.crow_indices(), t.col_indices()
    elif t.layout in (torch.sparse_csc, torch.sparse_bsc):
        compressed, plain = t.ccol_indices(), t.row_indices()
    else:
        msg = f"a received sparse tensor has an unknown layout {t.layout}"
        raise PdistError(msg)
    torch._validate_sparse_compressed_tensor_args(
        compressed, plain, t.values(), t.size(), t.layout, **pin
    )


_CUDA_LIMIT_MAX_L2_FETCH_GRANULARITY = 0x05  # cudaLimitMaxL2FetchGranularity


def _cudart() -> Any:
    """The CUDA runtime library torch loaded (a CUDA build loads it at import), or None."""
    paths: list[str] = []
    with contextlib.suppress(OSError), open("/proc/self/maps") as maps:
        paths = [line.split()[-1] for line in maps if "/libcudart.so" in line]
    for name in [*paths[:1], "libcudart.so.13", "libcudart.so.12", "libcudart.so"]:
        with contextlib.suppress(OSError):
            return ctypes.CDLL(name)
    return None


def l2_fetch_granularity() -> int | None:
    """The current device's L2 fetch granularity in bytes (``cudaDeviceGetLimit``), or None."""
    lib = _cudart()
    if lib is None:
        return None
    value = ctypes.c_size_t()
    if lib.cudaDeviceGetLimit(ctypes.byref(value), _CUDA_LIMIT_MAX_L2_FETCH_GRANULARITY):
        return None
    return int(value.value)


def set_l2_fetch_granularity(nbytes: int) -> str | None:
    """Set the current device's L2 fetch granularity, read back; None on success, else why not."""
    lib = _cudart()
    if lib is None:
        return "the CUDA runtime library (libcudart) is not loaded"
    code = lib.cudaDeviceSetLimit(_CUDA_LIMIT_MAX_L2_FETCH_GRANULARITY, ctypes.c_size_t(nbytes))
    if code:
        return f"cudaDeviceSetLimit returned error {code}"
    got = l2_fetch_granularity()
    if got != nbytes:
        return f"cudaDeviceGetLimit reads back {got}, not {nbytes}"
    return None
