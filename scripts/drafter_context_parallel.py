"""Memory and time per rank against W for the real drafter's loss on one long rollout: the ring
(`ContextShard`, attention="ring") against the all-gather baseline (attention="allgather").

Workload: one sequence of N tokens (a long RL rollout), its target features at the drafter's taps
(random: memory and time depend on shapes only), `--anchors` DFlash blocks on it, and a DFlash
drafter of the shipped SmolLM2 shape (float32, draft-vocabulary loss). For every N and W, W gloo
processes on loopback each run one loss forward + backward, then the gradient all-reduce, and
report:
- peak resident memory above the pre-step baseline (sampled every ms; `dcoco.parallel.bench`'s
  sampler, glibc told to unmap freed tensors);
- wall time between barriers (the slowest rank sets it) and CPU time of the busiest rank;
- that the ranks' summed loss equals W = 1's.

  python scripts/drafter_context_parallel.py --out DIR [--tokens 8192,16384,32768] \
      [--world-sizes 1,2,4] [--anchors 64] [--threads 1]

On a machine with fewer cores than W x threads, the ranks share cores: wall time then measures
the sum of the work, not the parallel speed; memory per rank is unaffected. Writes
DIR/drafter_context_parallel.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from dcoco.bench.system import git_commit, machine_info
from dcoco.drafters.dflash import DFlashConfig, DFlashModel
from dcoco.memory import rss_bytes, trim_heap
from dcoco.parallel import ContextShard, ZigzagLayout, allreduce_gradients
from dcoco.parallel.bench import PeakRSS
from dcoco.parallel.launch import spawn_local
from dcoco.train.batch import sample_anchors
from dcoco.train.losses import DrafterLoss

MODES = ("ring", "allgather")
# the shipped SmolLM2-135M DFlash drafter: 2 layers over 5 taps of the 576-wide target
SHAPE = dict(hidden=576, intermediate=1536, heads=9, kv_heads=3, head_dim=64, taps=5, vocab=49152, draft_vocab=8192)


def make_loss() -> DrafterLoss:
    s = SHAPE
    torch.manual_seed(0)
    cfg = DFlashConfig(
        hidden_size=s["hidden"],
        intermediate_size=s["intermediate"],
        num_hidden_layers=2,
        num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"],
        head_dim=s["head_dim"],
        vocab_size=s["vocab"],
        num_target_layers=30,
        block_size=16,
        target_layer_ids=list(range(s["taps"])),
        mask_token_id=0,
        max_position_embeddings=1 << 17,
    )
    model = DFlashModel(cfg)
    model.set_draft_vocab(torch.arange(s["draft_vocab"]))
    embed = torch.nn.Embedding(s["vocab"], s["hidden"]).requires_grad_(False)
    head = torch.nn.Linear(s["hidden"], s["vocab"], bias=False).requires_grad_(False)
    return DrafterLoss(model, embed, head, gamma=7.0, draft_vocab_loss=True)


def rollout(n_tokens: int, n_anchors: int):
    """The rollout's tokens, its features (packed, N x taps*hidden) and anchors: the same on every rank."""
    gen = torch.Generator().manual_seed(n_tokens)
    sample = {"input_ids": torch.randint(1, SHAPE["vocab"], (n_tokens,), generator=gen).tolist(), "prompt_len": 0}
    feats = torch.randn(n_tokens, SHAPE["taps"] * SHAPE["hidden"], generator=gen, dtype=torch.bfloat16)
    return sample, feats, [sample_anchors(0, n_tokens, n_anchors, gen)]


def rank_step(rank: int, world_size: int, n_tokens: int, n_anchors: int, mode: str) -> dict:
    loss = make_loss()
    sample, feats, anchors = rollout(n_tokens, n_anchors)
    layout = ZigzagLayout([n_tokens], world_size)
    shard = ContextShard(layout, None if world_size == 1 else dist.group.WORLD, attention=mode)
    shard.attach(loss)
    batch = shard.batch([sample], layout.shard(feats, shard.rank), anchors, loss.model.cfg.block_size)
    del feats  # a rank holds its shard only

    def step() -> float:
        value, _ = loss(batch)
        value.backward()
        if world_size > 1:
            allreduce_gradients(loss.model)
        loss.model.zero_grad(set_to_none=True)
        return float(value.detach())

    step()  # warm-up: allocator and kernels
    trim_heap()
    if world_size > 1:
        dist.barrier()
    base = rss_bytes()
    t0, c0 = time.perf_counter(), time.process_time()
    with PeakRSS() as mon:
        value = step()
    if world_size > 1:
        dist.barrier()
    total = torch.tensor([value], dtype=torch.float64)
    if world_size > 1:
        dist.all_reduce(total)
    return {
        "wall_s": time.perf_counter() - t0,
        "cpu_s": time.process_time() - c0,
        "peak_mem_bytes": mon.peak - base,
        "local_tokens": layout.local_len(rank),
        "own_blocks": int((batch.anchors >= 0).sum()),
        "loss": float(total),
    }


