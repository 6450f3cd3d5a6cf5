"""results.md and the plots, written from the rows of results.json and the run metadata (run.json).

Figures at T > 0 are means over the seeds run (the tables say how many). The "mean" column of a table
is the mean over the datasets a method has a value for: mean tokens/s, and the mean of the per-dataset
speedups (as paper tables do). Acceptance tables and plots use each method's smallest concurrency
(acceptance does not depend on batching beyond numerics).

Plots (matplotlib, Agg backend):

- ``speedup_vs_concurrency.png``: per temperature, output tokens/s (top) and speedup over vanilla
  (bottom) against concurrency, one line per method (peers are single points at concurrency 1);
  datasets are averaged.
- ``per_position_acceptance.png``: per dataset, the share of verification passes whose i-th draft token
  was accepted, one curve per method and temperature.
- ``acceptance_length.png``: acceptance length per dataset, one bar per method, per temperature.
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from statistics import mean
from typing import Optional

from ..nn.quantize import QUANTIZED_CPU_PASS_TOKENS
from .config import PEERS

PLOTS = ("speedup_vs_concurrency.png", "per_position_acceptance.png", "acceptance_length.png")


def select_baseline(method: str, measured: set[str]) -> Optional[str]:
    """The method whose token-selection time a method's is reported net of: its family's
    `select_baseline`, as the same labelled variant where the run measured that one
    (`dcoco/stage` against `dflash/stage`), else plain."""
    from ..families import FAMILIES
    from ..speculative import split_label

    family, tag = split_label(method)
    fam = FAMILIES.get(family)
    if fam is None or fam.select_baseline is None:
        return None
    variant = f"{fam.select_baseline}/{tag}"
    return variant if tag and variant in measured else fam.select_baseline


def _key(r: dict) -> tuple:
    return (r["method"], r["dataset"], float(r["temperature"]), int(r["concurrency"]))


def _mean(xs) -> Optional[float]:
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return mean(xs) if xs else None


def _mean_lists(lists) -> Optional[list[float]]:
    lists = [l for l in lists if l]
    if not lists:
        return None
    n = max(len(l) for l in lists)
    return [mean(l[i] if i < len(l) else 0.0 for l in lists) for i in range(n)]


def aggregate(rows: list[dict]) -> dict[tuple, dict]:
    """(method, dataset, temperature, concurrency) -> seed-averaged figures."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        groups[_key(r)].append(r)
    out = {}
    for k, rs in groups.items():
        out[k] = {
            "tokens_per_second": _mean(r["tokens_per_second"] for r in rs),
            "speedup_vs_vanilla": _mean(r["speedup_vs_vanilla"] for r in rs),
            "acceptance_length": _mean(r["acceptance_length"] for r in rs),
            "acceptance_rate": _mean(r["acceptance_rate"] for r in rs),
            "per_position_acceptance": _mean_lists(r["per_position_acceptance"] for r in rs),
            "greedy_match_rate": _mean(r["greedy_match_rate"] for r in rs),
            "num_prompts": rs[0]["num_prompts"],
            "seeds": len(rs),
        }
    return out


def _orders(rows: list[dict], meta: dict) -> tuple[list[str], list[str], list[float], list[int]]:
    cfg = meta.get("config", {}) or {}
    methods = list(
        dict.fromkeys(
            [m for m in cfg.get("methods", []) if any(r["method"] == m for r in rows)] + [r["method"] for r in rows]
        )
    )
    methods = [m for m in methods if m not in PEERS] + [m for m in methods if m in PEERS]
    datasets = list(dict.fromkeys(r["dataset"] for r in rows))  # results.json keeps the configured order
    temps = sorted({float(r["temperature"]) for r in rows})
    concs = sorted({int(r["concurrency"]) for r in rows})
    return methods, datasets, temps, concs


def _fmt(x: Optional[float], nd: int = 2) -> str:
    return "–" if x is None else f"{x:.{nd}f}"


def markdown_table(header: list[str], body: list[list[str]], left: int = 1) -> list[str]:
    """A Markdown table's lines and a blank line after it; the first `left` columns (labels)
    align left, the rest (figures) right."""
    align = ["---"] * left + ["---:"] * (len(header) - left)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in body]
    return lines + [""]


def _min_conc(agg: dict, method: str, temp: float, concs: list[int]) -> Optional[int]:
    for c in concs:
        if any(k[0] == method and k[2] == temp and k[3] == c for k in agg):
            return c
    return None


