"""Write the held-out samples of a training config as a ShareGPT-style .jsonl of first user turns,
for `dcoco bench --datasets FILE` or `dcoco data regenerate --source FILE` (e.g. the target's T=1
answers to them, for `scripts/t1_overlap.py --data`).

  python scripts/heldout_prompts.py OUT.jsonl [--config configs/dcoco_smollm2.yaml]
"""

from __future__ import annotations

import argparse
import json

from dcoco.train.config import load_config
from dcoco.train.data import RegeneratedUnion
from dcoco.train.trainer import is_eval_sample


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--config", default="configs/dcoco_smollm2.yaml")
    args = ap.parse_args()
    cfg = load_config(args.config)
    n = 0
    with open(args.out, "w") as f:
        for s in RegeneratedUnion(cfg.data.path).samples():
            if is_eval_sample(s["id"], cfg.data.eval_permille):
                user = [c for c in s["conversations"] if c.get("role", c.get("from")) in ("user", "human")][:1]
                f.write(json.dumps({"id": s["id"], "conversations": user}) + "\n")
                n += 1
    print(f"{n} held-out prompts -> {args.out}")


if __name__ == "__main__":
    main()
