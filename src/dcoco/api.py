"""The Python API, shaped like vLLM's offline `LLM`:

from dcoco import LLM, SamplingParams
llm = LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 5})
out = llm.generate(["Write a haiku about rain."], SamplingParams(temperature=0, max_tokens=64))
print(out[0].text, out[0].stats.acceptance_length)
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from .engine import GenerationOutput, SpeculativeEngine
from .errors import InvalidPromptError
from .metrics import SpecStats
from .sampling import SamplingParams
from .speculative import SpeculativeConfig, load_drafter
from .target import Target


class LLM:
    """A target model plus a drafter. `model=None` uses the embedded SmolLM2-135M-Instruct."""

    def __init__(
        self,
        model: Optional[str] = None,
        dtype: str | torch.dtype = "auto",
        device: str = "cpu",
        speculative_config: SpeculativeConfig | dict | None = None,
        max_batch_size: int = 32,
        target: Optional[Target] = None,
        quantization: str = "none",
        exact: bool = False,
    ):
        """`quantization`: "int8" or "int4" loads the target with weight-only quantized linear layers
        (`dcoco.nn.quantize`); speculative decoding is lossless with respect to that model. `exact`:
        each token's attention on its own, so greedy output equals vanilla's in bf16 too (`Target`)."""
        self.target = (
            target
            if target is not None
            else Target.from_pretrained(model, dtype=dtype, device=device, quantization=quantization, exact=exact)
        )
        self.max_batch_size = max_batch_size
        self.speculative_config = SpeculativeConfig.parse(speculative_config)
        self._drafters: dict[str, object] = {}
        self.last_stats: Optional[SpecStats] = None

    def _drafter(self, cfg: SpeculativeConfig):
        # one drafter per distinct set of drafter options (the draft length is the engine's)
        key = cfg.model_dump_json(exclude={"num_speculative_tokens"})
        if key not in self._drafters:
            self._drafters[key] = load_drafter(cfg, self.target)
        return self._drafters[key]

    def engine(self, speculative_config: SpeculativeConfig | dict | None = None) -> SpeculativeEngine:
        cfg = SpeculativeConfig.parse(speculative_config) if speculative_config is not None else self.speculative_config
        return SpeculativeEngine(self.target, self._drafter(cfg), cfg.num_speculative_tokens, self.max_batch_size)

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        speculative_config: SpeculativeConfig | dict | None = None,
        chat: bool = True,
        progress: bool = False,
    ) -> list[GenerationOutput]:
        """Generate for each prompt (text, chat messages or token ids). Text prompts are wrapped in the
        model's chat template unless `chat=False`. Run statistics land in `self.last_stats`."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not prompts:
            raise InvalidPromptError("no prompts given")
        ids = [self.target.encode(p, chat=chat) for p in prompts]
        sampling_params = sampling_params if sampling_params is not None else SamplingParams()
        sps = [sampling_params] * len(ids) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        outs, stats = self.engine(speculative_config).generate(ids, sps, progress=progress)
        self.last_stats = stats
        return outs
