"""The `dcoco` command. Status and progress go to stderr, results to stdout; bad input gives a
one-line error and exit status 2, never a traceback."""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shlex
import sys
import warnings
from pathlib import Path
from typing import Optional, Sequence

from .errors import ConfigError, DcocoError, InvalidPromptError

# MT-Bench question 81, turn 1 (the benchmark's first prompt). The earlier code prompt sent the
# 135M model into a repetition loop, which showed more about the model than about drafting.
PROG = "dcoco"  # the command's name, as regeneration manifests record the command

DEMO_PROMPT = (
    "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural experiences "
    "and must-see attractions."
)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF model directory (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32", "float16"], help=DTYPE_HELP)
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")


DTYPE_HELP = "auto (default): bfloat16 on a GPU or a CPU with bf16 matrix units (AVX-512 BF16, AMX), else float32"
QUANTIZATION_HELP = "weight-only quantization of the target's linear layers: none (default), int8 or int4"
EXACT_HELP = "each token attends over exactly the keys it sees, on its own: greedy output equals vanilla's in bf16 too"


def _add_quantization_arg(p: argparse.ArgumentParser) -> None:
    """The target's numerics beyond its dtype: --quantization and --exact."""
    p.add_argument("--quantization", default="none", metavar="Q", help=QUANTIZATION_HELP)
    p.add_argument("--exact", action="store_true", help=EXACT_HELP)


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    from .speculative import add_spec_args

    parser = argparse.ArgumentParser(prog=PROG, description="Lossless speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for one or more prompts")
    g.add_argument("--prompt", action="append", default=[], help="prompt text (repeatable: a batch)")
    g.add_argument(
        "--prompt-file",
        default=None,
        help="a text file holding one prompt ('-' for stdin), or a .jsonl with a 'prompt' field per line",
    )
    g.add_argument("--no-chat", action="store_true", help="do not wrap prompts in the chat template")
    g.add_argument("--json", action="store_true", help="print a JSON object per prompt on stdout")
    _add_model_args(g)
    _add_quantization_arg(g)
    add_spec_args(g, default_method=_default_method())
    _add_sampling_args(g)

    d = sub.add_parser("demo", help="speculative generation on a default prompt, compared with vanilla decoding")
    d.add_argument("--prompt", default=None)
    _add_model_args(d)
    _add_quantization_arg(d)
    add_spec_args(d, default_method=_default_method())
    d.add_argument("--max-new-tokens", type=int, default=160)

    b = sub.add_parser(
        "bench",
        help="benchmark methods and peers (tokens/s, speedup, acceptance) on MT-Bench, HumanEval, ShareGPT "
        "or a JSONL file",
        description="Measure dcoco's methods and peers in one process on the same prompts; writes results.json, "
        "results.md and PNG plots to --out. Lists are comma-separated. Re-running with the same --out skips "
        "the rows already measured. Explicit flags override --preset values.",
    )
    b.add_argument(
        "--preset",
        default=None,
        metavar="NAME",
        help="a named configuration: readme (every engine method and the HF peers)",
    )
    b.add_argument(
        "--methods",
        default=None,
        metavar="LIST",
        help="dcoco methods (vanilla, ngram and the available trained drafters), peers (hf_generate, "
        "hf_prompt_lookup, hf_assisted, llamacpp), or all (default: the engine methods + hf_generate,hf_prompt_lookup)",
    )
    b.add_argument(
        "--datasets",
        default=None,
        metavar="LIST",
        help="mtbench (both turns), mtbench_turn1, humaneval, sharegpt and/or .jsonl files "
        "(default: mtbench, humaneval, sharegpt)",
    )
    b.add_argument("--temperatures", default=None, metavar="LIST", help="default 0,1")
    b.add_argument("--seeds", default=None, metavar="LIST", help="seeds for T > 0, one row each (default 42,43,44)")
    b.add_argument(
        "--concurrency",
        default=None,
        metavar="LIST",
        help="requests in flight in dcoco's engine (default 1); peers run at 1 only",
    )
    b.add_argument(
        "--num-prompts",
        default=None,
        metavar="N",
        help="the first N prompts of each dataset in file order, or 'all' "
        "(default 10; MT-Bench: N questions, both turns)",
    )
    b.add_argument("--max-new-tokens", default=None, metavar="N", help="default 256")
    b.add_argument(
        "--num-speculative-tokens", default=None, metavar="K", help="draft tokens per pass (default: each drafter's)"
    )
    b.add_argument("--top-k", default=None, metavar="K", help="for T > 0 (default 0: off)")
    b.add_argument("--top-p", default=None, metavar="P", help="for T > 0 (default 1.0: off)")
    b.add_argument(
        "--model", default=None, metavar="DIR", help="HF model directory (default: embedded SmolLM2-135M-Instruct)"
    )
    b.add_argument("--dtype", default=None, metavar="DTYPE", help=DTYPE_HELP + "; float32 for exactness")
    b.add_argument("--device", default=None, metavar="DEVICE", help="cpu (default), cuda, ...")
    b.add_argument("--quantization", default=None, metavar="Q", help=QUANTIZATION_HELP)
    b.add_argument("--exact", action="store_true", default=None, help=EXACT_HELP)
    b.add_argument("--threads", default=None, metavar="N", help="torch CPU threads (default: torch's choice)")
    b.add_argument(
        "--drafters",
        default=None,
        metavar="LIST",
        help="drafter checkpoints as METHOD=DIR,... "
        "(default: the shipped ones; a trained method without one is unavailable)",
    )
    b.add_argument(
        "--out", default=None, metavar="DIR", help="output directory (default bench-results/run, or the preset's)"
    )
    b.add_argument("--no-progress", action="store_true", help="no progress bar")

    dt = sub.add_parser("data", help="training data: regenerate answers (and target features) with the target")
    dsub = dt.add_subparsers(dest="data_command", required=True)
    pr = dsub.add_parser(
        "prompts",
        help="write prompts (first user turns) as ShareGPT-format JSONL, for regenerate --source or bench --datasets",
    )
    pr.add_argument("out", help="the .jsonl file to write")
    pr.add_argument(
        "--from",
        dest="sources",
        nargs="+",
        default=[],
        metavar="DIR",
        help="the prompts of regenerated data directories (default: the ShareGPT training split)",
    )
    pr.add_argument("--heldout", action="store_true", help="only those training holds out (by a hash of their id)")
    pr.add_argument(
        "--eval-permille", type=int, default=20, help="the hold-out's share (training's data.eval_permille)"
    )
    pr.add_argument(
        "--exclude",
        nargs="+",
        default=[],
        metavar="DIR",
        help="drop prompts already answered in these data directories",
    )
    pr.add_argument("--shuffle-seed", type=int, default=None, help="random order from this seed (default: file order)")
    pr.add_argument("--limit", type=int, default=None, help="at most N prompts")
    pk = dsub.add_parser(
        "pack",
        help="pack the token ids of regenerated directories compactly (2 bytes per token), to commit and share",
    )
    pk.add_argument("sources", nargs="+", metavar="DIR", help="regenerated data directories (same sampling settings)")
    pk.add_argument("--out", required=True, help="packed directory (created; packing again appends new samples)")
    rg = dsub.add_parser("regenerate", help="answer prompts with the target; resumable and incremental")
    rg.add_argument("--out", required=True, help="data directory (created; a rerun resumes and extends it)")
    rg.add_argument("--source", default="sharegpt", help="'sharegpt' (the training split) or a ShareGPT-format .jsonl")
    rg.add_argument("--num-samples", type=int, required=True, help="total samples wanted in --out")
    rg.add_argument(
        "--turns",
        choices=("first", "all"),
        default="first",
        help="ShareGPT prompts: each record's first user turn, or every user turn with the conversation before it",
    )
    rg.add_argument(
        "--from-end",
        action="store_true",
        help="take prompts from the end of the source: a second process run side by side (one per core) "
        "into another --out gets disjoint prompts; train on both directories (data.path: [A, B])",
    )
    rg.add_argument(
        "--shard",
        default=None,
        metavar="I/N",
        help="take every N-th prompt starting at the I-th (0-based): N processes (or GPUs) with shards "
        "0/N .. N-1/N into N --out directories answer disjoint prompts",
    )
    rg.add_argument(
        "--exclude",
        nargs="+",
        default=[],
        metavar="DIR",
        help="skip prompts already answered in these data directories (regenerated or packed): "
        "extend a committed corpus from a fresh machine, then pack the new directory into it",
    )
    rg.add_argument("--max-new-tokens", type=int, default=384)
    rg.add_argument("--max-prompt-tokens", type=int, default=512, help="longer prompts are skipped")
    rg.add_argument("--temperature", type=float, default=0.0)
    rg.add_argument("--top-p", type=float, default=1.0)
    rg.add_argument("--seed", type=int, default=0, help="sampling seed at T > 0 (sample i uses seed + i)")
    rg.add_argument("--num-features", type=int, default=5, help="target layers to tap (evenly spaced, DFlash default)")
    rg.add_argument("--batch-size", type=int, default=48)
    rg.add_argument(
        "--no-features",
        action="store_true",
        help="keep only the tokens, not the target features (for data.features=online training)",
    )
    _add_model_args(rg)

    tr = sub.add_parser("train", help="train a drafter from a YAML config (resumes from its run directory)")
    tr.add_argument("--config", required=True, help="configs/NAME.yaml")
    tr.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. optim.steps=100")
    ev = sub.add_parser(
        "eval",
        help="held-out τ of a drafter checkpoint: as decoded and per slot, at T=0 and T=1",
        description="Evaluate a drafter checkpoint (any family) on regenerated data it was not trained on: "
        "τ as greedy decoding realizes it and over random anchors at T=0, and the expected τ of sampled "
        "verification at T=1 (from the target's stored last layer), each with per-slot acceptance. "
        "Prints a table; --out also writes eval.json and eval.md.",
    )
    ev.add_argument("checkpoint", help="drafter checkpoint directory (config.json + model.safetensors)")
    ev.add_argument("--data", nargs="+", required=True, metavar="DIR", help="regenerated data directories")
    ev.add_argument(
        "--split",
        default="heldout",
        choices=["heldout", "all"],
        help="heldout: the samples training holds out (by a hash of their id); all: every sample (a held-out set)",
    )
    ev.add_argument(
        "--eval-permille", type=int, default=20, help="--split heldout's share (training's data.eval_permille)"
    )
    ev.add_argument("--temperatures", default="0,1", help="0, 1 or 0,1 (default)")
    ev.add_argument(
        "--draft-lengths",
        default="",
        metavar="LIST",
        help="T=0 as decoded also at these draft lengths (tokens per pass, e.g. 3,4,5,7), from the same drafts",
    )
    ev.add_argument("--num-samples", type=int, default=48, help="evaluate at most N samples (default 48; 0: all)")
    ev.add_argument("--max-length", type=int, default=1024, help="tokens per sample, longer ones are cut")
    ev.add_argument("--out", default=None, help="directory for eval.json and eval.md")
    ev.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_model_args(ev)
    ev.set_defaults(dtype="float32")
    rl = sub.add_parser(
        "rl",
        help="GRPO post-training with online draft co-training (resumes from run.out); "
        "'rl compare RUN_DIR ...' tabulates runs",
        description="dcoco rl --config configs/rl_smollm2.yaml [section.key=value ...] trains; "
        "dcoco rl compare RUN_DIR ... [--out DIR] writes a table and a plot of several runs, with speedups "
        "against the run without a draft. See docs/rl.md.",
    )
    rl.add_argument("--config", default=None, help="configs/NAME.yaml (default: built-in defaults)")
    rl.add_argument("--out", default=None, help="rl compare: output directory (default runs/rl-compare)")
    rl.add_argument("--no-progress", action="store_true", help="no progress bar")
    rl.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. grpo.steps=10 draft.method=none")
    sv = sub.add_parser(
        "serve",
        help="serve the model behind an OpenAI-compatible HTTP API (continuous batching, speculative decoding)",
        description="OpenAI-compatible server: /v1/completions, /v1/chat/completions (streaming and not), "
        "/v1/models, /health, /metrics (Prometheus). Ctrl-C / SIGTERM drain in-flight requests. See docs/serving.md.",
    )
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=int, default=8000)
    _add_model_args(sv)
    _add_quantization_arg(sv)
    add_spec_args(sv, default_method=_model_free_method())
    sv.add_argument(
        "--served-model-name", default=None, help="model name clients use (default: the model directory's name)"
    )
    sv.add_argument("--max-batch-size", type=int, default=32, help="requests decoded together (the rest wait)")
    sv.add_argument("--max-queue", type=int, default=256, help="requests waiting to join the batch; beyond it: 503")
    sv.add_argument(
        "--max-tokens-in-flight",
        type=int,
        default=None,
        help="join the batch only while the batch's prompt + max_tokens sum stays under N (default: no bound)",
    )
    sv.add_argument(
        "--default-max-tokens",
        type=int,
        default=None,
        help="chat max_tokens when a request gives none (default: the rest of the context)",
    )
    sv.add_argument(
        "--load-aware",
        action="store_true",
        help="shorten the draft block as the batch grows (k = min(K, budget // batch - 1); 0 = plain decoding)",
    )
    sv.add_argument("--draft-token-budget", type=int, default=32, help="tokens per verification pass for --load-aware")
    sv.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    return parser


