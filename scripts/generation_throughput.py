"""Tokens/s of plain (vanilla) batched decoding against requests in flight: the pace of `dcoco data
regenerate` and of a loaded server. For each batch size B, B requests (ShareGPT training-split
prompts) are kept in flight, finished ones replaced at once, and the generated tokens are counted
over a window after a warm-up.

  python scripts/generation_throughput.py --batch-sizes 8,32,64,128,256 --seconds 40 --out DIR [--turns all]
      [--quantizations none,int4]

Writes DIR/generation_throughput.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from dcoco.bench.system import git_commit, machine_info
from dcoco.engine import SpeculativeEngine
from dcoco.sampling import SamplingParams
from dcoco.target import Target
from dcoco.train.data import sharegpt_train_prompts


def measure(target: Target, prompts: list[list[int]], batch: int, seconds: float, warmup: float, max_tokens: int):
    engine = SpeculativeEngine(target, None, max_batch_size=batch)
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    feed = iter(prompts * 10)
    reqs = []

    def top_up():
        while len(engine.waiting) + len(engine.running) < batch:
            reqs.append(engine.add_request(next(feed), sp))

    top_up()
    t_start = time.perf_counter()
    counted_from, base = None, 0
    steps = 0
    while True:
        engine.step()
        top_up()
        now = time.perf_counter()
        if counted_from is None and now - t_start >= warmup:
            counted_from, base, steps = now, sum(len(r.output_ids) for r in reqs), 0
        steps += 1
        if counted_from is not None and now - counted_from >= seconds:
            tokens = sum(len(r.output_ids) for r in reqs) - base
            return {
                "in_flight": batch,
                "tokens": tokens,
                "seconds": round(now - counted_from, 2),
                "tokens_per_s": round(tokens / (now - counted_from), 1),
                "steps_per_s": round(steps / (now - counted_from), 2),
            }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch-sizes", default="8,32,64,128,256")
    ap.add_argument("--seconds", type=float, default=40.0, help="measured window per batch size")
    ap.add_argument("--warmup", type=float, default=10.0)
    ap.add_argument("--max-tokens", type=int, default=256, help="new tokens per request")
    ap.add_argument("--max-prompt-tokens", type=int, default=512)
    ap.add_argument(
        "--turns", choices=["first", "all"], default="first", help="ShareGPT user turns (see data regenerate)"
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quantizations", default="none", help="comma-separated weight quantizations: none, int8, int4")
    ap.add_argument("--out", default="runs/generation-throughput")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows, prompts = [], []
    for quantization in args.quantizations.split(","):
        target = Target.from_pretrained(dtype=args.dtype, quantization=quantization)
        for p in sharegpt_train_prompts(args.turns) if not prompts else ():
            ids = target.encode(p.messages)
            if len(ids) <= args.max_prompt_tokens:
                prompts.append(ids)
            if len(prompts) >= 2000:
                break
        for b in (int(x) for x in args.batch_sizes.split(",")):
            row = measure(target, prompts, b, args.seconds, args.warmup, args.max_tokens)
            row = {"quantization": quantization, **row}
            rows.append(row)
            print(json.dumps(row), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    info = {**machine_info("cpu", args.dtype), "threads": args.threads, "max_tokens": args.max_tokens}
    info.update(max_prompt_tokens=args.max_prompt_tokens, turns=args.turns)
    info["commit"] = git_commit()
    (out / "generation_throughput.json").write_text(json.dumps({"machine": info, "rows": rows}, indent=2))
    lines = ["| quantization | requests in flight | tokens/s | passes/s |", "|---|---:|---:|---:|"]
    lines += [f"| {r['quantization']} | {r['in_flight']} | {r['tokens_per_s']} | {r['steps_per_s']} |" for r in rows]
    (out / "generation_throughput.md").write_text(
        f"Vanilla batched decoding, {info.get('cpu', '')}, {args.threads} threads, {args.dtype}, greedy, "
        f"up to {args.max_tokens} new tokens per request, ShareGPT training-split prompts ({args.turns} user "
        f"turns, at most {args.max_prompt_tokens} tokens)\n\n" + "\n".join(lines) + "\n"
    )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    for quantization in args.quantizations.split(","):
        mine = [r for r in rows if r["quantization"] == quantization]
        ax.plot([r["in_flight"] for r in mine], [r["tokens_per_s"] for r in mine], "o-", label=quantization)
    ax.legend(title="weights")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("requests in flight")
    ax.set_ylabel("tokens/s")
    ax.set_title("vanilla batched decoding")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "generation_throughput.png", dpi=120)


if __name__ == "__main__":
    main()
