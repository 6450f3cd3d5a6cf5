"""DCOCO, the DFlash Contextual Corrector.

A parallel drafter often has the right token among its leading candidates but combines
neighbouring choices the target rejects ("These key is missing"). DCOCO keeps the top-K candidates
c_{i,k} of every draft position, scores every neighbouring candidate pair in one batched pass and
walks the block left to right, each step conditioned on the candidate actually chosen before it:

  z_{i,k} = f(norm(P_e Emb(c_{i,k})), norm(P_h h_i))          candidate representation
  s_p     = norm(P_s [h_p ; h_{p+1}])                         pair context, shared by K^2 pairs
  S_p(a,b) = l_{p+1}(b) + Delta(z_{p,a}, z_{p+1,b}, s_p, l)   transition score
  k_1 = argmax l_1,   k_{p+1} = argmax_b S_p(k_p, b)           selection

Delta's last layer starts at zero, so an untrained corrector reproduces DFlash exactly. The scores
reuse the DFlash pass (hidden states and logits): no attention, no extra drafter pass; only the
K-way lookup of the walk is sequential, and it is vectorised over the batch.

`anchor_pair` (an extension, off by default) also corrects the first draft slot: the anchor (the
last accepted token, known exactly) becomes position 0 with a shortlist of itself and the drafter's
hidden state at the anchor slot, so S_0(anchor, b) re-ranks the first slot's candidates. The walk
is unchanged (it starts at index 0, which is now the anchor). At initialisation S_0 = l_1, so it
still reproduces DFlash.

At T > 0 the walk is (a) the one-hot corrected draft or (b) sampled, k_{p+1} ~ softmax(S_p(k_p, .) / T)
over the K candidates (`sampled_walk`). `vocab_walk` (an extension of (b)) samples each slot from the
drafter's own distribution over the draft vocabulary with the K candidates' logits replaced by
S_p(k_p, .): the target's mass off the shortlist stays reachable (at T=1 it is most of it), and a
zero corrector samples exactly as DFlash does. Its scores must be trained on an absolute scale
(the L1 term of `DCOCOLoss`): cross-entropy over K candidates leaves their common offset free.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict

from ..nn.layers import RMSNorm, at_least_float32
from ..verify import draw_uniforms, sample_from, target_probs
from .base import DraftInput, DraftOutput
from .dflash import BlockDrafter, DFlashConfig, DFlashModel, mixed_q, shortlist


class DCOCOConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    top_k: int = 8
    proj_dim: int = 128
    hidden: int = 256
    use_embedding: bool = True
    use_hidden: bool = True
    use_pair_context: bool = True
    sampled_walk: bool = False  # at T > 0: sample the walk from softmax(S / T) (variant b) instead of one-hot
    vocab_walk: bool = (
        False  # extension of the sampled walk: draw from the whole draft vocabulary, the shortlist rescored
    )
    sampled_head: bool = False  # extension: a second output of Delta scores the T > 0 walks (trained to match p_target)
    anchor_pair: bool = False  # extension: a pair (anchor, slot 1) so the first draft slot is corrected too
    # extension: pairs in the corpus bigram table Delta reads (buffers `bigram_*`, built by training from
    # the target's answers: `drafter.dcoco.bigram`); 0: none
    bigram_pairs: int = 0


class Corrector(nn.Module):
    """Scores all K x K candidate pairs of every neighbouring pair of draft positions.

    With a bigram table (`bigram_pairs` > 0) Delta also reads, for each pair (a, b), how often the
    target's own answers continue a with b: log c(a, b) / (c(a) + 1) and log(c(a) + 1). The drafter
    computes every slot blind to the token chosen before it, and a table of the target's bigrams is
    exact where the learned z_a * z_b term can only approximate them."""

    def __init__(self, hidden_size: int, cfg: DCOCOConfig, eps: float = 1e-6, vocab_size: int = 0):
        super().__init__()
        self.cfg = cfg
        self.vocab_size = vocab_size
        d, h = cfg.proj_dim, cfg.hidden
        self.proj_emb = nn.Linear(hidden_size, d, bias=False)
        self.proj_hid = nn.Linear(hidden_size, d, bias=False)
        self.norm_emb, self.norm_hid = RMSNorm(d, eps), RMSNorm(d, eps)
        self.fuse = nn.Linear(2 * d, d)
        self.proj_pair = nn.Linear(2 * hidden_size, d, bias=False)
        self.norm_pair = RMSNorm(d, eps)
        # first layer of Delta, split by input so the K x K broadcast stays cheap:
        # W [z_a ; z_b ; z_a * z_b ; s ; logit features] = W_a z_a + W_b z_b + W_ab (z_a * z_b) + W_s s + W_l l
        self.w_a = nn.Linear(d, h)
        self.w_b = nn.Linear(d, h, bias=False)
        self.w_ab = nn.Linear(d, h, bias=False)
        self.w_s = nn.Linear(d, h, bias=False)
        self.w_l = nn.Linear(4, h, bias=False)
        self.out = nn.Linear(h, 1)
        # the T > 0 walks' own output (`sampled_head`): greedy selection wants the target's argmax
        # ranked first, sampling wants q close to p_target; one output cannot serve both
        self.out_sampled = nn.Linear(h, 1) if cfg.sampled_head else None
        for layer in (self.out, self.out_sampled):
            if layer is not None:
                nn.init.zeros_(layer.weight)
                nn.init.zeros_(layer.bias)
        self.w_g = None
        if cfg.bigram_pairs:
            n = cfg.bigram_pairs
            self._bigram_buffers(torch.zeros(n, dtype=torch.long), torch.ones(n, dtype=torch.int32))

    def _bigram_buffers(self, keys: torch.Tensor, counts: torch.Tensor) -> None:
        """The table, integers (saved exactly): keys a * V + b (sorted), their counts c(a, b), and
        c(a) for every a."""
        if not self.vocab_size:
            raise ValueError("a corrector with a bigram table needs the vocabulary size")
        dev = self.out.weight.device
        keys, counts = keys.to(dev), counts.to(device=dev, dtype=torch.int32)
        totals = torch.zeros(self.vocab_size, dtype=torch.int32, device=dev).index_add_(
            0, keys // self.vocab_size, counts
        )
        self.register_buffer("bigram_keys", keys)
        self.register_buffer("bigram_counts", counts)
        self.register_buffer("bigram_totals", totals)
        if self.w_g is None:
            self.w_g = nn.Linear(2, self.cfg.hidden, bias=False, device=dev)
            nn.init.zeros_(self.w_g.weight)  # a trained corrector scores exactly as before until it learns

    def set_bigrams(self, keys: torch.Tensor, counts: torch.Tensor) -> None:
        """Read the bigram table `keys` (a * V + b, distinct) with their counts from now on."""
        order = keys.argsort()
        self.cfg.bigram_pairs = keys.numel()
        self._bigram_buffers(keys[order].long(), counts[order])

    def bigram_features(self, ids: torch.Tensor) -> torch.Tensor:
        """(N, P-1, K, K, 2) for the candidate ids (N, P, K): log c(a, b) / (c(a) + 1), an unseen pair
        counted as half, and log(c(a) + 1), both scaled to about unit size."""
        a, b = ids[:, :-1], ids[:, 1:]
        keys = a.unsqueeze(3) * self.vocab_size + b.unsqueeze(2)
        pos = torch.searchsorted(self.bigram_keys, keys).clamp(max=self.bigram_keys.numel() - 1)
        seen = self.bigram_keys[pos] == keys
        log_count = torch.where(seen, self.bigram_counts[pos].float(), 0.5).log()
        log_total = self.bigram_totals[a].float().log1p().unsqueeze(3).expand_as(log_count)
        return torch.stack([(log_count - log_total) / 4, log_total / 8], dim=-1)

    @torch.no_grad()
    def take(self, trained: "Corrector") -> None:
        """Load a trained corrector of this shape or a narrower one (smaller proj_dim and hidden) so
        that this one scores exactly as it does, up to RMSNorm's eps. Its weights fill the leading
        rows and columns; each new hidden unit keeps its random input weights and starts with a zero
        output weight; each new projection dimension starts at zero, with the norms' old gains rescaled
        so that they keep their scale over the wider mean. A corrector that has stopped improving
        gains capacity without starting again from zero."""
        d0, h0, d1, h1 = trained.cfg.proj_dim, trained.cfg.hidden, self.cfg.proj_dim, self.cfg.hidden
        if d0 > d1 or h0 > h1:
            raise ValueError(f"a corrector of proj_dim {d0}, hidden {h0} does not fit proj_dim {d1}, hidden {h1}")
        old = dict(trained.named_parameters())
        for name, p in self.named_parameters():
            q = old.get(name)
            if q is None:  # a T > 0 output the trained corrector lacks: it starts at zero
                p.zero_()
                continue
            if name == "fuse.weight":  # its input [e ; hh] grows in both halves
                p[:d0, :d0], p[:d0, d1 : d1 + d0] = q[:, :d0], q[:, d0:]
            else:
                p[tuple(slice(0, n) for n in q.shape)] = q
        for proj in (self.proj_emb, self.proj_hid, self.proj_pair):
            proj.weight[d0:] = 0
        for w in (self.w_a, self.w_b, self.w_ab, self.w_s):
            w.weight[:h0, d0:] = 0
        for out in (self.out, self.out_sampled):
            if out is not None:
                out.weight[:, h0:] = 0
        if trained.cfg.bigram_pairs:  # its table comes with it (`w_g` came with the parameters)
            self.set_bigrams(trained.bigram_keys, trained.bigram_counts)
        for norm in (self.norm_emb, self.norm_hid, self.norm_pair):
            norm.weight[:d0] *= (d0 / d1) ** 0.5

    def candidates(self, emb: torch.Tensor, hid: torch.Tensor) -> torch.Tensor:
        """z (N, P, K, d) from candidate embeddings (N, P, K, H) and position hidden states (N, P, H)."""
        e = self.norm_emb(self.proj_emb(emb))
        hh = self.norm_hid(self.proj_hid(hid)).unsqueeze(2).expand_as(e)
        if not self.cfg.use_embedding:
            e = torch.zeros_like(e)
        if not self.cfg.use_hidden:
            hh = torch.zeros_like(hh)
        return F.silu(self.fuse(torch.cat([e, hh], dim=-1)))

    def forward(
        self, emb: torch.Tensor, hid: torch.Tensor, logits: torch.Tensor, ids: Optional[torch.Tensor] = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Transition scores S (N, P-1, K, K): S[:, p, a, b] = l_{p+1}(b) + Delta(a, b), for the greedy
        walk and for the T > 0 walks (the same tensor without a `sampled_head`), from one pass.

        emb: (N, P, K, H) candidate embeddings; hid: (N, P, H) drafter hidden states;
        logits: (N, P, K) the drafter's logits of the candidates; ids: (N, P, K) their token ids
        (read with a bigram table only)."""
        z = self.candidates(emb, hid)
        za, zb = z[:, :-1], z[:, 1:]  # (N, P-1, K, d)
        # every term but W_ab (z_a * z_b) depends on one side only: sum it per side, broadcast once
        lg = at_least_float32(logits)
        ls = lg - torch.logsumexp(lg, -1, keepdim=True)
        wl = self.w_l.weight  # columns: l_a, l_b, log-softmax l_a, log-softmax l_b
        side_a = self.w_a(za) + F.linear(torch.stack([lg[:, :-1], ls[:, :-1]], -1).to(za.dtype), wl[:, 0::2])
        side_b = self.w_b(zb) + F.linear(torch.stack([lg[:, 1:], ls[:, 1:]], -1).to(zb.dtype), wl[:, 1::2])
        if self.cfg.use_pair_context:
            s = self.norm_pair(self.proj_pair(torch.cat([hid[:, :-1], hid[:, 1:]], dim=-1)))
            side_a = side_a + self.w_s(s).unsqueeze(2)
        x = self.w_ab(za.unsqueeze(3) * zb.unsqueeze(2))  # (N, P-1, K, K, h)
        if self.w_g is not None:
            if ids is None:
                raise ValueError("a corrector with a bigram table needs the candidates' token ids")
            x = x + self.w_g(self.bigram_features(ids).to(x.dtype))
        x = F.silu(x.add_(side_a.unsqueeze(3)).add_(side_b.unsqueeze(2)))
        base = lg[:, 1:].unsqueeze(2)
        if self.out_sampled is None:
            greedy = base + self.out(x).squeeze(-1)
            return greedy, greedy
        heads = F.linear(
            x, torch.cat([self.out.weight, self.out_sampled.weight]), torch.cat([self.out.bias, self.out_sampled.bias])
        )  # both outputs in one pass
        return base + heads[..., 0], base + heads[..., 1]


