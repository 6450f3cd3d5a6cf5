"""Wall time of one draft pass (`propose`) of each shipped drafter for one request with a 300-token
context, bf16, one CPU thread: the drafter's share of a speculative step.

  python scripts/time_propose.py [--methods dflash,dcoco,dspark] [--drafter METHOD=DIR] [--temperature T]

METHOD may be a variant label (`dcoco/sampled`, `dcoco/onehot`, `dcoco/k16`, ...).
"""

from __future__ import annotations

import argparse
import time

import torch

from dcoco import SamplingParams
from dcoco.drafters import SpeculativeConfig, load_drafter, split_label, variant_options
from dcoco.drafters.base import DraftInput
from dcoco.target import Target


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", default="dflash,dcoco,dspark")
    ap.add_argument("--drafter", action="append", default=[], help="METHOD=DIR: a checkpoint instead of the shipped one")
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--temperature", type=float, default=0.0, help="sampling temperature of the request (T > 0: sampled drafts)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    paths = dict(d.split("=", 1) for d in args.drafter)
    target = Target.from_pretrained(None, dtype="bfloat16")
    for method in args.methods.split(","):
        base, _ = split_label(method)
        d = load_drafter(SpeculativeConfig(method=base, model=paths.get(method), **variant_options(method)), target)
        width = len(d.tap_layers) * target.hidden_size
        seq = list(range(1, 302))
        sp, gen = [SamplingParams(temperature=args.temperature)], [torch.Generator().manual_seed(0)]
        d.propose(DraftInput([0], [seq], [torch.randn(300, width)], d.default_num_tokens, sp, gen))  # context
        step = DraftInput([0], [seq], [None], d.default_num_tokens, sp, gen)
        with torch.inference_mode():
            for _ in range(5):
                d.propose(step)
            t0 = time.perf_counter()
            for _ in range(args.repeats):
                d.propose(step)
        print(f"{method}: {(time.perf_counter() - t0) / args.repeats * 1e3:.1f} ms per draft pass "
              f"({d.default_num_tokens} tokens)")


if __name__ == "__main__":
    main()
