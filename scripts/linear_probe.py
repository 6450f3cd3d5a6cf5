"""A floor for a drafter's first slot: one layer on the target's last hidden state that predicts the
token after next (Medusa's first head), trained and judged on the target's own answers.

At a response position t the target's last layer h_t already predicts x_{t+1}; the probe predicts
x_{t+2} from it. Two probes, each a residual SiLU layer followed by the target's own final norm and
(frozen, tied) LM head, the only trained weights being the layer's:
  - `h`: from h_t alone (Medusa head 1);
  - `h+next`: from h_t and the embedding of x_{t+1}, which is what DFlash's slot 1 sees (the block's
    anchor token is x_{t+1}, its context the features up to t).
Top-1 accuracy on held-out samples (the hash hold-out training leaves out) is the probability that
greedy verification would accept that slot; a drafter whose slot 1 falls below it does not use the
target's features as well as one layer can.

  python scripts/linear_probe.py --data corpus/smollm2-135m-instruct/sharegpt-greedy --out DIR

Writes DIR/linear_probe.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from dcoco.bench.system import machine_info
from dcoco.target import Target
from dcoco.train.batch import is_eval_sample
from dcoco.train.data import RegeneratedUnion
from dcoco.train.features import FeatureSource
from dcoco.train.losses import TargetHead


class Probe(nn.Module):
    def __init__(self, hidden: int, use_next: bool):
        super().__init__()
        self.layer = nn.Linear(hidden, hidden)
        self.next = nn.Linear(hidden, hidden, bias=False) if use_next else None
        for m in (self.layer, self.next):
            if m is not None:
                nn.init.zeros_(m.weight)  # starts as the target's own head on h_t
        nn.init.zeros_(self.layer.bias)

    def forward(self, h: torch.Tensor, next_emb: torch.Tensor) -> torch.Tensor:
        z = self.layer(h) + (self.next(next_emb) if self.next is not None else 0)
        return h + F.silu(z)


def positions(target, data, samples, max_length: int, batch: int = 8):
    """Last-layer features h_t, x_{t+1} and x_{t+2} at every response position t of `samples`."""
    L = target.num_layers
    source = FeatureSource(target, data, [L], last_layer=False, online=True)
    hs, nxt, lab = [], [], []
    for i in range(0, len(samples), batch):
        chunk = [dict(s, input_ids=s["input_ids"][:max_length]) for s in samples[i : i + batch]]
        for s, f in zip(chunk, source(chunk)):
            ids = torch.tensor(s["input_ids"])
            t = torch.arange(max(s["prompt_len"] - 1, 0), len(ids) - 2)
            hs.append(f[t].to(torch.bfloat16))
            nxt.append(ids[t + 1])
            lab.append(ids[t + 2])
    return torch.cat(hs), torch.cat(nxt), torch.cat(lab)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", nargs="+", required=True, metavar="DIR", help="regenerated or packed data directories")
    ap.add_argument("--train-samples", type=int, default=400)
    ap.add_argument("--eval-samples", type=int, default=48)
    ap.add_argument("--eval-permille", type=int, default=20, help="training's data.eval_permille")
    ap.add_argument("--max-length", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--batch-positions", type=int, default=512)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="runs/linear-probe")
    ap.add_argument(
        "--compare",
        nargs="*",
        default=[],
        metavar="CHECKPOINT",
        help="drafter checkpoints whose slot 1 (teacher-forced, random anchors) is measured on the same samples",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    target = Target.from_pretrained(dtype="bfloat16")
    data = RegeneratedUnion(args.data)
    samples = [s for s in data.samples() if len(s["input_ids"]) - s["prompt_len"] >= 3]
    held = [s for s in samples if is_eval_sample(s["id"], args.eval_permille)][: args.eval_samples]
    train = [s for s in samples if not is_eval_sample(s["id"], args.eval_permille)][: args.train_samples]
    t0 = time.time()
    tr = positions(target, data, train, args.max_length)
    ev = positions(target, data, held, args.max_length)
    feature_s = time.time() - t0
    head = TargetHead(target)
    embed = target.model.get_input_embeddings()
    results = {}
    for name, use_next in (("h", False), ("h+next", True)):
        probe = Probe(target.hidden_size, use_next)
        opt = torch.optim.AdamW(probe.parameters(), lr=args.lr, weight_decay=0.0)
        gen = torch.Generator().manual_seed(0)
        for step in range(args.steps):
            idx = torch.randint(len(tr[0]), (args.batch_positions,), generator=gen)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                h = head.norm(tr[0][idx])
                with torch.no_grad():
                    e = embed(tr[1][idx])
                logits = F.linear(probe(h, e), head.lm_head.weight)
            loss = F.cross_entropy(logits.float(), tr[2][idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            for g in opt.param_groups:
                g["lr"] = args.lr * (1 - step / args.steps)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            correct = 0
            for i in range(0, len(ev[0]), 1024):
                h = head.norm(ev[0][i : i + 1024])
                pred = F.linear(probe(h, embed(ev[1][i : i + 1024])), head.lm_head.weight).argmax(-1)
                correct += int((pred == ev[2][i : i + 1024]).sum())
        results[name] = {"heldout_top1": round(correct / len(ev[0]), 4), "final_train_loss": round(loss.item(), 4)}
        print(name, results[name], flush=True)
    compare = {}
    for ckpt in args.compare:
        from dcoco.train.evaluate import evaluate_checkpoint

        r = evaluate_checkpoint(
            ckpt,
            args.data,
            "heldout",
            (0.0,),
            num_samples=args.eval_samples,
            max_length=args.max_length,
            eval_permille=args.eval_permille,
            dtype="bfloat16",
            progress=False,
        )
        compare[ckpt] = {"slot1_teacher_forced": r["t0"]["eval_per_position"][0], "samples": r["samples"]}
        print(ckpt, compare[ckpt], flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {
        "machine": machine_info("cpu"),
        "data": args.data,
        "train_samples": len(train),
        "train_positions": len(tr[0]),
        "eval_samples": len(held),
        "eval_positions": len(ev[0]),
        "steps": args.steps,
        "batch_positions": args.batch_positions,
        "feature_seconds": round(feature_s),
        "probes": results,
        "drafters_slot1": compare,
    }
    (out / "linear_probe.json").write_text(json.dumps(report, indent=2))
    rows = [f"| probe `{k}` | {v['heldout_top1']:.3f} |" for k, v in results.items()]
    rows += [f"| {k} (slot 1, teacher-forced) | {v['slot1_teacher_forced']:.3f} |" for k, v in compare.items()]
    (out / "linear_probe.md").write_text(
        f"Linear probe for the token after next, {len(train)} training samples ({len(tr[0])} positions), "
        f"{len(held)} held-out samples ({len(ev[0])} positions)\n\n"
        "| predictor of the token after next | held-out top-1 |\n|---|---:|\n" + "\n".join(rows) + "\n"
    )


if __name__ == "__main__":
    main()