def run(args) -> dict:
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # inherited by the workers
    rows = []
    for n in args.tokens:
        for w in args.world_sizes:
            for mode in MODES if w > 1 else ("ring",):
                ranks = spawn_local(rank_step, w, n, args.anchors, mode, timeout_s=args.timeout_s, threads=args.threads)
                row = {
                    "tokens": n,
                    "W": w,
                    "mode": mode if w > 1 else "one process",
                    "wall_s": max(r["wall_s"] for r in ranks),
                    "cpu_s_max_rank": max(r["cpu_s"] for r in ranks),
                    "peak_mem_mib_max_rank": max(r["peak_mem_bytes"] for r in ranks) / 2**20,
                    "peak_mem_mib_mean_rank": statistics.mean(r["peak_mem_bytes"] for r in ranks) / 2**20,
                    "loss": ranks[0]["loss"],
                    "per_rank": ranks,
                }
                rows.append(row)
                print(
                    f"N={n} W={w} {row['mode']}: peak {row['peak_mem_mib_max_rank']:.0f} MiB/rank, "
                    f"{row['wall_s']:.2f} s, loss {row['loss']:.6f}",
                    flush=True,
                )
    return {
        "command": " ".join(["python", "scripts/drafter_context_parallel.py", *sys.argv[1:]]),
        "commit": git_commit(),
        "machine": machine_info("cpu", "float32"),
        "shape": SHAPE,
        "anchors": args.anchors,
        "threads_per_rank": args.threads,
        "rows": rows,
    }


def write_markdown(res: dict, path: Path) -> None:
    lines = [
        "# Drafter loss, context parallel: memory and time per rank against W",
        "",
        f"`{res['command']}` at {res['commit']}. One rollout of N tokens, {res['anchors']} DFlash blocks of 16, "
        f"the SmolLM2 DFlash shape ({SHAPE['hidden']} wide, 2 layers, {SHAPE['taps']} taps, draft vocabulary "
        f"{SHAPE['draft_vocab']}), float32 drafter, bf16 features; one loss forward + backward + gradient "
        f"all-reduce per rank, {res['threads_per_rank']} thread(s) per rank.",
        "",
        "| N | W | attention | peak MiB, largest rank | peak MiB, mean rank | wall s | CPU s, busiest rank | loss |",
        "|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in res["rows"]:
        lines.append(
            f"| {r['tokens']} | {r['W']} | {r['mode']} | {r['peak_mem_mib_max_rank']:.0f} | "
            f"{r['peak_mem_mib_mean_rank']:.0f} | {r['wall_s']:.2f} | {r['cpu_s_max_rank']:.2f} | {r['loss']:.6f} |"
        )
    path.write_text("\n".join(lines) + "\n")


def write_plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for n in sorted({r["tokens"] for r in res["rows"]}):
        for mode, style in (("ring", "-o"), ("allgather", "--s")):
            pts = [r for r in res["rows"] if r["tokens"] == n and (r["mode"] == mode or r["W"] == 1)]
            pts.sort(key=lambda r: r["W"])
            ax.plot([r["W"] for r in pts], [r["peak_mem_mib_max_rank"] for r in pts], style, label=f"N={n} {mode}")
    ax.set_xlabel("context-parallel ranks W")
    ax.set_ylabel("peak memory per rank (MiB)")
    ax.set_xticks(sorted({r["W"] for r in res["rows"]}))
    ax.set_title("drafter loss fwd+bwd, one rollout")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", default="8192,16384,32768")
    ap.add_argument("--world-sizes", default="1,2,4")
    ap.add_argument("--anchors", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--timeout-s", type=float, default=1800.0)
    args = ap.parse_args()
    try:
        args.tokens = [int(x) for x in args.tokens.split(",")]
        args.world_sizes = [int(x) for x in args.world_sizes.split(",")]
    except ValueError:
        sys.exit("drafter_context_parallel.py: --tokens and --world-sizes are comma-separated integers")
    if min(args.tokens) < 2 * max(args.world_sizes) or min(args.world_sizes) < 1:
        sys.exit("drafter_context_parallel.py: every N must be at least 2W tokens, and W at least 1")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res = run(args)
    (out / "drafter_context_parallel.json").write_text(json.dumps(res, indent=1))
    write_markdown(res, out / "drafter_context_parallel.md")
    write_plot(res, out / "drafter_context_parallel.png")
    print(f"wrote {out}/drafter_context_parallel.{{json,md,png}}")


if __name__ == "__main__":
    main()
