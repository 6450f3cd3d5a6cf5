"""The policy under pipeline x context parallelism (`PolicyStage`) against one process.

One job of 4 gloo processes runs grids P x W = 2x2, 1x2, 4x1 (rank = stage * W + cp), each with
untied and tied embeddings. A tiny Llama in float64 takes three micro-batches of packed rollouts
through its stages: the first stage embeds its zigzag shard, every stage runs its decoder layers
with ring attention over its context-parallel group and sends its output to the next stage, the
last computes the completion tokens' log-probabilities and its share of the GRPO loss
(`clipped_surrogate` with `token_weights`), and the gradients flow back stage by stage. After the
context-parallel groups sum their gradients (and the first and last stage their tied embedding's),
every parameter's gradient, the log-probabilities and the tapped features equal the padded
single-process forward's (`completion_logprobs`, `grpo_loss`, `Target.tapping`) within 1e-10.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from parallel_harness import guarded, merge_ranks, metrics_of, run_job

GRIDS = [(2, 2), (1, 2), (4, 1)]  # (P, W)
MICROBATCHES = [[13, 7, 18], [11, 9], [16]]
LAYERS, TAPS, TEMP, TOL = 4, [0, 1, 3, 4], 0.7, 1e-10


def make_model(tied: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    cfg = LlamaConfig(
        vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tied, initializer_range=0.2,
    )  # fmt: skip
    return LlamaForCausalLM(cfg).double().train()


def make_data(seed):
    gen = torch.Generator().manual_seed(seed)
    mbs = []
    for lens in MICROBATCHES:
        seqs = [torch.randint(0, 40, (n,), generator=gen).tolist() for n in lens]
        plens = [int(torch.randint(2, n - 2, (1,), generator=gen)) for n in lens]
        adv = torch.randn(len(lens), generator=gen, dtype=torch.float64)
        noise = 0.3 * torch.randn(len(lens), max(lens) - 1, generator=gen, dtype=torch.float64)
        mbs.append({"seqs": seqs, "plens": plens, "adv": adv, "noise": noise})
    return mbs


def reference(tied, mbs, n_seq, n_tok):
    """One process: padded forward per micro-batch, as the RL loop runs it."""
    from dcoco.rl.grpo import completion_logprobs, grpo_loss
    from dcoco.rl.loop import pad_batch
    from dcoco.target import Target

    model = make_model(tied)
    target = Target(model)
    lps, feats = [], []
    for mb in mbs:
        ids, attn, tg = pad_batch(mb["seqs"], mb["plens"])
        with target.tapping(TAPS):
            lp = completion_logprobs(model, ids, attn, tg, TEMP)
            f = target.captured(TAPS)
        old = (lp + mb["noise"][:, : lp.shape[1]]).detach()
        loss, _ = grpo_loss(lp, old, mb["adv"], tg, 0.2, None, None, 0.0, "grpo", n_seq, n_tok)
        loss.backward()
        lps.append(lp.detach())
        feats.append([f[b, : len(s)].detach() for b, s in enumerate(mb["seqs"])])
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return lps, feats, grads


def run_grid(rank, P, W, tied, seed):
    from dcoco.parallel import ZigzagLayout
    from dcoco.parallel.policy_stage import PolicyStage
    from dcoco.rl.grpo import clipped_surrogate, token_weights

    mbs = make_data(seed)
    n_seq = sum(len(mb["seqs"]) for mb in mbs)
    n_tok = sum(len(s) - p for mb in mbs for s, p in zip(mb["seqs"], mb["plens"]))
    cp_groups = [dist.new_group([s * W + c for c in range(W)]) for s in range(P)]
    tie_groups = [dist.new_group([c, (P - 1) * W + c]) for c in range(W)] if P > 1 else []
    if rank >= P * W:
        return {}
    stage, c = divmod(rank, W)
    ref_lps, ref_feats, ref_grads = reference(tied, mbs, n_seq, n_tok)
    ps = PolicyStage(make_model(tied), stage, P, cp_groups[stage], W)
    H = ps.hidden_size
    lp_err = feat_err = 0.0
    held = {t for t in TAPS if (t == 0 and ps.first) or ps.lo < t <= ps.hi}  # the taps this stage makes
    taps_compared = True
    for m, mb in enumerate(mbs):
        layout = ZigzagLayout([len(s) for s in mb["seqs"]], W)
        ids = torch.tensor([t for s in mb["seqs"] for t in s])
        n = layout.local_len(c)
        x = None
        if not ps.first:
            x = torch.empty(n, H, dtype=torch.float64)
            dist.recv(x, rank - W)
            x.requires_grad_(True)
        h, tapped = ps.forward(layout, ids, x, TAPS)
        taps_compared = taps_compared and set(tapped) == held
        ref = torch.cat([torch.cat(ref_feats[m])], 0).view(-1, len(TAPS), H)  # packed (total, taps, H)
        for t, f in tapped.items():
            want = layout.shard(ref[:, TAPS.index(t)], c)
            feat_err = max(feat_err, float((f.detach() - want).abs().max()))
        if ps.last:
            lp, seq, pos = ps.completion_logprobs(layout, ids, h, mb["plens"], TEMP)
            lp_err = max(lp_err, float((lp - ref_lps[m][seq, pos]).abs().max()))
            old = (ref_lps[m][seq, pos] + mb["noise"][seq, pos]).detach()
            comp = torch.tensor([len(s) - p for s, p in zip(mb["seqs"], mb["plens"])])
            w = token_weights(seq, comp, "grpo", n_seq, n_tok).double()
            loss, _ = clipped_surrogate(lp, old, mb["adv"][seq], w, 0.2)
            loss.backward()
        else:
            dist.send(h.detach().contiguous(), rank + W)
            g = torch.empty_like(h)
            dist.recv(g, rank + W)
            h.backward(g)
        if not ps.first:
            dist.send(x.grad.contiguous(), rank - W)
    trained = {n: p for n, p in ps.params.items() if p.grad is not None}  # the last stage's untied
    for p in trained.values():  # embedding is there for the draft loss only
        if W > 1:
            dist.all_reduce(p.grad, group=cp_groups[stage])
    if ps.tied and P > 1 and (ps.first or ps.last):
        dist.all_reduce(ps.model.get_input_embeddings().weight.grad, group=tie_groups[c])
    grad_err = max(float((p.grad - ref_grads[n]).abs().max()) for n, p in trained.items())
    norm = float(sum(ref_grads[n].norm() ** 2 for n in trained) ** 0.5)
    return {
        "grad_err": grad_err,
        "lp_err": lp_err,
        "feat_err": feat_err,
        "grad_norm": norm,
        "n": len(trained),
        "taps_compared": taps_compared,
    }


def worker(rank, world_size):
    results: dict = {}
    for P, W in GRIDS:
        for tied in (False, True):
            guarded(results, f"P{P}xW{W}-tied{tied}", run_grid, rank, P, W, tied, 5 + P)
            dist.barrier()
    return results


@pytest.fixture(scope="module")
def results():
    return merge_ranks(run_job(worker, 4, timeout_s=300))


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("P,W", GRIDS)
def test_stages_match_single_process(results, P, W, tied):
    m = metrics_of(results, f"P{P}xW{W}-tied{tied}")
    assert m["grad_norm"] > 0 and m["n"] > 0 and m["taps_compared"]  # the comparison is not vacuous
    assert m["grad_err"] <= TOL and m["lp_err"] <= TOL and m["feat_err"] <= TOL, m