def _default_method() -> str:
    """The best method this build can run on the embedded target."""
    from .families import default_method
    from .speculative import available_methods

    return default_method(available_methods())


def _model_free_method() -> str:
    """What `dcoco serve` runs by default: the model-free family (no checkpoint, never slower at load)."""
    from .families import MODEL_FREE

    return MODEL_FREE.name


def _read_prompts(args) -> list[str]:
    prompts = list(args.prompt)
    if args.prompt_file:
        if args.prompt_file == "-":
            prompts.append(sys.stdin.read())
        else:
            path = Path(args.prompt_file)
            if not path.is_file():
                raise InvalidPromptError(f"prompt file not found: {path}")
            try:
                text = path.read_text(encoding="utf-8")
            except UnicodeDecodeError:
                raise InvalidPromptError(f"{path}: not UTF-8 text") from None
            if path.suffix == ".jsonl":
                for n, line in enumerate(text.splitlines(), 1):
                    if not line.strip():
                        continue
                    try:
                        prompts.append(json.loads(line)["prompt"])
                    except (json.JSONDecodeError, KeyError, TypeError):
                        raise InvalidPromptError(f"{path}:{n}: expected a JSON object with a 'prompt' field") from None
            else:
                prompts.append(text)
    if not prompts:
        raise InvalidPromptError("no prompt given: use --prompt or --prompt-file")
    for p in prompts:
        if not isinstance(p, str) or not p.strip():
            raise InvalidPromptError("the prompt is empty")
    return prompts


