"""Any parallel layout on real gloo ranks: the groups, flatten, meshes, torch's pipelining."""

from __future__ import annotations

import itertools
import re

import pytest
import torch
import torch.distributed as dist
from fsdp_state import needs_fsdp2_on_cpu
from launcher import run_ranks
from torch import nn

import pdist
from pdist.testing import spawn

# (arguments of distributed(), the axes they give: (name, size), slowest first)
LAYOUTS = [
    ({"pp": 2, "tp": 2}, [("pp", 2), ("dp", 2), ("sp", 1), ("tp", 2)]),
    ({"cp": 2, "sp": 2}, [("dp", 2), ("cp", 2), ("sp", 2), ("tp", 1)]),
    ({"pp": 2, "ep": 2, "tp": 2}, [("pp", 2), ("dp", 2), ("sp", 1), ("tp", 2)]),
    ({"ep": 4}, [("dp", 8), ("sp", 1), ("tp", 1)]),
    ({"axes": {"dp": -1, "cfg": 2, "sp": 2}}, [("dp", 2), ("cfg", 2), ("sp", 2)]),
    ({"axes": {"dp": 2, "pp": 2, "tp": 2}, "ep": 4}, [("dp", 2), ("pp", 2), ("tp", 2)]),
]
GROUPS = ("world", "node", "pp", "dp", "cp", "sp", "tp", "dp_sp", "ep", "edp")


def _expected(rank: int, axes: list[tuple[str, int]], ep: int) -> dict[str, tuple[int, ...]]:
    """Each group of ``rank``, from the coordinates (rank r is the r-th in product order)."""
    names = [n for n, _ in axes]
    coords = list(itertools.product(*(range(s) for _, s in axes)))

    def sharing(varied: set[str]) -> tuple[int, ...]:
        keep = [i for i, n in enumerate(names) if n not in varied]
        mine = coords[rank]
        return tuple(r for r, c in enumerate(coords) if all(c[i] == mine[i] for i in keep))

    out = {n: sharing({n}) for n in names}
    for n in ("pp", "dp", "cp", "sp", "tp"):
        out.setdefault(n, (rank,))
    out["world"] = out["node"] = tuple(range(len(coords)))
    out["dp_sp"] = sharing({"dp", "cp", "sp"})
    stage = sharing(set(names) - {"pp"})
    i = stage.index(rank)
    out["ep"] = stage[i - i % ep : i - i % ep + ep]
    out["edp"] = stage[i % ep :: ep]
    out["expert mesh"] = [list(stage[j : j + ep]) for j in range(0, len(stage), ep)]
    return out


def _every_layout() -> list[dict]:
    results = []
    for kwargs, _ in LAYOUTS:
        with pdist.distributed(**kwargs, stall_timeout=0) as ctx:
            out = {name: ctx.group(name).ranks for name in GROUPS}
            # One collective on every group, on its device and its CPU communicator.
            for name in GROUPS:
                group = ctx.group(name)
                total = pdist.all_reduce(group, torch.tensor([float(ctx.rank)])).item()
                assert total == sum(group.ranks), name
                assert pdist.all_gather_object(group, ctx.rank) == list(group.ranks), name
            out["axes"] = [(n, g.ranks) for n, g in ctx.axes.items()]
            with pdist.patch_tp(ctx, ctx.world) as inner, pdist.patch_sp(inner, ctx.world) as both:
                assert (both.tp, both.sp, both.pp, both.dp_sp) == (
                    ctx.world,
                    ctx.world,
                    ctx.pp,
                    ctx.dp_sp,
                )
                assert both.axes.get("tp", ctx.world) is ctx.world
                assert list(both.axes) == list(ctx.axes)
            names = list(ctx.axes)
            pair = pdist.flatten(ctx, names[-1], names[0])
            out["flatten"] = pair.ranks, pair.name
            out["flatten_sum"] = pdist.all_reduce(pair, torch.ones(1)).item()
            again = pdist.flatten(ctx, names[0], names[-1])
            out["flatten_reused"] = again.device_group is pair.device_group
            mesh = pdist.device_mesh(ctx, ("edp", "ep"))
            out["expert"] = (
                mesh.mesh.tolist(),
                mesh.mesh_dim_names,
                [tuple(dist.get_process_group_ranks(g)) for g in mesh.get_all_groups()],
            )
            whole = pdist.device_mesh(ctx)
            out["dense"] = tuple(whole.mesh.shape), whole.mesh_dim_names
            out["dense_groups"] = [
                tuple(dist.get_process_group_ranks(whole.get_group(n))) for n in names
            ]
            del mesh, whole
        results.append(out)
    return results


