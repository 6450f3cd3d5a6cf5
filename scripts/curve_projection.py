"""What a training curve would take to reach a held-out τ: the evaluated end of every stage in a
checkpoint's `training_log.jsonl` (held-out τ as decoded against sequences seen), fitted from
`--since` on by a line and by a logarithm (the two bracket a curve that bends, or does not), and the
sequences and hours each fit needs to reach `--goal` at the paces given.

  python scripts/curve_projection.py stages/smollm2-135m-instruct/dflash --since 60000 --goal 2.5 \\
      --pace "AVX2 EPYC, float32=2100" --pace "Xeon AMX, bf16=7000"

Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy

from dcoco.bench.report import markdown_table
from dcoco.train.runstate import read_log
from dcoco.train.trainer import CURVE_LOG


def stage_ends(rows: list[dict]) -> list[tuple[int, float]]:
    """(sequences seen, held-out τ as decoded) at each stage's last evaluation."""
    last: dict[int, dict] = {}
    for r in rows:
        stage = r.get("stage", 0)
        if "eval_tau_decode" in r and (stage not in last or r["samples_seen"] >= last[stage]["samples_seen"]):
            last[stage] = r
    return sorted((r["samples_seen"], r["eval_tau_decode"]) for r in last.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", help="a drafter directory with training_log.jsonl")
    ap.add_argument("--since", type=int, default=0, help="fit the stage ends from this many sequences seen on")
    ap.add_argument("--goal", type=float, required=True, help="held-out τ as decoded to reach")
    ap.add_argument("--pace", action="append", default=[], help="LABEL=SEQUENCES_PER_HOUR (repeatable)")
    a = ap.parse_args()
    path = Path(a.checkpoint) / CURVE_LOG
    if not path.is_file():
        raise SystemExit(f"curve_projection.py: {path} not found")
    try:
        paces = [(label, float(rate)) for label, rate in (p.rsplit("=", 1) for p in a.pace)]
    except ValueError:
        raise SystemExit(f"curve_projection.py: bad --pace in {a.pace} (LABEL=SEQUENCES_PER_HOUR)") from None
    ends = [(n, t) for n, t in stage_ends(read_log(path)) if n >= a.since]
    if len(ends) < 3:
        raise SystemExit(f"curve_projection.py: {len(ends)} stage ends from {a.since} sequences on; need 3")
    n_now, tau_now = ends[-1]
    first = f"{ends[0][0]:,} sequences seen, τ {ends[0][1]:.3f}"
    print(f"{len(ends)} stage ends, from {first} to {n_now:,}, τ {tau_now:.3f}\n")
    body = []
    for name, transform, inverse in (
        ("line", lambda n: n, lambda x: x),
        ("logarithm", math.log, math.exp),
    ):
        b, k = numpy.polyfit([transform(n) for n, _ in ends], [t for _, t in ends], 1)
        at_now = k + b * transform(n_now)
        more = inverse((a.goal - k) / b) - n_now if b > 0 else math.inf
        slope = b * (1000 if name == "line" else 1000 / n_now)  # per 1,000 sequences, at the last end
        hours = [f"{more / rate:.1f}" for _, rate in paces]
        body.append([name, f"{at_now:.3f}", f"{slope:.4f}", f"{more:,.0f}", *hours])
    header = ["fit", "fit at the last end", "τ per 1,000 sequences there", f"sequences more to {a.goal}"]
    print("\n".join(markdown_table(header + [f"hours, {label}" for label, _ in paces], body)))


if __name__ == "__main__":
    main()
