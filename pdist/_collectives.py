"""Tensor collectives on a Group: one runner over a table of specs.

Each out-of-place collective is a ``_Spec`` in ``_SPECS``, and
``_collective`` runs every one the same way: check the arguments, return
``x`` on a one-rank group, go through one autograd Function where a gradient is
wanted, then run the traced form or the eager launch (``_launches``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple, cast

import torch
import torch.distributed as dist

from . import _check, _departures, _launches, _rooted, _uneven, _wire
from ._group import DistContext, Group, as_group
from ._inflight import recorded

__all__ = [
    "all_gather",
    "all_gather_tensor",
    "all_reduce",
    "all_reduce_",
    "all_to_all_4d",
    "broadcast",
    "broadcast_",
    "gather",
    "generic_path",  # the test seam; pdist does not re-export it
    "recv",
    "reduce",
    "reduce_scatter",
    "send",
    "shard",
]

_GRAD_OPS = ("sum", "mean")  # the differentiable reductions


def _check_tensor(x: object) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        msg = f"x must be a torch.Tensor, got {type(x).__name__}"
        raise TypeError(msg)
    return x


def _check_op(x: torch.Tensor, op: str, allowed: tuple[str, ...] = tuple(_launches.OPS)) -> str:
    if op not in allowed:
        msg = f"op={op!r} is not one of {allowed}"
        raise ValueError(msg)
    if op == "mean" and not (x.is_floating_point() or x.is_complex()):
        msg = f"op='mean' needs a floating-point tensor, got dtype {x.dtype}; use op='sum'"
        raise TypeError(msg)
    if op in ("max", "min") and x.is_complex():
        msg = f"op={op!r} needs a real tensor (complex numbers have no order), got {x.dtype}"
        raise TypeError(msg)
    return op


def _norm_dim(x: torch.Tensor, dim: int, name: str = "dim") -> int:
    ndim = x.dim()
    if isinstance(dim, bool) or not isinstance(dim, int) or not -ndim <= dim < ndim:
        msg = f"{name}={dim!r} is out of range for a {ndim}-D tensor of shape {tuple(x.shape)}"
        if ndim == 0:
            msg += "; give the tensor a dimension first (x.reshape(1))"
        raise ValueError(msg)
    return dim % ndim


def _split_dim(group: Group, x: torch.Tensor, dim: int, what: str) -> int:
    d = _norm_dim(x, dim)
    if x.shape[d] % group.world_size:
        msg = (
            f"{what}: dimension {d} of shape {tuple(x.shape)} has size {x.shape[d]}, "
            f"which the group size {group.world_size} does not divide"
        )
        raise ValueError(msg)
    return d


def _check_all_to_all_4d(g: Group, x: torch.Tensor, scatter: int, gather: int) -> tuple[int, int]:
    if x.dim() != 4:
        msg = f"all_to_all_4d needs a 4-D tensor, got shape {tuple(x.shape)}"
        raise ValueError(msg)
    s, d = _norm_dim(x, scatter, "scatter_dim"), _norm_dim(x, gather, "gather_dim")
    if s == d:
        msg = f"scatter_dim={scatter} and gather_dim={gather} must differ"
        raise ValueError(msg)
    return _split_dim(g, x, s, "all_to_all_4d scatter_dim"), d


def _check_async(async_op: object) -> None:
    if not isinstance(async_op, bool):
        msg = f"async_op={async_op!r} must be True or False"
        raise TypeError(msg)


def _contiguous(group: Group, x: torch.Tensor) -> None:
    if group.world_size > 1 and not x.is_contiguous():
        msg = "broadcast writes x in place, so x must be contiguous; pass x.contiguous()"
        raise ValueError(msg)


def _refuse_grad(group: Group, x: torch.Tensor, name: str, use: str) -> None:
    if torch.is_grad_enabled() and x.requires_grad:
        msg = (
            f"{name} writes x in place and is not differentiable, but x requires grad "
            f"(rank {group.rank}); use pdist.{use}(...) (out of place), or call it "
            "under torch.no_grad()"
        )
        raise ValueError(msg)


class _Spec(NamedTuple):
    """One collective: ``check(group, x, *options)`` returns the normalized ``args``.

    ``launch`` (None: a local op), ``traced`` and ``shape`` (the result's, for
    the closed-group op) take ``(group, x, *args)``; ``backward(*args)`` names
    the gradient's ``(spec, args, divide by P)``, or None if not differentiable.
    ``names``: the names of ``args``, for check mode's summary.
    """

    names: tuple[str, ...]
    check: Callable[..., tuple[Any, ...]]
    launch: Callable[..., _launches.Launched] | None
    traced: Callable[..., torch.Tensor]
    shape: Callable[..., list[int]]
    backward: Callable[..., tuple[str, tuple[Any, ...], bool] | None]


_SPECS: dict[str, _Spec] = {
    "all_reduce": _Spec(
        names=("op",),
        check=lambda g, x, op: (_check_op(x, op),),
        launch=lambda g, x, op: _launches.all_reduce_into(
            g, x.clone(memory_format=torch.contiguous_format), op
        ),
        traced=_launches.traced_all_reduce,
        shape=lambda g, x, op: list(x.shape),
        # The gradient of a mean is the mean of the gradients.
        backward=lambda op: ("all_reduce", (op,), False) if op in _GRAD_OPS else None,
    ),
    "all_gather": _Spec(
        names=("dim",),
        check=lambda g, x, dim: (_norm_dim(x, dim),),
        launch=_launches.launch_all_gather,
        traced=_launches.traced_all_gather,
        shape=lambda g, x, d: _launches.resized(x, d, x.shape[d] * g.world_size),
        backward=lambda d: ("reduce_scatter", ("sum", d), False),
    ),
    "reduce_scatter": _Spec(
        names=("op", "dim"),
        check=lambda g, x, op, dim: (_check_op(x, op), _split_dim(g, x, dim, "reduce_scatter")),
        launch=_launches.launch_reduce_scatter,
        traced=_launches.traced_reduce_scatter,
        shape=lambda g, x, op, d: _launches.resized(x, d, x.shape[d] // g.world_size),
        backward=lambda op, d: ("all_gather", (d,), op == "mean") if op in _GRAD_OPS else None,
    ),
    "all_to_all_4d": _Spec(
        names=("scatter_dim", "gather_dim"),
        check=_check_all_to_all_4d,
        launch=_launches.launch_all_to_all,
        traced=_launches.traced_all_to_all,
        shape=_launches.exchanged,
        backward=lambda s, d: ("all_to_all_4d", (d, s), False),
    ),
    "shard": _Spec(
        names=("dim", "scale_grad"),
        check=lambda g, x, dim, scale: (_split_dim(g, x, dim, "shard"), bool(scale)),
        launch=None,
        traced=lambda g, x, d, scale: x.chunk(g.world_size, dim=d)[g.rank_in_group].contiguous(),
        shape=lambda g, x, d, scale: _launches.resized(x, d, x.shape[d] // g.world_size),
        backward=lambda d, scale: ("all_gather", (d,), scale),
    ),
}


def _forward(
    name: str, g: Group, x: torch.Tensor, args: tuple[Any, ...], async_op: bool = False
) -> torch.Tensor:
    spec = _SPECS[name]
    if spec.launch is None or torch.compiler.is_compiling():
        return spec.traced(g, x, *args)
    return _eager(g, _launches.local(x), spec.launch, args, async_op, what=name)


@recorded("collective")  # what the stall watch reads where torch's flight recorder is blind
def _eager(
    g: Group,
    x: torch.Tensor,
    launch: Callable[..., _launches.Launched],
    args: tuple[Any, ...],
    async_op: bool,
    *,
    what: str,
) -> torch.Tensor:
    with _departures.naming(g, what, counted=True):
        return _launches.result(launch(g, x, *args), async_op)


def _collective(
    name: str, group: Group | DistContext, x: torch.Tensor, *options: Any, async_op: bool = False
) -> torch.Tensor:
    spec, g = _SPECS[name], as_group(group)
    checks = (lambda: spec.check(g, _check_tensor(x), *options), lambda: _check_async(async_op))
    args, _ = _check.checked(g, name, x, *checks)
    if g.world_size == 1:
        return x
    grad = torch.is_grad_enabled() and x.requires_grad and spec.backward(*args) is not None
    fields = dict(zip(spec.names, args, strict=True))  # no keywords: torch 2.6 traces it
    fields["requires_grad"] = grad or None
    _check.agree_call(g, name, x, **fields)  # with a gradient, the backward communicates too
    if torch.compiler.is_compiling() and g.is_closed and spec.launch is not None:
        return _launches.traced_closed(x, spec.shape(g, x, *args))
    if grad:
        return cast("torch.Tensor", _Collective.apply(name, g, x, args, async_op))  # type: ignore[no-untyped-call]
    return _forward(name, g, x.detach() if x.requires_grad else x, args, async_op)


class _Collective(torch.autograd.Function):
    """A spec's forward; the gradient goes through the spec its ``backward`` names."""

    @staticmethod
    def forward(
        ctx: Any, name: str, group: Group, x: torch.Tensor, args: tuple[Any, ...], async_op: bool
    ) -> torch.Tensor:
        ctx.group, ctx.grad = group, _SPECS[name].backward(*args)
        return _forward(name, group, x, args, async_op)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, torch.Tensor, None, None]:
        name, args, divide = ctx.grad
        out = _forward(name, ctx.group, grad, args)
        return None, None, out / ctx.group.world_size if divide else out, None, None


