"""Where DCOCO's T=0 selection loses: its walk or its scores. Held-out τ as greedy decoding
realizes it (`Evaluator.decoded`), one DCOCO checkpoint, several ways of choosing the draft from
the same transition scores S_p(a, b), and other shortlist sizes K:

- greedy: the shipped walk, k_{p+1} = argmax_b S_p(k_p, b);
- first slot kept: the backbone's argmax at the first draft slot (no anchor-pair correction);
- Viterbi: the path of highest sum of log softmax_K S_p(a, .);
- expected length: the path that maximises the expected accepted prefix, sum_j prod_{i<=j} p_i,
  by dynamic programming, f_p(a) = max_b P_p(b | a) (1 + f_{p+1}(b)) with P = softmax_K S
  (optionally times the drafter's own probability mass of the shortlist), over the k draft slots;
  exact for calibrated Markov transitions, where greedy is myopic;
- K = 4, 16: the greedy walk over other shortlists (the corrector scores any K).

  python scripts/dcoco_walks.py CHECKPOINT --data DIR [DIR ...] [--num-samples 48] [--dtype float32] \\
      [--threads 2] --out DIR

Writes OUT/walks.json and OUT/walks.md.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from dcoco.bench.system import git_commit, machine_info
from dcoco.drafters.dcoco import walk_greedy
from dcoco.train.evaluate import checkpoint_evaluator

LABELS = {
    "": "greedy walk (shipped)",
    "_dflash": "no correction (the backbone's argmax)",
    "_first_kept": "first slot kept (the backbone's argmax)",
    "_viterbi": "Viterbi (highest log-probability path)",
    "_expected": "expected accepted length (dynamic programming)",
    "_expected_mass": "expected accepted length, times the shortlist's mass",
    "_k4": "greedy walk, K = 4",
    "_k16": "greedy walk, K = 16",
}


def best_path(logp: torch.Tensor, first: torch.Tensor | None, horizon: int, expected: bool) -> torch.Tensor:
    """Indices (n, W) of the path over W walk positions that maximises the expected accepted prefix
    (`expected`) or the summed log-probability, scored over walk positions <= `horizon`.
    logp (n, W-1, K, K): log P(b at p+1 | a at p); first (n, K) log P at position 0, or None when
    position 0 is fixed (the anchor). Positions past the horizon follow the greedy walk."""
    n, W1, K, _ = logp.shape
    f = torch.zeros(n, K, dtype=logp.dtype)
    choice = torch.zeros(n, W1 + 1, K, dtype=torch.long)
    for w in range(min(W1, horizon) - 1, -1, -1):
        val = logp[:, w].exp() * (1 + f.unsqueeze(1)) if expected else logp[:, w] + f.unsqueeze(1)
        f, choice[:, w + 1] = val.max(-1)
    idx = torch.zeros(n, W1 + 1, dtype=torch.long)
    if first is not None:
        idx[:, 0] = (first.exp() * (1 + f) if expected else first + f).argmax(-1)
    rows = torch.arange(n)
    for w in range(W1):
        nxt = choice[rows, w + 1, idx[:, w]] if w < horizon else logp[rows, w, idx[:, w]].argmax(-1)
        idx[:, w + 1] = nxt
    return idx


def variants(loss, k: int):
    """extras -> {suffix: drafts (S, A, P)}: the loss's own two and the ablation's."""
    model = loss.model
    lead = model.lead

    def predictions(extras: dict) -> dict:
        out = loss.predictions(extras)
        logits, ids, scores = extras["logits"], extras["ids"], extras["scores"]
        S, A, P, V = logits.shape
        n = S * A

        def drafts(ids_, idx):
            return ids_.gather(2, idx.unsqueeze(2)).squeeze(2)[:, lead:].reshape(S, A, P)

        kept = walk_greedy(scores)  # without the anchor pair the first slot is the backbone's argmax already
        if lead:  # with it, walk on from the backbone's argmax at the first draft slot
            kept = torch.cat([kept[:, :1], walk_greedy(scores[:, 1:])], 1)
        out["_first_kept"] = drafts(ids, kept)
        logp = torch.log_softmax(scores.float(), -1)
        vals = torch.log_softmax(extras["vals"][:, 0].float(), -1)
        first = None if lead else vals
        horizon = lead + k - 1
        out["_viterbi"] = drafts(ids, best_path(logp, first, horizon, expected=False))
        out["_expected"] = drafts(ids, best_path(logp, first, horizon, expected=True))
        probs = torch.softmax(model.restrict_to_draft_vocab(logits.reshape(n, P, V).float()), -1)
        mass = probs.gather(2, ids[:, lead:]).sum(-1).clamp_min(1e-6).log()  # (n, P)
        if lead:
            mass = torch.cat([torch.zeros_like(mass[:, :1]), mass], 1)
        first_m = None if lead else first + mass[:, :1]
        out["_expected_mass"] = drafts(ids, best_path(logp + mass[:, 1:, None, None], first_m, horizon, True))
        h = extras["hidden"][:, :, 1:].reshape(n, P, -1)
        for K in (4, 16):
            ids_k, _, scores_k, _ = model.pair_scores(
                h, logits.reshape(n, P, V), loss.embed, K, extras["anchor"], extras["anchor_hidden"]
            )
            out[f"_k{K}"] = drafts(ids_k, walk_greedy(scores_k))
        return out

    return predictions


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--data", nargs="+", required=True)
    ap.add_argument("--num-samples", type=int, default=48)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ev, method = checkpoint_evaluator(
        args.checkpoint, args.data, sampled=False, num_samples=args.num_samples, dtype=args.dtype, progress=True
    )
    if method != "dcoco":
        raise SystemExit(f"dcoco_walks.py: {args.checkpoint} is a {method} checkpoint, not dcoco")
    k = ev.draft_slots
    r = ev.decoded(k=k, predictions=variants(ev.loss, k))
    rows = [(LABELS[key], r[f"eval_tau_decode{key}"]) for key in LABELS]
    result = {
        "checkpoint": args.checkpoint,
        "samples": len(ev.samples),
        "draft_slots": k,
        "dtype": args.dtype,
        "commit": git_commit(),
        "machine": machine_info("cpu", args.dtype),
        "tau_decode": dict(rows),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "walks.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [
        f"Held-out τ as decoded, {len(ev.samples)} answers, {k} draft slots, {args.dtype}, "
        f"`{args.checkpoint}` at {result['commit']}",
        "",
        "| selection | τ |",
        "|---|---:|",
    ]
    lines += [f"| {name} | {tau:.3f} |" for name, tau in rows]
    (out / "walks.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
