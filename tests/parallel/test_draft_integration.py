"""End to end: draft loss with CP = W over features tapped from P pipeline stages.

One job of 4 gloo processes runs two grids: P=2 x W=2 (all four ranks, rank =
stage * W + cp) and P=3 x W=1 (ranks 0-2, rank 3 idle).  Each stage computes a
stand-in target layer on its zigzag shard, passes activations to the next stage
with plain ``dist.send`` on the world group (the "schedule"), and taps its
features to the last stage through a TapChannel.  The last stage consumes the
microbatches in reverse order, computes the DFlash-style draft loss with ring
branch attention over its CP group, and compares loss and gradients with the
single-process run of the same code on the unsharded data.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from parallel_harness import guarded, merge_ranks, metrics_of, run_job

GRIDS = [(2, 2), (3, 1)]  # (P, W)
MICROBATCHES = [[11, 17], [9, 14, 6]]
F_DIM, VOCAB, HIDDEN, H, HKV, D, B = 5, 17, 8, 4, 2, 4, 3
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


def block_inputs(mb, block_ids):
    """DFlash block inputs: [anchor token, MASK, ...]; position j predicts token a + j."""
    cu = [0]
    for n in mb["lens"]:
        cu.append(cu[-1] + n)
    toks, tgts, valid = [], [], []
    for b in block_ids.tolist():
        s, a = int(mb["bseq"][b]), int(mb["anch"][b])
        n_valid = min(B, mb["lens"][s] - a)
        valid.append(n_valid)
        for j in range(B):
            toks.append(int(mb["tokens"][cu[s] + a]) if j == 0 else MASK_ID)
            tgts.append(int(mb["tokens"][cu[s] + a + j]) if 1 <= j < n_valid else -100)
    return torch.tensor(toks, dtype=torch.long), torch.tensor(tgts, dtype=torch.long), torch.tensor(valid)


def make_layer(num_taps):
    from dcoco.parallel import StandInDraftLayer

    torch.manual_seed(1234)
    return StandInDraftLayer(num_taps, F_DIM, HIDDEN, H, HKV, D, VOCAB).double()


def mb_loss(layer, mb, features, block_ids, layout, group):
    from dcoco.parallel import dflash_spec, draft_branch_loss

    toks, tgts, valid = block_inputs(mb, block_ids)
    spec = dflash_spec(mb["bseq"][block_ids], mb["anch"][block_ids], B, valid_lens=valid, include_anchor=True)
    return draft_branch_loss(layer, features, toks, tgts, spec, layout, group=group)


def reference(P, seed):
    """Single process, unsharded, no pipeline."""
    from dcoco.parallel import ZigzagLayout

    target, mbs = make_data(seed, P)
    layer = make_layer(P)
    total = 0.0
    for mb in mbs:
        x, taps = mb["tokens"], []
        for s in range(P):
            x, tap = stage_forward(s, x, target)
            taps.append(tap)
        total = total + mb_loss(
            layer, mb, torch.cat(taps, 1), torch.arange(len(mb["anch"])), ZigzagLayout(mb["lens"], 1), None
        )
    total.backward()
    return float(total.detach()), {n: p.grad.clone() for n, p in layer.named_parameters()}


def run_grid(rank, P, W, seed):
    from dcoco.parallel import TapChannel, ZigzagLayout, allreduce_gradients, branch_owners

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
            layer = make_layer(P)
            total = 0.0
            for m in reversed(range(len(mbs))):  # consume microbatches out of order
                mb = mbs[m]
                layout = ZigzagLayout(mb["lens"], W)
                feats = [taps[(s, c)].recv(m) for s in range(P - 1)] + [own_taps[m]]
                owned = (branch_owners(layout, mb["bseq"], mb["anch"]) == c).nonzero().squeeze(1)
                total = total + mb_loss(layer, mb, torch.cat(feats, 1), owned, layout, cp_groups[stage])
            total.backward()
            allreduce_gradients(layer, cp_groups[stage])
            loss = total.detach().clone()
            dist.all_reduce(loss, group=cp_groups[stage])
            ref_loss, ref_grads = reference(P, seed)
            out = {
                "loss_err": abs(float(loss) - ref_loss),
                "grad_err": max(float((p.grad - ref_grads[n]).abs().max()) for n, p in layer.named_parameters()),
                "grad_norm": float(sum(p.grad.norm() ** 2 for p in layer.parameters()) ** 0.5),
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