def _in_place(
    group: Group,
    x: torch.Tensor,
    launch: Callable[..., _launches.Launched],
    traced: Callable[..., torch.Tensor],
    *args: Any,
) -> torch.Tensor:
    """Overwrite ``x`` with a collective's result (eagerly through a contiguous copy if need be)."""
    if group.world_size == 1:
        return x
    if torch.compiler.is_compiling():
        closed = group.is_closed
        return x.copy_(
            _launches.traced_closed(x, list(x.shape)) if closed else traced(group, x, *args)
        )
    buf = _launches.local(x)
    target = buf.contiguous()  # buf itself if contiguous
    with torch.no_grad():
        _eager(group, target, launch, args, False, what=launch.__name__)
        if target is not buf:
            buf.copy_(target)
    return x


def generic_path(
    name: str, group: Group | DistContext, x: torch.Tensor, *options: Any
) -> torch.Tensor:
    """The test seam: the off-gloo path of ``"all_gather"`` or ``"reduce_scatter"``, on any group.

    ``options`` as the public function takes them (``dim``; ``op, dim``). Not differentiable.
    """
    launch, g = _launches.GENERIC[name], as_group(group)
    args = _SPECS[name].check(g, _check_tensor(x), *options)
    return _launches.result(launch(g, _launches.local(x).detach(), *args), async_op=False)


