"""The benchmark configuration: defaults, preset values and explicit flags, validated in one place."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from ..errors import ConfigError, ModelNotFoundError, UnknownMethodError
from .system import shown_path

#: peers measured in the same run (one prompt at a time): HF generate, HF prompt-lookup assisted
#: generation, HF assisted generation with a small assistant model, llama.cpp on the same GGUF
PEERS = ("hf_generate", "hf_prompt_lookup", "hf_assisted", "llamacpp")

DEFAULTS: dict[str, Any] = {
    "methods": ["@engine", "hf_generate", "hf_prompt_lookup"],
    "datasets": ["mtbench", "humaneval", "sharegpt"],
    "temperatures": [0.0, 1.0],
    "seeds": [42, 43, 44],
    "concurrency": [1],
    "num_prompts": 10,
    "max_new_tokens": 256,
    "dtype": "auto",
    "quantization": "none",
    "exact": False,
    "device": "cpu",
    "model": None,
    "num_speculative_tokens": None,
    "top_k": 0,
    "top_p": 1.0,
    "threads": None,
    "drafters": None,
    "out": "bench-results/run",
}


@dataclass
class BenchConfig:
    """A resolved benchmark run. `seeds` apply to T > 0 only (greedy rows have seed None)."""

    methods: list[str]
    datasets: list[str]
    temperatures: list[float] = field(default_factory=lambda: [0.0, 1.0])
    seeds: list[int] = field(default_factory=lambda: [42, 43, 44])
    concurrency: list[int] = field(default_factory=lambda: [1])
    num_prompts: Optional[int] = 10
    max_new_tokens: int = 256
    dtype: str = "bfloat16"
    quantization: str = "none"  # weight-only quantization of the target (`dcoco.nn.quantize`)
    exact: bool = False  # each token's attention on its own (`Target(exact=True)`)
    device: str = "cpu"
    model: Optional[str] = None
    num_speculative_tokens: Optional[int] = None
    top_k: int = 0
    top_p: float = 1.0
    threads: Optional[int] = None
    drafters: dict[str, str] = field(default_factory=dict)  # method -> checkpoint dir (else the shipped one)
    out: Path = Path("bench-results/run")
    preset: Optional[str] = None
    command: str = ""
    progress: bool = True

    def settings(self) -> dict:
        """What every row's numbers depend on besides its key; rows are reused on a re-run only when
        these are equal. (Drafter checkpoints are tracked per method: see `runner.drafter_fingerprint`.)"""
        return {
            "model": self.model or "embedded:SmolLM2-135M-Instruct",
            "dtype": self.dtype,
            "quantization": self.quantization,
            "exact": self.exact,
            "device": self.device,
            "max_new_tokens": self.max_new_tokens,
            "num_prompts": self.num_prompts,
            "num_speculative_tokens": self.num_speculative_tokens,
            "top_k": self.top_k,
            "top_p": self.top_p,
        }

    def to_dict(self) -> dict:
        d = asdict(self)
        d["out"] = str(self.out)
        return d


def split_list(value: Any, what: str) -> list[str]:
    if isinstance(value, (list, tuple)):
        items = [str(v).strip() for v in value]
    else:
        items = [s.strip() for s in str(value).split(",")]
    if not items or any(not s for s in items):
        raise ConfigError(f"--{what}: expected a comma-separated list without empty items, got {value!r}")
    return list(dict.fromkeys(items))  # drop repeats, keep order


def _numbers(value: Any, what: str, kind, check, rule: str) -> list:
    out = []
    for s in split_list(value, what):
        try:
            x = kind(s)
        except (TypeError, ValueError):
            raise ConfigError(f"--{what}: {s!r} is not a valid {kind.__name__}") from None
        if not check(x):
            raise ConfigError(f"--{what}: {s!r} {rule}")
        out.append(x)
    return list(dict.fromkeys(out))


def _int(value: Any, what: str, lo: Optional[int], hi: Optional[int]) -> int:
    try:
        x = int(str(value).strip())
    except (TypeError, ValueError):
        raise ConfigError(f"--{what}: expected an integer, got {value!r}") from None
    if (lo is not None and x < lo) or (hi is not None and x > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ConfigError(f"--{what}: must be {rng}, got {x}")
    return x


def engine_methods() -> list[str]:
    """dcoco methods runnable in this build, asked of the registry at run time."""
    from ..speculative import available_methods

    return list(available_methods())


def parse_drafters(value: Any) -> dict[str, str]:
    """``"dflash=DIR,dcoco=DIR"`` -> {method: DIR as `shown_path` writes it}: drafter checkpoints to
    use instead of the shipped ones (and for trained methods that ship none). A key may be a variant
    label (``dcoco/noemb=DIR``): a second checkpoint of the same family, side by side."""
    from ..families import trained_families
    from ..speculative import split_label

    if value is None:
        return {}
    if isinstance(value, dict):
        items = list(value.items())
    else:
        items = []
        for part in split_list(value, "drafters"):
            method, sep, path = part.partition("=")
            if not sep or not method.strip() or not path.strip():
                raise ConfigError(f"--drafters: expected METHOD=DIR items, got {part!r}")
            items.append((method.strip(), path.strip()))
    out = {}
    for method, path in items:
        if split_label(method)[0] not in trained_families():
            raise UnknownMethodError(
                f"--drafters: {method!r} is not a trained drafter method; choose from {', '.join(trained_families())}"
            )
        p = shown_path(path)
        if not (Path(p) / "config.json").is_file():
            raise ModelNotFoundError(f"--drafters: no drafter checkpoint (config.json) in {p}")
        out[method] = p
    return out


def resolve_methods(names: Sequence[str], with_checkpoint: Sequence[str] = ()) -> list[str]:
    """Expand ``all`` / ``@engine`` and check every name; engine methods come first. Trained methods
    given a checkpoint with ``--drafters`` count as available."""
    from ..speculative import METHODS, split_label, variant_options

    avail = engine_methods()
    avail += [m for m in METHODS if m in with_checkpoint and m not in avail]
    avail = [m for m in METHODS if m in avail]
    out: list[str] = []
    for n in names:
        base, tag = split_label(n)
        if n in ("all", "@engine"):
            out += avail + (list(PEERS) if n == "all" else [])
        elif n in avail or n in PEERS:
            out.append(n)
        elif tag:  # a variant: an inference option of an available method, or a label given a checkpoint
            if n in with_checkpoint or (base in avail and variant_options(n)):
                out.append(n)
            elif base in avail:
                raise UnknownMethodError(
                    f"method {n!r}: unknown variant {tag!r} of {base} "
                    f"(a label it does not know needs --drafters {n}=DIR)"
                )
            else:
                raise UnknownMethodError(f"method {n!r}: {base!r} is not available; available: {', '.join(avail)}")
        elif n in METHODS:
            raise UnknownMethodError(
                f"method {n!r} is not available in this build; available: {', '.join(avail + list(PEERS))}"
            )
        else:
            raise UnknownMethodError(f"unknown method {n!r}; choose from {', '.join(avail + list(PEERS))} or 'all'")
    out = list(dict.fromkeys(out))
    return [m for m in out if m not in PEERS] + [m for m in out if m in PEERS]


def make_config(
    values: dict, preset_name: Optional[str] = None, command: str = "", progress: bool = True
) -> BenchConfig:
    """Defaults, then the preset's values, then `values` (explicit flags; None means "not given")."""
    from .presets import preset

    merged = dict(DEFAULTS)
    if preset_name:
        merged.update(preset(preset_name))
    merged.update({k: v for k, v in values.items() if v is not None})

    num_prompts = merged["num_prompts"]
    if isinstance(num_prompts, str) and num_prompts.strip().lower() == "all":
        num_prompts = None
    if num_prompts is not None:
        num_prompts = _int(num_prompts, "num-prompts", 1, None)
    max_new = _int(merged["max_new_tokens"], "max-new-tokens", 1, None)
    k = merged["num_speculative_tokens"]
    k = None if k is None else _int(k, "num-speculative-tokens", 0, 64)
    top_k = _int(merged["top_k"], "top-k", 0, None)
    try:
        top_p = float(merged["top_p"])
    except (TypeError, ValueError):
        raise ConfigError(f"--top-p: {merged['top_p']!r} is not a number") from None
    if not 0 < top_p <= 1:
        raise ConfigError(f"--top-p: must be in (0, 1], got {top_p}")
    if merged["dtype"] not in ("auto", "bfloat16", "float32", "float16"):
        raise ConfigError(f"--dtype: choose auto, bfloat16, float32 or float16, got {merged['dtype']!r}")
    from ..nn.quantize import QUANTIZATIONS

    if merged["quantization"] not in QUANTIZATIONS:
        raise ConfigError(f"--quantization: choose one of {', '.join(QUANTIZATIONS)}, got {merged['quantization']!r}")
    if merged["dtype"] == "auto":
        from ..target import auto_dtype

        merged["dtype"] = auto_dtype(merged["device"], merged["quantization"])
    threads = merged["threads"]
    threads = None if threads is None else _int(threads, "threads", 1, None)

    drafters = parse_drafters(merged["drafters"])
    return BenchConfig(
        methods=resolve_methods(split_list(merged["methods"], "methods"), with_checkpoint=list(drafters)),
        datasets=split_list(merged["datasets"], "datasets"),
        temperatures=[
            t + 0.0
            for t in _numbers(
                merged["temperatures"],
                "temperatures",
                float,
                lambda t: math.isfinite(t) and t >= 0,
                "must be a finite number >= 0",
            )
        ],
        seeds=_numbers(merged["seeds"], "seeds", int, lambda s: 0 <= s < 2**31, "must be in [0, 2^31)"),
        concurrency=sorted(
            _numbers(merged["concurrency"], "concurrency", int, lambda c: 1 <= c <= 4096, "must be in [1, 4096]")
        ),
        num_prompts=num_prompts,
        max_new_tokens=max_new,
        dtype=merged["dtype"],
        quantization=merged["quantization"],
        exact=bool(merged["exact"]),
        device=merged["device"],
        model=None if merged["model"] is None else shown_path(merged["model"]),
        num_speculative_tokens=k,
        top_k=top_k,
        top_p=top_p,
        threads=threads,
        drafters=drafters,
        out=Path(merged["out"]),
        preset=preset_name,
        command=command,
        progress=progress,
    )