def _setup(args) -> None:
    import torch
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    if args.threads is not None and args.threads < 0:
        raise ConfigError(f"--threads must be 0 (torch's choice) or more, got {args.threads}")
    if args.threads:
        torch.set_num_threads(args.threads)
    if getattr(args, "dtype", None) == "auto" and args.command != "bench":  # bench resolves it with its config's
        from .target import auto_dtype  # device; resolved here, what is printed and recorded is the dtype run

        args.dtype = auto_dtype(args.device, getattr(args, "quantization", "none"))


def cmd_generate(args) -> int:
    from .api import LLM
    from .sampling import SamplingParams
    from .speculative import SpeculativeConfig, config_of_args

    prompts = _read_prompts(args)
    sp = SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        max_tokens=args.max_new_tokens,
        stop=args.stop,
    )
    cfg = SpeculativeConfig.parse(config_of_args(args))
    _setup(args)
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        speculative_config=cfg,
        quantization=args.quantization,
        exact=args.exact,
    )
    outs = llm.generate(prompts, sp, chat=not args.no_chat, progress=sys.stderr.isatty())
    for o in outs:
        if args.json:
            stats = o.stats.to_dict()
            keep = (
                "output_tokens",
                "wall_s",
                "tokens_per_second",
                "verify_passes",
                "acceptance_length",
                "acceptance_rate",
                "per_position_acceptance",
            )
            print(
                json.dumps(
                    {
                        "text": o.text,
                        "token_ids": o.token_ids,
                        "finish_reason": o.finish_reason,
                        "stats": {k: stats[k] for k in keep},
                    }
                )
            )
        else:
            print(o.text)
    s = llm.last_stats
    print(
        f"[{cfg.method}] {s.output_tokens} tokens in {s.wall_s:.2f}s = {s.tokens_per_second:.1f} tok/s, "
        f"acceptance length {s.acceptance_length:.2f}, acceptance rate {s.acceptance_rate:.2f}",
        file=sys.stderr,
    )
    return 0


