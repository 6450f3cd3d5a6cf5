"""`dcoco bench`: dcoco's methods and their peers measured in one process on the same prompts.

    from dcoco.bench import make_config, run_bench
    cfg = make_config({"methods": "vanilla,ngram,hf_generate", "datasets": "mtbench,humaneval",
                       "num_prompts": 2, "max_new_tokens": 64, "temperatures": "0", "out": "bench-results/example"})
    run_bench(cfg)   # writes results.json, results.md, run.json, outputs/ and the PNG plots

Modules: `config` (options, defaults, validation), `presets` (``--preset readme``), `runner` (rows,
resume, atomic writes), `peers` (HF generate / prompt lookup / assisted, llama.cpp), `report` (markdown
and plots), `system` (machine, device, git commit). Prompts come from `dcoco.datasets`.
"""

from .config import PEERS, BenchConfig, config_from_args, make_config
from .presets import PRESETS
from .runner import KEY_FIELDS, ROW_KEYS, BenchRunner, derive, run_bench

__all__ = [
    "KEY_FIELDS",
    "PEERS",
    "PRESETS",
    "ROW_KEYS",
    "BenchConfig",
    "BenchRunner",
    "config_from_args",
    "derive",
    "make_config",
    "run_bench",
]
