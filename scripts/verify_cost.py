"""How much a block verification pass costs next to a one-token decode step, per dtype and weight
quantization, on this machine: the break-even acceptance length of speculative decoding. A block of
n tokens pays off only when the expected tokens per pass (tau) exceed cost(n) / cost(1) plus the
draft's own cost. On CPUs with bf16 matrix units (AMX) a 16-token bf16 pass costs about one decode
step; on AVX2-only CPUs bf16 has no fast kernel and a 16-token pass costs several; the int8 and int4
kernels dequantize per row, so their passes grow with the block.

  python scripts/verify_cost.py [--dtypes bfloat16,float32] [--quantizations none,int8,int4]
                                [--blocks 1,4,8,16] [--context 200] [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import torch

from dcoco.target import Target


def pass_ms(target: Target, kv, n: int, repeats: int) -> float:
    """Median wall time of the target's forward over n new tokens after the cached context
    (`Target.forward`, as the engine runs it; the slots are dropped again after each pass)."""
    ids = torch.randint(0, 1000, (1, n))
    times = []
    for _ in range(repeats + 1):  # the first call warms up
        start = time.perf_counter()
        target.forward(kv, ids, torch.tensor([n]))
        times.append(time.perf_counter() - start)
        kv.commit(torch.tensor([0]))
    return sorted(times[1:])[len(times[1:]) // 2] * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", default="bfloat16")
    ap.add_argument("--quantizations", default="none", help="comma-separated: none, int8, int4 (bf16 only)")
    ap.add_argument("--blocks", default="1,4,8,16", help="tokens per forward pass (1 = plain decoding)")
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    blocks = [int(b) for b in args.blocks.split(",")]
    print(f"Forward pass over n new tokens after a {args.context}-token context, median of {args.repeats}, "
          f"{args.threads} thread(s)\n")  # fmt: skip
    print("| dtype | quantization | " + " | ".join(f"{n} tokens" for n in blocks) + " |")
    print("|---|---|" + "---:|" * len(blocks))
    for dtype in args.dtypes.split(","):
        for quantization in args.quantizations.split(","):
            target = Target.from_pretrained(None, dtype=dtype, quantization=quantization)
            kv, _ = target.prefill([torch.randint(0, 1000, (args.context,)).tolist()])
            ms = [pass_ms(target, kv, n, args.repeats) for n in blocks]
            cells = " | ".join(f"{m:.1f} ms ({m / ms[0]:.2f}x)" for m in ms)
            print(f"| {dtype} | {quantization} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
