"""Training curves from log rows (one run's, or every stage's: `Trainer.curve_rows`)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional


def training_curve(rows: list[dict], out: Path, title: str = "training") -> Optional[Path]:
    """Loss and held-out τ against sequences seen; a dotted line where each later stage begins, and
    hollow markers where an earlier stage ended (its decayed drafter, off the line continued)."""
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(10, 3.8))
    # x: sequences seen (earlier stages included) where the log has them, else steps
    xkey = "samples_seen" if all("samples_seen" in r for r in rows) else "step"
    ends = [r for r in rows if r.get("decayed")]  # an earlier stage's evaluated end, off the line continued
    rows = [r for r in rows if not r.get("decayed")]
    trained = [r for r in rows if "loss" in r]  # a warm start's opening evaluation has no training loss
    steps = [r[xkey] for r in trained]
    loss = [r["loss"] for r in trained]
    k = max(1, len(loss) // 100)
    smooth = [sum(loss[max(0, i - k) : i + 1]) / len(loss[max(0, i - k) : i + 1]) for i in range(len(loss))]
    ax[0].plot(steps, loss, alpha=0.25, color="tab:blue", label="train loss")
    ax[0].plot(steps, smooth, color="tab:blue", label=f"train loss (mean of {k + 1})")
    ev = [r for r in rows if "eval_loss" in r]
    if ev:
        ax[0].plot([r[xkey] for r in ev], [r["eval_loss"] for r in ev], "o-", color="tab:orange", label="held-out loss")
        xs = [r[xkey] for r in ev]
        corrected = "eval_tau_dflash" in ev[-1]  # DCOCO logs the same drafts without correction and the oracle
        mode = "with correction, " if corrected else ""
        ax[1].plot(xs, [r["eval_tau"] for r in ev], "o-", color="tab:green", label=mode + "random anchors")
        if "eval_tau_decode" in ev[-1]:  # the τ greedy decoding gets (each block opens where the last one ended)
            ax[1].plot(xs, [r.get("eval_tau_decode") for r in ev], "D-", color="tab:olive", label=mode + "as decoded")
        if corrected:
            ax[1].plot(
                xs,
                [r.get("eval_tau_dflash") for r in ev],
                "s--",
                color="tab:gray",
                label="same drafts, no correction, random anchors",
            )
            if "eval_tau_decode_dflash" in ev[-1]:
                ax[1].plot(
                    xs,
                    [r.get("eval_tau_decode_dflash") for r in ev],
                    "s:",
                    color="tab:gray",
                    label="no correction, as decoded",
                )
            ax[1].plot(
                xs,
                [r.get("eval_tau_oracle") for r in ev],
                "^:",
                color="tab:purple",
                label="oracle (best of shortlist), random anchors",
            )
        if ends and "eval_tau_decode" in ends[-1]:
            ax[1].plot(
                [r[xkey] for r in ends],
                [r["eval_tau_decode"] for r in ends],
                "D",
                mfc="none",
                color="tab:olive",
                label="as decoded, each stage's decayed end",
            )
        ax[1].legend(fontsize=8)
    xlabel = "sequences seen" if xkey == "samples_seen" else "step"
    if xkey == "samples_seen":
        starts = [b[xkey] for a, b in zip(rows, rows[1:]) if b.get("stage", 1) != a.get("stage", 1)]
        for axis in ax:
            for x in starts:
                axis.axvline(x, ls=":", color="gray", lw=1)
    ax[0].set_xlabel(xlabel), ax[0].set_ylabel("decayed CE"), ax[0].legend(), ax[0].grid(alpha=0.3)
    ax[1].set_xlabel(xlabel), ax[1].set_ylabel("simulated acceptance length (T=0)"), ax[1].grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
