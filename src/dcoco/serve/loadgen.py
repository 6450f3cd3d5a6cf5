"""Load generator: a closed-loop concurrency sweep against a running `dcoco serve`, and the same sweep
through the offline engine in this process for comparison.

    python -m dcoco.serve.loadgen --url http://127.0.0.1:8000 --concurrency 1,4,8,16,32 \\
        --num-requests 64 --max-tokens 128 --out bench-results/serve \\
        [--offline --model DIR --method ngram --num-speculative-tokens 5 --dtype bfloat16]

Server mode: at concurrency c, c client threads each send their next request as soon as the previous
one is answered (streaming chat completions, `stream_options.include_usage`), until `--num-requests`
are done. Recorded per level: output tokens/s (sum of `usage.completion_tokens` over the level's wall
time), requests/s, time to first token and end-to-end latency (median, p90), errors, and from the
server's `/metrics` the level's speculative counters (mean acceptance length as vLLM reports it,
`1 + accepted / drafts`).

Offline mode (`--offline`): the same prompts and sampling through `SpeculativeEngine.generate` with
`max_batch_size = c` and all requests submitted at once (the engine keeps c in flight), for each of
`--offline-variants`: `vanilla` (no drafter), `fixed` (the method at a fixed draft length) and
`load-aware` (the method with `LoadAwarePolicy`). This measures what load-aware drafting buys and
what the HTTP layer costs.

Writes `loadgen.json` (settings, machine, rows), `loadgen.md` (tables) and `loadgen.png` (output
tokens/s against concurrency, one line per mode) to `--out`. Only the standard library talks HTTP.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import sys
import threading
import time
from pathlib import Path
from typing import Optional, Sequence
from urllib.parse import urlparse

#: default prompts: short chat requests, a few with text to reuse (where n-gram drafting shines)
BUILTIN_PROMPTS = [
    "Write a haiku about rain.",
    "Explain what a hash table is in three sentences.",
    "Rewrite this sentence in the passive voice: The cat chased the mouse across the kitchen.",
    "Add type hints to this Python function and return the whole function:\n\ndef add(a, b):\n    return a + b\n",
    "List five fruits that are red.",
    "What is the capital of France? Answer in one sentence.",
    "Translate to French: Good morning, how are you today?",
    "Fix the bug and return the corrected code:\n\ndef mean(xs):\n    return sum(xs) / len(x)\n",
    "Give three tips for writing clear emails.",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "Convert this list to a JSON array: apples, pears, plums, cherries.",
    "Write a short limerick about a programmer.",
    "Repeat the following words exactly, separated by commas: red, green, blue, yellow, red, green, blue, yellow.",
    "Describe the water cycle for a ten-year-old.",
    "Write a SQL query that selects all users older than 30 from a table named users.",
    "Name three planets of the solar system and one fact about each.",
]


# -- prompts ------------------------------------------------------------------------------------
def load_prompts(spec: str, n: Optional[int]) -> list[dict]:
    """Prompts as `{"messages": [...]}` (chat) or `{"token_ids": [...]}` (completions)."""
    if spec == "builtin":
        return [{"messages": [{"role": "user", "content": p}]} for p in BUILTIN_PROMPTS]
    from ..datasets import load_prompts as dataset_prompts  # mtbench, humaneval, sharegpt, .jsonl

    out = []
    for p in dataset_prompts(spec, n):
        out.append({"messages": p.messages} if p.messages is not None else {"token_ids": list(p.token_ids)})
    return out


def _pct(xs: Sequence[float], q: float) -> Optional[float]:
    if not xs:
        return None
    xs = sorted(xs)
    i = min(len(xs) - 1, max(0, int(round(q * (len(xs) - 1)))))
    return xs[i]


# -- HTTP (stdlib) --------------------------------------------------------------------------------
class Client:
    def __init__(self, url: str, timeout: float = 600.0):
        u = urlparse(url.rstrip("/"))
        self.host, self.port = u.hostname or "127.0.0.1", u.port or (443 if u.scheme == "https" else 80)
        self.https = u.scheme == "https"
        self.prefix = u.path.rstrip("/")
        if self.prefix.endswith("/v1"):
            self.prefix = self.prefix[:-3]
        self.timeout = timeout

    def _conn(self):
        cls = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
        return cls(self.host, self.port, timeout=self.timeout)

    def get(self, path: str) -> tuple[int, str]:
        c = self._conn()
        try:
            c.request("GET", self.prefix + path)
            r = c.getresponse()
            return r.status, r.read().decode("utf-8", "replace")
        finally:
            c.close()

    def stream(self, path: str, body: dict) -> dict:
        """POST a streaming request; returns timings, usage and the error (if any)."""
        c = self._conn()
        t0 = time.perf_counter()
        first = None
        usage = None
        text = []
        try:
            c.request("POST", self.prefix + path, body=json.dumps(body), headers={"Content-Type": "application/json"})
            r = c.getresponse()
            if r.status != 200:
                return {
                    "error": f"HTTP {r.status}: {r.read()[:300].decode('utf-8', 'replace')}",
                    "e2e_s": time.perf_counter() - t0,
                }
            while True:
                line = r.readline()
                if not line:
                    break
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    return {"error": obj["error"].get("message", "error"), "e2e_s": time.perf_counter() - t0}
                for ch in obj.get("choices") or []:
                    piece = (ch.get("delta") or {}).get("content") if "delta" in ch else ch.get("text")
                    if piece:
                        if first is None:
                            first = time.perf_counter() - t0
                        text.append(piece)
                if obj.get("usage"):
                    usage = obj["usage"]
        except (OSError, http.client.HTTPException, json.JSONDecodeError) as e:
            return {"error": f"{type(e).__name__}: {e}", "e2e_s": time.perf_counter() - t0}
        finally:
            c.close()
        e2e = time.perf_counter() - t0
        return {
            "ttft_s": first if first is not None else e2e,
            "e2e_s": e2e,
            "text": "".join(text),
            "completion_tokens": (usage or {}).get("completion_tokens", 0),
            "error": None,
        }


def request_body(prompt: dict, model: str, args) -> tuple[str, dict]:
    body = {
        "model": model,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.ignore_eos:
        body["ignore_eos"] = True
    if args.seed is not None:
        body["seed"] = args.seed
    if "messages" in prompt:
        return "/v1/chat/completions", dict(body, messages=prompt["messages"])
    return "/v1/completions", dict(body, prompt=prompt["token_ids"])


def _spec_counters(client: Client) -> dict[str, float]:
    from .metrics import parse_prometheus

    status, text = client.get("/metrics")
    if status != 200:
        return {}
    m = parse_prometheus(text)
    return {
        k: m.get(f"dcoco:spec_decode_{k}_total", 0.0) for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
    }


def run_server_level(client: Client, model: str, prompts: list[dict], conc: int, args) -> dict:
    before = _spec_counters(client)
    lock = threading.Lock()
    next_i = [0]
    results: list[dict] = []

    def worker():
        while True:
            with lock:
                i = next_i[0]
                if i >= args.num_requests:
                    return
                next_i[0] += 1
            path, body = request_body(prompts[i % len(prompts)], model, args)
            res = client.stream(path, body)
            with lock:
                results.append(res)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, daemon=True) for _ in range(conc)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    after = _spec_counters(client)
    ok = [r for r in results if not r["error"]]
    toks = sum(r["completion_tokens"] for r in ok)
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    row = {
        "mode": "server",
        "concurrency": conc,
        "requests": len(results),
        "errors": len(results) - len(ok),
        "output_tokens": toks,
        "wall_s": round(wall, 4),
        "output_tokens_per_s": round(toks / wall, 3) if wall > 0 else 0.0,
        "requests_per_s": round(len(ok) / wall, 4) if wall > 0 else 0.0,
        "ttft_p50_s": _round(_pct([r["ttft_s"] for r in ok], 0.5)),
        "ttft_p90_s": _round(_pct([r["ttft_s"] for r in ok], 0.9)),
        "e2e_p50_s": _round(_pct([r["e2e_s"] for r in ok], 0.5)),
        "e2e_p90_s": _round(_pct([r["e2e_s"] for r in ok], 0.9)),
        "num_drafts": int(d.get("num_drafts", 0)),
        "draft_tokens": int(d.get("num_draft_tokens", 0)),
        "accepted_tokens": int(d.get("num_accepted_tokens", 0)),
    }
    row["mean_acceptance_length"] = (
        _round(1 + row["accepted_tokens"] / row["num_drafts"]) if row["num_drafts"] else None
    )
    errs = [r["error"] for r in results if r["error"]]
    if errs:
        row["first_error"] = errs[0]
    return row


def _round(x: Optional[float], nd: int = 4) -> Optional[float]:
    return None if x is None else round(x, nd)


# -- offline ---------------------------------------------------------------------------------------
def run_offline(args, prompts: list[dict], concs: list[int]) -> tuple[list[dict], dict]:
    import torch

    from ..draft_policy import LoadAwarePolicy
    from ..engine import SpeculativeEngine
    from ..sampling import SamplingParams
    from ..speculative import SpeculativeConfig, config_of_args, load_drafter
    from ..target import Target

    if args.threads:
        torch.set_num_threads(args.threads)
    target = Target.from_pretrained(args.model, dtype=args.dtype, device=args.device)
    cfg = SpeculativeConfig.parse(config_of_args(args))
    drafter = load_drafter(cfg, target)
    ids = [target.encode(p["messages"] if "messages" in p else p["token_ids"]) for p in prompts]
    reqs = [ids[i % len(ids)] for i in range(args.num_requests)]
    sp = SamplingParams(
        temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed, ignore_eos=args.ignore_eos
    )
    variants = [v for v in args.offline_variants.split(",") if v]
    rows = []

    def make(variant: str, conc: int) -> SpeculativeEngine:
        if variant == "vanilla" or drafter is None:
            return SpeculativeEngine(target, None, None, conc)
        policy = LoadAwarePolicy(args.draft_token_budget) if variant == "load-aware" else None
        return SpeculativeEngine(target, drafter, cfg.num_speculative_tokens, conc, draft_policy=policy)

    make("vanilla", 1).generate([reqs[0]], SamplingParams(max_tokens=4))  # warm-up, untimed
    k = make("fixed", 1).num_speculative_tokens
    for conc in concs:
        for variant in variants:
            if variant not in ("vanilla", "fixed", "load-aware"):
                raise SystemExit(f"loadgen: unknown offline variant {variant!r}")
            _, st = make(variant, conc).generate(reqs, sp)
            rows.append(
                {
                    "mode": f"offline-{variant}",
                    "concurrency": conc,
                    "requests": len(reqs),
                    "errors": 0,
                    "output_tokens": st.output_tokens,
                    "wall_s": round(st.wall_s, 4),
                    "output_tokens_per_s": round(st.tokens_per_second, 3),
                    "requests_per_s": round(len(reqs) / st.wall_s, 4) if st.wall_s > 0 else 0.0,
                    "num_drafts": st.num_drafts,
                    "draft_tokens": st.drafted,
                    "accepted_tokens": st.accepted,
                    "verify_passes": st.verify_passes,
                    "mean_acceptance_length": _round(1 + st.accepted / st.num_drafts) if st.num_drafts else None,
                    "tokens_per_pass": _round(st.acceptance_length),
                }
            )
            print(f"loadgen: offline {variant:10s} c={conc:3d}: {st.tokens_per_second:8.1f} tok/s", file=sys.stderr)
    for r in rows:  # speedup over vanilla at the same concurrency
        base = next((b for b in rows if b["mode"] == "offline-vanilla" and b["concurrency"] == r["concurrency"]), None)
        if base and base["output_tokens_per_s"]:
            r["speedup_vs_vanilla"] = round(r["output_tokens_per_s"] / base["output_tokens_per_s"], 3)
    info = {
        "model": args.model or "SmolLM2-135M-Instruct (embedded)",
        "method": cfg.method,
        "num_speculative_tokens": k,
        "dtype": args.dtype,
        "device": args.device,
        "draft_token_budget": args.draft_token_budget,
        "load_aware_table": LoadAwarePolicy(args.draft_token_budget).table(k, concs) if drafter is not None else None,
    }
    return rows, info


# -- report ----------------------------------------------------------------------------------------
def machine() -> dict:
    import torch

    from ..bench.system import cpu_model, git_commit

    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "git_commit": git_commit(),
    }


def _f(x, nd=2) -> str:
    return "-" if x is None else (f"{x:.{nd}f}" if isinstance(x, float) else str(x))


def markdown(result: dict) -> str:
    s = result["settings"]
    m = result["machine"]
    lines = [
        f"# dcoco serving load test{' (' + s['label'] + ')' if s.get('label') else ''}",
        "",
        f"- command: `{s['command']}`",
        f"- {s['num_requests']} requests per level, max_tokens {s['max_tokens']}, temperature {s['temperature']}, "
        f"ignore_eos {s['ignore_eos']}, prompts `{s['dataset']}`",
        f"- machine: {m['cpu']} ({m['cores']} cores, torch threads {m['torch_threads']}), torch {m['torch']}, "
        f"git {m['git_commit']}",
    ]
    if result.get("server"):
        lines.append(f"- server: {json.dumps(result['server'])}")
    if result.get("offline"):
        lines.append(f"- offline: {json.dumps(result['offline'])}")
    lines += [
        "",
        "Output tokens/s = sum of completion tokens / wall time of the level. Acceptance length is "
        "vLLM's mean `1 + accepted / drafts` (passes that drafted nothing are not counted).",
        "",
    ]
    head = (
        "| mode | concurrency | requests | errors | output tok/s | req/s | speedup vs offline vanilla "
        "| TTFT p50 (s) | TTFT p90 (s) | e2e p50 (s) | e2e p90 (s) | acceptance length |"
    )
    lines += [head, "|" + "|".join(["---"] * (head.count("|") - 1)) + "|"]
    van = {r["concurrency"]: r["output_tokens_per_s"] for r in result["rows"] if r["mode"] == "offline-vanilla"}
    for r in sorted(result["rows"], key=lambda r: (r["mode"] != "server", r["mode"], r["concurrency"])):
        sp = r.get("speedup_vs_vanilla")
        if sp is None and van.get(r["concurrency"]):
            sp = r["output_tokens_per_s"] / van[r["concurrency"]]
        lines.append(
            f"| {r['mode']} | {r['concurrency']} | {r['requests']} | {r['errors']} | "
            f"{_f(r['output_tokens_per_s'], 1)} | "
            f"{_f(r['requests_per_s'], 2)} | {_f(sp)} | {_f(r.get('ttft_p50_s'), 3)} | {_f(r.get('ttft_p90_s'), 3)} | "
            f"{_f(r.get('e2e_p50_s'), 3)} | {_f(r.get('e2e_p90_s'), 3)} | {_f(r.get('mean_acceptance_length'))} |"
        )
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    s = result["settings"]
    modes = sorted({r["mode"] for r in result["rows"]}, key=lambda m: (m != "server", m))
    series = {m: {r["concurrency"]: r["output_tokens_per_s"] for r in result["rows"] if r["mode"] == m} for m in modes}
    plot_series(
        series,
        f"dcoco serving: {s['num_requests']} requests x {s['max_tokens']} tokens"
        + (f" ({s['label']})" if s.get("label") else ""),
        path,
    )


def plot_series(series: dict[str, dict[int, float]], title: str, path: Path) -> None:
    """Output tokens/s against concurrency, one line per series."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.2, 4.6))
    family = {n: n.split(" ")[0].split("-")[0] for n in series}  # "dcoco-load-aware (HTTP)" -> "dcoco"
    colours = {f: f"C{i % 10}" for i, f in enumerate(dict.fromkeys(family.values()))}  # one colour per method
    for name, pts in series.items():
        cs = sorted(pts)
        ax.plot(
            cs,
            [pts[c] for c in cs],
            label=name,
            color=colours[family[name]],
            linestyle="--" if "offline" in name else "-",
            marker="^" if "load-aware" in name else "o",
        )
    concs = sorted({c for pts in series.values() for c in pts})
    if concs and max(concs) > 1:
        ax.set_xscale("log", base=2)
    ax.set_xticks(concs)
    ax.set_xticklabels([str(c) for c in concs])
    ax.set_xlabel("concurrency (requests in flight)")
    ax.set_ylabel("output tokens/s")
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def compare(dirs: Sequence[str], out: Path) -> Path:
    """One table and one plot from several loadgen runs (each named by its --label): output tokens/s
    per concurrency for every server and offline series, and its ratio to offline vanilla."""
    series: dict[str, dict[int, float]] = {}
    accept: dict[str, dict[int, Optional[float]]] = {}
    settings = None
    for d in dirs:
        path = Path(d) / "loadgen.json"
        if not path.is_file():
            raise SystemExit(f"loadgen: no loadgen.json in {d}")
        res = json.loads(path.read_text())
        settings = settings or res["settings"]
        label = res["settings"].get("label") or Path(d).name
        for r in res["rows"]:
            name = (
                "vanilla (offline engine)"
                if r["mode"] == "offline-vanilla"
                else (f"{label} (HTTP)" if r["mode"] == "server" else f"{label} ({r['mode']})")
            )
            series.setdefault(name, {})[r["concurrency"]] = r["output_tokens_per_s"]
            accept.setdefault(name, {})[r["concurrency"]] = r.get("mean_acceptance_length")
    series = dict(sorted(series.items(), key=lambda kv: not kv[0].startswith("vanilla")))  # baselines first
    concs = sorted({c for pts in series.values() for c in pts})
    van = series.get("vanilla (offline engine)", {})
    lines = [
        "# dcoco serving sweep",
        "",
        f"- {settings['num_requests']} requests per level, max_tokens {settings['max_tokens']}, temperature "
        f"{settings['temperature']}, prompts `{settings['dataset']}`; runs: "
        + ", ".join(f"`{Path(d).name}`" for d in dirs),
        "",
        "Output tokens/s (ratio to the offline vanilla engine at the same concurrency; acceptance length):",
        "",
        "| series | " + " | ".join(f"C={c}" for c in concs) + " |",
        "|---|" + "---:|" * len(concs),
    ]
    for name, pts in series.items():
        cells = []
        for c in concs:
            if c not in pts:
                cells.append("-")
                continue
            cell = f"{pts[c]:.1f}"
            if van.get(c) and name != "vanilla (offline engine)":
                cell += f" ({pts[c] / van[c]:.2f}x"
                a = accept[name].get(c)
                cell += f"; τ {a:.2f})" if a else ")"
            cells.append(cell)
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    out.mkdir(parents=True, exist_ok=True)
    md = out / "sweep.md"
    md.write_text("\n".join(lines) + "\n")
    plot_series(
        series,
        f"dcoco serving sweep: {settings['num_requests']} requests x {settings['max_tokens']} tokens",
        out / "sweep.png",
    )
    return md