def walk_greedy(scores: torch.Tensor) -> torch.Tensor:
    """Left-to-right selection: index 0 (the drafter's first choice) at the first position, then
    argmax_b S_p(k_p, b). scores (N, P-1, K, K) -> indices (N, P)."""
    N, P1, K, _ = scores.shape
    idx = torch.zeros(N, P1 + 1, dtype=torch.long, device=scores.device)
    rows = torch.arange(N, device=scores.device)
    for p in range(P1):
        idx[:, p + 1] = scores[rows, p, idx[:, p]].argmax(-1)
    return idx


def walk_sampled(
    scores: torch.Tensor, first_logits: Optional[torch.Tensor], temperature: torch.Tensor, uniforms: torch.Tensor
):
    """Sampled walk: k_1 ~ softmax(l_1 / T) over the shortlist, k_{p+1} ~ softmax(S_p(k_p, .) / T).
    `first_logits` None: position 0 is fixed at index 0 (the anchor of `anchor_pair`). Returns
    indices (N, P) and the K-way distribution each index was drawn from (N, P, K); `uniforms` holds
    one column per drawn position, in order."""
    N, P1, K, _ = scores.shape
    T = temperature.view(N, 1).float()
    probs = torch.zeros(N, P1 + 1, K, device=scores.device)
    idx = torch.zeros(N, P1 + 1, dtype=torch.long, device=scores.device)
    rows = torch.arange(N, device=scores.device)
    if first_logits is None:
        probs[:, 0, 0] = 1.0
    else:
        probs[:, 0] = torch.softmax(first_logits.float() / T, -1)
        idx[:, 0] = sample_from(probs[:, 0], uniforms[:, 0])
    u = uniforms[:, int(first_logits is not None) :]
    for p in range(P1):
        probs[:, p + 1] = torch.softmax(scores[rows, p, idx[:, p]].float() / T, -1)
        idx[:, p + 1] = sample_from(probs[:, p + 1], u[:, p])
    return idx, probs


