"""Held-out greedy τ of a trained checkpoint, as `dcoco train` logs it: over random anchors
(`eval_tau`) and as greedy decoding realizes it (`eval_tau_decode`; README, "Held-out τ: random
anchors vs decoding"), with DCOCO's uncorrected and DSpark's Markov-free figures where they apply.

  python scripts/heldout_tau.py CHECKPOINT --method {dflash,dcoco,dspark,eagle3} [--config YAML]
                                [--greedy-data DIR] [--dtype D] [--response-tokens N]

--config defaults to configs/METHOD_smollm2.yaml (its data and held-out split). --greedy-data
evaluates every sample of another regenerated set instead (e.g. the target's greedy answers to the
held-out prompts of `scripts/heldout_prompts.py`), so the training data need not be on disk. The
target runs in float32 unless --dtype says otherwise (`dcoco train` evaluates in the config's dtype,
bfloat16 for the shipped recipes: --dtype bfloat16 reproduces its held-out τ).
"""

from __future__ import annotations

import argparse
import tempfile
from typing import Optional

import torch

from dcoco.target import Target
from dcoco.train.config import load_config
from dcoco.train.data import RegeneratedUnion
from dcoco.train.trainer import Trainer


def checkpoint_trainer(
    checkpoint: str,
    config: str,
    target: Target,
    greedy_data: Optional[str] = None,
    response_tokens: Optional[int] = None,
) -> Trainer:
    """A trainer whose model is `checkpoint` (float32) and whose held-out samples are the config's,
    or every sample of `greedy_data`, cut to their first `response_tokens` response tokens."""
    overrides = [f"run.out={tempfile.mkdtemp()}", f"drafter.init_from={checkpoint}"]
    if greedy_data:  # every sample is "training" data to the trainer, then evaluated
        overrides += [f"data.path={greedy_data}", "data.eval_permille=0"]
    cfg = load_config(config, overrides)
    tr = Trainer(cfg, target, RegeneratedUnion(cfg.data.path))
    if greedy_data:
        tr.eval_samples = tr.train_samples
    if response_tokens:  # e.g. to compare with `dcoco bench --max-new-tokens N` on the same prompts
        tr.eval_samples = [
            dict(s, input_ids=s["input_ids"][: s["prompt_len"] + response_tokens]) for s in tr.eval_samples
        ]
    return tr


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("checkpoint")
    ap.add_argument("--greedy-data", help="greedy tau on all samples of this regenerated data directory instead")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the target's dtype")
    ap.add_argument(
        "--response-tokens", type=int, metavar="N", help="greedy tau on the first N response tokens of each sample"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(ap)
    ap.add_argument("--method", required=True, choices=["dflash", "dcoco", "dspark", "eagle3"])
    ap.add_argument("--config", help="training config (data, held-out split); default configs/METHOD_smollm2.yaml")
    args = ap.parse_args()
    torch.set_num_threads(1)
    target = Target.from_pretrained(None, dtype=args.dtype)
    tr = checkpoint_trainer(
        args.checkpoint,
        args.config or f"configs/{args.method}_smollm2.yaml",
        target,
        args.greedy_data,
        args.response_tokens,
    )
    ev = tr.evaluate()
    print(f"{len(tr.eval_samples)} held-out samples")
    for key, value in ev.items():
        if key.startswith("eval_tau"):
            print(f"{key:28s} {value:.4f}")


if __name__ == "__main__":
    main()
