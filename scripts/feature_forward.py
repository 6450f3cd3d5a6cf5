"""Online target features for a training batch: one padded forward over the batch against one forward
per sequence, on the same batches, alternating, in one process (the machine's pace drifts between
processes).

  python scripts/feature_forward.py --data corpus/smollm2-135m-instruct/sharegpt-all-greedy \\
      [--batches 6] [--batch-size 4] [--max-length 1024] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

from dcoco.bench.system import git_commit, machine_info
from dcoco.errors import ConfigError
from dcoco.target import Target
from dcoco.train.data import RegeneratedUnion


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", nargs="+", required=True, metavar="DIR")
    ap.add_argument("--batches", type=int, default=6)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--max-length", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    try:
        data = RegeneratedUnion(args.data)
        taps = list(data.manifest["taps"])
    except ConfigError as e:
        raise SystemExit(f"feature_forward.py: {e}") from None
    target = Target.from_pretrained(dtype="bfloat16")
    samples = [s["input_ids"][: args.max_length] for s in data.samples()]
    rng = random.Random(0)
    batches = [rng.sample(samples, args.batch_size) for _ in range(args.batches)]

    def padded(batch):
        target.prefill(batch)

    def per_sequence(batch):
        for ids in batch:
            target.prefill([ids])

    ways = {"padded batch": padded, "per sequence": per_sequence}
    seconds = dict.fromkeys(ways, 0.0)
    with target.tapping(taps):
        for run in ways.values():  # warm-up
            run(batches[0])
        for batch in batches:
            for name, run in ways.items():
                t0 = time.perf_counter()
                run(batch)
                seconds[name] += time.perf_counter() - t0
    tokens = sum(len(ids) for b in batches for ids in b)
    padded_tokens = sum(len(b) * max(len(ids) for ids in b) for b in batches)
    report = {
        "machine": {**machine_info("cpu", "bfloat16"), "commit": git_commit()},
        "batches": args.batches,
        "batch_size": args.batch_size,
        "tokens": tokens,
        "padded_tokens": padded_tokens,
        "seconds": {k: round(v, 3) for k, v in seconds.items()},
        "per_sequence_speedup": round(seconds["padded batch"] / seconds["per sequence"], 3),
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
