"""``python -m pdist doctor``: what torch offers, the topology, then every collective once."""

from __future__ import annotations

import os
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch

import pdist
from pdist import DistContext
from pdist._compat import FEATURES
from pdist._env import env_flag, stall_settings
from pdist._topology import nvml_handle

__all__ = ["CHECKS", "doctor", "doctor_rank", "render", "torch_support"]


def _expect(condition: bool, what: str) -> None:
    if not condition:
        raise AssertionError(what)


def _check_all_reduce(ctx: DistContext) -> None:
    out = pdist.all_reduce(ctx, torch.full((4,), float(ctx.rank + 1), device=ctx.device))
    total = ctx.world_size * (ctx.world_size + 1) / 2
    _expect(bool((out == total).all()), f"sum {out.tolist()} != {total}")


def _check_all_gather(ctx: DistContext) -> None:
    out = pdist.all_gather(ctx, torch.tensor([float(ctx.rank)], device=ctx.device), dim=0)
    _expect(out.tolist() == list(range(ctx.world_size)), f"got {out.tolist()}")


def _check_broadcast(ctx: DistContext) -> None:
    x = torch.full((3,), float(ctx.rank), device=ctx.device)
    pdist.broadcast(ctx, x, src=ctx.world_size - 1)
    _expect(bool((x == ctx.world_size - 1).all()), f"got {x.tolist()}")


def _check_reduce_gather(ctx: DistContext) -> None:
    x = torch.tensor([float(ctx.rank)], device=ctx.device)
    summed = pdist.reduce(ctx, x, dst=0, op="sum")
    gathered = pdist.gather(ctx, x, dst=0, dim=0)
    if ctx.rank == 0:
        ranks = list(range(ctx.world_size))
        _expect(summed is not None and summed.item() == sum(ranks), f"reduce gave {summed}")
        _expect(gathered is not None and gathered.tolist() == ranks, "gather order")


def _check_all_to_all(ctx: DistContext) -> None:
    p = ctx.world_size
    full = torch.arange(2 * p * p * 3, dtype=torch.float32).reshape(1, 2 * p, p, 3)
    local = full[:, 2 * ctx.rank : 2 * ctx.rank + 2].to(ctx.device)
    out = pdist.all_to_all_4d(ctx, local).cpu()
    _expect(torch.equal(out, full[:, :, ctx.rank : ctx.rank + 1]), "all_to_all_4d layout")


def _check_send_recv(ctx: DistContext) -> None:
    if ctx.world_size == 1:
        return
    x = torch.full((2,), float(ctx.rank), device=ctx.device)
    if ctx.rank == 0:
        pdist.send(ctx, x)
    got = pdist.recv(ctx, (2,), torch.float32)
    if ctx.rank != 0:
        pdist.send(ctx, x)
    _expect(bool((got == ctx.world.prev_rank).all()), f"ring gave {got.tolist()}")


def _check_objects(ctx: DistContext) -> None:
    mine = {"from": ctx.rank, "t": torch.ones(2)} if ctx.rank == 0 else None
    _expect(pdist.broadcast_object(ctx, mine)["from"] == 0, "broadcast_object")
    everyone = pdist.all_gather_object(ctx, ctx.rank)
    _expect(everyone == list(range(ctx.world_size)), f"all_gather_object gave {everyone}")
    items: list[Any] = [{"w": torch.arange(10.0)}] if ctx.rank == 0 else [None]
    pdist.broadcast_object_list(ctx, items)
    _expect(torch.equal(items[0]["w"].cpu(), torch.arange(10.0)), "broadcast_object_list")


def _check_collate(ctx: DistContext) -> None:
    size = 2 * ctx.world_size + 1
    indices = list(pdist.EvalSampler(range(size), ctx))
    batches = [torch.tensor(indices, device=ctx.device)] if indices else []
    out = pdist.collate_batches(ctx, batches)
    _expect(out is not None and out.tolist() == list(range(size)), "collate_batches order")


def _check_message_queue(ctx: DistContext) -> None:
    if ctx.node.world_size != ctx.world_size:
        return  # needs one host
    with pdist.message_queue(ctx, chunk_bytes=1 << 16, chunks=2) as group:
        got = pdist.broadcast_object(group, {"step": 1} if ctx.rank == 0 else None)
    _expect(got == {"step": 1}, "message_queue")