def markdown(rows: list[dict], meta: dict) -> str:
    agg = aggregate(rows)
    methods, datasets, temps, concs = _orders(rows, meta)
    settings = meta.get("settings", {}) or {}
    machine = meta.get("machine", {}) or {}
    L = ["# dcoco benchmark", ""]
    cmds = meta.get("commands") or []
    if cmds:
        L.append("Command line" + ("s (each run that wrote to this directory)" if len(cmds) > 1 else "") + ":")
        L.append("")
        L += ["```", *cmds, "```", ""]
    k = settings.get("num_speculative_tokens")
    quantized_cpu = settings.get("quantization", "none") != "none" and settings.get("device", "cpu") == "cpu"
    default_cap = f", at most {QUANTIZED_CPU_PASS_TOKENS - 1}" if quantized_cpu else ""  # the engine's cap
    L += [
        f"- Machine: {machine.get('cpu', '?')}, {machine.get('cpu_count', '?')} CPUs; torch threads "
        f"{', '.join(str(t) for t in sorted({r['threads'] for r in rows})) or machine.get('torch_threads', '?')}; "
        f"device {', '.join(sorted({r['device'] for r in rows})) or machine.get('device', '?')}"
        + (
            ""
            if "prepacked_weights" not in machine
            else f"; weights prepacked for oneDNN: {'yes' if machine['prepacked_weights'] else 'no'}"
        ),
        f"- Target: {settings.get('model', '?')}; dtype {settings.get('dtype', '?')}; "
        f"max new tokens {settings.get('max_new_tokens', '?')}; draft tokens per pass "
        f"{k if k is not None else 'each drafter default' + default_cap}; "
        f"top-k {settings.get('top_k', 0)}, top-p {settings.get('top_p', 1.0)}",
        f"- git commit: {', '.join(sorted({r['git_commit'] for r in rows})) or meta.get('git_commit', '?')}; "
        f"torch {machine.get('torch', '?')}, transformers {machine.get('transformers', '?')}, "
        f"python {machine.get('python', '?')}",
    ]
    drafters = {m: fp for m, fp in (meta.get("drafters") or {}).items() if any(r["method"] == m for r in rows)}
    if drafters:
        L.append("- Drafter checkpoints: " + "; ".join(f"{m}: `{fp}`" for m, fp in drafters.items()))
    if datasets:
        counts = {}
        for ds in datasets:
            ns = sorted({r["num_prompts"] for r in rows if r["dataset"] == ds})
            counts[ds] = "/".join(str(n) for n in ns)
        L.append(
            "- Prompts per dataset: "
            + ", ".join(f"{ds} {n}" for ds, n in counts.items())
            + f" (the first {settings.get('num_prompts') or 'all'} in file order; "
            + "MT-Bench counts questions, both turns)"
        )
    seeds_t = sorted({r["seed"] for r in rows if r["seed"] is not None})
    if seeds_t:
        L.append(f"- Seeds at T > 0: {', '.join(str(s) for s in seeds_t)} (figures are means over seeds)")
    L += [
        "- Speedup: tokens/s over dcoco vanilla at the same dataset, temperature, seed and concurrency, measured "
        "in the same process on the same prompts. Concurrency C: all prompts submitted to dcoco's engine with "
        "`max_batch_size=C` (continuous batching); peers run one prompt at a time.",
    ]
    notes = meta.get("notes") or []
    if notes:
        L += ["", "Notes:", ""] + [f"- {n}" for n in notes]
    L.append("")
    if not rows:
        return "\n".join(L + ["No rows measured yet.", ""])

    L += ["## Output tokens/s (speedup over vanilla)", ""]
    for t in temps:
        for c in concs:
            body = []
            for m in methods:
                cells, tps, sps = [], [], []
                for ds in datasets:
                    a = agg.get((m, ds, t, c))
                    if a is None or a["tokens_per_second"] is None:
                        cells.append("–")
                        continue
                    tps.append(a["tokens_per_second"])
                    if a["speedup_vs_vanilla"] is not None:
                        sps.append(a["speedup_vs_vanilla"])
                    sp = "" if a["speedup_vs_vanilla"] is None else f" ({a['speedup_vs_vanilla']:.2f}×)"
                    cells.append(f"{a['tokens_per_second']:.1f}{sp}")
                if not tps:
                    continue
                msp = "" if not sps else f" ({mean(sps):.2f}×)"
                body.append([m] + cells + [f"{mean(tps):.1f}{msp}"])
            if body:
                short = {
                    ds: n
                    for ds in datasets
                    for n in [min((a["num_prompts"] for k2, a in agg.items() if k2[1:] == (ds, t, c)), default=c)]
                    if n < c
                }
                header = ["method"] + [ds + ("†" if ds in short else "") for ds in datasets] + ["mean"]
                L += [f"### T = {t:g}, concurrency {c}", ""] + markdown_table(header, body)
                if short:
                    L += [
                        "† fewer prompts than the concurrency: at most "
                        f"{', '.join(f'{n} ({ds})' for ds, n in short.items())} "
                        "requests were in flight.",
                        "",
                    ]

    if 0.0 in temps:
        body = []
        for c in concs:
            for m in methods:
                if m == "vanilla":
                    continue
                vals = [agg.get((m, ds, 0.0, c), {}).get("greedy_match_rate") for ds in datasets]
                if all(v is None for v in vals):
                    continue
                body.append([m, str(c)] + [_fmt(v) for v in vals] + [_fmt(_mean(vals))])
        if body:
            L += [
                "## Greedy match with dcoco vanilla (T = 0)",
                "",
                "Share of prompts whose output token ids equal dcoco vanilla's at the same concurrency. "
                + (
                    "With `--exact` a token's logits do not depend on the tokens sharing its pass: every "
                    "method's must be 1.00, in any dtype."
                    if settings.get("exact")
                    else "In bfloat16 the numerics depend on the batch shape and block length, so only "
                    "`--dtype float32` (or `--exact`) is an exactness check."
                ),
                "",
            ]
            L += markdown_table(["method", "concurrency"] + datasets + ["mean"], body)

    L += [
        "## Acceptance length τ",
        "",
        "τ = 1 + accepted / verification passes (1.0 for plain decoding); HF peers: counted target forwards.",
        "",
    ]
    for t in temps:
        body = []
        for m in methods:
            c = _min_conc(agg, m, t, concs)
            vals = [agg.get((m, ds, t, c), {}).get("acceptance_length") for ds in datasets]
            if c is None or all(v is None for v in vals):
                continue
            body.append([m, str(c)] + [_fmt(v) for v in vals] + [_fmt(_mean(vals))])
        if body:
            L += [f"### T = {t:g}", ""] + markdown_table(["method", "concurrency"] + datasets + ["mean"], body)

    body, width = [], 0
    for m in methods:
        for t in temps:
            c = _min_conc(agg, m, t, concs)
            for ds in datasets:
                pp = agg.get((m, ds, t, c), {}).get("per_position_acceptance")
                if pp:
                    width = max(width, len(pp))
                    body.append((m, ds, t, c, pp))
    if body:
        L += [
            "## Per-position acceptance",
            "",
            "Share of verification passes whose i-th draft token was accepted (sums to τ − 1).",
            "",
        ]
        L += markdown_table(
            ["method", "dataset", "T", "concurrency"] + [str(i + 1) for i in range(width)],
            [
                [m, ds, f"{t:g}", str(c)] + [_fmt(pp[i]) if i < len(pp) else "–" for i in range(width)]
                for m, ds, t, c, pp in body
            ],
        )

    sel = [r for r in rows if r.get("select_share") is not None]
    if sel:

        def row_id(r: dict, method: str) -> tuple:
            return method, r["dataset"], float(r["temperature"]), r.get("seed"), int(r["concurrency"])

        share = {row_id(r, r["method"]): r["select_share"] for r in sel}
        body, measured = [], set(methods)
        for m in methods:
            # the same rows of the family it extends (DCOCO: DFlash), when measured: what selection
            # costs there, so the rest is this family's own
            ref = select_baseline(m, measured)
            for t in temps:
                for c in concs:
                    mine = [
                        r
                        for r in sel
                        if r["method"] == m and float(r["temperature"]) == t and int(r["concurrency"]) == c
                    ]
                    if not mine:
                        continue
                    vals = [r["select_share"] for r in mine]
                    base = [(r["select_share"], share.get(row_id(r, ref))) for r in mine] if ref else []
                    net = [a - b for a, b in base if b is not None]
                    body.append(
                        [
                            m,
                            f"{t:g}",
                            str(c),
                            f"{100 * mean(vals):.2f}%",
                            f"{100 * max(vals):.2f}%",
                            f"{100 * mean(net):+.2f}%" if net else "–",
                        ]
                    )
        L += [
            "## Token selection time (DCOCO's corrector overhead)",
            "",
            "Share of the generation's wall time spent choosing the draft tokens from the drafter's logits: "
            "argmax or sampling (DFlash), the Markov head (DSpark), shortlist + pair scores + left-to-right "
            "walk (DCOCO); mean and worst row over datasets and seeds. `over dflash`: the mean difference "
            "from DFlash's share on the same dataset, seed and concurrency, when DFlash ran too (the "
            "same labelled variant where it ran: `dcoco/stage` against `dflash/stage`): the "
            "corrector's own cost.",
            "",
        ]
        L += markdown_table(["method", "T", "concurrency", "mean", "max", "over dflash"], body)

    looked = [r for r in rows if r.get("lookup_share") is not None]
    if looked:
        shares: dict[tuple, list[float]] = {}
        for r in looked:
            shares.setdefault((r["method"], r["dataset"], float(r["temperature"])), []).append(r["lookup_share"])
        L += [
            "## Prompt lookup first: the drafting steps it drafted",
            "",
            "Share of the requests' drafting steps that prompt lookup drafted (the rest: the trained drafter), "
            "mean over seeds and concurrencies.",
            "",
        ]
        L += markdown_table(
            ["method", "T"] + datasets,
            [
                [m, f"{t:g}"] + [_fmt(_mean(shares.get((m, ds, t), []))) for ds in datasets]
                for m in methods
                for t in temps
                if any((m, ds, t) in shares for ds in datasets)
            ],
        )

    L += ["## Plots", ""] + [f"![{p[:-4]}]({p})" for p in PLOTS] + [""]
    return "\n".join(L)