def all_reduce(
    group: Group | DistContext, x: torch.Tensor, *, op: str = "sum", async_op: bool = False
) -> torch.Tensor:
    """Reduce ``x`` over the group, out of place; every rank gets the result.

    Note:
        All ranks of the group must call it with tensors of the same shape and dtype.

    Args:
        group: The group (a ``DistContext`` means its ``world``).
        x: This rank's tensor; left unchanged ([`all_reduce_`][pdist.all_reduce_] saves the clone).
        op: ``"sum"``, ``"mean"``, ``"max"``, ``"min"`` (real dtypes) or ``"product"``;
            the first two are differentiable. Mind that [`reduce`][pdist.reduce] defaults to
            ``"mean"``.
        async_op: Return at once a tensor that waits on first use (torch's
            ``AsyncCollectiveTensor``); use it inside the ``distributed()`` block.

    Returns:
        A new tensor; on a one-rank group, ``x``.
    """
    return _collective("all_reduce", group, x, op, async_op=async_op)


def all_reduce_(group: Group | DistContext, x: torch.Tensor, *, op: str = "sum") -> torch.Tensor:
    """Reduce ``x`` over the group in place (``op`` as in ``all_reduce``); returns ``x``.

    Note:
        All ranks of the group must call it with tensors of the same shape and dtype.

    Raises:
        ValueError: ``x`` requires grad while gradients are enabled (use
            [`all_reduce`][pdist.all_reduce]).
    """
    g = as_group(group)
    refuse = functools.partial(_refuse_grad, g, x, "all_reduce_", "all_reduce")
    _check.checked(g, "all_reduce_", x, lambda: _check_op(_check_tensor(x), op), refuse)
    _check.agree_call(g, "all_reduce_", x, op=op)
    return _in_place(g, x, _launches.all_reduce_into, _launches.traced_all_reduce, op)


