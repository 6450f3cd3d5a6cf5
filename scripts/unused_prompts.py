"""Write the ShareGPT training-split first user turns that no given data directory has answered yet,
in a seeded random order, as a .jsonl for `dcoco data regenerate --source FILE` (more training data
from fresh prompts; the evaluation split never reaches it).

  python scripts/unused_prompts.py OUT.jsonl --exclude data/smollm2-sharegpt data/smollm2-sharegpt-b
"""

from __future__ import annotations

import argparse
import json
import random

from dcoco.train.data import RegeneratedUnion, sharegpt_train_prompts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--exclude", nargs="*", default=[], metavar="DIR", help="regenerated data directories")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    used = {s["id"] for s in RegeneratedUnion(args.exclude).samples()} if args.exclude else set()
    fresh = [p for p in sharegpt_train_prompts() if p.id not in used]
    random.Random(args.seed).shuffle(fresh)
    with open(args.out, "w") as f:
        for p in fresh:
            f.write(json.dumps({"id": p.id, "conversations": p.messages}) + "\n")
    print(f"{len(fresh)} unused training prompts ({len(used)} excluded) -> {args.out}")


if __name__ == "__main__":
    main()
