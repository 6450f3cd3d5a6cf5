"""Running benchmark rows, and resuming a run.

One row per (method, dataset, temperature, seed, concurrency). Engine methods (vanilla, ngram, trained
drafters) run through `SpeculativeEngine(target, drafter, k, max_batch_size=C)` with every prompt of the
dataset submitted at once: the engine admits up to C at a time and refills free slots between steps
(continuous batching); a row's wall time covers the whole dataset, prefill included. With fewer
prompts than C, at most that many are in flight (results.md marks those columns). Peers run one
prompt at a time, at concurrency 1 only. All methods run in one process on the same prompt token ids,
with one untimed warm-up generation per method before its first row.

Files written to the output directory:

- ``results.json``: the rows (`ROW_KEYS`), rewritten atomically (temp file + ``os.replace``) after
  every row, so an interrupted run leaves a valid partial result;
- ``run.json``: the settings the rows depend on (`BenchConfig.settings`), the machine, every command
  line that wrote to the directory, and notes (skipped peers, skipped prompts);
- ``outputs/<method>__<dataset>__T<t>__s<seed>__c<C>.json``: each row's generated token ids and texts,
  used for the greedy match rate (also on re-runs) and for inspection;
- ``mtbench_turn1_answers.json``: the target's greedy vanilla answers to MT-Bench turn 1 (the
  assistant turn of the turn-2 prompts), reused while model, dtype, device and max-new-tokens match;
- ``results.md`` and the PNG plots (`dcoco.bench.report`).

Re-running with the same ``--out`` keeps the rows already in results.json (matched by key) and runs only
the missing ones; it refuses to mix rows made with different settings, and re-measures a trained
method whose drafter checkpoint changed (`drafter_fingerprint`, kept in run.json). Derived columns
(`speedup_vs_vanilla`, `greedy_match_rate`) are recomputed over all rows at every write.

Per-prompt seeds at T > 0: prompt i of a row with seed s samples with ``s * 1_000_003 + i``; greedy rows
(T = 0) have seed null and run once.
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from ..datasets import DatasetError, Prompt, dataset_name, load_prompts
from ..errors import ConfigError, PromptTooLongError
from .config import PEERS, BenchConfig
from .peers import Unavailable, unavailable_reason
from .system import device_label, git_commit, machine_info, shown_path

ROW_KEYS = (
    "method",
    "dataset",
    "temperature",
    "seed",
    "concurrency",
    "num_prompts",
    "output_tokens",
    "wall_s",
    "tokens_per_second",
    "speedup_vs_vanilla",
    "acceptance_length",
    "acceptance_rate",
    "per_position_acceptance",
    "greedy_match_rate",
    "device",
    "dtype",
    "threads",
    "git_commit",
)
# block drafters: share of the wall time spent choosing draft tokens; prompt lookup first: share of the
# drafting steps prompt lookup drafted
OPTIONAL_ROW_KEYS = ("select_share", "lookup_share")
KEY_FIELDS = ("method", "dataset", "temperature", "seed", "concurrency")
WARMUP_TOKENS = 8


def row_key(row: dict) -> tuple:
    t = float(row["temperature"])
    return (
        row["method"],
        row["dataset"],
        t,
        None if row["seed"] is None else int(row["seed"]),
        int(row["concurrency"]),
    )


def prompt_seed(seed: Optional[int], index: int) -> Optional[int]:
    return None if seed is None else int(seed) * 1_000_003 + index


@dataclass
class RowSpec:
    method: str
    dataset: str  # reported name
    temperature: float
    seed: Optional[int]
    concurrency: int

    @property
    def key(self) -> tuple:
        return (self.method, self.dataset, float(self.temperature), self.seed, self.concurrency)

    @property
    def slug(self) -> str:
        seed = "-" if self.seed is None else self.seed
        s = f"{self.method}__{self.dataset}__T{self.temperature:g}__s{seed}__c{self.concurrency}"
        return re.sub(r"[^A-Za-z0-9_.=-]", "_", s)

    def label(self) -> str:
        seed = "" if self.seed is None else f" seed={self.seed}"
        return f"{self.method} {self.dataset} T={self.temperature:g}{seed} C={self.concurrency}"


def plan(cfg: BenchConfig, datasets: list[str]) -> list[RowSpec]:
    """Rows in run order: dataset, temperature, seed, concurrency, then method (vanilla first), so the
    methods of one condition run back to back. Peers only at concurrency 1."""
    rows = []
    for ds in datasets:
        for t in cfg.temperatures:
            for seed in [None] if t == 0 else cfg.seeds:
                for c in cfg.concurrency:
                    for m in cfg.methods:
                        if m in PEERS and c != 1:
                            continue
                        rows.append(RowSpec(m, ds, float(t), seed, c))
    return rows


# -- files -------------------------------------------------------------------------------------------
def write_json_atomic(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=1)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def read_json(path: Path, default=None):
    if not path.exists():
        return default
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path} is not valid JSON ({e}); move it away or pick another --out") from None


def load_existing(out: Path, settings: dict) -> tuple[list[dict], dict]:
    """Rows and run metadata already in `out`; refuse rows made with other settings."""
    rows = read_json(out / "results.json", [])
    meta = read_json(out / "run.json", {})
    if not isinstance(rows, list) or not all(isinstance(r, dict) and set(KEY_FIELDS) <= set(r) for r in rows):
        raise ConfigError(f"{out / 'results.json'} is not a list of benchmark rows; move it away or pick another --out")
    if rows and meta.get("settings") != settings:
        old = meta.get("settings") or {}
        diff = [f"{k}: {old.get(k)!r} -> {v!r}" for k, v in settings.items() if old.get(k) != v] or ["no run.json"]
        raise ConfigError(f"{out} holds results made with other settings ({'; '.join(diff)}); use another --out")
    return rows, meta


def drafter_fingerprint(method: str, path: Optional[str]) -> Optional[str]:
    """Identity of the checkpoint a trained method runs with (its directory plus a hash of its config
    and weight files' sizes and times), so a re-run notices a retrained drafter. None for model-free
    methods and peers."""
    import hashlib

    from ..families import shipped_checkpoint, trained_families
    from ..speculative import split_label

    base = split_label(method)[0]
    if base not in trained_families() or method in PEERS:
        return None
    if path is None:
        found = shipped_checkpoint(base)
        if found is None:
            return "shipped"
        path = str(found)
    root = Path(path)
    h = hashlib.sha1()
    for f in sorted(root.iterdir()) if root.is_dir() else []:
        if f.is_file():
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns};".encode())
            if f.name == "config.json":
                h.update(f.read_bytes())
    return f"{shown_path(root)}@{h.hexdigest()[:12]}"


# -- derived columns ---------------------------------------------------------------------------------
class Outputs:
    """Per-row token ids on disk (``outputs/``), cached in memory."""

    def __init__(self, out: Path):
        self.dir = out / "outputs"
        self._cache: dict[str, Optional[list]] = {}

    def path(self, spec: RowSpec) -> Path:
        return self.dir / f"{spec.slug}.json"

    def save(self, spec: RowSpec, prompts: list[Prompt], token_ids: list[list[int]], texts: list[str]) -> None:
        obj = {
            "key": dict(zip(KEY_FIELDS, spec.key)),
            "prompts": [p.id for p in prompts],
            "token_ids": token_ids,
            "texts": texts,
        }
        write_json_atomic(self.path(spec), obj)
        self._cache[spec.slug] = token_ids

    def token_ids(self, spec: RowSpec) -> Optional[list]:
        if spec.slug not in self._cache:
            obj = None
            try:
                obj = json.loads(self.path(spec).read_text(encoding="utf-8"))
            except (OSError, json.JSONDecodeError):
                pass
            self._cache[spec.slug] = obj.get("token_ids") if isinstance(obj, dict) else None
        return self._cache[spec.slug]


def greedy_match_rate(ids: list[list[int]], ref: list[list[int]]) -> Optional[float]:
    if not ids or len(ids) != len(ref):
        return None
    return round(sum(a == b for a, b in zip(ids, ref)) / len(ids), 4)


def derive(rows: list[dict], outputs: Optional[Outputs] = None) -> list[dict]:
    """Fill `speedup_vs_vanilla` (tokens/s over dcoco vanilla's in the same dataset, temperature, seed
    and concurrency) and, at T = 0, `greedy_match_rate` against vanilla's outputs at the same
    concurrency; null where there is no vanilla row to compare with."""
    vanilla = {row_key(r)[1:]: r for r in rows if r["method"] == "vanilla"}
    for r in rows:
        key = row_key(r)
        ref = vanilla.get(key[1:])
        tps = r.get("tokens_per_second")
        if ref is not None and ref.get("tokens_per_second") and tps is not None:
            r["speedup_vs_vanilla"] = round(tps / ref["tokens_per_second"], 4)
        else:
            r["speedup_vs_vanilla"] = None
        if key[2] != 0:
            r["greedy_match_rate"] = None
        elif r["method"] == "vanilla":
            r["greedy_match_rate"] = 1.0
        elif outputs is not None and ref is not None:
            spec, vspec = RowSpec(*key), RowSpec("vanilla", *key[1:])
            a, b = outputs.token_ids(spec), outputs.token_ids(vspec)
            if a is not None and b is not None:
                r["greedy_match_rate"] = greedy_match_rate(a, b)
        elif ref is None:
            r["greedy_match_rate"] = None
    return rows


def sort_rows(rows: list[dict], methods_order: list[str], datasets_order: list[str] = ()) -> list[dict]:
    """Rows in report order: dataset (as configured), temperature, seed, concurrency, method."""
    order = {m: i for i, m in enumerate(methods_order)}
    dorder = {d: i for i, d in enumerate(datasets_order)}

    def k(r):
        m, ds, t, s, c = row_key(r)
        return (dorder.get(ds, len(dorder)), ds, t, -1 if s is None else s, c, order.get(m, len(order)), m)

    return sorted(rows, key=k)


# -- the run -----------------------------------------------------------------------------------------
class BenchRunner:
    """Runs a `BenchConfig`. `target` may be given (tests); otherwise it is loaded from `cfg.model`."""

    def __init__(self, cfg: BenchConfig, target=None, log: Callable[[str], None] | None = None):
        self.cfg = cfg
        self.out = Path(cfg.out)
        self.target = target
        self.log = log or (lambda s: print(s, file=sys.stderr))
        self.settings = cfg.settings()
        self.rows: list[dict] = []
        self.meta: dict = {}
        self.notes: list[str] = []
        self.outputs = Outputs(self.out)
        self._drafters: dict[str, object] = {}
        self._peers: dict[str, object] = {}
        self._warm: set[str] = set()
        self.computed: list[tuple] = []  # keys of the rows this run measured

    # -- notes / files ------------------------------------------------------------------------------
    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)
            self.log(f"dcoco bench: {text}")

    def _write(self) -> None:
        self.rows = sort_rows(
            derive(self.rows, self.outputs), self.cfg.methods, [dataset_name(d) for d in self.cfg.datasets]
        )
        write_json_atomic(
            self.out / "results.json",
            [{k: r.get(k) for k in ROW_KEYS + OPTIONAL_ROW_KEYS if k in ROW_KEYS or k in r} for r in self.rows],
        )
        self.meta["notes"] = list(dict.fromkeys(self.meta.get("notes", []) + self.notes))
        write_json_atomic(self.out / "run.json", self.meta)

    def report(self) -> None:
        from .report import write_report

        write_report(self.out, self.rows, self.meta)

    # -- setup --------------------------------------------------------------------------------------
    def _check_datasets(self) -> list[str]:
        names = [dataset_name(d) for d in self.cfg.datasets]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise DatasetError(f"two datasets are named {sorted(dup)[0]!r}; rename one of the files")
        for d in self.cfg.datasets:  # fail on bad names, missing or malformed files before loading a model
            load_prompts(d, self.cfg.num_prompts)
        return names

    def _load_target(self):
        if self.target is None:
            from ..target import Target

            self.log(
                f"dcoco bench: loading {self.cfg.model or 'SmolLM2-135M-Instruct (embedded)'} "
                f"({self.cfg.dtype}, {self.cfg.device})"
            )
            self.target = Target.from_pretrained(
                self.cfg.model,
                dtype=self.cfg.dtype,
                device=self.cfg.device,
                quantization=self.cfg.quantization,
                exact=self.cfg.exact,
            )
        return self.target

    def _encode(self, prompts: list[Prompt]) -> tuple[list[Prompt], list[list[int]]]:
        keep, ids = [], []
        for p in prompts:
            x = self.target.encode(p.content)
            try:
                self.target.check_fits(len(x), self.cfg.max_new_tokens)
            except PromptTooLongError:
                self.note(
                    f"{p.dataset}: skipped prompt {p.id} "
                    f"({len(x)} tokens + {self.cfg.max_new_tokens} new exceed the context)"
                )
                continue
            keep.append(p)
            ids.append(x)
        return keep, ids

    def _mtbench_answers(self) -> Callable[[Prompt], str]:
        """The target's greedy vanilla answers to turn 1, cached in the output directory."""
        from ..engine import SpeculativeEngine
        from ..sampling import SamplingParams

        path = self.out / "mtbench_turn1_answers.json"
        settings = {k: self.settings[k] for k in ("model", "dtype", "device", "max_new_tokens")}
        cache = read_json(path, {}) or {}
        answers = cache.get("answers", {}) if cache.get("settings") == settings else {}

        def answer(p: Prompt) -> str:
            qid = str(p.meta.get("question_id", p.id))
            if qid not in answers:
                ids = self.target.encode(p.content)
                eng = SpeculativeEngine(self.target, None, max_batch_size=1)
                outs, _ = eng.generate([ids], SamplingParams(temperature=0.0, max_tokens=self.cfg.max_new_tokens))
                answers[qid] = outs[0].text
                write_json_atomic(path, {"settings": settings, "answers": answers})
            return answers[qid]

        return answer

    # -- rows ---------------------------------------------------------------------------------------
    def _engine(self, method: str, concurrency: int):
        from ..engine import SpeculativeEngine
        from ..speculative import SpeculativeConfig, load_drafter, split_label, variant_options

        options = variant_options(method)
        # a `draftN` variant's draft length wins over --num-speculative-tokens
        k = options.pop("num_speculative_tokens", self.cfg.num_speculative_tokens)
        if method not in self._drafters:
            base = split_label(method)[0]
            cfg = SpeculativeConfig.parse(
                {
                    "method": base,
                    **options,
                    "model": self.cfg.drafters.get(method, self.cfg.drafters.get(base)),
                    "num_speculative_tokens": k,
                }
            )
            self._drafters[method] = load_drafter(cfg, self.target)
        return SpeculativeEngine(self.target, self._drafters[method], k, concurrency)

    def _peer(self, method: str):
        from .peers import make_peer

        if method not in self._peers:
            self._peers[method] = make_peer(
                method,
                self.target,
                embedded=self.cfg.model is None,
                num_speculative_tokens=self.cfg.num_speculative_tokens,
                n_ctx=min(self.target.max_context, 8192),
                threads=torch.get_num_threads(),
            )
        return self._peers[method]

    def _params(self, spec: RowSpec, n: int):
        from ..sampling import SamplingParams

        return [
            SamplingParams(
                temperature=spec.temperature,
                top_k=self.cfg.top_k,
                top_p=self.cfg.top_p,
                seed=prompt_seed(spec.seed, i),
                max_tokens=self.cfg.max_new_tokens,
            )
            for i in range(n)
        ]

    def _warmup(self, method: str, ids: list[int], peer=None) -> None:
        """One short untimed generation per method, before its first timed row."""
        if method in self._warm:
            return
        from ..sampling import SamplingParams

        if peer is None:
            self._engine(method, 1).generate([ids], SamplingParams(temperature=0.0, max_tokens=WARMUP_TOKENS))
        else:
            peer.generate([ids], 0.0, 0, 1.0, [None], WARMUP_TOKENS)
        self._warm.add(method)

    def run_row(self, spec: RowSpec, prompts: list[Prompt], ids: list[list[int]], bar=None) -> dict:
        """Measure one row; returns it (derived columns are filled by `derive`)."""
        from .peers import PeerRun

        inner = None
        if bar is not None and self.cfg.progress and sys.stderr.isatty():
            from tqdm import tqdm

            inner = tqdm(
                total=len(ids) * self.cfg.max_new_tokens, unit="tok", desc=spec.label(), leave=False, position=1
            )
        base = {
            "method": spec.method,
            "dataset": spec.dataset,
            "temperature": spec.temperature,
            "seed": spec.seed,
            "concurrency": spec.concurrency,
            "num_prompts": len(ids),
            "speedup_vs_vanilla": None,
            "greedy_match_rate": None,
            "device": device_label(self.cfg.device),
            "dtype": self.cfg.dtype,
            "threads": torch.get_num_threads(),
            "git_commit": self.git_commit,
        }
        try:
            if spec.method in PEERS:
                peer = self._peer(spec.method)
                self._warmup(spec.method, ids[0], peer)
                seeds = [prompt_seed(spec.seed, i) for i in range(len(ids))]
                res: PeerRun = peer.generate(
                    ids,
                    spec.temperature,
                    self.cfg.top_k,
                    self.cfg.top_p,
                    seeds,
                    self.cfg.max_new_tokens,
                    on_prompt=inner.update if inner is not None else None,
                )
                token_ids, wall, tokens = res.token_ids, res.wall_s, res.output_tokens
                tau = res.acceptance_length
                row = dict(
                    base,
                    acceptance_length=None if tau is None else round(tau, 4),
                    acceptance_rate=None,
                    per_position_acceptance=None,
                )
                texts = [self.target.decode(t) for t in token_ids]
            else:
                self._warmup(spec.method, ids[0])
                engine = self._engine(spec.method, spec.concurrency)
                if inner is not None:
                    engine.on_pass.append(lambda _r, _d, acc: inner.update(acc + 1))
                select_s = getattr(engine.drafter, "select_seconds", None)
                split = _lookup_split(engine.drafter)
                outs, stats = engine.generate(ids, self._params(spec, len(ids)), progress=False)
                token_ids, wall, tokens = [o.token_ids for o in outs], stats.wall_s, stats.output_tokens
                texts = [o.text for o in outs]
                drafted = spec.method != "vanilla"
                row = dict(
                    base,
                    acceptance_length=round(stats.acceptance_length, 4),
                    acceptance_rate=round(stats.acceptance_rate, 4) if drafted else None,
                    per_position_acceptance=[round(x, 4) for x in stats.per_position_acceptance] if drafted else None,
                )
                if select_s is not None and wall > 0:  # block drafters: share of the wall time choosing tokens
                    row["select_share"] = round((engine.drafter.select_seconds - select_s) / wall, 5)
                if split is not None:  # prompt lookup first: share of the drafting steps it drafted
                    looked, modelled = (b - a for a, b in zip(split, _lookup_split(engine.drafter)))
                    row["lookup_share"] = round(looked / max(1, looked + modelled), 4)
        finally:
            if inner is not None:
                inner.close()
        row.update(
            output_tokens=int(tokens),
            wall_s=round(wall, 4),
            tokens_per_second=round(tokens / wall, 3) if wall > 0 else None,
        )
        self.outputs.save(spec, prompts, token_ids, texts)
        return row

    # -- main loop ----------------------------------------------------------------------------------
    def run(self) -> int:
        """Run every missing row; write results.json after each, then results.md and the plots.
        Returns 0, or 130 when interrupted (the partial results and report are written)."""
        cfg = self.cfg
        names = self._check_datasets()
        self.out.mkdir(parents=True, exist_ok=True)
        self.rows, self.meta = load_existing(self.out, self.settings)
        prints = dict(self.meta.get("drafters") or {})
        for m in cfg.methods:
            fp = drafter_fingerprint(m, cfg.drafters.get(m, cfg.drafters.get(m.partition("/")[0])))
            if fp is None:
                continue
            if m in prints and prints[m] != fp and any(r["method"] == m for r in self.rows):
                self.rows = [r for r in self.rows if r["method"] != m]
                self.note(f"{m}: its drafter checkpoint changed since the last run; its rows are measured again")
            prints[m] = fp
        self.meta["drafters"] = prints
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.git_commit = git_commit()
        self.meta.update(
            settings=self.settings,
            machine=machine_info(cfg.device, cfg.dtype),
            git_commit=self.git_commit,
            config=cfg.to_dict(),
        )
        self.meta["commands"] = list(dict.fromkeys(self.meta.get("commands", []) + [cfg.command or "dcoco bench"]))
        skip = set()
        for m in cfg.methods:
            reason = unavailable_reason(m, embedded=cfg.model is None) if m in PEERS else None
            if reason:
                self.note(reason)
                skip.add(m)
        done = {row_key(r) for r in self.rows}
        specs = [s for s in plan(cfg, names) if s.method not in skip]
        if any(m in PEERS for m in cfg.methods) and 1 not in cfg.concurrency:
            self.note("peers run at concurrency 1 only; add 1 to --concurrency to measure them")
        todo = [s for s in specs if s.key not in done]
        if len(specs) > len(todo):
            self.log(
                f"dcoco bench: {len(specs) - len(todo)} of {len(specs)} rows already in "
                f"{self.out / 'results.json'}; skipping them"
            )

        from tqdm import tqdm

        bar = tqdm(
            total=len(specs),
            initial=len(specs) - len(todo),
            unit="row",
            desc="bench",
            disable=not cfg.progress,
            position=0,
            dynamic_ncols=True,
        )
        try:
            if todo:
                self._load_target()
                self._run(todo, bar)
            self._write()
        except KeyboardInterrupt:
            bar.close()
            self.log("dcoco bench: interrupted; writing the partial results")
            self._write()
            self.report()
            return 130
        except BaseException:
            bar.close()
            try:  # leave a report of the rows measured so far, then fail as we would have
                self._write()
                self.report()
            except Exception:
                pass
            raise
        finally:
            bar.close()
        self.report()
        return 0

    def _run(self, todo: list[RowSpec], bar) -> None:
        cfg = self.cfg
        by_ds: dict[str, list[RowSpec]] = {}
        for s in todo:
            by_ds.setdefault(s.dataset, []).append(s)
        spec_of = dict(zip((dataset_name(d) for d in cfg.datasets), cfg.datasets))
        unavailable: set[str] = set()
        for ds, specs in by_ds.items():
            answer = self._mtbench_answers() if spec_of[ds] == "mtbench" else None
            if answer is not None:
                bar.set_postfix_str("mtbench turn-1 answers (greedy vanilla, cached)")
            prompts = load_prompts(spec_of[ds], cfg.num_prompts, mtbench_answer=answer)
            prompts, ids = self._encode(prompts)
            if not ids:
                raise DatasetError(f"dataset {ds!r}: no prompt fits the model context")
            for spec in specs:
                bar.set_postfix_str(spec.label())
                if spec.method in unavailable:
                    bar.update(1)
                    continue
                try:
                    row = self.run_row(spec, prompts, ids, bar)
                except Unavailable as e:
                    self.note(str(e))
                    unavailable.add(spec.method)
                    bar.update(1)
                    continue
                self.rows = [r for r in self.rows if row_key(r) != spec.key] + [row]
                self.computed.append(spec.key)
                self._write()
                r = next(x for x in self.rows if row_key(x) == spec.key)
                extra = "" if r["speedup_vs_vanilla"] is None else f" ({r['speedup_vs_vanilla']:.2f}x)"
                tau = "" if r["acceptance_length"] is None else f", tau {r['acceptance_length']:.2f}"
                match = "" if r["greedy_match_rate"] is None else f", greedy match {r['greedy_match_rate']:.2f}"
                bar.write(f"{spec.label()}: {r['tokens_per_second']} tok/s{extra}{tau}{match}", file=sys.stderr)
                bar.update(1)


def run_bench(cfg: BenchConfig, target=None) -> int:
    """Run a benchmark; returns the exit status (0, or 130 when interrupted)."""
    return BenchRunner(cfg, target=target).run()


def _lookup_split(drafter) -> tuple[int, int] | None:
    """(requests drafted by prompt lookup, by the model) so far, for a `LookupFirst` drafter."""
    return (drafter.looked_up, drafter.drafted) if hasattr(drafter, "looked_up") else None