def walk_vocab(
    scores: torch.Tensor, ids: torch.Tensor, logits: torch.Tensor, lead: int, params, uniforms: torch.Tensor
):
    """Sampled walk over the whole draft vocabulary (an extension): slot j draws from the drafter's
    own distribution (temperature, top-k, top-p of the request) with its K shortlisted candidates
    rescored by S(k_prev, .), where k_prev is the candidate drawn before it; a draw off the
    shortlist leaves the next slot uncorrected. The K-way walk loses the target's mass off the
    shortlist, which at T=1 is large; this q keeps it, and with Delta = 0 it is exactly DFlash's.

    scores (N, L+k-1, K, K), ids (N, L+k, K) over the walk's positions; logits (N, k, V) of the
    draft slots; L = `lead`. Returns tokens (N, k) and q (N, k, V)."""
    N, k, V = logits.shape
    rows = torch.arange(N, device=logits.device)
    tokens = torch.zeros(N, k, dtype=torch.long, device=logits.device)
    probs = torch.zeros(N, k, V, device=logits.device)
    prev = torch.zeros(
        N, dtype=torch.long, device=logits.device
    )  # index of the drawn candidate at the previous position
    listed = torch.full((N,), bool(lead), device=logits.device)  # ... and whether it was on its shortlist
    for j in range(k):
        w = j + lead  # walk position of slot j
        row = logits[:, j].float()
        if w > 0:
            fixed = row.scatter(1, ids[:, w], scores[rows, w - 1, prev].float())
            row = torch.where(listed.unsqueeze(1), fixed, row)
        probs[:, j] = target_probs(row.unsqueeze(1), params).squeeze(1)
        tokens[:, j] = sample_from(probs[:, j], uniforms[:, j])
        hit = ids[rows, w] == tokens[:, j : j + 1]
        listed, prev = hit.any(-1), hit.float().argmax(-1)
    return tokens, probs