# -- plots -------------------------------------------------------------------------------------------
def _colors(methods: list[str]) -> dict[str, tuple]:
    import matplotlib

    cmap = matplotlib.colormaps["tab10"]
    return {m: cmap(i % 10) for i, m in enumerate(methods)}


def _empty(ax, text="no data") -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="gray")


def plot_speedup(rows: list[dict], meta: dict, path: Path) -> None:
    import matplotlib.pyplot as plt

    agg = aggregate(rows)
    methods, datasets, temps, concs = _orders(rows, meta)
    temps = temps or [0.0]
    colors = _colors(methods)
    fig, axes = plt.subplots(2, len(temps), figsize=(max(8.0, 5.2 * len(temps)), 8.0), squeeze=False, sharex=True)
    for j, t in enumerate(temps):
        for i, (field, ylabel) in enumerate(
            (("tokens_per_second", "output tokens/s"), ("speedup_vs_vanilla", "speedup over vanilla"))
        ):
            ax = axes[i][j]
            drawn = False
            for m in methods:
                xs, ys = [], []
                for c in concs:
                    v = _mean(agg[(m, ds, t, c)][field] for ds in datasets if (m, ds, t, c) in agg)
                    if v is not None:
                        xs.append(c)
                        ys.append(v)
                if not xs:
                    continue
                drawn = True
                style = (
                    dict(marker="s", linestyle="none", markersize=8) if m in PEERS else dict(marker="o", linewidth=2)
                )
                ax.plot(xs, ys, label=m, color=colors[m], **style)
            if not drawn:
                _empty(ax)
            if field == "speedup_vs_vanilla":
                ax.axhline(1.0, color="gray", linewidth=1, linestyle=":")
                ax.set_xlabel("concurrency (requests in flight)")
            ax.set_xscale("log", base=2)
            ax.set_xticks(concs or [1])
            ax.set_xticklabels([str(c) for c in concs or [1]])
            ax.set_ylabel(ylabel)
            ax.grid(True, alpha=0.3)
            if i == 0:
                ax.set_title(f"T = {t:g} (mean over datasets)")
    _finish(fig, axes, "Throughput and speedup vs concurrency", meta, path)


