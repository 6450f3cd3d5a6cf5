"""Write the held-out samples of a training config as a ShareGPT-style .jsonl of first user turns,
for `dcoco bench --datasets FILE` or `dcoco data regenerate --source FILE` (e.g. the target's T=1
answers to them, for `scripts/t1_overlap.py --data`).

  python scripts/heldout_prompts.py OUT.jsonl [--config configs/dcoco_smollm2.yaml]
  python scripts/heldout_prompts.py OUT.jsonl --split 60   # no data on disk: the first 60 prompts of
                                                           # the training split that the hash holds out
  python scripts/heldout_prompts.py OUT.jsonl --data data/heldout-greedy   # the prompts a regenerated
                                                           # set answered (all of them), e.g. to bench them
"""

from __future__ import annotations

import argparse
import json

from dcoco.datasets import first_user_turn
from dcoco.train.config import load_config
from dcoco.train.data import RegeneratedUnion, sharegpt_train_prompts
from dcoco.train.trainer import is_eval_sample


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--config", default="configs/dcoco_smollm2.yaml")
    ap.add_argument(
        "--split", type=int, metavar="N", help="instead of the config's data: the first N held-out prompts of the split"
    )
    ap.add_argument("--data", metavar="DIR", help="instead of the config's data: every prompt of this regenerated set")
    args = ap.parse_args()
    cfg = load_config(args.config)
    if args.data:
        rows = ((s["id"], s["conversations"]) for s in RegeneratedUnion(args.data).samples())
    elif args.split:
        rows = ((p.id, p.messages) for p in sharegpt_train_prompts())
    else:
        rows = ((s["id"], s["conversations"]) for s in RegeneratedUnion(cfg.data.path).samples())
    n = 0
    with open(args.out, "w") as f:
        for sid, turns in rows:
            text = first_user_turn(turns)
            if text is not None and (args.data or is_eval_sample(sid, cfg.data.eval_permille)):
                f.write(json.dumps({"id": sid, "conversations": [{"role": "user", "content": text}]}) + "\n")
                n += 1
                if n == args.split:
                    break
    print(f"{n} held-out prompts -> {args.out}")


if __name__ == "__main__":
    main()