def cmd_demo(args) -> int:
    from .api import LLM
    from .sampling import SamplingParams
    from .speculative import config_of_args

    _setup(args)
    prompt = args.prompt or DEMO_PROMPT
    numerics = (f", {args.quantization}" if args.quantization != "none" else "") + (", exact" if args.exact else "")
    print(
        f"dcoco demo: target {args.model or 'SmolLM2-135M-Instruct (embedded)'}, {args.dtype}{numerics}, "
        f"{args.device}, method {args.method}",
        file=sys.stderr,
    )
    llm = LLM(model=args.model, dtype=args.dtype, device=args.device, quantization=args.quantization, exact=args.exact)
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_new_tokens)
    spec = config_of_args(args)
    llm.generate("Hello", SamplingParams(max_tokens=4))  # warm-up, untimed
    van = llm.generate(prompt, sp)[0]
    vs = llm.last_stats
    out = llm.generate(prompt, sp, speculative_config=spec)[0]
    ss = llm.last_stats
    print(f"### prompt\n{prompt}\n### answer ({args.method})\n{out.text}\n")
    same = (
        "identical to vanilla"
        if out.token_ids == van.token_ids
        else f"DIFFERS from vanilla ({args.dtype} numerics depend on the pass; --exact makes it identical)"
    )
    print(
        f"vanilla {vs.tokens_per_second:.1f} tok/s | {args.method} {ss.tokens_per_second:.1f} tok/s | "
        f"speedup {ss.tokens_per_second / max(vs.tokens_per_second, 1e-9):.2f}x | "
        f"acceptance length {ss.acceptance_length:.2f} | {ss.output_tokens} tokens, output {same}"
    )
    return 0


