"""Sampling parameters and the logits transforms shared by vanilla sampling and verification.

The same `probabilities()` turns target logits into the distribution p that vanilla decoding samples
from and that the rejection sampler verifies against, which is what makes speculative sampling
lossless with respect to vanilla sampling (temperature, top-k and top-p included).
"""

from __future__ import annotations

from typing import Optional

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from .errors import InvalidSamplingParamsError


class SamplingParams(BaseModel):
    """Per-request sampling settings; names follow vLLM's `SamplingParams`.

    `temperature == 0` means greedy decoding. `top_k <= 0` and `top_p == 1` disable those filters.
    `max_tokens` (alias `max_new_tokens`, as in HF `GenerationConfig`) bounds the generated tokens.
    `stop` strings end generation and are not included in the returned text.
    """

    model_config = ConfigDict(extra="forbid", populate_by_name=True, frozen=True)

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: Optional[int] = None
    max_tokens: int = Field(default=256, alias="max_new_tokens")
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, v: float) -> float:
        if not v >= 0 or v == float("inf"):
            raise ValueError(f"temperature must be a finite number >= 0, got {v}")
        return v

    @field_validator("top_p")
    @classmethod
    def _top_p(cls, v: float) -> float:
        if not 0 < v <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {v}")
        return v

    @field_validator("max_tokens")
    @classmethod
    def _max_tokens(cls, v: int) -> int:
        if v < 1:
            raise ValueError(f"max_tokens must be >= 1, got {v}")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: list[str]) -> list[str]:
        if any(not s for s in v):
            raise ValueError("stop strings must be non-empty")
        return v

    def __init__(self, **kwargs):
        """Bad values raise `InvalidSamplingParamsError` (a `DcocoError`) with a one-line message."""
        try:
            super().__init__(**kwargs)
        except ValidationError as e:
            err = e.errors()[0]
            loc = ".".join(str(x) for x in err["loc"]) or "sampling"
            raise InvalidSamplingParamsError(f"invalid {loc}: {err['msg']}") from None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def probabilities(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Target distribution p over the vocabulary after temperature, top-k and top-p (float32).

    `logits` has shape (..., V). Ties at the top-k / top-p boundary are kept, so the result does not
    depend on sort stability.
    """
    x = logits.float() / max(temperature, 1e-6)
    if top_k > 0 and top_k < x.shape[-1]:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if top_p < 1.0:
        sorted_p, _ = torch.sort(probs, dim=-1, descending=True)
        # mass strictly above each token; keep a token while that mass is < top_p
        above = torch.cumsum(sorted_p, dim=-1) - sorted_p
        keep_sorted = above < top_p
        # threshold = smallest kept probability; keep everything >= it
        thresh = torch.where(keep_sorted, sorted_p, torch.full_like(sorted_p, float("inf"))).amin(-1, keepdim=True)
        probs = torch.where(probs >= thresh, probs, torch.zeros_like(probs))
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, params) -> torch.Tensor:
    """log p(token) (B, T) of `tokens` (B, T) under each row's sampling distribution p of `logits`
    (B, T, V): the same transform as `probabilities`, so these are the log-probabilities of the
    distribution the tokens were drawn from (RL uses them as the rollout policy's)."""
    out = torch.empty(tokens.shape, dtype=torch.float32, device=logits.device)
    for b, sp in enumerate(params):
        tok = tokens[b].to(logits.device).unsqueeze(-1)
        if sp.top_k <= 0 and sp.top_p >= 1.0:  # plain temperature: log-softmax without the full p
            x = logits[b].float() / max(sp.temperature, 1e-6)
            out[b] = x.gather(-1, tok).squeeze(-1) - torch.logsumexp(x, dim=-1)
        else:
            out[b] = probabilities(logits[b], sp.temperature, sp.top_k, sp.top_p).gather(-1, tok).squeeze(-1).log()
    return out


def make_generator(seed: Optional[int], device: torch.device | str = "cpu") -> torch.Generator:
    """A private RNG per request, so results do not depend on the batch a request runs in."""
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()
    else:
        g.manual_seed(int(seed))
    return g
