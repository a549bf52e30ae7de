"""Pickling with dense tensors taken out, and unpickling through an optional allow-list.

``dumps`` takes dense strided tensors (plain tensors and ``nn.Parameter``) out
of the pickle, so that transports move them as tensors; everything else is left to
pickle (classes, cycles and sharing survive), and the storages that torch's own
reductions of other tensors pickle are taken out too, as raw bytes. Pickles use
protocol 2, the one torch's ``weights_only`` unpickler (``safe=True``) reads.
"""

from __future__ import annotations

import io
import pickle
import threading
import warnings
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import torch

from . import _compat
from ._errors import PdistError, raised_as_is

__all__ = [
    "DTYPES",
    "PROTOCOL",
    "Safe",
    "TensorSpec",
    "dtype_name",
    "dtype_of",
    "dumps",
    "loads",
    "safe_or_error",
    "shaped",
]

PROTOCOL = 2

Safe = bool | Iterable[type]  # False (plain pickle), True (allow-list), or extra classes to allow


DTYPES = tuple(sorted({d for d in vars(torch).values() if isinstance(d, torch.dtype)}, key=str))
"""Every dtype of this torch, in one order (an index into it travels as a dtype's code)."""
_DTYPES: dict[str, torch.dtype] = {str(d).removeprefix("torch."): d for d in DTYPES}
_NAMES: dict[torch.dtype, str] = {d: name for name, d in _DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """``"float32"`` for ``torch.float32``: how dtypes travel in pdist's metadata."""
    return _NAMES[dtype]


def dtype_of(name: object) -> torch.dtype:
    """The ``torch.dtype`` called ``name``; anything else raises ``PdistError``."""
    dtype = _DTYPES.get(name) if isinstance(name, str) else None
    if dtype is None:
        msg = f"unknown dtype {name!r:.80} in a received tensor"
        raise PdistError(msg)
    return dtype


class TensorSpec(NamedTuple):
    """What a receiver needs to rebuild one tensor (not ``"cpu"``: on the receiver's device)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    device_type: str
    requires_grad: bool
    is_param: bool


def shaped(spec: TensorSpec, flat: torch.Tensor) -> torch.Tensor:
    """The tensor described by ``spec`` from ``flat``, its elements in its dtype (a view)."""
    t = flat if len(spec.shape) == 1 else flat.view(spec.shape)
    if spec.is_param:
        return torch.nn.Parameter(t, requires_grad=spec.requires_grad)
    if spec.requires_grad:
        t.requires_grad_(True)
    return t


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _extracted(t: torch.Tensor) -> bool:
    """Whether ``t`` travels as raw bytes: a dense strided tensor of a plain class with data."""
    return (
        type(t) in _PLAIN
        and t.layout is torch.strided
        and not (t.is_quantized or t.is_nested or t.is_meta)
        and not t.__dict__  # attributes set on a tensor are kept by torch's own reduction
    )


# Types persistent_id answers None for at once: it runs for every object pickled, including
# the parts of the ids it returns, and TypedStorage's isinstance check runs in Python.
_NOT_SET_ASIDE = frozenset({type(None), bool, int, float, str, bytes, list, tuple, dict})
# A tensor's first id: the next tensor entry. One object, so that pickle memoizes it and
# asks persistent_id about it (and its parts) once; a tensor seen again names its index.
_NEXT = ("storage",)


class _Pickler(pickle.Pickler):
    # persistent_id runs for every object pickled: it is kept lean.
    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=PROTOCOL)
        self.entries: list[tuple[torch.Tensor, bool]] = []  # (tensor or storage bytes, storage?)
        self._tensors: dict[int, int] = {}  # id(tensor) -> entry index
        self._storages: dict[int, int] = {}  # storage _cdata -> entry index
        self._alive: list[object] = []  # keeps every keyed object alive, so its key stays unique

    def persistent_id(self, obj: Any) -> tuple[Any, ...] | None:
        if type(obj) in _NOT_SET_ASIDE:
            return None
        if isinstance(obj, torch.Tensor):
            if not _extracted(obj):
                return None
            index = self._tensors.get(id(obj))
            if index is not None:
                return ("storage", index)
            self._tensors[id(obj)] = len(self.entries)
            self.entries.append((obj, False))
            self._alive.append(obj)
            return _NEXT
        if isinstance(obj, (torch.storage.TypedStorage, torch.UntypedStorage)):
            if isinstance(obj, torch.storage.TypedStorage):
                return ("storage", "s", self._storage(obj._untyped_storage), _NAMES[obj.dtype])
            return ("storage", "u", self._storage(obj))
        return None

    def _storage(self, untyped: torch.UntypedStorage) -> int:
        index = self._storages.get(untyped._cdata)
        if index is None:
            index = self._storages[untyped._cdata] = len(self.entries)
            flat = torch.empty(0, dtype=torch.uint8, device=untyped.device).set_(untyped)
            self.entries.append((flat, True))
            self._alive.append(untyped)
        return index


_SCALARS = frozenset({type(None), bool, int, float, str, bytes})
_SCAN = 64  # items looked at before a container counts as not small


def _small_and_builtin(obj: Any) -> bool:
    """Whether ``obj`` is a few builtin scalars in dicts, lists and tuples (no tensor inside)."""
    todo, seen = [obj], 0
    while todo:
        item = todo.pop()
        kind = type(item)
        if kind in _SCALARS:
            continue
        if kind is not dict and kind is not list and kind is not tuple:
            return False
        seen += 1 + len(item)
        if seen > _SCAN:
            return False
        todo.extend(item)
        if kind is dict:
            todo.extend(item.values())
    return True


def dumps(obj: Any) -> tuple[bytes, list[tuple[torch.Tensor, bool]]]:
    """The skeleton of ``obj`` and what it set aside.

    Raises:
        pickle.PicklingError | AttributeError | TypeError: ``obj`` cannot be pickled: what
            pickle raised, of its type, with the fix added to its message.
    """
    if _small_and_builtin(obj):
        # torch's pickler hook runs in Python for every object; a small config has no tensor.
        return pickle.dumps(obj, protocol=PROTOCOL), []
    buf = io.BytesIO()
    pickler = _Pickler(buf)
    try:
        pickler.dump(obj)
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        msg = (
            f"cannot pickle the object: {exc}; objects travel as pickles, which name their "
            "classes and functions: define those at module level (not as lambdas or inside "
            "functions), or send plain data"
        )
        try:
            hinted = type(exc)(msg)
        except Exception:  # a type whose constructor wants other arguments
            raise raised_as_is(exc) from None
        raise raised_as_is(hinted) from exc
    return buf.getvalue(), pickler.entries


def safe_or_error(safe: object, rank: int) -> tuple[Safe, TypeError | None]:
    """A valid ``safe=`` (classes as a tuple) and None, or False and the error for the peers."""
    if isinstance(safe, bool):
        return safe, None
    fix = "pass safe=True, safe=False, or an iterable of classes such as safe=[MyConfig]"
    if isinstance(safe, (str, bytes)) or not isinstance(safe, Iterable):
        msg = f"safe={safe!r:.80} on rank {rank} is not a bool or an iterable of classes; {fix}"
        return False, TypeError(msg)
    classes = tuple(safe)
    bad = [c for c in classes if not isinstance(c, type)]
    if bad:
        msg = f"safe= on rank {rank} lists {bad[0]!r:.80}, which is not a class; {fix}"
        return False, TypeError(msg)
    return classes, None


def _persistent_loader(
    entries: Sequence[torch.Tensor], storage: Sequence[bool]
) -> tuple[Any, dict[int, torch.UntypedStorage]]:
    """The ``persistent_load`` of a received skeleton, and the storages it handed out."""
    untyped: dict[int, torch.UntypedStorage] = {}
    tensors = iter([i for i, is_storage in enumerate(storage) if not is_storage])

    def storage_of(index: int) -> torch.UntypedStorage:
        found = untyped.get(index)
        if found is None:
            # A storage of its own: the received bytes are a view into a shared bucket.
            found = untyped[index] = entries[index].clone().untyped_storage()
        return found

    def load(pid: Any) -> Any:
        if type(pid) is tuple and len(pid) == 1 and pid[0] == "storage":
            index = next(tensors, None)
            if index is not None:
                return entries[index]
        elif type(pid) is tuple and 2 <= len(pid) <= 4 and pid[0] == "storage":
            index = pid[1] if len(pid) == 2 else pid[2]
            if type(index) is int and 0 <= index < len(entries):
                if len(pid) == 2 and not storage[index]:
                    return entries[index]
                if len(pid) == 3 and pid[1] == "u" and storage[index]:
                    return storage_of(index)
                if len(pid) == 4 and pid[1] == "s" and storage[index]:
                    return torch.storage.TypedStorage(  # type: ignore[no-untyped-call]
                        wrap_storage=storage_of(index), dtype=dtype_of(pid[3]), _internal=True
                    )
        msg = (
            f"unexpected persistent id {pid!r:.120} in a received object "
            f"({len(entries)} tensors and storages travelled with it)"
        )
        raise PdistError(msg)

    return load, untyped


# The persistent_load of a skeleton that travelled alone (most safe loads): it refuses every id.
_NO_ENTRIES = _persistent_loader([], [])[0]

# Torch queues every sparse tensor it unpickles in one module-level list, to be validated after
# loading; pdist validates those its own loads queued (the lock keeps concurrent loads apart).
_SPARSE_LOCK = threading.RLock()


def loads(
    data: bytes,
    entries: Sequence[torch.Tensor],
    storage: Sequence[bool],
    *,
    safe: Safe = False,
) -> Any:
    """Unpickle a ``dumps`` skeleton (``storage[i]``: entry ``i`` is a storage's bytes).

    With ``safe``, through torch's ``weights_only`` allow-list plus the classes ``safe`` lists; a
    [`PdistError`][pdist.PdistError] says why the object is refused or cannot be rebuilt.
    """
    persistent_load, storages = _persistent_loader(entries, storage) if entries else (None, {})
    with _SPARSE_LOCK:
        pending = _compat.sparse_tensors_to_validate()
        start = len(pending)
        try:
            obj = _load(data, persistent_load, safe, quiet=any(storage))
            fresh = pending[start:]
        finally:
            del pending[start:]
        # torch grows a storage too small for the tensor set on it (with uninitialized memory).
        for index, found in storages.items():
            if found.nbytes() != entries[index].numel():
                msg = (
                    f"a received tensor needs {found.nbytes()} bytes of a storage of which "
                    f"{entries[index].numel()} travelled; the sender's payload is corrupt"
                )
                raise PdistError(msg)
        for t in fresh:
            try:
                _compat.validate_sparse(t)
            except PdistError:
                raise
            except (RuntimeError, ValueError, TypeError, IndexError) as exc:
                msg = f"a received sparse tensor is invalid: {exc}"
                raise PdistError(msg) from None
    return obj


def _load(data: bytes, persistent_load: Any, safe: Safe, *, quiet: bool) -> Any:
    if quiet:
        # Rebuilding a whole-pickled tensor reads a TypedStorage, which torch deprecates loudly.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "TypedStorage is deprecated", UserWarning)
            return _load(data, persistent_load, safe, quiet=False)
    try:
        if safe is False and persistent_load is None:
            return pickle.loads(data)  # it refuses any persistent id: nothing travelled
        if safe is False:
            unpickler = pickle.Unpickler(io.BytesIO(data))
            unpickler.persistent_load = persistent_load  # type: ignore[method-assign]
            return unpickler.load()
        extra: list[Any] = [] if safe is True else list(safe)
        return _compat.safe_load(data, persistent_load or _NO_ENTRIES, extra)
    except PdistError:
        raise
    except pickle.UnpicklingError as exc:
        if safe is False:
            msg = f"the received object could not be unpickled: {exc}"
            raise PdistError(msg) from exc
        msg = (
            f"safe unpickling refused the received object: {exc} "
            "(pass the class in safe=[...] if you trust the sender)"
        )
        raise PdistError(msg) from None
    except Exception as exc:
        msg = f"the received object could not be rebuilt: {type(exc).__name__}: {exc}"
        raise PdistError(msg) from exc
