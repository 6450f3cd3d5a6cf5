"""Drafter training throughput against the machine's bf16 matmul peak, side by side for several
step shapes (threads, sequences per step, anchors per sequence), on the same data.

For each shape: one warm-up step, then `--steps` timed steps (sequences/s, anchor blocks/s, tokens/s),
then two steps under `dcoco.train.flops` for the matmul FLOPs per token, which gives the TFLOPS
achieved at the timed pace. The peak is a large matmul (2048^3) in the same dtype at the same thread
count. Steps run as `dcoco train` runs them: oneDNN's kernel cache capped, the heap trimmed after each.
`--dtype float32` runs the target and the drafter's products in float32 (a CPU without bf16 matrix
units, docs/training.md).

  python scripts/train_throughput.py --data DIR [--config configs/dflash_smollm2.yaml] \
      [--shapes 1x4x16,2x4x16,2x8x32,2x8x64] [--steps 5] [--dtype bfloat16|float32] [--profile] --out DIR

A shape is THREADSxSEQUENCESxANCHORS, optionally followed by `:key=value` config overrides of its
own (e.g. `2x4x64:drafter.draft_vocab_loss=true`). Writes DIR/train_throughput.{json,md,png};
`--profile` also three more steps per shape under torch's profiler, their top operators by own CPU time
in DIR/profile_N_SHAPE.txt (where a step's time goes beyond its matrix products).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch

from dcoco.bench.system import git_commit, machine_info
from dcoco.memory import trim_heap
from dcoco.target import Target
from dcoco.train.config import load_config
from dcoco.train.data import RegeneratedUnion
from dcoco.train.flops import StepFlops
from dcoco.train.run import cap_kernel_cache
from dcoco.train.trainer import Trainer


def matmul_peak(threads: int, dtype: torch.dtype, n: int = 2048, repeats: int = 5) -> float:
    """TFLOPS of an n x n x n matmul (best of `repeats`)."""
    torch.set_num_threads(threads)
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e12


def run_steps(tr: Trainer, steps: int) -> int:
    """`steps` training steps as `dcoco train` takes them (the heap trimmed after each); their tokens."""
    tokens = 0
    for _ in range(steps):
        tr.train_step()
        trim_heap()
        tokens += tr.batch_tokens
    return tokens


def profile_steps(tr: Trainer, out: Path, steps: int = 3) -> None:
    """The top operators of `steps` training steps by their own CPU time, as torch's profiler tables them."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        run_steps(tr, steps)
    out.write_text(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20) + "\n")


