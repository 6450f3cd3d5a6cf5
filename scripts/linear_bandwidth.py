"""How fast a bf16 (or float32) linear layer reads its weight on one CPU thread (or more): plain
`F.linear` against a weight packed once for oneDNN (`dcoco.nn.prepack`), at decoding's row counts,
with weights streamed from memory (many distinct weights, more than the caches hold) rather than
re-read from cache. A plain `sum` over a large tensor gives the memory bandwidth to compare with.

  python scripts/linear_bandwidth.py [--shape 1536x576] [--weights 120] [--rows 1,5,64]
                                     [--dtype bfloat16|float32] [--threads N]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F


def per_call_us(fn, weights, x, repeats: int = 5) -> float:
    for w in weights:  # warm-up
        fn(w, x)
    t0 = time.perf_counter()
    for _ in range(repeats):
        for w in weights:
            fn(w, x)
    return (time.perf_counter() - t0) / (repeats * len(weights)) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="1536x576", help="OUTxIN of each weight (default: SmolLM2's MLP up-projection)")
    ap.add_argument("--weights", type=int, default=120, help="distinct weights cycled through")
    ap.add_argument("--rows", default="1,5,64", help="input rows per multiply")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    out_f, in_f = (int(v) for v in args.shape.lower().split("x"))
    weights = [torch.randn(out_f, in_f, dtype=dtype) for _ in range(args.weights)]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w) for w in weights]
    mb = out_f * in_f * weights[0].element_size() / 1e6
    big = torch.randn(100_000_000, dtype=torch.float32)
    big.sum()
    t0 = time.perf_counter()
    for _ in range(5):
        big.sum()
    print(f"memory read (float32 sum over 400 MB): {big.numel() * 4 * 5 / (time.perf_counter() - t0) / 1e9:.1f} GB/s")
    size = f"{mb * args.weights:.0f} MB"
    print(f"{args.weights} weights of {out_f}x{in_f} {args.dtype} ({size}), {args.threads} thread(s)")
    for rows in (int(r) for r in args.rows.split(",")):
        x = torch.randn(rows, in_f, dtype=dtype)
        plain = per_call_us(lambda w, x: F.linear(x, w), weights, x)
        pk = per_call_us(lambda w, x: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""), packed, x)
        print(
            f"rows {rows:3d}: F.linear {plain:6.0f} us ({mb / plain * 1e3:4.1f} GB/s), packed {pk:6.0f} us "
            f"({mb / pk * 1e3:4.1f} GB/s): {1 - pk / plain:.0%} less time"
        )


if __name__ == "__main__":
    main()
