"""Pickling with tensors kept aside, and unpickling through an optional allow-list.

Tensors inside a pickled object become persistent ids (``("storage", i)``)
into a side list, so that transports can move their bytes as tensors and
rebuild them on the receiver's device. Repeated references to one tensor get
one id, so identity survives the trip. Pickles use protocol 2, the one torch's
``weights_only`` unpickler (reused for ``safe=True``) reads.
"""

from __future__ import annotations

import io
import math
import pickle
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import torch

from ._errors import PdistError

__all__ = [
    "PROTOCOL",
    "Safe",
    "TensorSpec",
    "dtype_name",
    "dumps",
    "loads",
    "rebuild",
    "shaped",
    "spec_of",
    "tensor_bytes",
]

PROTOCOL = 2

Safe = bool | Iterable[type]
"""``safe=`` argument: False (plain pickle), True (allow-list), or extra classes to allow."""


_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)
}
_NAMES: dict[torch.dtype, str] = {d: name for name, d in _DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """``"float32"`` for ``torch.float32``: how dtypes travel in pdist's metadata."""
    return _NAMES[dtype]


class TensorSpec(NamedTuple):
    """What a receiver needs to rebuild one tensor from its bytes."""

    dtype: str
    shape: tuple[int, ...]
    device_type: str
    requires_grad: bool
    is_param: bool

    @property
    def torch_dtype(self) -> torch.dtype:
        """The ``torch.dtype`` named by ``dtype``."""
        dtype = _DTYPES.get(self.dtype)
        if dtype is None:
            msg = f"unknown dtype {self.dtype!r} in a received tensor"
            raise PdistError(msg)
        return dtype

    @property
    def nbytes(self) -> int:
        """Size of the tensor's data in bytes."""
        return math.prod(self.shape) * self.torch_dtype.itemsize


def spec_of(t: torch.Tensor) -> tuple[str, tuple[int, ...], str, bool, bool]:
    """The fields of ``t``'s :class:`TensorSpec` as a plain tuple (how specs travel)."""
    return (
        _NAMES[t.dtype],
        tuple(t.shape),
        "cpu" if t.is_cpu else t.device.type,
        t.requires_grad,
        type(t) is torch.nn.Parameter,
    )


def tensor_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s data as a flat contiguous uint8 tensor on its own device (a view when possible)."""
    flat = t.detach()
    flat = flat.view(-1) if flat.is_contiguous() else flat.contiguous().view(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


def rebuild(spec: TensorSpec, data: torch.Tensor) -> torch.Tensor:
    """The tensor described by ``spec`` from its flat uint8 ``data`` (a view of it)."""
    dtype = spec.torch_dtype
    return shaped(spec, data if dtype == torch.uint8 else data.view(dtype))


def shaped(spec: TensorSpec, flat: torch.Tensor) -> torch.Tensor:
    """The tensor described by ``spec`` from ``flat``, its elements in its dtype (a view)."""
    t = flat if len(spec.shape) == 1 else flat.view(spec.shape)
    if spec.is_param:
        return torch.nn.Parameter(t, requires_grad=spec.requires_grad)
    if spec.requires_grad:
        t.requires_grad_(True)
    return t


class _Pickler(pickle.Pickler):
    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=PROTOCOL)
        self.tensors: list[torch.Tensor] = []
        self._index: dict[int, int] = {}

    def persistent_id(self, obj: Any) -> tuple[str, int] | None:
        if not isinstance(obj, torch.Tensor):
            return None
        index = self._index.get(id(obj))
        if index is None:
            index = self._index[id(obj)] = len(self.tensors)
            self.tensors.append(obj)  # keeps obj alive, so its id stays unique
        return ("storage", index)


def dumps(obj: Any) -> tuple[bytes, list[torch.Tensor]]:
    """Pickle ``obj`` with its tensors set aside; returns the skeleton and the tensors."""
    buf = io.BytesIO()
    pickler = _Pickler(buf)
    pickler.dump(obj)
    return buf.getvalue(), pickler.tensors


def _persistent_loader(tensors: Sequence[torch.Tensor]) -> Any:
    def load(pid: Any) -> torch.Tensor:
        if not (isinstance(pid, tuple) and len(pid) == 2 and pid[0] == "storage"):
            msg = f"unexpected persistent id {pid!r} in a received object"
            raise PdistError(msg)
        return tensors[pid[1]]

    return load


def loads(data: bytes, tensors: Sequence[torch.Tensor], *, safe: Safe = False) -> Any:
    """Unpickle a skeleton from :func:`dumps`, substituting ``tensors``.

    With ``safe`` set, unpickling goes through torch's ``weights_only``
    allow-list (builtin containers and scalars, tensors, dtypes, devices),
    plus the classes ``safe`` lists; anything else raises
    :class:`~pdist.PdistError` naming it, without running it.
    """
    if safe is False:
        unpickler = pickle.Unpickler(io.BytesIO(data))
        unpickler.persistent_load = _persistent_loader(tensors)  # type: ignore[method-assign]
        return unpickler.load()
    from torch import _weights_only_unpickler

    extra: list[Any] = [] if safe is True else list(safe)
    safe_unpickler = _weights_only_unpickler.Unpickler(io.BytesIO(data), encoding="utf-8")
    safe_unpickler.persistent_load = _persistent_loader(tensors)  # type: ignore[method-assign]
    try:
        with torch.serialization.safe_globals(extra):
            return safe_unpickler.load()  # type: ignore[no-untyped-call]
    except pickle.UnpicklingError as exc:
        msg = (
            f"safe unpickling refused the received object: {exc} "
            "(pass the class in safe=[...] if you trust the sender)"
        )
        raise PdistError(msg) from None