def measure(
    config: str,
    data: list[str],
    target,
    threads: int,
    seqs: int,
    anchors: int,
    steps: int,
    extra,
    profile_to: Optional[Path] = None,
) -> dict:
    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as run:
        over = [
            f"data.path={json.dumps(data)}",
            "data.features=online",
            f"run.out={run}",
            "run.eval_every=1000000",
            "run.checkpoint_every=1000000",
            "run.flops_every=0",
            "data.eval_samples=0",
            f"optim.batch_size={seqs}",
            f"optim.anchors_per_seq={anchors}",
            f"optim.threads={threads}",
            *extra,
        ]
        tr = Trainer(load_config(config, over), target, RegeneratedUnion(data))
        tr.train_step()  # warm-up
        t0 = time.perf_counter()
        tokens = run_steps(tr, steps)
        dt = time.perf_counter() - t0
        blocks = steps * seqs * anchors
        counter, flop, flop_tokens = StepFlops(), 0, 0
        for _ in range(2):
            with counter.counting():
                tr.train_step()
            flop, flop_tokens = flop + counter.total, flop_tokens + tr.batch_tokens
        if profile_to is not None:
            profile_steps(tr, profile_to)
    tflops = flop / flop_tokens * tokens / dt / 1e12
    return {
        "threads": threads,
        "sequences_per_step": seqs,
        "anchors_per_sequence": anchors,
        "step_s": round(dt / steps, 3),
        "sequences_per_s": round(steps * seqs / dt, 3),
        "blocks_per_s": round(blocks / dt, 1),
        "tokens_per_s": round(tokens / dt, 1),
        "gflop_per_token": round(flop / flop_tokens / 1e9, 3),
        "tflops": round(tflops, 4),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", nargs="+", required=True, metavar="DIR")
    ap.add_argument("--config", default="configs/dflash_smollm2.yaml")
    ap.add_argument("--shapes", default="1x4x16,2x4x16,2x8x32,2x8x64", help="THREADSxSEQSxANCHORS,...")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--out", default="runs/train-throughput")
    ap.add_argument("--profile", action="store_true", help="also each shape's top operators (profile_N_SHAPE.txt)")
    ap.add_argument("overrides", nargs="*", help="config overrides for every shape, e.g. drafter.num_layers=1")
    args = ap.parse_args()
    cap_kernel_cache()  # before oneDNN's first kernel
    target = Target.from_pretrained(dtype=args.dtype)
    if args.dtype == "float32":
        args.overrides = ["optim.autocast_bf16=false", *args.overrides]
    shapes = []
    for spec in args.shapes.split(","):
        dims, *own = spec.split(":")
        shapes.append((*(int(v) for v in dims.split("x")), own))
    peaks = {t: round(matmul_peak(t, target.dtype), 3) for t in sorted({s[0] for s in shapes})}
    rows = []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for i, (threads, seqs, anchors, own) in enumerate(shapes):
        profile_to = out / f"profile_{i + 1}_{threads}x{seqs}x{anchors}.txt" if args.profile else None
        extra = [*args.overrides, *own]
        row = measure(args.config, args.data, target, threads, seqs, anchors, args.steps, extra, profile_to)
        row["overrides"] = own
        row["peak_tflops"] = peaks[threads]
        row["of_peak"] = round(row["tflops"] / peaks[threads], 3)
        rows.append(row)
        print(json.dumps(row), flush=True)
    base = rows[0]
    for r in rows:
        r["sequences_vs_first"] = round(r["sequences_per_s"] / base["sequences_per_s"], 2)
        r["blocks_vs_first"] = round(r["blocks_per_s"] / base["blocks_per_s"], 2)
    info = {
        **machine_info("cpu", args.dtype),
        "commit": git_commit(),
        "dtype": args.dtype,
        "config": args.config,
        "overrides": args.overrides,
    }
    (out / "train_throughput.json").write_text(json.dumps({"machine": info, "peaks": peaks, "rows": rows}, indent=2))
    head = (
        "| threads | seq/step | anchors/seq | overrides | s/step | seq/s | blocks/s | tokens/s | GFLOP/token | TFLOPS "
        "| of peak | seq/s vs first | blocks/s vs first |"
    )
    lines = [head, "|" + "---:|" * 3 + "---|" + "---:|" * 9]
    for r in rows:
        lines.append(
            f"| {r['threads']} | {r['sequences_per_step']} | {r['anchors_per_sequence']} "
            f"| {' '.join(r['overrides']) or '-'} | {r['step_s']} "
            f"| {r['sequences_per_s']} | {r['blocks_per_s']} | {r['tokens_per_s']} | {r['gflop_per_token']} "
            f"| {r['tflops']} | {r['of_peak']:.0%} | {r['sequences_vs_first']}x | {r['blocks_vs_first']}x |"
        )
    peak_txt = ", ".join(f"{v} TFLOPS at {k} thread{'s' if k > 1 else ''}" for k, v in peaks.items())
    (out / "train_throughput.md").write_text(
        f"Drafter training throughput, `{args.config}` {' '.join(args.overrides)}, "
        "target features online unless overridden, "
        f"{info.get('cpu', '')}; {args.dtype} matmul peak {peak_txt}; commit {info['commit']}\n\n"
        + "\n".join(lines)
        + "\n"
    )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    labels = [
        f"{r['threads']}x{r['sequences_per_step']}x{r['anchors_per_sequence']}" + ("*" if r["overrides"] else "")
        for r in rows
    ]
    ax.bar(labels, [r["tflops"] for r in rows], label="achieved")
    for t, p in peaks.items():
        ax.axhline(p, ls="--", color="gray", lw=1)
        ax.text(len(rows) - 0.5, p, f"{args.dtype} matmul peak, {t} thr", ha="right", va="bottom", fontsize=8)
    ax.set_ylabel("TFLOPS (matmul)")
    ax.set_xlabel("threads x sequences/step x anchors/sequence (* own overrides)")
    ax.set_title("drafter training throughput")
    fig.tight_layout()
    fig.savefig(out / "train_throughput.png", dpi=120)


if __name__ == "__main__":
    main()
