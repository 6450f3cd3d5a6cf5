"""End to end: draft loss with CP = W over features tapped from P pipeline stages.

One job of 4 gloo processes runs two grids: P=2 x W=2 (all four ranks, rank =
stage * W + cp) and P=3 x W=1 (ranks 0-2, rank 3 idle).  Each stage computes a
stand-in target layer on its zigzag shard, passes activations to the next stage
with plain ``dist.send`` on the world group (the "schedule"), and taps its
features to the last stage through a TapChannel.  The last stage consumes the
microbatches in reverse order, computes the real DFlash loss (`DrafterLoss`
with a `ContextShard`: ring branch attention over its CP group), and compares
loss and gradients with the same loss in one process on the padded batch.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from parallel_harness import guarded, merge_ranks, metrics_of, run_job

GRIDS = [(2, 2), (3, 1)]  # (P, W)
MICROBATCHES = [[11, 17], [9, 14, 6]]
F_DIM, VOCAB, H, HKV, D, B = 8, 17, 4, 2, 4, 3  # F_DIM: the target's hidden size
MASK_ID = VOCAB - 1
TOL = 1e-10


def make_data(seed, p_max):
    gen = torch.Generator().manual_seed(seed)
    target = {
        "embed": torch.randn(VOCAB, F_DIM, generator=gen, dtype=torch.float64),
        "A": [torch.randn(F_DIM, F_DIM, generator=gen, dtype=torch.float64) / 2 for _ in range(p_max)],
    }
    mbs = []
    for lens in MICROBATCHES:
        tokens = torch.randint(0, VOCAB - 1, (sum(lens),), generator=gen)
        nb = 6
        bseq = torch.randint(0, len(lens), (nb,), generator=gen)
        anch = torch.stack([torch.randint(0, lens[s], (1,), generator=gen)[0] for s in bseq.tolist()])
        mbs.append({"lens": lens, "tokens": tokens, "bseq": bseq, "anch": anch})
    return target, mbs


def stage_forward(stage, x, target):
    """Stand-in target stage: returns (activation for the next stage, tapped features)."""
    z = (target["embed"][x] if stage == 0 else x) @ target["A"][stage]
    h = torch.tanh(z)
    return h, 0.5 * h + 0.1 * z


def make_loss(num_taps):
    """The real DFlash loss over `num_taps` tapped stages (float64, seeded: the same on every rank)."""
    from dcoco.drafters.dflash import DFlashConfig, DFlashModel
    from dcoco.train.losses import DrafterLoss

    torch.manual_seed(1234)
    cfg = DFlashConfig(
        hidden_size=F_DIM,
        intermediate_size=2 * F_DIM,
        num_hidden_layers=2,
        num_attention_heads=H,
        num_key_value_heads=HKV,
        head_dim=D,
        vocab_size=VOCAB,
        num_target_layers=num_taps,
        block_size=B,
        target_layer_ids=list(range(num_taps)),
        mask_token_id=MASK_ID,
    )
    model = DFlashModel(cfg).double()
    embed = torch.nn.Embedding(VOCAB, F_DIM).double()
    head = torch.nn.Linear(F_DIM, VOCAB, bias=False).double()
    return DrafterLoss(model, embed, head, gamma=3.0)


def samples_and_anchors(mb):
    """The microbatch's sequences as samples, and its blocks' anchors grouped by sequence."""
    cu = [0]
    for n in mb["lens"]:
        cu.append(cu[-1] + n)
    samples = [{"input_ids": mb["tokens"][a:b].tolist(), "prompt_len": 0} for a, b in zip(cu, cu[1:])]
    anchors = [sorted(int(a) for a, s in zip(mb["anch"], mb["bseq"]) if int(s) == i) for i in range(len(cu) - 1)]
    return samples, anchors


def reference(P, seed):
    """Single process, unsharded, no pipeline: the padded batch of `DrafterLoss` itself."""
    target, mbs = make_data(seed, P)
    loss = make_loss(P)
    total = 0.0
    for mb in mbs:
        x, taps = mb["tokens"], []
        for s in range(P):
            x, tap = stage_forward(s, x, target)
            taps.append(tap)
        samples, anchors = samples_and_anchors(mb)
        value, _ = loss(loss.batch_at(samples, list(torch.split(torch.cat(taps, 1), mb["lens"])), anchors))
        total = total + value
    total.backward()
    return float(total.detach()), {n: p.grad.clone() for n, p in loss.model.named_parameters()}


def run_grid(rank, P, W, seed):
    from dcoco.parallel import ContextShard, TapChannel, ZigzagLayout, allreduce_gradients

    target, mbs = make_data(seed, P)
    cp_groups = [dist.new_group([s * W + c for c in range(W)]) for s in range(P)]
    rows = max(max(ZigzagLayout(mb["lens"], W).local_lens()) for mb in mbs)
    taps = {
        (s, c): TapChannel(
            s * W + c,
            (P - 1) * W + c,
            (rows, F_DIM),
            torch.float64,
            num_slots=2,
            transport="p2p",
            timeout=60,
            name=f"tap[stage{s},cp{c}]",
        )
        for s in range(P - 1)
        for c in range(W)
    }
    out = {}
    if rank < P * W:
        stage, c = divmod(rank, W)
        own_taps = {}
        for m, mb in enumerate(mbs):  # the schedule: forward of every microbatch, stage by stage
            layout = ZigzagLayout(mb["lens"], W)
            n = layout.local_len(c)
            if stage == 0:
                x = mb["tokens"][layout.local_indices(c)]
            else:
                x = torch.empty(n, F_DIM, dtype=torch.float64)
                dist.recv(x, (stage - 1) * W + c)
            h, tap = stage_forward(stage, x, target)
            if stage < P - 1:
                dist.send(h.contiguous(), (stage + 1) * W + c)
                taps[(stage, c)].send(tap, stamp=m)
            else:
                own_taps[m] = tap
        if stage == P - 1:
            loss = make_loss(P)
            total = 0.0
            for m in reversed(range(len(mbs))):  # consume microbatches out of order
                mb = mbs[m]
                layout = ZigzagLayout(mb["lens"], W)
                feats = [taps[(s, c)].recv(m) for s in range(P - 1)] + [own_taps[m]]
                shard = ContextShard(layout, cp_groups[stage])
                shard.attach(loss)
                samples, anchors = samples_and_anchors(mb)
                value, _ = loss(shard.batch(samples, torch.cat(feats, 1), anchors, B))
                total = total + value
            total.backward()
            allreduce_gradients(loss.model, cp_groups[stage])
            value = total.detach().clone()
            dist.all_reduce(value, group=cp_groups[stage])
            ref_loss, ref_grads = reference(P, seed)
            params = list(loss.model.named_parameters())
            out = {
                "loss_err": abs(float(value) - ref_loss),
                "grad_err": max(float((p.grad - ref_grads[n]).abs().max()) for n, p in params),
                "grad_norm": float(sum(p.grad.norm() ** 2 for _, p in params) ** 0.5),
            }
    for ch in taps.values():
        ch.close()
    return out


def worker(rank, world_size):
    results: dict = {}
    for P, W in GRIDS:
        guarded(results, f"P{P}xW{W}", run_grid, rank, P, W, 7 + P)
        dist.barrier()
    return results


@pytest.fixture(scope="module")
def results():
    return merge_ranks(run_job(worker, 4))


@pytest.mark.parametrize("P,W", GRIDS)
def test_cp_and_tapped_pipeline_match_single_process(results, P, W):
    m = metrics_of(results, f"P{P}xW{W}")
    assert m["grad_norm"] > 0  # the comparison is not vacuous
    assert m["loss_err"] <= TOL and m["grad_err"] <= TOL, m
