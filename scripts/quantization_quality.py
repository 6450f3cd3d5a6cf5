"""What a weight-only quantized target costs in quality: its greedy answers against the bf16
target's, and the perplexity both give the bf16 target's own answers, on prompts never trained on
(the bench's held-out ShareGPT split, MT-Bench turn 1, HumanEval).

  python scripts/quantization_quality.py --out DIR [--num-prompts 10] [--max-new-tokens 128]

Per dataset and quantization: the share of prompts whose greedy answer is the bf16 one token for
token, the mean share of each answer that matches before the first difference, and the perplexity
of the bf16 greedy answers (teacher-forced) under that model, next to bf16's own. Writes
DIR/quantization_quality.{json,md}. Not a timing: it may share the machine.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from dcoco.bench.system import machine_info
from dcoco.datasets import load_prompts
from dcoco.engine import SpeculativeEngine
from dcoco.nn.quantize import QUANTIZATIONS
from dcoco.sampling import SamplingParams
from dcoco.target import Target

DATASETS = ("sharegpt", "mtbench_turn1", "humaneval")


@torch.no_grad()
def answer_nll(target: Target, prompt: list[int], answer: list[int]) -> tuple[float, int]:
    """Summed negative log-likelihood of `answer` after `prompt` under `target`, and its length."""
    ids = torch.tensor([prompt + answer])
    logits = target.model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    nll = torch.nn.functional.cross_entropy(logits, torch.tensor(answer), reduction="sum")
    return float(nll), len(answer)


def prefix_share(a: list[int], b: list[int]) -> float:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n / max(len(a), 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--num-prompts", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    targets = {q: Target.from_pretrained(dtype="bfloat16", quantization=q) for q in QUANTIZATIONS}
    ref = targets["none"]
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_new_tokens)
    rows = []
    for ds in DATASETS:
        prompts = [ref.encode(p.content) for p in load_prompts(ds, args.num_prompts)]
        answers = {}
        for q, t in targets.items():
            outs, _ = SpeculativeEngine(t, max_batch_size=len(prompts)).generate(prompts, sp)
            answers[q] = [o.token_ids for o in outs]
        for q, t in targets.items():
            nll = [answer_nll(t, p, a) for p, a in zip(prompts, answers["none"]) if a]
            rows.append(
                {
                    "dataset": ds,
                    "quantization": q,
                    "prompts": len(prompts),
                    "same_answer": sum(a == b for a, b in zip(answers[q], answers["none"])) / len(prompts),
                    "matching_prefix": sum(map(prefix_share, answers["none"], answers[q])) / len(prompts),
                    "ppl_of_bf16_answers": math.exp(sum(n for n, _ in nll) / max(1, sum(k for _, k in nll))),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"machine": machine_info("cpu"), "num_prompts": args.num_prompts, "max_new_tokens": args.max_new_tokens}
    (out / "quantization_quality.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    lines = [
        f"Greedy answers of the quantized SmolLM2-135M-Instruct against bf16's, {args.num_prompts} prompts per "
        f"dataset, {args.max_new_tokens} new tokens; perplexity of bf16's greedy answers under each model",
        "",
        "| dataset | quantization | same answer | matching prefix | perplexity of bf16's answers |",
        "|---|---|---:|---:|---:|",
    ]
    lines += [
        f"| {r['dataset']} | {r['quantization']} | {r['same_answer']:.2f} | {r['matching_prefix']:.2f} "
        f"| {r['ppl_of_bf16_answers']:.3f} |"
        for r in rows
    ]
    (out / "quantization_quality.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