def cmd_bench(args) -> int:
    from .bench import config_from_args, run_bench

    cfg = config_from_args(args)
    args.threads = cfg.threads  # validated
    _setup(args)
    return run_bench(cfg)


def _parse_shard(spec: str) -> tuple[int, int]:
    try:
        i, n = (int(x) for x in spec.split("/"))
    except ValueError:
        i, n = -1, 0
    if not 0 <= i < n:
        raise InvalidPromptError(f"--shard {spec!r}: expected I/N with 0 <= I < N, e.g. 0/4")
    return i, n


def cmd_data(args) -> int:
    if args.data_command == "prompts":
        return cmd_data_prompts(args)
    if args.data_command == "pack":
        from .train.data import RegeneratedData
        from .train.packed import pack

        t = pack([RegeneratedData(s) for s in args.sources], args.out).get("totals", {})
        print(
            f"{args.out}: {t.get('samples', 0)} samples, {t.get('response_tokens', 0)} response tokens "
            f"({t.get('prompt_tokens', 0)} prompt tokens)"
        )
        return 0
    from .drafters.dflash import default_target_layer_ids
    from .sampling import SamplingParams
    from .target import Target
    from .train.data import jsonl_conversation_prompts, regenerate, sharegpt_train_prompts

    shard = _parse_shard(args.shard) if args.shard is not None else None
    if args.source == "sharegpt":
        prompts = sharegpt_train_prompts(args.turns)
    elif args.source.endswith(".jsonl") and Path(args.source).is_file():
        prompts = jsonl_conversation_prompts(args.source)
    else:
        raise InvalidPromptError(f"unknown source {args.source!r}: use 'sharegpt' or an existing .jsonl file")
    if args.from_end:
        prompts = reversed(list(prompts))
    if shard is not None:
        prompts = itertools.islice(prompts, shard[0], None, shard[1])
    sp = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        max_tokens=args.max_new_tokens,
        seed=None if args.temperature == 0 else args.seed,
    )
    _setup(args)
    target = Target.from_pretrained(args.model, dtype=args.dtype, device=args.device)
    # DFlash-family taps, plus the last layer's output: distribution-matching losses (DSpark,
    # EAGLE-3) recompute the target's logits from it with the target's own final norm and LM head
    taps = sorted({i + 1 for i in default_target_layer_ids(target.num_layers, args.num_features)} | {target.num_layers})
    regenerate(
        target,
        prompts,
        args.out,
        num_samples=args.num_samples,
        taps=taps,
        sampling=sp,
        batch_size=args.batch_size,
        max_prompt_tokens=args.max_prompt_tokens,
        source=args.source + (" (from the end)" if args.from_end else ""),
        features=not args.no_features,
        command=shlex.join([PROG, *sys.argv[1:]]),
        exclude=args.exclude,
    )
    return 0


def cmd_data_prompts(args) -> int:
    from .train.data import select_prompts, write_prompts

    prompts = select_prompts(
        args.sources,
        heldout_permille=args.eval_permille if args.heldout else None,
        exclude=args.exclude,
        seed=args.shuffle_seed,
        limit=args.limit,
    )
    n = write_prompts(prompts, args.out)
    print(f"{n} prompts -> {args.out}", file=sys.stderr)
    return 0