def test_every_layout_on_eight_ranks():
    """Each layout's groups equal the coordinates' on 8 ranks; a collective runs on every group."""
    per_rank = spawn(_every_layout, 8, timeout=240)
    for rank, results in enumerate(per_rank):
        for (kwargs, axes), out in zip(LAYOUTS, results, strict=True):
            ep = kwargs.get("ep", 1)
            expected = _expected(rank, axes, ep)
            for name in GROUPS:
                assert out[name] == expected[name], (kwargs, name, rank)
            assert out["axes"] == [(n, expected[n]) for n, _ in axes]
            first, last = axes[0][0], axes[-1][0]
            coords = list(itertools.product(*(range(s) for _, s in axes)))
            keep = range(1, len(axes) - 1)
            flat = tuple(
                r for r, c in enumerate(coords) if all(c[i] == coords[rank][i] for i in keep)
            )
            assert out["flatten"] == (flat, f"{first}_{last}")
            assert out["flatten_sum"] == len(flat)
            assert out["flatten_reused"]
            mesh, dim_names, groups = out["expert"]
            assert dim_names == ("edp", "ep")
            assert mesh == expected["expert mesh"]
            assert groups == [expected["edp"], expected["ep"]]
            assert out["dense"] == (tuple(s for _, s in axes), tuple(n for n, _ in axes))
            assert out["dense_groups"] == [expected[n] for n, _ in axes]


def _sub_meshes() -> dict:
    out = {}
    with pdist.distributed(cp=2, sp=2, stall_timeout=0) as ctx:  # dp 2, cp 2, sp 2
        for axes in [("dp",), ("dp", "sp"), ("dp_sp",), ("cp", "sp"), ("dp_sp", "tp")]:
            mesh = pdist.device_mesh(ctx, axes)
            out[axes] = (mesh.mesh.tolist(), mesh.mesh_dim_names)
            del mesh
    return out


def test_sub_meshes_of_a_cp_layout():
    """("dp",), ("dp", "sp"), ("dp_sp",) and friends hold the caller's coordinates' ranks."""
    for rank, out in enumerate(spawn(_sub_meshes, 8, timeout=120)):
        d, c, s = rank // 4, rank // 2 % 2, rank % 2
        assert out[("dp",)] == ([c * 2 + s, 4 + c * 2 + s], ("dp",))
        assert out[("dp", "sp")] == ([[c * 2, c * 2 + 1], [4 + c * 2, 5 + c * 2]], ("dp", "sp"))
        assert out[("dp_sp",)] == (list(range(8)), ("dp_sp",))
        assert out[("cp", "sp")] == ([[d * 4, d * 4 + 1], [d * 4 + 2, d * 4 + 3]], ("cp", "sp"))
        assert out[("dp_sp", "tp")] == ([[r] for r in range(8)], ("dp_sp", "tp"))


def _bad_flatten() -> list[str]:
    messages = []
    with pdist.distributed(pp=2, stall_timeout=0) as ctx:
        for axes in [(), ("cfg",), ("dp", "dp"), (3,)]:
            with pytest.raises((TypeError, ValueError)) as info:
                pdist.flatten(ctx, *axes)
            messages.append(str(info.value))
        mine = ("dp",) if ctx.rank == 0 else ("pp",)
        with pytest.raises(pdist.RankMismatchError) as info:
            pdist.flatten(ctx, *mine)
        messages.append(str(info.value))
    return messages


