"""How much a block verification pass costs next to a one-token decode step, per dtype, on this
machine: the break-even acceptance length of speculative decoding. A block of n tokens pays off
only when the expected tokens per pass (tau) exceed cost(n) / cost(1) plus the draft's own cost.
On CPUs with bf16 matrix units (AMX) a 16-token pass costs about one decode step; on AVX2-only
CPUs bf16 has no fast kernel and a 16-token pass costs several.

  python scripts/verify_cost.py [--dtypes bfloat16,float32] [--blocks 1,4,8,16] [--context 200]
"""

from __future__ import annotations

import argparse
import time

import torch

from dcoco.target import Target


def decode_ms(model, cache, n: int, repeats: int) -> float:
    """Best wall time of a forward over n new tokens after the cached context (the cache is cropped back)."""
    ids = torch.randint(0, 1000, (1, n))
    times = []
    for _ in range(repeats + 1):  # the first call warms up
        start = time.perf_counter()
        model(ids, past_key_values=cache, use_cache=True)
        times.append(time.perf_counter() - start)
        cache.crop(-n)
    return min(times[1:]) * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--blocks", default="1,4,8,16", help="tokens per forward pass (1 = plain decoding)")
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    blocks = [int(b) for b in args.blocks.split(",")]
    print("| dtype | " + " | ".join(f"{n} tokens" for n in blocks) + " |")
    print("|---|" + "---:|" * len(blocks))
    for dtype in args.dtypes.split(","):
        model = Target.from_pretrained(None, dtype=dtype).model
        with torch.inference_mode():
            cache = model(torch.randint(0, 1000, (1, args.context)), use_cache=True).past_key_values
            ms = [decode_ms(model, cache, n, args.repeats) for n in blocks]
        print(f"| {dtype} | " + " | ".join(f"{m:.1f} ms ({m / ms[0]:.2f}x)" for m in ms) + " |", flush=True)


if __name__ == "__main__":
    main()
