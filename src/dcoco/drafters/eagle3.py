"""EAGLE-3: a one-layer autoregressive drafter on fused low/mid/high target features.

Published design (Li et al., "EAGLE-3: Scaling up Inference Acceleration of Large Language Models via
Training-Time Test"; checkpoint layout of SpecForge / vLLM `LlamaForCausalLMEagle3`):

- three target layers (low, middle, high) are concatenated and fused by `fc`: Linear(3H -> H, no bias);
- one decoder layer (`midlayer`) whose attention input is concat(input_layernorm(token embedding),
  hidden_norm(hidden)), so q/k/v_proj take 2H; the residual is the (un-normed) hidden input;
  SwiGLU MLP; then the final `norm` and an own `lm_head` over a reduced draft vocabulary;
- entry t of the drafter sequence reads the fused target feature of token t and the embedding of
  token t+1, at position t, and predicts token t+2. Drafting step j >= 1 feeds the drafter's own
  pre-norm output (not a target feature) and the token drafted at the previous step, at the next
  position; its attention sees the step-0 entries of every committed token plus the chain so far.

Draft vocabulary: the `draft_vocab_size` most frequent tokens of the training data's responses
(ties by token id), sorted by id. Buffers as SpecForge / vLLM store them: `d2t` (draft_vocab_size,)
int64 offsets, target_id = draft_id + d2t[draft_id]; `t2d` (vocab_size,) bool, True for target
tokens in the draft vocabulary. Drafted tokens are mapped back with d2t. At T > 0 the reported q is
the request's transform (temperature / top-k / top-p) of the draft logits, scattered onto the full
vocabulary (zero outside the draft vocabulary): exactly the distribution the token was drawn from.

Layer ids (the off-by-one trap): dcoco stores `eagle_config.eagle_aux_hidden_state_layer_ids` as
0-based decoder-layer ids (the OUTPUT of decoder layer i = tap / `hidden_states[i + 1]`), as SpecForge
trains and SGLang reads them (SGLang adds 1 internally). vLLM reads the TOP-LEVEL
`eagle_aux_hidden_state_layer_ids` as the index of the decoder layer whose INPUT it captures, which
is `hidden_states[i]`; so the checkpoint also carries the top-level field with the same layers
expressed that way (each id + 1). For SmolLM2 (30 layers): layer ids [1, 14, 27] = taps
[2, 15, 28] = top-level [2, 15, 28]. On load, `eagle_config` wins; a checkpoint with only the
top-level field is read with vLLM's meaning.

Inference state is per request (`request_id`): the K/V of the step-0 entries of its committed
tokens (appended as target features arrive, never rolled back: rejected drafts never enter it) and
the pre-norm output of its last entry. Chain K/V live only inside one `propose`. Requests of
different lengths are batched with padding masks; `release` drops a request's state.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict

from ..errors import ModelNotFoundError
from ..nn.layers import RMSNorm, SwiGLU, apply_rope, at_least_float32, rope_cos_sin
from ..verify import draw_uniforms, sample_from, target_probs
from .base import Drafter, DraftInput, DraftOutput, check_feature_drafter
from .checkpoint import save_checkpoint


def default_eagle_layer_ids(num_target_layers: int, available_taps: Optional[Sequence[int]] = None) -> list[int]:
    """Low / middle / high layers, as 0-based decoder-layer ids (output of layer i = tap i + 1).

    The published default taps are hidden_states[2], [L // 2], [L - 3] (SpecForge layer ids
    [1, L // 2 - 1, L - 4]). With `available_taps` (e.g. a data manifest's), each is replaced by the
    nearest available tap in [1, L - 1] not already chosen (ties: the lower one), so training can
    use regenerated data as it is: SmolLM2's [2, 9, 15, 21, 28, 30] gives taps [2, 15, 28]."""
    L = num_target_layers
    wanted = [2, L // 2, L - 3]
    pool = sorted({int(t) for t in (available_taps if available_taps is not None else range(1, L))} & set(range(1, L)))
    if len(pool) < 3:
        raise ValueError(f"EAGLE-3 needs 3 tapped decoder layers below the last, have {pool}")
    chosen: list[int] = []
    for w in wanted:
        best = min((t for t in pool if t not in chosen), key=lambda t: (abs(t - w), t))
        chosen.append(best)
    return [t - 1 for t in sorted(chosen)]


class Eagle3Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192
    vocab_size: int  # the target's
    draft_vocab_size: int
    num_target_layers: int
    layer_ids: list[int]  # 0-based decoder-layer ids, low -> high (see module docstring)
    num_speculative_tokens: int = 7  # default chain length K at inference

    @property
    def taps(self) -> tuple[int, ...]:
        return tuple(i + 1 for i in self.layer_ids)

    @classmethod
    def for_target(
        cls,
        target,
        layer_ids: Sequence[int],
        draft_vocab_size: int = 8192,
        intermediate_size: Optional[int] = None,
        num_speculative_tokens: int = 7,
    ) -> "Eagle3Config":
        cfg = target.config
        rope = getattr(cfg, "rope_parameters", None) or {}
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"EAGLE-3 drafter supports default RoPE only, target uses {rope.get('rope_type')}")
        heads = cfg.num_attention_heads
        return cls(
            hidden_size=cfg.hidden_size,
            intermediate_size=intermediate_size or cfg.intermediate_size,
            num_attention_heads=heads,
            num_key_value_heads=getattr(cfg, "num_key_value_heads", heads),
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
            rms_norm_eps=cfg.rms_norm_eps,
            rope_theta=float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))),
            max_position_embeddings=target.max_context,
            vocab_size=target.vocab_size,
            draft_vocab_size=min(draft_vocab_size, target.vocab_size),
            num_target_layers=target.num_layers,
            layer_ids=[int(i) for i in layer_ids],
            num_speculative_tokens=num_speculative_tokens,
        )

    # -- HF-style config.json (field names as SpecForge / vLLM EAGLE-3 checkpoints) ---------------
    def to_hf(self, extra: Optional[dict] = None) -> dict:
        d = {
            "architectures": ["LlamaForCausalLMEagle3"],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "target_hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": 1,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": False,
            "norm_before_residual": False,
            "eagle_config": {
                "eagle_aux_hidden_state_layer_ids": list(self.layer_ids),  # SpecForge / SGLang: output of layer i
                "use_aux_hidden_state": True,
            },
            "eagle_aux_hidden_state_layer_ids": [i + 1 for i in self.layer_ids],  # vLLM: input of layer i
            "num_target_layers": self.num_target_layers,
            "dcoco_method": "eagle3",
            "dcoco_num_speculative_tokens": self.num_speculative_tokens,
        }
        d.update(extra or {})
        return d

    @classmethod
    def from_hf(cls, d: dict) -> "Eagle3Config":
        ec = d.get("eagle_config") or {}
        if ec.get("eagle_aux_hidden_state_layer_ids"):
            ids = [int(i) for i in ec["eagle_aux_hidden_state_layer_ids"]]
        elif d.get("eagle_aux_hidden_state_layer_ids"):
            ids = [int(i) - 1 for i in d["eagle_aux_hidden_state_layer_ids"]]  # vLLM meaning
        else:
            raise ModelNotFoundError("EAGLE-3 config.json names no eagle_aux_hidden_state_layer_ids")
        try:
            heads = d["num_attention_heads"]
            return cls(
                hidden_size=d["hidden_size"],
                intermediate_size=d["intermediate_size"],
                num_attention_heads=heads,
                num_key_value_heads=d.get("num_key_value_heads", heads),
                head_dim=d.get("head_dim") or d["hidden_size"] // heads,
                rms_norm_eps=d.get("rms_norm_eps", 1e-6),
                rope_theta=d.get("rope_theta", (d.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
                max_position_embeddings=d.get("max_position_embeddings", 8192),
                vocab_size=d["vocab_size"],
                draft_vocab_size=d.get("draft_vocab_size") or d["vocab_size"],
                num_target_layers=d["num_target_layers"],
                layer_ids=ids,
                num_speculative_tokens=d.get("dcoco_num_speculative_tokens", 7),
            )
        except KeyError as e:
            raise ModelNotFoundError(f"drafter config.json lacks field {e.args[0]!r}") from None


class Eagle3Attention(nn.Module):
    """Projections of the 2H-wide attention input; the attention itself is computed by the caller
    (training-time-test structure in training, per-request cache + chain at inference)."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(2 * hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(2 * hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(2 * hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        N, n, _ = x.shape
        q = self.q_proj(x).view(N, n, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(N, n, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(N, n, self.kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def expand(self, t: torch.Tensor) -> torch.Tensor:
        """Repeat K/V heads for grouped-query attention."""
        rep = self.heads // self.kv_heads
        return t.repeat_interleave(rep, dim=1) if rep > 1 else t


class Eagle3DecoderLayer(nn.Module):
    def __init__(self, hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int, eps: float):
        super().__init__()
        self.input_layernorm = RMSNorm(hidden, eps)
        self.hidden_norm = RMSNorm(hidden, eps)
        self.self_attn = Eagle3Attention(hidden, heads, kv_heads, head_dim)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = SwiGLU(hidden, intermediate)

    def qkv(self, emb: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        x = torch.cat([self.input_layernorm(emb.to(hidden.dtype)), self.hidden_norm(hidden)], dim=-1)
        return self.self_attn.qkv(x, cos, sin)

    def finish(self, hidden: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Residual + o_proj of the attention output (N, heads, n, d), then the MLP block."""
        N, _, n, _ = attn.shape
        h = hidden + self.self_attn.o_proj(attn.transpose(1, 2).reshape(N, n, -1))
        return h + self.mlp(self.post_attention_layernorm(h))


def ttt_attention(q, qpos, k0, v0, diag_k: list, diag_v: list, attn: Eagle3Attention) -> torch.Tensor:
    """Training-time-test attention of unrolled step j = len(diag_k) >= 1: the query of start slot t
    sees the step-0 entries s <= t and its own chain entries (t, 1..j), exactly as drafting step j
    at inference sees the request's cache and the chain so far.
    q: (S, h, A, d) queries of the A start slots `qpos` (S, A); k0/v0: (S, kv, T, d) step-0 entries of
    every slot; diag_k/diag_v: (S, kv, A, d) per chain step. Returns (S, h, A, d)."""
    T, d = k0.shape[2], q.shape[3]
    scale = d**-0.5
    k0, v0 = attn.expand(k0), attn.expand(v0)
    main = at_least_float32(torch.matmul(q, k0.transpose(-1, -2))) * scale  # (S, h, A, T)
    seen = torch.arange(T, device=q.device).view(1, 1, 1, T) <= qpos.view(qpos.shape[0], 1, -1, 1)
    main = main.masked_fill(~seen, float("-inf"))
    dv = [attn.expand(v) for v in diag_v]
    diag = [at_least_float32((q * attn.expand(k)).sum(-1, keepdim=True)) * scale for k in diag_k]  # (S, h, A, 1)
    w = torch.softmax(torch.cat([main] + diag, dim=-1), dim=-1).to(q.dtype)
    out = torch.matmul(w[..., :T], v0)
    for i, v in enumerate(dv):
        out = out + w[..., T + i : T + i + 1] * v
    return out


class Eagle3Model(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.cfg = cfg
        H = cfg.hidden_size
        self.fc = nn.Linear(len(cfg.layer_ids) * H, H, bias=False)
        self.midlayer = Eagle3DecoderLayer(
            H, cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps
        )
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        self.t2d[: cfg.draft_vocab_size] = True  # identity mapping until `set_vocab`
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)

    # -- vocabulary ------------------------------------------------------------------------------
    def set_vocab(self, draft_ids: torch.Tensor) -> None:
        """Use the target tokens `draft_ids` (draft_vocab_size distinct ids) as the draft vocabulary."""
        ids = torch.as_tensor(draft_ids, dtype=torch.long).sort().values
        if ids.numel() != self.cfg.draft_vocab_size or ids.unique().numel() != ids.numel():
            raise ValueError(f"need {self.cfg.draft_vocab_size} distinct token ids")
        self.d2t.copy_(ids - torch.arange(ids.numel()))
        self.t2d.zero_()
        self.t2d[ids] = True

    @property
    def draft_to_target(self) -> torch.Tensor:
        """Target id of every draft id (draft_vocab_size,)."""
        return torch.arange(self.cfg.draft_vocab_size, device=self.d2t.device) + self.d2t

    def init_lm_head_from(self, target_lm_head: nn.Module) -> None:
        """Start the draft head from the target's LM head rows of the draft vocabulary."""
        with torch.no_grad():
            self.lm_head.weight.copy_(target_lm_head.weight[self.draft_to_target].to(self.lm_head.weight.dtype))

    # -- pieces ----------------------------------------------------------------------------------
    def rope(self, positions: torch.Tensor, dtype: torch.dtype):
        return rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta, dtype)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits of pre-norm drafter outputs."""
        return self.lm_head(self.norm(hidden))

    def unroll(
        self,
        embed: nn.Module,
        ids: torch.Tensor,
        features: torch.Tensor,
        steps: int,
        slots: Optional[torch.Tensor] = None,
    ) -> list[torch.Tensor]:
        """Training-time test. `ids` (S, T) tokens, `features` (S, T, 3H) the target features of token t
        at slot t. Step 0 runs on every slot (their K/V are the keys all later steps see): slot t
        reads token t+1 at position t. Steps j >= 1 run on the start slots `slots` (S, A) (None: all
        slots; entries < 0 are padding): start slot t reads its own step j-1 output and token
        t+1+j at position t+j. Step j at start slot t predicts token t+2+j. Returns the pre-norm
        outputs (S, A, H) of every step at the start slots."""
        S, T, _ = features.shape
        dev, layer = features.device, self.midlayer
        ext = torch.cat([ids, ids.new_zeros(S, steps + 1)], 1)  # tokens past the end: padding
        with torch.no_grad():
            emb0 = embed(ext[:, 1 : T + 1])
        g = self.fc(features)
        pos = torch.arange(T, device=dev).unsqueeze(0).expand(S, T)
        cos, sin = self.rope(pos, g.dtype)
        q, k0, v0 = layer.qkv(emb0, g, cos, sin)
        a = layer.self_attn
        h0 = layer.finish(g, F.scaled_dot_product_attention(q, a.expand(k0), a.expand(v0), is_causal=True))
        if slots is None:
            start, hidden = pos, h0
        else:
            start = slots.clamp(min=0)
            hidden = h0.gather(1, start.unsqueeze(2).expand(-1, -1, h0.shape[-1]))
        outs, dk, dv = [hidden], [], []
        for j in range(1, steps):
            with torch.no_grad():
                emb = embed(ext.gather(1, start + 1 + j))
            cos, sin = self.rope(start + j, g.dtype)
            q, k, v = layer.qkv(emb, hidden, cos, sin)
            dk.append(k)
            dv.append(v)
            hidden = layer.finish(hidden, ttt_attention(q, start, k0, v0, dk, dv, a))
            outs.append(hidden)
        return outs

    def unroll_sharded(self, embed: nn.Module, ids: torch.Tensor, features: torch.Tensor, steps: int, slots, shard):
        """`unroll` on one rank's zigzag shard (`shard`, a `dcoco.parallel.ContextShard`): `ids`
        (1, total) the packed tokens of every sequence, `features` (1, T_r, 3H) the shard's, `slots`
        (1, A) the packed start slots this rank owns (-1: a placeholder chain). Step 0 is causal
        self-attention over the sequences (the ring); step j >= 1 of a chain sees the step-0
        entries up to its start slot wherever they live, and its own entries (`chain_attend`). A
        token past a sequence's end is the next sequence's here, padding in `unroll`: it feeds only
        entries no loss term reads."""
        layout, layer = shard.layout, self.midlayer
        last = layout.total - 1
        with torch.no_grad():
            emb0 = embed(ids[:, (layout.local_indices(shard.rank) + 1).clamp(max=last)])
        g = self.fc(features)
        cos, sin = self.rope(layout.local_positions(shard.rank).view(1, -1), g.dtype)
        q, k0, v0 = layer.qkv(emb0, g, cos, sin)
        h0 = layer.finish(g, shard.self_attend(q, k0, v0))
        real = slots[0] >= 0
        start = slots[0].clamp(min=0)
        seq = torch.searchsorted(layout.cu_seqlens[1:], start, right=True)
        pos = start - layout.cu_seqlens[seq]
        row = torch.where(real, layout.owners(seq, pos)[1], 0)
        limits = torch.where(real, pos, -1)  # a placeholder sees no context
        hidden = h0[:, row]
        outs, dk, dv = [hidden], [], []
        for j in range(1, steps):
            with torch.no_grad():
                emb = embed(ids[:, (start + 1 + j).clamp(max=last)])
            cos, sin = self.rope((pos + j).view(1, -1), g.dtype)
            q, k, v = layer.qkv(emb, hidden, cos, sin)
            dk.append(k)
            dv.append(v)
            hidden = layer.finish(hidden, shard.chain_attend(q, seq, limits, k0, v0, dk, dv))
            outs.append(hidden)
        return outs


@dataclass
class _RequestState:
    k: torch.Tensor  # (kv_heads, n, d) step-0 entries of committed tokens
    v: torch.Tensor
    n: int  # entries so far (= committed tokens whose features arrived)
    last: torch.Tensor  # (H,) pre-norm output of the last entry


class Eagle3Drafter(Drafter):
    """Chain drafting of K tokens with a per-request drafter KV cache."""

    method = "eagle3"

    def __init__(self, model: Eagle3Model, target):
        self.model = model.eval()
        self.cfg = model.cfg
        self.embed = target.model.get_input_embeddings()
        self.tap_layers = self.cfg.taps
        self.default_num_tokens = self.cfg.num_speculative_tokens
        self.dtype = next(model.parameters()).dtype
        self.state: dict[int, _RequestState] = {}

    def check_target(self, target) -> None:
        c = self.cfg
        check_feature_drafter(target, c.vocab_size, c.hidden_size, c.num_target_layers, c.layer_ids)

    @property
    def device(self) -> torch.device:
        """Where every tensor of a drafting step is made: the model's (= the target's) device."""
        return self.model.fc.weight.device

    def absorb(self, inp: DraftInput) -> None:
        self._ingest(inp)

    def release(self, request_id: int) -> None:
        self.state.pop(request_id, None)

    def _attend(self, q, k, v, mask) -> torch.Tensor:
        a = self.model.midlayer.self_attn
        return F.scaled_dot_product_attention(q, a.expand(k), a.expand(v), attn_mask=mask)

    @torch.inference_mode()
    def _ingest(self, inp: DraftInput) -> None:
        """Step-0 entries for the newly committed tokens of every request, in one batched pass."""
        rows = [
            (b, r, f) for b, (r, f) in enumerate(zip(inp.request_ids, inp.new_features)) if f is not None and f.shape[0]
        ]
        if not rows:
            return
        R, n, dev = len(rows), max(f.shape[0] for _, _, f in rows), self.device
        feats = torch.zeros(R, n, rows[0][2].shape[-1], dtype=self.dtype, device=dev)
        toks = torch.zeros(R, n, dtype=torch.long, device=dev)
        pos = torch.zeros(R, n, dtype=torch.long, device=dev)
        old = []
        for i, (b, r, f) in enumerate(rows):
            st = self.state.get(r)
            P, m, seq = (st.n if st else 0), f.shape[0], inp.token_ids[b]
            if P + m != len(seq) - 1:
                raise RuntimeError(f"eagle3: request {r} has {len(seq)} tokens but {P + m} committed features")
            feats[i, :m] = f.to(self.dtype)
            toks[i, :m] = torch.tensor(seq[P + 1 : P + 1 + m], dtype=torch.long, device=dev)
            pos[i] = torch.arange(P, P + n, device=dev)
            old.append(P)
        layer = self.model.midlayer
        hidden = self.model.fc(feats)
        cos, sin = self.model.rope(pos, self.dtype)
        q, k, v = layer.qkv(self.embed(toks), hidden, cos, sin)
        Tc = max(old)
        kvh, d = k.shape[1], k.shape[3]
        K = torch.zeros(R, kvh, Tc + n, d, dtype=k.dtype, device=dev)
        V = torch.zeros_like(K)
        mask = torch.zeros(R, 1, n, Tc + n, dtype=torch.bool, device=dev)
        for i, (_, r, _) in enumerate(rows):
            if old[i]:
                K[i, :, : old[i]] = self.state[r].k
                V[i, :, : old[i]] = self.state[r].v
                mask[i, :, :, : old[i]] = True
        K[:, :, Tc:], V[:, :, Tc:] = k, v
        mask[:, :, :, Tc:] = torch.ones(n, n, dtype=torch.bool, device=dev).tril()
        out = layer.finish(hidden, self._attend(q, K, V, mask))
        for i, (_, r, f) in enumerate(rows):
            m = f.shape[0]
            st = self.state.get(r)
            nk, nv = k[i, :, :m], v[i, :, :m]
            if st is None:
                self.state[r] = _RequestState(nk.clone(), nv.clone(), m, out[i, m - 1].clone())
            else:
                st.k, st.v = torch.cat([st.k, nk], 1), torch.cat([st.v, nv], 1)
                st.n += m
                st.last = out[i, m - 1].clone()

    @torch.inference_mode()
    def propose(self, inp: DraftInput) -> DraftOutput:
        self._ingest(inp)
        rids, N, k, dev = inp.request_ids, len(inp.request_ids), inp.num_tokens, self.device
        if k <= 0:
            return DraftOutput.empty(N, dev)
        states = [self.state[r] for r in rids]
        lens = [s.n for s in states]
        T = max(lens)
        kvh, d = states[0].k.shape[0], states[0].k.shape[2]
        Kc = torch.zeros(N, kvh, T, d, dtype=self.dtype, device=dev)
        Vc = torch.zeros_like(Kc)
        cmask = torch.zeros(N, 1, 1, T, dtype=torch.bool, device=dev)
        for b, s in enumerate(states):
            Kc[b, :, : s.n], Vc[b, :, : s.n] = s.k, s.v
            cmask[b, :, :, : s.n] = True
        h = torch.stack([s.last for s in states]).unsqueeze(1)  # (N, 1, H)
        last_pos = torch.tensor(lens, dtype=torch.long, device=dev) - 1  # position of each request's last entry
        to_target = self.model.draft_to_target
        V = self.cfg.vocab_size
        sampled = [b for b, sp in enumerate(inp.params) if not sp.greedy]
        u = draw_uniforms([inp.generators[b] for b in sampled], k, h.device) if sampled else None
        tokens = torch.zeros(N, k, dtype=torch.long, device=dev)
        probs = torch.zeros(N, k, V, device=dev) if sampled else None
        layer = self.model.midlayer
        chain_k, chain_v = [], []
        for j in range(k):
            z = self.model.logits(h[:, 0]).float()  # (N, draft_vocab)
            did = z.argmax(-1)
            if sampled:
                qd = target_probs(z[sampled].unsqueeze(1), [inp.params[b] for b in sampled]).squeeze(1)
                did[sampled] = sample_from(qd, u[:, j])
                full = torch.zeros(len(sampled), V, device=dev)
                full[:, to_target] = qd
                probs[sampled, j] = full
            tok = to_target[did]
            tokens[:, j] = tok
            if j == k - 1:
                break
            cos, sin = self.model.rope((last_pos + 1 + j).unsqueeze(1), self.dtype)
            q, kk, vv = layer.qkv(self.embed(tok.unsqueeze(1)), h, cos, sin)
            chain_k.append(kk)
            chain_v.append(vv)
            K = torch.cat([Kc] + chain_k, dim=2)
            Vv = torch.cat([Vc] + chain_v, dim=2)
            mask = torch.cat([cmask, torch.ones(N, 1, 1, j + 1, dtype=torch.bool, device=dev)], dim=-1)
            h = layer.finish(h, self._attend(q, K, Vv, mask))
        if probs is not None:
            for b in (b for b, sp in enumerate(inp.params) if sp.greedy):
                probs[b].scatter_(1, tokens[b].unsqueeze(1), 1.0)  # greedy rows: one-hot q
        return DraftOutput(tokens=tokens, lengths=torch.full((N,), k, dtype=torch.long, device=dev), probs=probs)


# -- checkpoints ---------------------------------------------------------------------------------
def save_eagle3(
    path: str | Path, model: Eagle3Model, extra: Optional[dict] = None, dtype: torch.dtype = torch.bfloat16
) -> None:
    save_checkpoint(path, model.cfg.to_hf(extra), model.state_dict(), dtype)


def eagle3_state(model: Eagle3Model, state: dict[str, torch.Tensor], path) -> dict[str, torch.Tensor]:
    """A checkpoint's weights in `Eagle3Model`'s names: SpecForge's `layers.0.` prefix as `midlayer.`,
    no embedding table (dcoco always uses the target's), and `t2d` derived from `d2t` when missing."""
    state = {("midlayer." + k[len("layers.0.") :] if k.startswith("layers.0.") else k): v for k, v in state.items()}
    state.pop("embed_tokens.weight", None)
    if "t2d" not in state and "d2t" in state:
        state["t2d"] = torch.zeros(model.cfg.vocab_size, dtype=torch.bool)
        state["t2d"][torch.arange(model.cfg.draft_vocab_size) + state["d2t"].long()] = True
    if "t2d" in state and "d2t" in state:
        t2d = state["t2d"].bool().nonzero().squeeze(1)
        if not torch.equal(t2d, torch.arange(model.cfg.draft_vocab_size) + state["d2t"].long()):
            raise ModelNotFoundError(f"{path}: d2t and t2d disagree")
    return state
