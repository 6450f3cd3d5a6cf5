"""Shared fixtures: tiny randomly initialised targets built in-process, and the embedded SmolLM2."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from dcoco.drafters.base import Drafter, DraftInput, DraftOutput
from dcoco.kv import pad_rows
from dcoco.target import Target

TINY = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.3,  # peaky logits: argmax ties are far apart, float32 greedy is stable
    tie_word_embeddings=False,
    eos_token_id=None,
    bos_token_id=None,
    pad_token_id=None,
)


def tiny_model(family: str = "llama", seed: int = 0, **over) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = dict(TINY, **over)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**cfg))
    elif family == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=16, **cfg))
    else:
        raise ValueError(family)
    return model.float().eval()


def tiny_target(family: str = "llama", seed: int = 0, **over) -> Target:
    return Target(tiny_model(family, seed, **over))


@pytest.fixture(params=["llama", "qwen3"])
def target(request) -> Target:
    return tiny_target(request.param)


def random_prompts(n: int, vocab: int, lengths=(5, 17, 9, 30), seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(lengths[i % len(lengths)])] for i in range(n)]


class OracleDrafter(Drafter):
    """Proposes a known continuation, corrupting each token with probability `error_rate`, so drafts
    are partly right. Knows nothing of the target beyond the reference sequences it is given."""

    method = "oracle"

    def __init__(self, references: dict[tuple, list[int]], vocab: int, error_rate: float = 0.3, seed: int = 0):
        self.references = references
        self.vocab = vocab
        self.error_rate = error_rate
        self.rng = random.Random(seed)

    def propose(self, inp: DraftInput) -> DraftOutput:
        rows = []
        for ids in inp.token_ids:
            cont = None
            for prompt, ref in self.references.items():
                full = list(prompt) + ref
                if full[: len(ids)] == ids:
                    cont = full[len(ids) : len(ids) + inp.num_tokens]
                    break
            cont = cont or []
            rows.append([t if self.rng.random() > self.error_rate else (t + 1) % self.vocab for t in cont])
        tokens, lens = pad_rows(rows, max(1, max(len(r) for r in rows)))
        return DraftOutput(tokens, lens)


@pytest.fixture(scope="session")
def smollm() -> Target:
    """The embedded SmolLM2-135M-Instruct in float32 (for exactness checks)."""
    return Target.from_pretrained(dtype="float32")


class ModelDrafter(Drafter):
    """A real (tiny) draft LM that samples its block from q = softmax(logits / T) and reports q, so
    the engine's rejection sampler is exercised with full draft distributions."""

    method = "model"

    def __init__(self, model, temperature: float = 1.0):
        self.model = model
        self.temperature = temperature

    @torch.no_grad()
    def propose(self, inp: DraftInput) -> DraftOutput:
        seqs = [list(s) for s in inp.token_ids]
        L = max(len(s) for s in seqs)
        B, V = len(seqs), self.model.config.vocab_size
        ids = torch.zeros(B, L, dtype=torch.long)
        mask = torch.zeros(B, L, dtype=torch.long)
        for b, s in enumerate(seqs):  # left-pad
            ids[b, L - len(s) :] = torch.tensor(s)
            mask[b, L - len(s) :] = 1
        toks = torch.zeros(B, inp.num_tokens, dtype=torch.long)
        probs = torch.zeros(B, inp.num_tokens, V)
        for k in range(inp.num_tokens):
            pos = (mask.cumsum(1) - 1).clamp(min=0)
            logits = self.model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -1].float()
            q = torch.softmax(logits / self.temperature, -1)
            t = torch.stack([torch.multinomial(q[b], 1, generator=inp.generators[b]) for b in range(B)]).squeeze(1)
            toks[:, k], probs[:, k] = t, q
            ids = torch.cat([ids, t.unsqueeze(1)], 1)
            mask = torch.cat([mask, torch.ones(B, 1, dtype=torch.long)], 1)
        return DraftOutput(toks, torch.full((B,), inp.num_tokens), probs)


def chi_square_pvalue(samples, expected: dict) -> float:
    """Chi-square goodness of fit of `samples` (hashable outcomes) to `expected` probabilities; cells
    expected fewer than 5 times are pooled. Fails outright on an outcome of probability 0."""
    import numpy as np
    from scipy import stats

    counts = {k: 0 for k in expected}
    for s in samples:
        assert expected.get(s, 0) > 0, f"sampled {s}, which the target never produces"
        counts[s] += 1
    keys = [k for k in expected if expected[k] > 0]
    exp = np.array([expected[k] for k in keys]) * len(samples)
    obs = np.array([counts[k] for k in keys], dtype=float)
    small = exp < 5
    if small.any():
        exp = np.append(exp[~small], exp[small].sum())
        obs = np.append(obs[~small], obs[small].sum())
    return float(stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)


LOSSLESS_PROMPT = [1, 3, 0, 2, 4, 1]


def exact_joint(model, prompt: list[int], sp, depth: int = 3) -> dict:
    """The target's exact distribution of its first `depth` tokens after `prompt`, by enumeration."""
    import itertools

    from dcoco.sampling import probabilities

    V = model.config.vocab_size
    out = {}
    with torch.no_grad():
        for seq in itertools.product(range(V), repeat=depth):
            pr = 1.0
            for i in range(depth):
                logits = model(torch.tensor([prompt + list(seq[:i])])).logits[0, -1]
                pr *= float(probabilities(logits.view(1, -1), sp.temperature, sp.top_k, sp.top_p)[0, seq[i]])
            out[seq] = pr
    return out


def engine_lossless_pvalue(target, drafter, sp, n: int = 4000, k: int = 2, seed: int = 0):
    """Run `n` seeded requests of 3 tokens through the real engine (first token from prefill, the
    next two from a speculative pass) and test their joint distribution against the target's.
    Returns (p-value, run stats)."""
    from dcoco.engine import SpeculativeEngine
    from dcoco.metrics import SpecStats

    sp = sp.model_copy(update={"max_tokens": 3})
    samples, total = [], SpecStats()
    for start in range(0, n, 1000):
        params = [sp.model_copy(update={"seed": 7919 * i + seed}) for i in range(start, min(n, start + 1000))]
        outs, stats = SpeculativeEngine(target, drafter, k, max_batch_size=1000).generate(
            [LOSSLESS_PROMPT] * len(params), params
        )
        samples += [tuple(o.token_ids) for o in outs]
        total.merge(stats)
    return chi_square_pvalue(samples, exact_joint(target.model, LOSSLESS_PROMPT, sp)), total
