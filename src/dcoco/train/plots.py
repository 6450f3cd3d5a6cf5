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

    fig, ax = plt.subplots(1, 2, figsize=(12.5, 3.8))
    # x: sequences seen (earlier stages included) where the log has them, else steps
    xkey = "samples_seen" if all("samples_seen" in r for r in rows) else "step"
    carried = [r for r in rows if r.get("carried")]  # a continued corrector's evaluations on earlier backbones
    rows = [r for r in rows if not r.get("carried")]
    ends = [r for r in rows if r.get("decayed")]  # an earlier stage's evaluated end, off the line continued
    rows = [r for r in rows if not r.get("decayed")]
    # a DCOCO stage's loss adds its corrector's to the backbone's: the backbone's part continues the
    # line of the stages before it, the corrector's is drawn on its own
    trained = [r for r in rows if "loss" in r]  # a warm start's opening evaluation has no training loss
    steps = [r[xkey] for r in trained]
    loss = [r.get("dflash_loss", r["loss"]) for r in trained]
    k = max(1, len(loss) // 100)
    ax[0].plot(steps, loss, alpha=0.25, color="tab:blue", label="train loss")
    ax[0].plot(steps, running_mean(loss, k), color="tab:blue", label=f"train loss (mean of {k + 1})")
    corrector = [r for r in trained if "corrector_loss" in r]
    if corrector:
        ax[0].plot(
            [r[xkey] for r in corrector],
            running_mean([r["corrector_loss"] for r in corrector], k),
            color="tab:red",
            label=f"corrector train loss (mean of {k + 1})",
        )
    ev = [r for r in rows if "eval_loss" in r]
    if ev:
        ax[0].plot(
            [r[xkey] for r in ev],
            [r.get("eval_dflash_loss", r["eval_loss"]) for r in ev],
            "o-",
            color="tab:orange",
            label="held-out loss",
        )
        scatter(ax[0], ev, xkey, "eval_corrector_loss", "o", "tab:red", "corrector held-out loss")
        xs = [r[xkey] for r in ev]
        # the drafts as drafted (a DCOCO row's before its correction) make one line across the stages;
        # the corrected τ and the oracle are drawn where a row has them
        ax[1].plot(
            xs, [r.get("eval_tau_dflash", r["eval_tau"]) for r in ev], "o-", color="tab:green", label="random anchors"
        )
        if "eval_tau_decode" in ev[-1]:  # the τ greedy decoding gets (each block opens where the last one ended)
            decoded = [r.get("eval_tau_decode_dflash", r.get("eval_tau_decode")) for r in ev]
            ax[1].plot(xs, decoded, "D-", color="tab:olive", label="as decoded")
        # DCOCO: the same drafts corrected, and the oracle, on this backbone and (carried) on earlier
        # ones; points, not lines: the stages of a corrector moved from backbone to backbone overlap
        corrected = carried + [r for r in ev if "eval_tau_dflash" in r]
        marks = [  # key, marker, colour, label, hollow
            ("eval_tau", "o", "tab:red", "corrected, random anchors", False),
            ("eval_tau_decode", "D", "tab:red", "corrected, as decoded", True),
            ("eval_tau_oracle", "^", "tab:purple", "oracle (best of shortlist), random anchors", False),
        ]
        for mark in marks:
            scatter(ax[1], corrected, xkey, *mark)
        scatter(ax[1], ends, xkey, "eval_tau_decode", "D", "tab:olive", "as decoded, each stage's decayed end", True)
        ax[1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1))  # beside: points fill the panel
    xlabel = "sequences seen" if xkey == "samples_seen" else "step"
    if xkey == "samples_seen":
        starts = [b[xkey] for a, b in zip(rows, rows[1:]) if b.get("stage", 1) != a.get("stage", 1)]
        for axis in ax:
            for x in starts:
                axis.axvline(x, ls=":", color="gray", lw=1)
            axis.xaxis.set_major_formatter(lambda v, _: f"{v / 1000:g}k" if v else "0")
    ax[0].set_xlabel(xlabel), ax[0].set_ylabel("decayed CE"), ax[0].legend(fontsize=8), ax[0].grid(alpha=0.3)
    ax[1].set_xlabel(xlabel), ax[1].set_ylabel("simulated acceptance length (T=0)"), ax[1].grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def running_mean(values: list[float], k: int) -> list[float]:
    """Each value averaged with the k before it (fewer at the start)."""
    return [sum(values[max(0, i - k) : i + 1]) / len(values[max(0, i - k) : i + 1]) for i in range(len(values))]


def scatter(axis, rows: list[dict], xkey: str, key: str, marker: str, color: str, label: str, hollow=False) -> None:
    """Markers, no line, for the rows that have `key` (none drawn, and no legend entry, if none has)."""
    points = [(r[xkey], r[key]) for r in rows if key in r]
    if points:
        axis.plot(*zip(*points), marker, mfc="none" if hollow else color, color=color, ls="none", label=label)