def all_gather(
    group: Group | DistContext,
    x: torch.Tensor,
    *,
    dim: int = -1,
    sizes: list[int] | None = None,
    async_op: bool = False,
) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` in group order; every rank gets it.

    Differentiable (the gradient is reduce-scattered); ``async_op`` as in
    [`all_reduce`][pdist.all_reduce].

    ``sizes``: each rank's size along ``dim``, for uneven shards (one all-to-all of
    rows; every rank passes the same list, and the caller vouches for the other ranks'
    entries: only ``sizes[me]`` is checked, against ``x``; check mode verifies the
    lists on every rank). None: equal sizes.

    Note:
        All ranks of the group must call it with tensors of the same shape and dtype
        (with ``sizes``, the same shape but along ``dim``).

    Returns:
        ``x``'s shape with ``dim`` ``world_size`` times larger (``sum(sizes)``); on a
        one-rank group, ``x``.
    """
    if sizes is not None:
        g = as_group(group)
        (d,) = _check.checked(g, "all_gather", x, lambda: _norm_dim(_check_tensor(x), dim))
        return _uneven.all_gather_sizes(g, x, d, sizes)
    return _collective("all_gather", group, x, dim, async_op=async_op)


def all_gather_tensor(group: Group | DistContext, x: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's ``x`` as a list in group order (not differentiable).

    Note:
        All ranks of the group must call it with tensors of the same shape and dtype.

    Returns:
        A *list*, one tensor per rank ([`all_gather`][pdist.all_gather] returns their
        concatenation).
    """
    g = as_group(group)
    _check.checked(g, "all_gather_tensor", x, lambda: _check_tensor(x))
    if g.world_size == 1:
        return [x]
    _check.agree_call(g, "all_gather_tensor", x)
    x = _launches.local(x).detach().contiguous()
    outs = [torch.empty_like(x) for _ in g.ranks]
    with _departures.naming(g, "all_gather_tensor", counted=True):
        dist.all_gather(outs, x, group=g.device_group)
    return outs


def reduce_scatter(
    group: Group | DistContext,
    x: torch.Tensor,
    *,
    dim: int = -1,
    op: str = "sum",
    sizes: list[int] | None = None,
    async_op: bool = False,
) -> torch.Tensor:
    """Reduce ``x`` over the group; rank ``r`` gets chunk ``r`` along ``dim``.

    The inverse of [`all_gather`][pdist.all_gather]; ``op`` and ``async_op`` as in
    [`all_reduce`][pdist.all_reduce] (``"sum"`` and ``"mean"`` are differentiable).

    Note:
        All ranks of the group must call it with tensors of the same shape and dtype.

    ``sizes``: each rank's share of ``dim``, for uneven shards (rank ``r`` gets
    part ``r`` of ``x.split(sizes, dim)``; every rank passes the same list, which the
    caller vouches for and check mode verifies on every rank). None: equal.

    Returns:
        Chunk ``r`` of ``x.chunk(world_size, dim)`` (of ``x.split(sizes, dim)``), reduced;
        on a one-rank group, ``x``.

    Raises:
        ValueError: The group size does not divide ``x.shape[dim]``, or ``sizes`` has
            the wrong length or sum.
    """
    if sizes is not None:
        g = as_group(group)
        norm = functools.partial(_norm_dim, x, dim)
        _, d, op = _check.checked(
            g, "reduce_scatter", x, lambda: _check_tensor(x), norm, lambda: _check_op(x, op)
        )
        return _uneven.reduce_scatter_sizes(g, x, op, d, sizes)
    return _collective("reduce_scatter", group, x, op, dim, async_op=async_op)


def gather(
    group: Group | DistContext, x: torch.Tensor, dst: int = 0, *, dim: int = -1
) -> torch.Tensor | None:
    """Concatenate every rank's ``x`` along ``dim`` on group index ``dst``.

    Note:
        All ranks of the group must call it with tensors of the same shape and dtype.

    Returns:
        The concatenation on ``dst``, None on the other ranks.
    """
    g = as_group(group)
    _, _, d = _check.checked(
        g,
        "gather",
        x,
        lambda: _check_tensor(x),
        lambda: g.global_rank(dst, name="dst"),
        lambda: _norm_dim(x, dim),
    )
    if g.world_size == 1:
        return x
    _check.agree_call(g, "gather", x, dst=dst, dim=d)
    x = _launches.local(x).detach().contiguous()
    outs = [torch.empty_like(x) for _ in g.ranks] if g.rank_in_group == dst else None
    with _departures.naming(g, "gather", counted=True):
        _rooted.gather_to(x, outs, g.device_group, dst)
    return None if outs is None else torch.cat(outs, dim=d)


def reduce(
    group: Group | DistContext, x: torch.Tensor, dst: int = 0, *, op: str = "mean"
) -> torch.Tensor | None:
    """Reduce ``x`` (``"sum"`` or ``"mean"``) onto group index ``dst``, out of place.

    Mind the default: ``"mean"`` here, while [`all_reduce`][pdist.all_reduce] and torch's
    ``reduce`` sum.

    Note:
        All ranks of the group must call it with tensors of the same shape and dtype.

    Returns:
        The reduction on ``dst``, None on the other ranks.
    """
    g = as_group(group)
    op_ok = lambda: _check_op(_check_tensor(x), op, ("sum", "mean"))  # noqa: E731
    _check.checked(g, "reduce", x, op_ok, lambda: g.global_rank(dst, name="dst"))
    if g.world_size == 1:
        return x
    _check.agree_call(g, "reduce", x, dst=dst, op=op)
    out = _launches.local(x).detach().clone(memory_format=torch.contiguous_format)
    with _departures.naming(g, "reduce", counted=True):
        _rooted.reduce_to(out, g.device_group, dst, dist.ReduceOp.SUM)
    if g.rank_in_group != dst:
        return None
    return out.div_(g.world_size) if op == "mean" else out


def broadcast(group: Group | DistContext, x: torch.Tensor, src: int = 0) -> torch.Tensor:
    """Fill every rank's ``x`` with group index ``src``'s, in place; returns ``x``.

    Note:
        All ranks of the group must call it with tensors of the same shape and dtype.

    Raises:
        ValueError: ``x`` is not contiguous ([`broadcast_`][pdist.broadcast_] takes any layout).
    """
    g = as_group(group)
    checks = (lambda: _check_tensor(x), lambda: g.global_rank(src), lambda: _contiguous(g, x))
    _check.checked(g, "broadcast", x, *checks)
    _check.agree_call(g, "broadcast", x, src=src)
    return _in_place(g, x, _launches.broadcast_into, _launches.traced_broadcast, src)


def broadcast_(group: Group | DistContext, x: torch.Tensor, *, src: int = 0) -> torch.Tensor:
    """Fill every rank's ``x`` with group index ``src``'s, in place (any layout); returns ``x``.

    Note:
        All ranks of the group must call it with tensors of the same shape and dtype.

    Raises:
        ValueError: ``x`` requires grad while gradients are enabled.
    """
    g = as_group(group)
    refuse = functools.partial(_refuse_grad, g, x, "broadcast_", "broadcast")
    _check.checked(g, "broadcast_", x, lambda: _check_tensor(x), lambda: g.global_rank(src), refuse)
    _check.agree_call(g, "broadcast_", x, src=src)
    return _in_place(g, x, _launches.broadcast_into, _launches.traced_broadcast, src)


def all_to_all_4d(
    group: Group | DistContext,
    x: torch.Tensor,
    *,
    scatter_dim: int = 2,
    gather_dim: int = 1,
    async_op: bool = False,
) -> torch.Tensor:
    """The sequence-parallel (Ulysses) exchange of a 4-D tensor.

    Splits ``scatter_dim`` among the ranks and concatenates along ``gather_dim``:
    ``[B, S/P, H, D] -> [B, S, H/P, D]`` with the defaults, ``scatter_dim=1,
    gather_dim=2`` the way back. Differentiable; ``async_op`` as in
    [`all_reduce`][pdist.all_reduce]. The defaults assume ``[B, S, H, D]`` (flash-attn), while
    [`ulysses_attention`][pdist.ulysses_attention] defaults to SDPA's ``"bhsd"``: for
    ``[B, H, S, D]`` pass ``scatter_dim=1, gather_dim=2``.

    Note:
        All ranks of the group must call it with tensors of the same shape and dtype.

    Raises:
        ValueError: ``x`` is not 4-D, the dims are out of range or equal, or
            the group size does not divide ``x.shape[scatter_dim]``.
    """
    return _collective("all_to_all_4d", group, x, scatter_dim, gather_dim, async_op=async_op)


def shard(
    group: Group | DistContext, x: torch.Tensor, dim: int = -1, *, scale_grad: bool
) -> torch.Tensor:
    """This rank's chunk of ``x`` along ``dim`` (``x`` is the same on every rank).

    No communication forward; the backward all-gathers the gradient (every
    rank must run it), divided by the group size when ``scale_grad``.

    Raises:
        ValueError: The group size does not divide ``x.shape[dim]``.
    """
    return _collective("shard", group, x, dim, scale_grad)


def _p2p_ends(g: Group, name: str, index: int | None, travels: Callable[[], str]) -> int:
    """This end's checks, then its peer's index; in check mode the swap (``_check.agree_ends``)."""
    default, label = (g.next_rank, "dst") if name == "send" else (g.prev_rank, "src")
    try:
        peer = g.peer_index(index, default, label)
    except ValueError:
        travels()  # the arguments' errors first, in order
        raise
    send = functools.partial(_wire.send_bytes, g, dst=peer, what=f"{name} (check mode)")
    recv = functools.partial(_wire.recv_bytes, g, peer, what=f"{name} (check mode)")
    _check.agree_ends(g, name, travels, peer=peer, send=send, recv=recv)
    return peer


@recorded("send", p2p=True)
def send(group: Group | DistContext, x: torch.Tensor, dst: int | None = None) -> None:
    """Send ``x`` to group index ``dst`` (default: the next rank) on the device group.

    Note:
        The destination must call [`recv`][pdist.recv] with the same shape and dtype. Check mode
        swaps them first (two small CPU messages): a difference raises on both ends.
    """
    g = as_group(group)
    peer = _p2p_ends(g, "send", dst, lambda: _check.tensor_of(_check_tensor(x).shape, x.dtype))
    _rooted.send_to(_launches.local(x).detach().contiguous(), g.device_group, peer)


@recorded("recv", p2p=True)
def recv(
    group: Group | DistContext,
    shape: int | tuple[int, ...] | list[int] | torch.Size,
    dtype: torch.dtype,
    src: int | None = None,
) -> torch.Tensor:
    """Receive a new tensor from group index ``src`` (default: the previous rank).

    ``shape`` is a tensor shape or an int size, as ``torch.empty`` takes.

    Note:
        The source must call [`send`][pdist.send] with a tensor of this shape and dtype.

    Returns:
        The tensor, on the group's device.

    Raises:
        TypeError: ``shape`` is no int or sequence of ints >= 0, or ``dtype`` no dtype.
        ValueError: ``src`` is outside the group, or the group has one rank.
    """
    g = as_group(group)
    peer = _p2p_ends(g, "recv", src, lambda: _check.tensor_of(shape, dtype))
    out = torch.empty(shape, dtype=dtype, device=g.device)
    _rooted.recv_from(out, g.device_group, peer)
    return out
