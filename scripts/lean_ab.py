"""The lean decoder against Hugging Face's forward, A/B in one process: plain greedy generation of
64 tokens (prefill included) on the embedded target, alternating the two paths on the same prompt so
that both see the same machine; median and best tokens/s per weight quantization.

  python scripts/lean_ab.py [--quantizations none,int8,int4] [--repeats 5] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dcoco import LLM, SamplingParams

PROMPT = "Explain how a hash map works, with an example in Python."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quantizations", default="none,int8,int4")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print("| quantization | HF forward: median / best tok/s | lean: median / best tok/s | lean / HF (medians) |")
    print("|---|---:|---:|---:|")
    for quantization in args.quantizations.split(","):
        llm = LLM(dtype="bfloat16", quantization=quantization)
        lean = llm.target._lean
        llm.generate(PROMPT, SamplingParams(max_tokens=8))  # warm-up
        speed = {"hf": [], "lean": []}
        for _ in range(args.repeats):
            for path in ("hf", "lean"):
                llm.target._lean = lean if path == "lean" else None
                start = time.perf_counter()
                llm.generate(PROMPT, SamplingParams(max_tokens=64))
                speed[path].append(64 / (time.perf_counter() - start))
        hf, ln = statistics.median(speed["hf"]), statistics.median(speed["lean"])
        cells = f"{hf:.1f} / {max(speed['hf']):.1f} | {ln:.1f} / {max(speed['lean']):.1f} | {ln / hf:.2f}x"
        print(f"| {quantization} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
