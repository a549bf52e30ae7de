"""broadcast_weights from an FSDP2 trainer: its DTensors gathered one at a time, sent by one rank.

Two jobs, as in production: a 2-rank trainer that shards its model with ``fully_shard``
over its ``dp`` (gloo, CPU), whose rank 0 is the link's member 0, and a 2-rank receiving
job (link members 1 and 2) with bf16 models. The trainer's rank 1 gathers with rank 0
(``broadcast_weights(None, state_dict)``) and sends nothing.
"""

from __future__ import annotations

from fsdp_state import needs_fsdp2_on_cpu
from test_links import free_port, passed, run_jobs

MODEL = """
    import os
    import torch
    from torch import nn
    import pdist
    import pdist.testing

    BUCKET = 64 << 10  # each 128 x 128 fp32 weight (64 KiB) travels alone; the biases packed

    def model():
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Linear(128, 128) for _ in range(6)])
"""

TRAINER = (
    MODEL
    + """
    import weakref
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    # Every full tensor gathered, counted until its memory (its storage) is freed.
    live, peak, gathers = [0], [0], [0]
    full_tensor = DTensor.full_tensor

    def counted(self, **kwargs):
        out = full_tensor(self, **kwargs)
        out = out.wait() if hasattr(out, "wait") else out  # funcol's tensor, still gathering
        n = out.untyped_storage().nbytes()
        live[0] += n
        peak[0], gathers[0] = max(peak[0], live[0]), gathers[0] + 1
        weakref.finalize(out.untyped_storage(), lambda: live.__setitem__(0, live[0] - n))
        return out

    DTensor.full_tensor = counted

    with pdist.distributed() as ctx:
        net = model()
        mesh = pdist.device_mesh(ctx, ("dp",))
        for layer in net:
            fully_shard(layer, mesh=mesh)
        fully_shard(net, mesh=mesh)
        state = net.state_dict()
        assert all(isinstance(t, DTensor) for t in state.values())
        total = sum(t.numel() * t.element_size() for t in state.values())
        staging = []
        if ctx.rank == 0:
            with pdist.link(os.environ["LINK"], rank=0, world_size=3, timeout=60) as g:
                # A receiver's into lacks a name: every member raises before any byte moves,
                # and this rank still gathers every tensor with rank 1, which raises too.
                try:
                    pdist.broadcast_weights(g, state, bucket_bytes=BUCKET)
                except pdist.PdistError as exc:
                    print(f"RAISED {exc}")
                assert gathers[0] == len(state), gathers
                gathers[0] = peak[0] = 0
                with pdist.testing.inject(allocate=staging.append):
                    pdist.broadcast_weights(g, state, bucket_bytes=BUCKET)
        else:
            # It learns that the member raised, after gathering every tensor with it.
            try:
                pdist.broadcast_weights(None, state)
            except pdist.PdistError as exc:
                print(f"RAISED {exc}")
            assert gathers[0] == len(state), gathers
            gathers[0] = peak[0] = 0
            assert pdist.broadcast_weights(None, state) == {}
        print(f"PEAK {peak[0]} STAGING {max(staging, default=0)} TOTAL {total}")
        assert gathers[0] == len(state), gathers
        # One full tensor at a time (64 KiB); now and then two, while torch's communicator
        # lets go of the last one. Gathering them all at once would hold 6 buckets.
        assert total > 6 * BUCKET, total
        assert peak[0] <= 2 * BUCKET, peak
        assert max(staging, default=0) <= BUCKET, staging
        assert pdist.all_reduce(ctx, torch.ones(1)).item() == 2.0  # the trainer goes on
    print("OK")
"""
)

RECEIVERS = (
    MODEL
    + """
    rank = int(os.environ["RANK"])
    reference = model().state_dict()  # the trainer's full weights, computed independently
    served = {n: torch.zeros_like(t, dtype=torch.bfloat16) for n, t in reference.items()}
    with pdist.link(os.environ["LINK"], rank=1 + rank, world_size=3, timeout=60) as g:
        partial = {n: t for n, t in served.items() if n != "5.bias" or rank == 0}
        try:
            pdist.broadcast_weights(g, into=partial, bucket_bytes=BUCKET)
        except pdist.PdistError as exc:
            print(f"RAISED {exc}")
        assert all(not t.any() for t in served.values())  # untouched
        pdist.broadcast_weights(g, into=served, bucket_bytes=BUCKET)
    for n, t in served.items():
        assert torch.equal(t, reference[n].bfloat16()), n
    print("OK")
"""
)


@needs_fsdp2_on_cpu
def test_an_fsdp2_trainer_sends_full_weights_gathered_one_at_a_time() -> None:
    """Receivers' bf16 into equals the full weights; the trainer's gathers stay within 2 buckets."""
    trainer, receivers = run_jobs(
        [(TRAINER, 2), (RECEIVERS, 2)], timeout=150, env={"LINK": f"127.0.0.1:{free_port()}"}
    )
    passed(trainer, 2)
    passed(receivers, 2)
    for r in [trainer[0], *receivers]:
        assert "RAISED" in r.output, r.output
        assert "'5.bias'" in r.output, r.output
    assert "RAISED broadcast_weights: the trainer's link member raised" in trainer[1].output