def plot_per_position(rows: list[dict], meta: dict, path: Path) -> None:
    import matplotlib.pyplot as plt

    agg = aggregate(rows)
    methods, datasets, temps, concs = _orders(rows, meta)
    colors = _colors(methods)
    styles = ["-", "--", ":", "-."]
    n = max(1, len(datasets))
    fig, axes = plt.subplots(1, n, figsize=(max(8.0, 4.6 * n), 4.8), squeeze=False, sharey=True)
    for j, ds in enumerate(datasets or ["(none)"]):
        ax = axes[0][j]
        drawn = False
        for m in methods:
            for ti, t in enumerate(temps):
                c = _min_conc(agg, m, t, concs)
                pp = agg.get((m, ds, t, c), {}).get("per_position_acceptance")
                if not pp:
                    continue
                drawn = True
                ax.plot(
                    range(1, len(pp) + 1),
                    pp,
                    marker="o",
                    color=colors[m],
                    linestyle=styles[ti % len(styles)],
                    label=f"{m}, T={t:g}",
                )
        if not drawn:
            _empty(ax, "no drafted tokens")
        ax.set_title(ds)
        ax.set_xlabel("draft position")
        ax.set_ylim(0, 1)
        ax.grid(True, alpha=0.3)
        if drawn:
            ax.xaxis.get_major_locator().set_params(integer=True)
    axes[0][0].set_ylabel("share of passes accepting position i")
    _finish(fig, axes, "Per-position acceptance", meta, path)