class DCOCOModel(DFlashModel):
    """The DFlash backbone plus the corrector (trained jointly)."""

    def __init__(self, cfg: DFlashConfig, dcfg: DCOCOConfig):
        super().__init__(cfg)
        self.dcfg = dcfg
        self.corrector = Corrector(cfg.hidden_size, dcfg, cfg.rms_norm_eps, cfg.vocab_size)

    @property
    def lead(self) -> int:
        """Positions of the walk before the first draft slot: 1 (the anchor) with `anchor_pair`, else 0."""
        return int(self.dcfg.anchor_pair)

    def pair_scores(
        self,
        hidden: torch.Tensor,
        logits: torch.Tensor,
        embed,
        top_k: Optional[int] = None,
        anchor: Optional[torch.Tensor] = None,
        anchor_hidden: Optional[torch.Tensor] = None,
    ):
        """Shortlists and their transition scores for draft slots: hidden (N, P, H), logits
        (N, P, V). Returns (candidate ids (N, L+P, K), candidate logits (N, L+P, K), greedy scores
        and T > 0 scores (N, L+P-1, K, K)) over the walk's positions; K is the trained top_k unless given
        (the corrector scores any K: an inference-time ablation). With `anchor_pair` (L = 1)
        position 0 is the anchor: `anchor` (N,) repeated K times, logits 0, hidden state
        `anchor_hidden` (N, H) (the drafter's anchor slot)."""
        vals, ids = shortlist(logits, top_k or self.dcfg.top_k, self.draft_ids)
        if self.lead:
            if anchor is None or anchor_hidden is None:
                raise ValueError("anchor_pair needs the anchor tokens and the anchor slot's hidden state")
            ids = torch.cat([anchor.view(-1, 1, 1).expand(-1, 1, ids.shape[-1]), ids], dim=1)
            vals = torch.cat([torch.zeros_like(vals[:, :1]), vals], dim=1)
            hidden = torch.cat([anchor_hidden.unsqueeze(1).to(hidden.dtype), hidden], dim=1)
        with torch.no_grad():
            emb = embed(ids)
        return ids, vals, *self.corrector(emb.to(hidden.dtype), hidden, vals, ids)


