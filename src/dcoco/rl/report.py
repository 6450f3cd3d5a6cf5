"""Plots of one RL run and the comparison of several (`dcoco rl compare RUN_DIR ...`).

Speedups are measured against the run whose draft method is `none` (the no-draft baseline, same
config otherwise): rollout speedup = rollout tokens/s over the baseline's, end-to-end speedup =
rollout tokens per second of the whole step (rollout + policy update + draft update) over the
baseline's. Throughputs, not times, because the runs' completions differ in length. The table gives
each run's start and end (reward and acceptance length over its first and last 10 steps, validation
at its first and last point) and medians over steps for throughputs and times; the plot shows every
step and every validation.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Optional

from ..errors import ConfigError
from ..train.runstate import read_log


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in rows if key in r]
    return [p[0] for p in pts], [p[1] for p in pts]


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_run(log: Path, out: Path, title: str = "GRPO") -> Optional[Path]:
    """reward, validation accuracy, acceptance length and draft loss vs step."""
    rows = read_log(log)
    if not rows:
        return None
    plt = _plt()
    fig, ax = plt.subplots(2, 2, figsize=(10, 7))
    ax = ax.ravel()
    mk = "." if len(rows) < 40 else None  # a short run still shows its points
    ax[0].plot(*_series(rows, "reward"), marker=mk, label="reward")
    ax[0].plot(*_series(rows, "solved"), marker=mk, alpha=0.6, label="exact (reward 1)")
    ax[0].set_ylabel("rollout reward")
    ax[1].plot(*_series(rows, "val_acc"), "o-", label="exact match")
    ax[1].plot(*_series(rows, "val_reward"), "s--", alpha=0.7, label="reward")
    ax[1].set_ylabel("validation (greedy)")
    ax[2].plot(*_series(rows, "acceptance_length"), marker=mk, label="rollouts (sampled)")
    ax[2].plot(*_series(rows, "val_acceptance_length"), "o-", label="validation (T=0)")
    ax[2].set_ylabel("acceptance length")
    ax[3].plot(*_series(rows, "draft_loss"), marker=mk, label="draft loss")
    ax[3].set_ylabel("draft loss")
    for a in ax:
        a.set_xlabel("step")
        a.grid(alpha=0.3)
        if a.get_legend_handles_labels()[0]:
            a.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return Path(out)


def _stat(rows: list[dict], key: str, fn=statistics.median) -> Optional[float]:
    """`fn` of `key` over the rows that have it (None when none has)."""
    vals = [r[key] for r in rows if key in r]
    return fn(vals) if vals else None


def _run_summary(d: Path) -> dict:
    """One run's start and end (reward and rollout τ over its first and last 10 steps, validation at
    its first and last point: what decides whether the policy learned and the draft kept up) and its
    medians over all steps (throughputs and times)."""
    cfg = json.loads((d / "config.json").read_text())
    rows = read_log(d / "log.jsonl")
    steps = [r for r in rows if "reward" in r]
    if not steps:
        raise ConfigError(f"{d}: no training steps logged yet")
    val = [r for r in rows if "val_acc" in r]
    first, last = steps[:10], steps[-10:]

    def ends(key: str) -> tuple[Optional[float], Optional[float]]:
        return (val[0].get(key), val[-1].get(key)) if val else (None, None)

    return {
        "run": d.name,
        "dir": str(d),
        "method": cfg["draft"]["method"],
        "cotrain": cfg["draft"]["cotrain"],
        "steps": steps[-1]["step"],
        "rows": steps,
        "val_rows": val,
        # (start, end) pairs
        "reward": tuple(_stat(part, "reward", statistics.fmean) for part in (first, last)),
        "tau": tuple(_stat(part, "acceptance_length", statistics.fmean) for part in (first, last)),
        "val_reward": ends("val_reward"),
        "val_acc": ends("val_acc"),
        "val_tau": ends("val_acceptance_length"),
        "acceptance_length": _stat(steps, "acceptance_length"),
        "rollout_tps": _stat(steps, "rollout_tps"),
        "step_tps": _stat(steps, "step_tps"),
        "rollout_s": _stat(steps, "rollout_s"),
        "step_s": _stat(steps, "step_s"),
        "train_infer_kl": _stat(steps, "train_infer_kl"),
    }


def compare(run_dirs: list[str], out: str) -> Path:
    """Table (compare.md, compare.json) and plot (compare.png) of several runs of the same task."""
    if not run_dirs:
        raise ConfigError("rl compare needs at least one run directory")
    runs = []
    for d in map(Path, run_dirs):
        if not (d / "config.json").exists() or not (d / "log.jsonl").exists():
            raise ConfigError(f"not an RL run directory (no config.json / log.jsonl): {d}")
        runs.append(_run_summary(d))
    base = next((r for r in runs if r["method"] == "none"), None)
    for r in runs:
        ok = base is not None and r["rollout_tps"] and base["rollout_tps"]
        r["rollout_speedup"] = r["rollout_tps"] / base["rollout_tps"] if ok else None
        r["e2e_speedup"] = r["step_tps"] / base["step_tps"] if ok and base["step_tps"] else None
    outd = Path(out)
    outd.mkdir(parents=True, exist_ok=True)

    def f(x, p=2, unit=""):
        return "-" if x is None else f"{x:.{p}f}{unit}"

    def span(pair: tuple, p: int = 2) -> str:
        return f"{f(pair[0], p)} -> {f(pair[1], p)}"

    lines = [
        "| run | draft | co-trained | steps | rollout reward, first 10 -> last 10 | val reward, first -> last | "
        "val acc, first -> last | rollout τ, first 10 -> last 10 | val τ (T=0), first -> last | rollout tok/s | "
        "rollout speedup | s/step | end-to-end speedup | train-infer KL |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        lines.append(
            f"| {r['run']} | {r['method']} | {'yes' if r['cotrain'] and r['method'] != 'none' else 'no'} | "
            f"{r['steps']} | {span(r['reward'], 3)} | {span(r['val_reward'], 3)} | {span(r['val_acc'])} | "
            f"{span(r['tau'])} | {span(r['val_tau'])} | {f(r['rollout_tps'], 1)} | "
            f"{f(r['rollout_speedup'], unit='x')} | {f(r['step_s'], 1)} | {f(r['e2e_speedup'], unit='x')} | "
            f"{f(r['train_infer_kl'], 6)} |"
        )
    note = "Rollout tok/s, s/step and the KL are medians over steps; speedups are tokens/s ratios against the " + (
        "`none` run." if base else "`none` run, and none was given."
    )
    (outd / "compare.md").write_text("\n".join(lines) + "\n\n" + note + "\n")
    (outd / "compare.json").write_text(
        json.dumps([{k: v for k, v in r.items() if k not in ("rows", "val_rows")} for r in runs], indent=2) + "\n"
    )
    _plot_compare(runs, base, outd / "compare.png")
    return outd / "compare.md"


def _plot_compare(runs: list[dict], base: Optional[dict], out: Path) -> None:
    plt = _plt()
    fig, ax = plt.subplots(3, 2, figsize=(11, 10))
    ax = ax.ravel()
    base_tps = {r["step"]: r["rollout_tps"] for r in base["rows"]} if base else {}
    for i, r in enumerate(runs):
        style = {"label": r["run"], "color": f"C{i}"}
        ax[0].plot(*_series(r["rows"], "reward"), **style)
        ax[1].plot(*_series(r["rows"], "acceptance_length"), **style)
        ax[2].plot(*_series(r["val_rows"], "val_reward"), marker="o", **style)
        ax[3].plot(*_series(r["val_rows"], "val_acceptance_length"), marker="o", **style)
        ax[4].plot(*_series(r["rows"], "rollout_tps"), **style)
        if base and r is not base:
            pts = [(s["step"], s["rollout_tps"] / base_tps[s["step"]]) for s in r["rows"] if base_tps.get(s["step"])]
            ax[5].plot([p[0] for p in pts], [p[1] for p in pts], **style)
    labels = (
        "rollout reward",
        "rollout acceptance length",
        "validation reward",
        "validation acceptance length (T=0)",
        "rollout tokens/s",
        "rollout speedup vs no draft",
    )
    for a, y in zip(ax, labels):
        a.set_xlabel("step")
        a.set_ylabel(y)
        a.grid(alpha=0.3)
        if a.get_legend_handles_labels()[0]:
            a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
