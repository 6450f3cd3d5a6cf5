"""Named benchmark configurations. Explicit command-line flags override a preset's values.

``readme`` -- the configuration behind the README headline table, sized for an idle 2-core CPU
(about 40 tok/s vanilla decoding): roughly 25 minutes for vanilla + n-gram + the peers, plus about 5
minutes for each trained drafter that is available (so 20-40 minutes with up to three). Run it on an
otherwise idle machine: timings taken while other jobs share the cores are not meaningful. Use
``--num-prompts`` for more prompts when there is time.

- methods: ``vanilla``, ``ngram``, every trained drafter in `dcoco.speculative.available_methods()` at run
  time, and the peers ``hf_generate``, ``hf_prompt_lookup``, ``hf_assisted`` (skipped with a note: no
  compatible assistant exists for SmolLM2-135M) and ``llamacpp`` (skipped with a note unless
  llama-cpp-python is installed);
- datasets: ``mtbench`` (the first 6 questions, both turns: 12 prompts), ``humaneval`` and ``sharegpt``
  (the first 6 prompts each), ``--max-new-tokens 256``;
- temperatures 0 and 1; at T=1 **one seed (42)** instead of the default three, to keep the run short;
- concurrency 1, 4 and 16 for dcoco's engine methods (continuous batching); the peers run at
  concurrency 1 only. 16 is more than the prompts of a dataset, so those rows have every prompt of the
  dataset in flight at once (results.md marks such columns with †);
- bfloat16 on CPU, torch's default thread count.
"""

from __future__ import annotations

from ..errors import ConfigError

PRESETS: dict[str, dict] = {
    "readme": {
        "methods": ["@engine", "hf_generate", "hf_prompt_lookup", "hf_assisted", "llamacpp"],
        "datasets": ["mtbench", "humaneval", "sharegpt"],
        "num_prompts": 6,
        "max_new_tokens": 256,
        "temperatures": [0.0, 1.0],
        "seeds": [42],
        "concurrency": [1, 4, 16],
        "dtype": "bfloat16",
        "out": "bench-results/readme",
    },
}


def preset(name: str) -> dict:
    """The values of a named preset (a copy). ``"@engine"`` in `methods` stands for every engine
    method available at run time (vanilla, ngram and the registered trained drafters)."""
    try:
        return {k: (list(v) if isinstance(v, list) else v) for k, v in PRESETS[name].items()}
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}") from None