#: Set in the environment of the fresh process a `run.restart_every` restart starts: it continues the
#: same command, which has already said what it warns about once.
RESTARTED_ENV = "DCOCO_TRAIN_RESTARTED"


def cmd_train(args) -> int:
    from .parallel.launch import launched, launched_rank, torchrun
    from .train.config import check_context_parallel, load_config
    from .train.run import train, warn_slow_bf16

    cfg = load_config(args.config, args.overrides)
    check_context_parallel(cfg.parallel, cfg.target.device)
    if not launched() and RESTARTED_ENV not in os.environ:  # once per command, not per rank or restart
        warn_slow_bf16(cfg)
    if cfg.parallel.context > 1 and not launched():  # this command again, one process per rank
        return torchrun(cfg.parallel.context, args.argv, log_dir=str(Path(cfg.run.out) / "ranks"))
    with launched_rank():
        restart = train(cfg).restart_requested
    if restart:  # run.restart_every: the same command in a fresh process resumes
        sys.stdout.flush()
        sys.stderr.flush()
        os.environ[RESTARTED_ENV] = "1"
        os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])
    return 0


def cmd_eval(args) -> int:
    from .train.evaluate import eval_markdown, evaluate_checkpoint, write_eval

    try:
        temps = [float(t) for t in args.temperatures.split(",") if t.strip()]
    except ValueError:
        raise InvalidPromptError(f"--temperatures: expected numbers like 0,1, got {args.temperatures!r}") from None
    try:
        lengths = [int(n) for n in args.draft_lengths.split(",") if n.strip()]
    except ValueError:
        lengths = [0]
    if any(n < 1 for n in lengths):
        raise InvalidPromptError(f"--draft-lengths: expected positive integers like 3,4,7, got {args.draft_lengths!r}")
    _setup(args)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)  # a bad --out fails now, not after the evaluation
    result = evaluate_checkpoint(
        args.checkpoint,
        args.data,
        split=args.split,
        temperatures=temps,
        draft_lengths=lengths,
        num_samples=args.num_samples or None,
        max_length=args.max_length,
        eval_permille=args.eval_permille,
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        progress=not args.no_progress and sys.stderr.isatty(),
    )
    print(eval_markdown(result), end="")
    if args.out:
        write_eval(result, Path(args.out))
    return 0


def cmd_rl(args) -> int:

    if args.overrides and args.overrides[0] == "compare":
        from .rl.report import compare

        md = compare(args.overrides[1:], args.out or "runs/rl-compare")
        print(md.read_text(), end="")
        return 0
    if args.out is not None:
        raise ConfigError("--out is for 'rl compare'; set the run directory with run.out=DIR")
    from .parallel.launch import launched, launched_rank, torchrun
    from .rl.config import check_rl_parallel, load_rl_config
    from .rl.run import run_rl

    cfg = load_rl_config(args.config, args.overrides)
    check_rl_parallel(cfg)
    if cfg.processes > 1 and not launched():  # this command again, one process per rank of the grid
        return torchrun(cfg.processes, args.argv, log_dir=str(Path(cfg.run.out) / "ranks"))
    with launched_rank():
        run_rl(cfg, progress=not args.no_progress)
    return 0


def cmd_serve(args) -> int:
    from .serve.server import run_server

    _setup(args)
    return run_server(args)


COMMANDS = {
    "generate": cmd_generate,
    "demo": cmd_demo,
    "bench": cmd_bench,
    "data": cmd_data,
    "train": cmd_train,
    "eval": cmd_eval,
    "rl": cmd_rl,
    "serve": cmd_serve,
}


def _sigterm_as_interrupt(*_):
    raise KeyboardInterrupt


def main(argv: Optional[Sequence[str]] = None) -> int:
    import signal

    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # to start this command again under a launcher
    warnings.formatwarning = lambda message, *_a, **_k: f"dcoco: warning: {message}\n"  # one line, no source
    signal.signal(signal.SIGTERM, _sigterm_as_interrupt)  # long jobs save their work on a plain kill too
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even when started in the background
    try:
        return COMMANDS[args.command](args)
    except (DcocoError, OSError) as e:  # OSError: a path the user named cannot be read or written
        print(f"dcoco: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("dcoco: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