class DCOCODrafter(BlockDrafter):
    method = "dcoco"

    def __init__(self, model: DCOCOModel, target, correct: bool = True):
        super().__init__(model, target)
        self.correct = correct
        self.top_k = model.dcfg.top_k
        self.walk = "vocab" if model.dcfg.vocab_walk else "sampled" if model.dcfg.sampled_walk else "onehot"
        vocab = model.draft_ids  # token id -> its column of the draft vocabulary (shortlists lie within it)
        self.vocab_pos = (
            None
            if vocab is None
            else torch.zeros(model.cfg.vocab_size, dtype=torch.long, device=vocab.device).index_copy_(
                0, vocab, torch.arange(len(vocab), device=vocab.device)
            )
        )

    def configure(
        self, correct: bool = True, top_k: Optional[int] = None, walk: Optional[str] = None
    ) -> "DCOCODrafter":
        """Inference options: correction on/off, shortlist size, T > 0 variant ('onehot' | 'sampled' | 'vocab')."""
        self.correct = correct
        if top_k is not None:
            self.top_k = top_k
        if walk is not None:
            self.walk = walk
        return self

    def select(
        self, hidden: torch.Tensor, logits: torch.Tensor, inp: DraftInput, anchor_hidden: Optional[torch.Tensor] = None
    ) -> DraftOutput:
        N, k, V = logits.shape
        if not self.correct or k + self.model.lead < 2:
            return super().select(hidden, logits, inp)
        return self._corrected(hidden, logits, inp, anchor_hidden)

    def _vocab_walk(self, scores: torch.Tensor, ids: torch.Tensor, logits: torch.Tensor, params, u: torch.Tensor):
        """`walk_vocab` over the draft vocabulary's columns when there is one (q is zero elsewhere)."""
        cols = ids if self.vocab_pos is None else self.vocab_pos[ids]
        tok, q = walk_vocab(scores, cols, self.draft_columns(logits), self.model.lead, params, u)
        return self.full_columns(tok, q, logits.shape[-1])

    def _corrected(
        self, hidden: torch.Tensor, logits: torch.Tensor, inp: DraftInput, anchor_hidden: Optional[torch.Tensor]
    ) -> DraftOutput:
        N, k, V = logits.shape
        lead, dev = self.model.lead, logits.device
        anchor = torch.tensor([ids[-1] for ids in inp.token_ids], dtype=torch.long, device=dev)
        greedy = torch.tensor([sp.greedy for sp in inp.params], device=dev)
        sampled = self.walk != "onehot" and not greedy.all()
        ids, vals, scores, hot = self.model.pair_scores(hidden, logits, self.embed, self.top_k, anchor, anchor_hidden)
        if not sampled or greedy.any():
            pick = walk_greedy(scores)
        else:
            pick = torch.zeros(N, k + lead, dtype=torch.long, device=dev)
        tokens = ids[:, lead:].gather(2, pick[:, lead:].unsqueeze(2)).squeeze(2)
        probs = None
        if sampled:
            si = (~greedy).nonzero().squeeze(1)
            u = draw_uniforms([inp.generators[b] for b in si.tolist()], k, logits.device)
            if self.walk == "vocab":
                tok, q = self._vocab_walk(hot[si], ids[si], logits[si], [inp.params[b] for b in si.tolist()], u)
            else:
                temps = torch.tensor([inp.params[b].temperature for b in si.tolist()], device=dev)
                sidx, sprobs = walk_sampled(hot[si], None if lead else vals[si, 0], temps, u)
                tok = ids[si, lead:].gather(2, sidx[:, lead:].unsqueeze(2)).squeeze(2)
                # q of each drawn slot over the vocabulary, zero off the shortlist (its ids are distinct)
                q = torch.zeros(len(si), k, V, device=dev).scatter_(2, ids[si, lead:], sprobs[:, lead:])
            tokens[si] = tok
            probs = mixed_q(tokens, si, q, V)
        return DraftOutput(tokens=tokens, lengths=torch.full((N,), k, dtype=torch.long, device=dev), probs=probs)