CHECKS: list[tuple[str, Callable[[DistContext], None]]] = [
    ("all_reduce", _check_all_reduce),
    ("all_gather", _check_all_gather),
    ("broadcast", _check_broadcast),
    ("reduce+gather", _check_reduce_gather),
    ("all_to_all_4d", _check_all_to_all),
    ("send/recv", _check_send_recv),
    ("object collectives", _check_objects),
    ("collate_batches", _check_collate),
    ("message_queue", _check_message_queue),
    ("barrier", pdist.barrier),
]
"""The doctor's checks, in the order they run: ``(name, check(ctx))``."""


def _gpu_name(ctx: DistContext) -> str:
    """The GPU's name from NVML (through CUDA_VISIBLE_DEVICES), else from torch."""
    if ctx.device.type != "cuda" or ctx.device.index is None:
        return "-"
    try:
        with nvml_handle(ctx.device.index) as (pynvml, handle):
            name = pynvml.nvmlDeviceGetName(handle)
            return name.decode() if isinstance(name, bytes) else str(name)
    except (pdist.PdistError, ValueError):  # no NVML: torch knows the name too
        return torch.cuda.get_device_name(ctx.device)


def _yes(flag: bool, yes: str, no: str) -> str:
    return yes if flag else no


def torch_support(features: Any = FEATURES) -> list[str]:
    """What this torch supports, in plain words: one line per thing a user can tell apart."""
    f = features
    recorder = {
        "_dump_fr_trace": f"torch's flight recorder, for every backend (its buffer: "
        f"{f.flight_recorder_env})",
        "_dump_nccl_trace": f"torch's flight recorder for NCCL (its buffer: "
        f"{f.flight_recorder_env}), pdist's own record for gloo",
    }.get(f.flight_recorder or "", "pdist's own record (this torch has no flight recorder)")
    return [
        "subgroups (patch_tp, new_group, layouts): "
        + _yes(f.split_group, "split off the world's communicator", "each a new communicator"),
        "device_mesh(): "
        + _yes(f.device_mesh_from_group, "yes, over pdist's groups", "no (needs a newer torch)"),
        "devices: "
        + _yes(f.accelerator_api, "any accelerator torch knows (torch.accelerator)", "CUDA only"),
        "FSDP2 (fully_shard) with grad_sync: "
        + _yes(f.fsdp2_on_cpu, "on CPU and GPU", "on GPU only (CPU needs torch 2.7+)"),
        f"stall reports read {recorder}",
        "async collectives: "
        + _yes(f.async_results == "native", "torch's own work handles", "wrapped in Python works"),
        *(
            [f"leaving a block waits {f.destroy_wait_sec:g}s for gloo's threads (a torch bug)"]
            if f.destroy_wait_sec
            else []
        ),
    ]


def _run_checks(ctx: DistContext) -> list[tuple[str, str | None]]:
    """Every check's failure line, or None; a failure does not stop the others (ranks in step)."""
    results: list[tuple[str, str | None]] = []
    for name, check in CHECKS:
        try:
            check(ctx)
            results.append((name, None))
        except Exception as exc:
            results.append((name, traceback.format_exception_only(type(exc), exc)[-1].strip()))
    return results


def doctor_rank() -> dict[str, Any]:
    """Run the doctor on this rank; every rank returns the same report (all must call it)."""
    with pdist.distributed() as ctx:
        me = {
            "rank": ctx.rank,
            "host": socket.gethostname(),
            "device": str(ctx.device),
            "gpu": _gpu_name(ctx),
            "cpus": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [],
            "node": list(ctx.node.ranks),
        }
        with pdist.world_comm_guard(ctx):
            results = _run_checks(ctx)
        subgroups = ctx.world.lifetime.subgroup_timeout or ctx.world.timeout
        return {
            "world_size": ctx.world_size,
            "backend": ctx.backend,
            "torch": [torch.__version__, *torch_support()],
            "timeout": ctx.world.timeout.total_seconds(),
            "subgroup_timeout": subgroups.total_seconds(),
            "guard_timeout": pdist.world_comm_timeout(),
            "stall_timeout": stall_settings(None)[0],
            "ranks": pdist.all_gather_object(ctx, {"me": me, "results": results}),
        }