def plot_acceptance_length(rows: list[dict], meta: dict, path: Path) -> None:
    import matplotlib.pyplot as plt

    agg = aggregate(rows)
    methods, datasets, temps, concs = _orders(rows, meta)
    temps = temps or [0.0]
    colors = _colors(methods)
    panel = max(4.5, 1.4 * len(datasets) + 1.5)
    fig, axes = plt.subplots(1, len(temps), figsize=(max(8.0, panel * len(temps)), 5.0), squeeze=False, sharey=True)
    for j, t in enumerate(temps):
        ax = axes[0][j]
        shown = [
            m
            for m in methods
            if any(
                agg.get((m, ds, t, _min_conc(agg, m, t, concs)), {}).get("acceptance_length") is not None
                for ds in datasets
            )
        ]
        width = 0.8 / max(1, len(shown))
        for i, m in enumerate(shown):
            c = _min_conc(agg, m, t, concs)
            vals = [agg.get((m, ds, t, c), {}).get("acceptance_length") for ds in datasets]
            xs = [d + (i - (len(shown) - 1) / 2) * width for d in range(len(datasets))]
            bars = ax.bar(
                [x for x, v in zip(xs, vals) if v is not None],
                [v for v in vals if v is not None],
                width=width,
                color=colors[m],
                label=m,
            )
            ax.bar_label(bars, fmt="%.2f", fontsize=7, padding=1)
        if not shown:
            _empty(ax)
        ax.set_xticks(range(len(datasets)))
        ax.set_xticklabels(datasets)
        ax.axhline(1.0, color="gray", linewidth=1, linestyle=":")
        ax.set_title(f"T = {t:g}")
        ax.grid(True, axis="y", alpha=0.3)
        ax.margins(y=0.12)
    axes[0][0].set_ylabel("acceptance length τ (tokens per target forward)")
    _finish(fig, axes, "Acceptance length per dataset", meta, path)


def _subtitle(meta: dict) -> str:
    s = meta.get("settings", {}) or {}
    m = meta.get("machine", {}) or {}
    return (
        f"{s.get('model', '?')}, {s.get('dtype', '?')}, max {s.get('max_new_tokens', '?')} new tokens\n"
        f"{m.get('cpu', '?')}, {m.get('torch_threads', '?')} threads, commit {meta.get('git_commit', '?')}"
    )


def _finish(fig, axes, title: str, meta: dict, path: Path) -> None:
    """Title + run details on top, one shared legend below the panels, then save."""
    import matplotlib.pyplot as plt

    handles, labels = [], []
    for ax in axes.flat:
        for h, l in zip(*ax.get_legend_handles_labels()):
            if l not in labels:
                handles.append(h)
                labels.append(l)
    ncol = max(1, min(len(labels), 4))
    rows = -(-len(labels) // ncol) if labels else 0
    bottom = 0.03 + 0.045 * rows * (8.0 / fig.get_figheight()) if labels else 0.0
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=ncol, frameon=False, fontsize=9)
    fig.suptitle(f"{title}\n{_subtitle(meta)}", fontsize=9)
    top = 1 - 0.5 / fig.get_figheight()
    fig.tight_layout(rect=(0, bottom, 1, top))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(out: Path, rows: list[dict], meta: dict) -> None:
    """Write results.md and the PNG plots into `out` (each written to a temp name, then renamed)."""
    import os

    import matplotlib

    matplotlib.use("Agg", force=True)
    out = Path(out)
    md = out / "results.md"
    tmp = out / ".results.md.tmp"
    tmp.write_text(markdown(rows, meta), encoding="utf-8")
    os.replace(tmp, md)
    for name, fn in zip(PLOTS, (plot_speedup, plot_per_position, plot_acceptance_length)):
        tmp = out / f".{name[:-4]}.tmp.png"
        fn(rows, meta, tmp)
        os.replace(tmp, out / name)