def test_flatten_refuses_bad_axes_together():
    """No axis, an unknown or repeated one, or ranks asking for different ones: all ranks raise."""
    for messages in spawn(_bad_flatten, 2, timeout=90):
        assert "names no axis" in messages[0]
        assert "'cfg' is not an axis of the layout" in messages[1]
        assert "names an axis twice" in messages[2]
        assert "3 is not an axis name" in messages[3]
        assert "flatten()" in messages[4]


# --------------------------------------------------------------------------- pipelining


def _stage_model(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(7)
    return [(torch.randn(4, 8, generator=gen), torch.randn(4, 8, generator=gen)) for _ in range(2)]


def _pipeline() -> tuple[int, float, float]:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
    from torch.distributed.tensor import DTensor

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(out, target)

    with pdist.distributed(pp=2) as ctx:  # pp [0, 2] [1, 3]; dp [0, 1] [2, 3]
        stage_index = ctx.pp.rank_in_group
        module = _stage_model(stage_index)
        fully_shard(module, mesh=pdist.device_mesh(ctx, ("dp",)))
        stage = PipelineStage(module, stage_index, 2, ctx.device, group=ctx.pp.device_group)
        schedule = ScheduleGPipe(stage, n_microbatches=2, loss_fn=loss_fn, scale_grads=True)
        x, y = _batches()[ctx.dp.rank_in_group]  # each dp rank its own batch
        if stage_index == 0:
            schedule.step(x)
        else:
            schedule.step(target=y)
        grads = [
            p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            for p in module.parameters()
        ]
        # The reference: one process, both stages, the two batches averaged.
        first, second = _stage_model(0), _stage_model(1)
        for bx, by in _batches():
            # GPipe averages over the 2 microbatches (scale_grads), FSDP over the 2 dp ranks.
            for mx, my in zip(bx.chunk(2), by.chunk(2), strict=True):
                (loss_fn(second(first(mx)), my) / 4).backward()
        reference = first if stage_index == 0 else second
        diff = max(
            (g - r.grad).abs().max().item()
            for g, r in zip(grads, reference.parameters(), strict=True)
        )
        scale = max(r.grad.abs().max().item() for r in reference.parameters())
        del schedule, stage, module
    return stage_index, diff, scale


@needs_fsdp2_on_cpu
def test_torch_pipelining_over_pp_with_fsdp_over_dp():
    """GPipe over ctx.pp with each stage FSDP2-sharded over dp: the grads of one process."""
    results = spawn(_pipeline, 4, timeout=180)
    assert [r[0] for r in results] == [0, 0, 1, 1]
    for _, diff, scale in results:
        assert scale > 0
        assert diff <= 1e-5 * max(1.0, scale)


PP_STALL = """
    import logging, time, torch, pdist
    logging.basicConfig(format="%(created).3f %(message)s")

    with pdist.distributed(pp=2, stall_timeout=2) as ctx:  # pp [0, 2] [1, 3]
        pdist.barrier(ctx)
        if ctx.rank == 2:
            time.sleep(8)  # late to its pp all_reduce
        pdist.all_reduce(ctx.pp, torch.ones(1024))
        pdist.barrier(ctx)  # ranks 1 and 3 stay (and answer) until rank 2 is back
    print("DONE", flush=True)
"""


@pytest.mark.serial
@pytest.mark.timeout(90)
def test_a_stall_on_the_pp_axis_names_the_pp_group():
    """Rank 0 waits on ctx.pp while rank 2 sleeps: the live report names the pp group."""
    results = run_ranks(PP_STALL, 4, timeout=60, env={"PDIST_STALL_ANSWER_SEC": "6"})
    for r in results:
        assert r.returncode == 0, r.output
        assert "DONE" in r.output
    outputs = "\n".join(r.output for r in results)
    report = re.search(r"pdist: stall report .*?did not answer[^\n]*", outputs, flags=re.DOTALL)
    assert report is not None, outputs
    text = report.group(0)
    # Rank 2 shows under pp once it used the group (the flight recorder knows no group before).
    assert re.search(r"group pp \(.*\), ranks? 0(, 2)?:\n +rank 0 in (gloo:)?all_reduce", text), (
        text
    )
    assert "rank 2 on" in text  # its stack: the sleep
