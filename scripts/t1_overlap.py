"""Expected acceptance at T=1 of a DFlash-family checkpoint's first two draft slots, teacher-forced
on held-out samples: sum_x min(p(x), q(x)) with p the target's T=1 distribution (from the stored
last-layer features) and q what the drafter samples the slot from. Slot 2 is conditioned on slot 1
being the data token (blocks where it is shortlisted). For DCOCO, q is that of both sampled walks:
over the shortlist (softmax of S over the K candidates) and over the draft vocabulary (DFlash's
softmax with the K candidates rescored, `vocab_walk`), from the T > 0 scores (the sampled head's
when the checkpoint has one); DFlash's q is the same backbone's softmax.
Greedy first-slot hit rates are printed too, and the checkpoint's simulated greedy τ on the config's
held-out samples as `dcoco train` logs it (with and without correction): over random anchors, and
as decoded (blocks open where the last one ended, as in `dcoco bench`). A DFlash checkpoint gets a
zero corrector, so its DCOCO rows are DFlash's own.

  python scripts/t1_overlap.py CHECKPOINT [--config configs/dcoco_smollm2.yaml] [--data DIR] [--greedy-data DIR] [--dtype D]
                              [--response-tokens N]

The target runs in float32 unless --dtype says otherwise (`dcoco train` evaluates in the config's
dtype, bfloat16 for the shipped recipes: --dtype bfloat16 reproduces its held-out τ).

--data evaluates every sample of another regenerated set (e.g. the target's own T=1 answers,
`dcoco data regenerate --temperature 1`) instead of the config's held-out samples; --greedy-data
does the same for the greedy τ (e.g. the target's greedy answers to the held-out prompts of
`scripts/heldout_prompts.py`), so neither needs the training data on disk.
"""

from __future__ import annotations

import argparse

import torch
from heldout_tau import add_arguments, checkpoint_trainer

from dcoco.drafters.dcoco import walk_greedy
from dcoco.target import Target
from dcoco.train.data import RegeneratedUnion


def overlap(p: torch.Tensor, q: torch.Tensor) -> float:
    return torch.minimum(p, q).sum().item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(ap)
    ap.add_argument("--config", default="configs/dcoco_smollm2.yaml", help="training config (data, held-out split)")
    ap.add_argument("--data", help="evaluate all samples of this regenerated data directory instead")
    args = ap.parse_args()
    torch.set_num_threads(1)
    target = Target.from_pretrained(None, dtype=args.dtype)
    tr = checkpoint_trainer(args.checkpoint, args.config, target, args.greedy_data, args.response_tokens)
    ev = tr.evaluate()
    print(
        f"greedy held-out tau {ev['eval_tau']:.4f} (uncorrected {ev['eval_tau_dflash']:.4f}); as decoded "
        f"{ev['eval_tau_decode']:.4f} (uncorrected {ev['eval_tau_decode_dflash']:.4f}; {len(tr.eval_samples)} samples)"
    )
    if args.data:
        tr.data = RegeneratedUnion(args.data)
        tr.eval_samples = [s for s in tr.data.samples() if len(s["input_ids"]) - s["prompt_len"] >= 2]
    model = tr.model.eval()
    H, V = target.hidden_size, target.vocab_size
    lead = model.lead
    names = ("dflash", "dcoco shortlist", "dcoco vocab")
    rows: dict[str, list[float]] = {f"{s} {n}": [] for s in ("slot1", "slot2|1") for n in names}
    rows.update({"greedy slot1 dflash": [], "greedy slot1 dcoco": []})
    gen = torch.Generator().manual_seed(1234)
    with (
        torch.no_grad(),
        torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.dtype == "bfloat16"),
    ):  # features in the target's dtype
        for i in range(0, len(tr.eval_samples), 2):
            samples = [tr._truncate(s) for s in tr.eval_samples[i : i + 2]]
            b = tr._batch(samples, 32, gen)
            h = tr.loss.hidden(b)
            hs = h[:, :, 1:5]
            logits = model.restrict_to_draft_vocab(tr.lm_head(hs).float())
            for s, smp in enumerate(samples):
                feats = target.model.model.norm(tr.data.features(smp)[:, -H:].float())  # last layer, normed
                p_all = torch.softmax(tr.lm_head(feats).float(), -1)  # p_all[t] predicts token t + 1
                x = smp["input_ids"]
                for a in range(b.anchors.shape[1]):
                    anc = int(b.anchors[s, a])
                    if anc < 0 or anc + 2 >= len(x) or anc + 1 >= feats.shape[0]:
                        continue
                    l1, l2 = logits[s, a, 0], logits[s, a, 1]
                    rows["slot1 dflash"].append(overlap(p_all[anc], torch.softmax(l1, -1)))
                    rows["greedy slot1 dflash"].append(float(l1.argmax().item() == x[anc + 1]))
                    ids, vals, greedy, sc = model.pair_scores(  # the walks' scores: greedy and T > 0 (sampled head)
                        hs[s, a].unsqueeze(0),
                        logits[s, a].unsqueeze(0),
                        tr.embed,
                        anchor=torch.tensor([x[anc]]),
                        anchor_hidden=h[s, a, 0].unsqueeze(0),
                    )
                    ids = ids[0]
                    first = sc[0, 0, 0] if lead else vals[0, 0]
                    rows["slot1 dcoco shortlist"].append(overlap(p_all[anc], shortlist_q(ids[lead], first, V)))
                    rows["slot1 dcoco vocab"].append(overlap(p_all[anc], vocab_q(l1, ids[lead], first)))
                    rows["greedy slot1 dcoco"].append(
                        float(ids[lead, walk_greedy(greedy)[0, lead]].item() == x[anc + 1])
                    )
                    hit = (ids[lead] == x[anc + 1]).nonzero()
                    if hit.numel():
                        row = sc[0, lead, int(hit[0, 0])]
                        rows["slot2|1 dflash"].append(overlap(p_all[anc + 1], torch.softmax(l2, -1)))
                        rows["slot2|1 dcoco shortlist"].append(
                            overlap(p_all[anc + 1], shortlist_q(ids[lead + 1], row, V))
                        )
                        rows["slot2|1 dcoco vocab"].append(overlap(p_all[anc + 1], vocab_q(l2, ids[lead + 1], row)))
    for k, v in rows.items():
        if v:
            print(f"{k:24s} {sum(v) / len(v):.3f}  ({len(v)} blocks)")


def shortlist_q(ids: torch.Tensor, scores: torch.Tensor, V: int) -> torch.Tensor:
    """The shortlist walk's q over the vocabulary: softmax of the K scores, zero elsewhere."""
    return torch.zeros(V).index_copy_(0, ids, torch.softmax(scores.float(), -1))


def vocab_q(logits: torch.Tensor, ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """The vocabulary walk's q: the drafter's softmax with the K candidates' logits replaced by S."""
    return torch.softmax(logits.clone().index_copy_(0, ids, scores.float()), -1)


if __name__ == "__main__":
    main()