def _cpus(cpus: list[int]) -> str:
    """``[0, 1, 2, 5]`` as ``"0-2,5"``."""
    spans: list[list[int]] = []
    for c in cpus:
        if spans and c == spans[-1][-1] + 1:
            spans[-1][1:] = [c]
        else:
            spans.append([c])
    return ",".join("-".join(map(str, s)) for s in spans) or "-"


def _var(name: str) -> str:
    return os.environ.get(name, "-")


def _stall_text(report: dict[str, Any]) -> str:
    """``300s``, ``off``, or ``?`` for a report made before doctor looked at it."""
    if "stall_timeout" not in report:
        return "?"
    seconds = report["stall_timeout"]
    return "off" if seconds is None else f"{seconds:g}s"


def render(report: dict[str, Any]) -> tuple[str, int]:
    """The text report and the exit code (0 healthy, 1 a check failed)."""
    hosts = sorted({tuple(r["me"]["node"]) for r in report["ranks"]})
    guard = report["guard_timeout"]
    version, *features = report["torch"]
    lines = [
        f"pdist doctor: {report['world_size']} ranks on {len(hosts)} host(s), "
        f"{len(hosts[0]) if hosts else 0} per host; backend {report['backend']}",
        f"torch {version} supports:",
        *(f"  {line}" for line in features),
        f"timeouts: collective {report['timeout']:g}s, subgroup {report['subgroup_timeout']:g}s, "
        f"start-up guard {'forever' if guard is None else f'{guard:g}s'}"
        f", stall watch {_stall_text(report)}"
        f" (PDIST_TIMEOUT_SEC={_var('PDIST_TIMEOUT_SEC')}, "
        f"PDIST_WORLD_COMM_TIMEOUT_SEC={_var('PDIST_WORLD_COMM_TIMEOUT_SEC')}, "
        f"PDIST_STALL_TIMEOUT_SEC={_var('PDIST_STALL_TIMEOUT_SEC')})",
        f"check mode: {'on' if env_flag('PDIST_CHECK', False) else 'off'} by default"
        f" (PDIST_CHECK={_var('PDIST_CHECK')}; distributed(check=True) turns it on)",
        f"{'rank':>4}  {'host':<20} {'node ranks':<14} {'device':<8} {'gpu':<24} cpus",
    ]
    for me in (r["me"] for r in report["ranks"]):
        lines.append(
            f"{me['rank']:>4}  {me['host'][:20]:<20} {str(me['node'])[:14]:<14} "
            f"{me['device']:<8} {me['gpu'][:24]:<24} {_cpus(me['cpus'])}"
        )
    failures: dict[str, list[tuple[int, str]]] = {}
    for name, _ in CHECKS:
        for r in report["ranks"]:
            detail = dict(r["results"]).get(name)
            if detail is not None:
                failures.setdefault(name, []).append((r["me"]["rank"], detail))
        lines.append(f"check {name:<20} {'FAILED' if name in failures else 'ok'}")
    if failures:
        name, bad = next(iter(failures.items()))
        ranks = [b[0] for b in bad]
        lines.append(f"verdict: UNHEALTHY: check {name!r} failed on ranks {ranks}: {bad[0][1]}")
        return "\n".join(lines), 1
    lines.append(f"verdict: healthy ({len(CHECKS)} checks passed on {report['world_size']} ranks)")
    return "\n".join(lines), 0


def doctor(nproc: int | None) -> int:
    """Run the doctor; returns the exit code (0 healthy, 1 a check or a rank failed)."""
    from pdist.testing import SpawnError

    from . import on_ranks

    try:
        report, reports = on_ranks(doctor_rank, nproc, timeout=600)
    except SpawnError as exc:
        print(f"pdist doctor: UNHEALTHY: {exc}")
        return 1
    text, code = render(report)
    if reports:  # every rank exits with the verdict; one prints it
        print(text)
    return code
