"""Lossless verification of draft blocks, batched over requests that accept different amounts.

Greedy rows (temperature 0) accept the longest prefix of the draft that equals the target's argmax
and then emit the target's argmax. Sampled rows use the standard speculative rejection sampler
(Leviathan et al. 2023; Chen et al. 2023): draft token x at position i is accepted with probability
min(1, p_i(x) / q_i(x)); at the first rejection a token is drawn from normalise(max(0, p_i - q_i));
when every draft is accepted a bonus token is drawn from p_{n}. A draft given without q is a
deterministic (one-hot) draft: q_i(x) = 1, so x is accepted with probability p_i(x) and the
recovery distribution is p_i with x removed.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from .sampling import SamplingParams, probabilities


@dataclass
class VerifyResult:
    """`num_accepted[b]` drafts of row b were accepted; `next_token[b]` follows them (recovered or bonus)."""

    num_accepted: torch.Tensor  # (B,) long
    next_token: torch.Tensor  # (B,) long

    def emitted(self, draft_tokens: torch.Tensor) -> list[list[int]]:
        """The tokens each row emits this step: accepted drafts then the next token."""
        out = []
        for b, n in enumerate(self.num_accepted.tolist()):
            out.append(draft_tokens[b, :n].tolist() + [int(self.next_token[b])])
        return out


def sample_from(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: one token per row of `probs` (..., V) from `uniforms` (...) in [0, 1)."""
    cdf = torch.cumsum(probs.float(), dim=-1)
    total = cdf[..., -1:]
    v = uniforms.unsqueeze(-1).to(cdf.dtype) * total
    idx = torch.searchsorted(cdf, v, right=True).squeeze(-1)
    return idx.clamp_(max=probs.shape[-1] - 1)


def draw_uniforms(generators: Sequence[torch.Generator], n: int, device) -> torch.Tensor:
    """(B, n) uniforms, row b from request b's own generator (so a request's randomness is its own)."""
    rows = [torch.rand(n, generator=g, device=g.device) for g in generators]
    return torch.stack(rows).to(device)


def target_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Apply each row's transforms to `logits` (B, T, V); rows with equal settings share one call."""
    out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    groups: dict[tuple, list[int]] = defaultdict(list)
    for b, sp in enumerate(params):
        groups[(sp.temperature, sp.top_k, sp.top_p)].append(b)
    for (t, k, p), rows in groups.items():
        idx = torch.tensor(rows, device=logits.device)
        out[idx] = probabilities(logits[idx], t, k, p)
    return out


def verify(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_lens: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator],
    draft_probs: Optional[torch.Tensor] = None,
) -> VerifyResult:
    """Verify a batch of draft blocks.

    target_logits: (B, G+1, V) target logits at [last committed token, d_1 .. d_G].
    draft_tokens:  (B, G) proposed tokens; row b uses its first `draft_lens[b]` (the rest is padding).
    draft_probs:   (B, G, V) the distributions the drafts were sampled from, or None for
                   deterministic drafts (verified as one-hot q).
    """
    B, G1, V = target_logits.shape
    G = G1 - 1
    device = target_logits.device
    draft_tokens = draft_tokens.to(device)
    draft_lens = draft_lens.to(device)
    pos = torch.arange(G, device=device)
    valid = pos.unsqueeze(0) < draft_lens.unsqueeze(1)  # (B, G)
    num_accepted = torch.zeros(B, dtype=torch.long, device=device)
    next_token = torch.zeros(B, dtype=torch.long, device=device)

    greedy = torch.tensor([sp.greedy for sp in params], device=device)
    if greedy.any():
        gi = greedy.nonzero().squeeze(1)
        argmax = target_logits[gi].argmax(-1)  # (b, G+1)
        match = (argmax[:, :G] == draft_tokens[gi]) & valid[gi]
        n = torch.cumprod(match.long(), dim=1).sum(1)
        num_accepted[gi] = n
        next_token[gi] = argmax.gather(1, n.unsqueeze(1)).squeeze(1)

    if not greedy.all():
        si = (~greedy).nonzero().squeeze(1)
        rows = si.tolist()
        p = target_probs(target_logits[si], [params[b] for b in rows])  # (s, G+1, V)
        d = draft_tokens[si]
        u = draw_uniforms([generators[b] for b in rows], G + 1, device)  # G accept draws + 1 for the final token
        p_d = p[:, :G].gather(2, d.unsqueeze(2)).squeeze(2)  # p_i(d_i)
        if draft_probs is None:
            q_d = torch.ones_like(p_d)
        else:
            q = draft_probs[si].to(device=device, dtype=torch.float32)
            q_d = q.gather(2, d.unsqueeze(2)).squeeze(2)
        # accept iff u < p/q, written without division; q_d == 0 means always accept (min(1, inf))
        accept = (u[:, :G] * q_d < p_d) & valid[si]
        n = torch.cumprod(accept.long(), dim=1).sum(1)
        num_accepted[si] = n

        # distribution of the final token: residual at a rejection, p itself for a bonus
        final_p = p.gather(1, n.view(-1, 1, 1).expand(-1, 1, V)).squeeze(1)  # p_n
        rejected = n < draft_lens[si]
        if rejected.any():
            ri = rejected.nonzero().squeeze(1)
            pr = final_p[ri]
            dn = d[ri].gather(1, n[ri].unsqueeze(1))  # rejected draft token
            if draft_probs is None:
                resid = pr.scatter(1, dn, 0.0)
            else:
                qn = q[ri].gather(1, n[ri].view(-1, 1, 1).expand(-1, 1, V)).squeeze(1)
                resid = (pr - qn).clamp_min(0.0)
            mass = resid.sum(-1, keepdim=True)
            # mass 0 only when p == q, where a rejection has probability 0: fall back to p
            final_p[ri] = torch.where(mass > 0, resid, pr)
        next_token[si] = sample_from(final_p, u[:, G])
    return VerifyResult(num_accepted=num_accepted, next_token=next_token)


def sample_tokens(
    logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator]
) -> torch.Tensor:
    """Vanilla decoding of one token per row from `logits` (B, V): argmax or a sample from p."""
    B = logits.shape[0]
    empty = torch.zeros(B, 0, dtype=torch.long, device=logits.device)
    res = verify(logits.unsqueeze(1), empty, torch.zeros(B, dtype=torch.long, device=logits.device), params, generators)
    return res.next_token
