"""Wall time of one draft pass (`propose`) of each shipped drafter for one request with a 300-token
context (bf16 and one CPU thread unless told otherwise), next to the target's verification pass of the same block: the
drafter's share of a speculative step, and the corrector's marginal cost (a `dcoco` pass minus the
`dflash` pass, both measured) as a share of a DCOCO step.

  python scripts/time_propose.py [--methods dflash,dcoco,dspark] [--drafter METHOD=DIR] [--temperature T]
                                 [--dtype bfloat16|float32] [--threads N]

METHOD may be a variant label (`dcoco/sampled`, `dcoco/onehot`, `dcoco/k16`, ...).
"""

from __future__ import annotations

import argparse
import time

import torch

from dcoco import SamplingParams
from dcoco.drafters.base import DraftInput
from dcoco.speculative import SpeculativeConfig, load_drafter, split_label, variant_options
from dcoco.target import Target


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", default="dflash,dcoco,dspark")
    ap.add_argument(
        "--drafter", action="append", default=[], help="METHOD=DIR: a checkpoint instead of the shipped one"
    )
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument(
        "--temperature", type=float, default=0.0, help="sampling temperature of the request (T > 0: sampled drafts)"
    )
    ap.add_argument("--dtype", default="bfloat16", help="the target's and drafters' dtype")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    paths = dict(d.split("=", 1) for d in args.drafter)
    target = Target.from_pretrained(None, dtype=args.dtype)
    draft_ms = {}
    for method in args.methods.split(","):
        base, _ = split_label(method)
        d = load_drafter(SpeculativeConfig(method=base, model=paths.get(method), **variant_options(method)), target)
        width = len(d.tap_layers) * target.hidden_size
        seq = list(range(1, 302))
        sp, gen = [SamplingParams(temperature=args.temperature)], [torch.Generator().manual_seed(0)]
        context = torch.randn(300, width, dtype=target.dtype)
        d.propose(DraftInput([0], [seq], [context], d.default_num_tokens, sp, gen))  # context
        step = DraftInput([0], [seq], [None], d.default_num_tokens, sp, gen)
        with torch.inference_mode():
            for _ in range(5):
                d.propose(step)
            t0 = time.perf_counter()
            for _ in range(args.repeats):
                d.propose(step)
        draft_ms[method] = (time.perf_counter() - t0) / args.repeats * 1e3
        verify = verify_ms(target, d.default_num_tokens + 1, args.repeats)
        print(
            f"{method}: {draft_ms[method]:.1f} ms per draft pass ({d.default_num_tokens} tokens), verification "
            f"{verify:.1f} ms: draft share of a step {draft_ms[method] / (draft_ms[method] + verify):.1%}"
        )
        if split_label(method)[0] == "dcoco" and "dflash" in draft_ms:
            extra = draft_ms[method] - draft_ms["dflash"]
            print(
                f"{method}: corrector {extra:.1f} ms over dflash's pass, "
                f"{extra / (draft_ms[method] + verify):.1%} of a step"
            )


def verify_ms(target: Target, width: int, repeats: int) -> float:
    """One target forward of `width` tokens on a 301-token context, rolled back after each pass."""
    kv, _ = target.prefill([list(range(1, 302))])
    block, n = torch.ones(1, width, dtype=torch.long), torch.tensor([width])
    for _ in range(3):
        target.forward(kv, block, n)
        kv.commit(torch.tensor([0]))
    t0 = time.perf_counter()
    for _ in range(repeats):
        target.forward(kv, block, n)
        kv.commit(torch.tensor([0]))
    return (time.perf_counter() - t0) / repeats * 1e3


if __name__ == "__main__":
    main()