# -- main --------------------------------------------------------------------------------------------
def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dcoco.serve.loadgen", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default=None, help="server base URL, e.g. http://127.0.0.1:8000 (omit for --offline only)")
    p.add_argument("--concurrency", default="1,4,8,16,32", help="comma-separated levels")
    p.add_argument("--num-requests", type=int, default=64, help="requests per level")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true", help="always generate max_tokens tokens")
    p.add_argument("--dataset", default="builtin", help="builtin, mtbench, humaneval, sharegpt or a .jsonl file")
    p.add_argument("--model-name", default=None, help="model name to request (default: the server's first)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--label", default="", help="a label for the report title (e.g. 'smoke run')")
    p.add_argument(
        "--offline", action="store_true", help="also run the sweep through the offline engine in this process"
    )
    p.add_argument("--offline-variants", default="vanilla,fixed,load-aware")
    p.add_argument("--model", default=None, help="offline: HF model directory (default: embedded SmolLM2)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32", "float16"])
    p.add_argument("--device", default="cpu")
    from ..families import MODEL_FREE
    from ..speculative import add_spec_args

    add_spec_args(p, default_method=MODEL_FREE.name)  # offline: as in dcoco serve
    p.add_argument("--draft-token-budget", type=int, default=32)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument(
        "--compare",
        default=None,
        metavar="DIR,DIR,...",
        help="only combine earlier runs' loadgen.json into --out/sweep.md and sweep.png",
    )
    args = p.parse_args(argv)
    if args.compare:
        return args
    if not args.url and not args.offline:
        p.error("give --url, --offline or both")
    if args.dtype == "auto":  # the offline engine's, recorded as run
        from ..target import auto_dtype

        args.dtype = auto_dtype(args.device)
    try:
        args.concurrency_levels = [int(x) for x in args.concurrency.split(",") if x.strip()]
    except ValueError:
        p.error(f"--concurrency must be comma-separated integers, got {args.concurrency!r}")
    if not args.concurrency_levels or min(args.concurrency_levels) < 1:
        p.error("--concurrency levels must be >= 1")
    if args.num_requests < 1 or args.max_tokens < 1:
        p.error("--num-requests and --max-tokens must be >= 1")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    if args.compare:
        md = compare([d for d in args.compare.split(",") if d], out)
        print(md.read_text(), end="")
        return 0
    out.mkdir(parents=True, exist_ok=True)
    prompts = load_prompts(args.dataset, None if args.dataset == "builtin" else args.num_requests)
    concs = args.concurrency_levels
    result = {
        "settings": {
            "command": "python -m dcoco.serve.loadgen " + " ".join(sys.argv[1:] if argv is None else argv),
            "url": args.url,
            "concurrency": concs,
            "num_requests": args.num_requests,
            "max_tokens": args.max_tokens,
            "temperature": args.temperature,
            "seed": args.seed,
            "ignore_eos": args.ignore_eos,
            "dataset": args.dataset,
            "label": args.label,
            "time": time.strftime("%Y-%m-%d %H:%M:%S"),
        },
        "machine": machine(),
        "server": None,
        "offline": None,
        "rows": [],
    }
    if args.url:
        client = Client(args.url)
        status, text = client.get("/health")
        if status != 200:
            raise SystemExit(f"loadgen: {args.url}/health answered {status}: {text[:200]}")
        result["server"] = json.loads(text)
        model = args.model_name
        if model is None:
            _, text = client.get("/v1/models")
            model = json.loads(text)["data"][0]["id"]
        path, body = request_body(prompts[0], model, args)  # warm-up, untimed
        client.stream(path, dict(body, max_tokens=4))
        for conc in concs:
            row = run_server_level(client, model, prompts, conc, args)
            result["rows"].append(row)
            print(
                f"loadgen: server             c={conc:3d}: {row['output_tokens_per_s']:8.1f} tok/s, "
                f"{row['errors']} errors, TTFT p50 {row['ttft_p50_s']}s",
                file=sys.stderr,
            )
    if args.offline:
        rows, info = run_offline(args, prompts, concs)
        result["rows"] += rows
        result["offline"] = info
    (out / "loadgen.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "loadgen.md").write_text(markdown(result))
    plot(result, out / "loadgen.png")
    print(f"loadgen: wrote {out / 'loadgen.json'}, loadgen.md, loadgen.png", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
