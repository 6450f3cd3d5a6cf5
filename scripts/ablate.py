"""Drafter ablations at equal budget: each variant (a name and `section.key=value` overrides of one
training config) trains for the same wall time with `optim.time_budget_s` (`--budget-s`), or for the
same steps on the same batches (`--steps`: a paired comparison, each variant's time reported), one
`dcoco train` process after another (never two at once: they would share the cores), and is judged
by the held-out τ as greedy decoding realizes it, which training measures on its last step.

  python scripts/ablate.py --config configs/dflash_smollm2.yaml --budget-s 1800 --out runs/ablation \\
      --set data.path=corpus/smollm2-135m-instruct/sharegpt-all-greedy data.features=online \\
      --variant base --variant layers-1:drafter.num_layers=1 --variant anchors-64:optim.anchors_per_seq=64

A variant's overrides follow its name after a colon, separated by commas. Rerunning the same command
resumes: finished variants are read from their logs, an interrupted one continues from its last
checkpoint. Writes OUT/ablation.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from dcoco.bench.report import markdown_table
from dcoco.bench.system import git_commit, machine_info
from dcoco.train.config import load_config
from dcoco.train.runstate import read_log


def parse_variant(spec: str) -> tuple[str, list[str]]:
    name, _, rest = spec.partition(":")
    overrides = [o for o in rest.split(",") if o]
    if not name or any("=" not in o for o in overrides):
        raise SystemExit(f"ablate.py: bad --variant {spec!r} (NAME or NAME:section.key=value,...)")
    return name, overrides


def last_eval(log: Path) -> dict | None:
    """The last logged line that carries held-out figures, with the run's totals."""
    rows = read_log(log)
    evals = [r for r in rows if "eval_tau_decode" in r]
    if not evals:
        return None
    last = evals[-1]
    return {
        "step": last["step"],
        "samples_seen": last.get("samples_seen"),
        "train_s": round(sum(r.get("step_s", 0.0) for r in rows), 1),
        "eval_tau_decode": last["eval_tau_decode"],
        "eval_tau_decode_dflash": last.get("eval_tau_decode_dflash"),  # DCOCO's drafts uncorrected
        "eval_tau": last.get("eval_tau"),
        "loss": last["loss"],
    }


def budget_label(args) -> str:
    return f"{args.steps} steps" if args.steps else f"{args.budget_s:.0f} s of training"


def train(args, name: str, overrides: list[str]) -> int:
    out = Path(args.out) / name
    cmd = [sys.executable, "-m", "dcoco.cli", "train", "--config", args.config, *args.set, *overrides]
    limit = f"optim.steps={args.steps}" if args.steps else f"optim.time_budget_s={args.budget_s}"
    cmd += [limit, f"run.out={out}"]
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "train.log", "a") as log:
        return subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT)


def write_report(args, rows: list[dict]) -> None:
    out = Path(args.out)
    target = load_config(args.config, args.set).target  # the common overrides' device and dtype
    info = {**machine_info(target.device, target.dtype), "dtype": target.dtype, "commit": git_commit()}
    report = {
        "config": args.config,
        "common": args.set,
        "budget_s": args.budget_s,
        "steps": args.steps,
        "machine": info,
        "rows": rows,
    }
    (out / "ablation.json").write_text(json.dumps(report, indent=2) + "\n")
    # DCOCO's runs also give their drafts uncorrected, so the corrector's margin reads off each row
    uncorrected = any(r.get("eval_tau_decode_dflash") is not None for r in rows)
    header = ["variant", "overrides", "steps", "sequences seen", "training (min)", "held-out τ decoded"]
    header += ["uncorrected", "margin"] * uncorrected + ["held-out τ (random anchors)", "loss"]
    body = []
    for r in rows:
        cells = [r["name"], f"`{' '.join(r['overrides'])}`"]
        if r.get("eval_tau_decode") is None:
            body.append(cells + [f"failed (exit {r.get('exit')})"] + [""] * (len(header) - 3))
            continue
        tau, plain = r.get("eval_tau"), r.get("eval_tau_decode_dflash")
        cells += [str(r["step"]), str(r["samples_seen"]), f"{r['train_s'] / 60:.1f}", f"{r['eval_tau_decode']:.3f}"]
        if uncorrected:
            cells += [f"{plain:.3f}", f"{r['eval_tau_decode'] / plain:.3f}x"] if plain else ["", ""]
        body.append(cells + ["" if tau is None else f"{tau:.3f}", f"{r['loss']:.3f}"])
    lines = [
        f"Ablations of `{args.config}` at {budget_label(args)} each ({info.get('cpu', '')}), "
        f"common overrides: `{' '.join(args.set)}`",
        "",
        *markdown_table(header, body, left=2)[:-1],
    ]
    (out / "ablation.md").write_text("\n".join(lines) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in rows if r.get("eval_tau_decode") is not None]
    fig, ax = plt.subplots(figsize=(max(4, 0.8 * len(done) + 2), 3.5))
    ax.bar([r["name"] for r in done], [r["eval_tau_decode"] for r in done])
    ax.set_ylabel("held-out τ as decoded")
    ax.set_title(f"equal budget: {budget_label(args)} each")
    ax.tick_params(axis="x", rotation=30)
    ax.set_ylim(bottom=1.0)
    fig.tight_layout()
    fig.savefig(out / "ablation.png", dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True)
    limit = ap.add_mutually_exclusive_group(required=True)
    limit.add_argument("--budget-s", type=float, help="training wall time per variant")
    limit.add_argument("--steps", type=int, help="training steps per variant, on the same batches")
    ap.add_argument("--set", nargs="*", default=[], help="overrides shared by every variant")
    ap.add_argument("--variant", action="append", required=True, help="NAME or NAME:section.key=value,...")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    variants = [parse_variant(v) for v in args.variant]
    if len({n for n, _ in variants}) != len(variants):
        raise SystemExit("ablate.py: variant names must differ")
    rows = []
    for name, overrides in variants:
        code = 0
        if last_eval(Path(args.out) / name / "log.jsonl") is None or not _finished(Path(args.out) / name, args.steps):
            print(f"training {name} for {budget_label(args)}", flush=True)
            code = train(args, name, overrides)
        got = last_eval(Path(args.out) / name / "log.jsonl") if code == 0 else None
        rows.append({"name": name, "overrides": overrides, "exit": code, **(got or {})})
        print(json.dumps(rows[-1]), flush=True)
        write_report(args, rows)


def _finished(run: Path, steps: int | None) -> bool:
    """Whether the run reached its last step (`steps`, or the steps its time budget fixed)."""
    rows = read_log(run / "log.jsonl")
    fixed = [steps] if steps else [r["steps_from_time_budget"] for r in rows if "steps_from_time_budget" in r]
    return bool(fixed) and bool(rows) and rows[-1]["step"] >= fixed[-1]


if __name__ == "__main__":
    main()
