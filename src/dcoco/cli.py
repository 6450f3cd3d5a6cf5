"""The `dcoco` command. Status and progress go to stderr, results to stdout; bad input gives a
one-line error and exit status 2, never a traceback."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

from .errors import DcocoError, InvalidPromptError

DEMO_PROMPT = (
    "Add type hints and a docstring to this Python function, and return the whole function:\n\n"
    "def moving_average(values, window):\n"
    "    if window <= 0:\n"
    "        raise ValueError('window must be positive')\n"
    "    out = []\n"
    "    total = 0\n"
    "    for i, v in enumerate(values):\n"
    "        total += v\n"
    "        if i >= window:\n"
    "            total -= values[i - window]\n"
    "        if i >= window - 1:\n"
    "            out.append(total / window)\n"
    "    return out\n"
)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF model directory (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")


def _add_spec_args(p: argparse.ArgumentParser, default_method: str) -> None:
    from .drafters import METHODS

    p.add_argument("--method", default=default_method, help=f"one of: {', '.join(METHODS)}")
    p.add_argument("--drafter", default=None, help="drafter checkpoint directory (default: the shipped one)")
    p.add_argument("--num-speculative-tokens", type=int, default=None, help="draft tokens per pass")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dcoco", description="Lossless speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for one or more prompts")
    g.add_argument("--prompt", action="append", default=[], help="prompt text (repeatable: a batch)")
    g.add_argument("--prompt-file", default=None, help="a text file holding one prompt ('-' for stdin), or a .jsonl with a 'prompt' field per line")
    g.add_argument("--no-chat", action="store_true", help="do not wrap prompts in the chat template")
    g.add_argument("--json", action="store_true", help="print a JSON object per prompt on stdout")
    _add_model_args(g)
    _add_spec_args(g, default_method=_default_method())
    _add_sampling_args(g)

    d = sub.add_parser("demo", help="speculative generation on a default prompt, compared with vanilla decoding")
    d.add_argument("--prompt", default=None)
    _add_model_args(d)
    _add_spec_args(d, default_method=_default_method())
    d.add_argument("--max-new-tokens", type=int, default=160)
    return parser


def _default_method() -> str:
    """The best method this build can run on the embedded target."""
    from .drafters import available_methods

    for m in ("dcoco", "dflash", "dspark", "eagle3"):
        if m in available_methods():
            return m
    return "ngram"


def _read_prompts(args) -> list[str]:
    prompts = list(args.prompt)
    if args.prompt_file:
        if args.prompt_file == "-":
            prompts.append(sys.stdin.read())
        else:
            path = Path(args.prompt_file)
            if not path.is_file():
                raise InvalidPromptError(f"prompt file not found: {path}")
            text = path.read_text(encoding="utf-8")
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
    if args.threads:
        torch.set_num_threads(args.threads)


def _spec_config(args) -> dict:
    return {"method": args.method, "model": args.drafter, "num_speculative_tokens": args.num_speculative_tokens}


def cmd_generate(args) -> int:
    from .api import LLM
    from .drafters import SpeculativeConfig
    from .sampling import SamplingParams

    prompts = _read_prompts(args)
    sp = SamplingParams.make(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
        max_tokens=args.max_new_tokens, stop=args.stop,
    )
    cfg = SpeculativeConfig.parse(_spec_config(args))
    _setup(args)
    llm = LLM(model=args.model, dtype=args.dtype, device=args.device, speculative_config=cfg)
    outs = llm.generate(prompts, sp, chat=not args.no_chat, progress=sys.stderr.isatty())
    for o in outs:
        if args.json:
            stats = o.stats.to_dict()
            keep = ("output_tokens", "wall_s", "tokens_per_second", "verify_passes", "acceptance_length",
                    "acceptance_rate", "per_position_acceptance")
            print(json.dumps({"text": o.text, "token_ids": o.token_ids, "finish_reason": o.finish_reason,
                              "stats": {k: stats[k] for k in keep}}))
        else:
            print(o.text)
    s = llm.last_stats
    print(f"[{cfg.method}] {s.output_tokens} tokens in {s.wall_s:.2f}s = {s.tokens_per_second:.1f} tok/s, "
          f"acceptance length {s.acceptance_length:.2f}, acceptance rate {s.acceptance_rate:.2f}", file=sys.stderr)
    return 0


def cmd_demo(args) -> int:
    from .api import LLM
    from .sampling import SamplingParams

    _setup(args)
    prompt = args.prompt or DEMO_PROMPT
    print(f"dcoco demo: target {args.model or 'SmolLM2-135M-Instruct (embedded)'}, {args.dtype}, {args.device}, "
          f"method {args.method}", file=sys.stderr)
    llm = LLM(model=args.model, dtype=args.dtype, device=args.device)
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_new_tokens)
    spec = _spec_config(args)
    llm.generate("Hello", SamplingParams(max_tokens=4))  # warm-up, untimed
    van = llm.generate(prompt, sp)[0]
    vs = llm.last_stats
    out = llm.generate(prompt, sp, speculative_config=spec)[0]
    ss = llm.last_stats
    print(f"### prompt\n{prompt}\n### answer ({args.method})\n{out.text}\n")
    same = "identical to vanilla" if out.token_ids == van.token_ids else "DIFFERS from vanilla (bfloat16 numerics)"
    print(f"vanilla {vs.tokens_per_second:.1f} tok/s | {args.method} {ss.tokens_per_second:.1f} tok/s | "
          f"speedup {ss.tokens_per_second / max(vs.tokens_per_second, 1e-9):.2f}x | "
          f"acceptance length {ss.acceptance_length:.2f} | {ss.output_tokens} tokens, output {same}")
    return 0


COMMANDS = {"generate": cmd_generate, "demo": cmd_demo}


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except DcocoError as e:
        print(f"dcoco: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("dcoco: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