#: `dcoco bench` options that map onto `make_config` values (None: not given on the command line)
CLI_OPTIONS = (
    "methods",
    "datasets",
    "temperatures",
    "seeds",
    "concurrency",
    "num_prompts",
    "max_new_tokens",
    "num_speculative_tokens",
    "top_k",
    "top_p",
    "model",
    "dtype",
    "quantization",
    "exact",
    "device",
    "threads",
    "drafters",
    "out",
)


def command_line(args) -> str:
    """The command as typed when run from a shell; rebuilt from the parsed options otherwise (in-process
    calls such as tests)."""
    import shlex
    import sys

    if sys.argv[1:2] == ["bench"]:
        return "dcoco " + shlex.join(sys.argv[1:])
    parts = ["bench"] + (["--preset", args.preset] if getattr(args, "preset", None) else [])
    for k in CLI_OPTIONS:
        v = getattr(args, k, None)
        if v is True:  # a flag
            parts.append("--" + k.replace("_", "-"))
        elif v is not None:
            parts += ["--" + k.replace("_", "-"), str(v)]
    return "dcoco " + shlex.join(parts)


def config_from_args(args) -> BenchConfig:
    """The `BenchConfig` for parsed `dcoco bench` arguments."""
    values = {k: getattr(args, k, None) for k in CLI_OPTIONS}
    return make_config(
        values,
        preset_name=getattr(args, "preset", None),
        command=command_line(args),
        progress=not getattr(args, "no_progress", False),
    )
