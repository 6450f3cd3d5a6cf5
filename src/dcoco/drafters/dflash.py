"""DFlash: a parallel block drafter conditioned on the target's hidden states.

Published design (Chen et al., "DFlash: Block Diffusion for Flash Speculative Decoding"):
- n target layers are tapped, concatenated and fused by Linear(n*H -> H, no bias) + RMSNorm into a
  context feature per accepted token;
- the block is [anchor token, MASK x (B-1)], embedded with the target's frozen embedding table;
  slot k predicts the token at anchor + k;
- every drafter layer attends from the block to [context K/V ; block K/V] (context K/V come from
  the fused feature through that layer's own K/V projections), bidirectionally inside the block;
- the output goes through the drafter's final norm and the target's frozen LM head.

`target_layer_ids` use the published convention: 0-based decoder-layer indices, i.e. the output
of decoder layer i, which is dcoco tap index i + 1 (`hidden_states[i + 1]`).

`DFlashModel` is the backbone that DSpark and DCOCO reuse; `BlockDrafter` is the inference side
(per-request context caches, batching) with a `select` hook the families override.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict

from ..errors import ModelNotFoundError
from ..nn.attention import pack_gqa_mask
from ..nn.layers import DraftDecoderLayer, RMSNorm, rope_cos_sin
from ..nn.prepack import linear_of
from ..verify import draw_uniforms, sample_from, target_probs
from .base import Drafter, DraftInput, DraftOutput, check_feature_drafter
from .checkpoint import save_checkpoint


def default_target_layer_ids(num_target_layers: int, n: int) -> list[int]:
    """n decoder layers evenly spaced from layer 1 to layer L-3 (the published default)."""
    if n == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [int(round(start + i * (end - start) / (n - 1))) for i in range(n)]


class DFlashConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int = 2
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192
    vocab_size: int
    num_target_layers: int
    block_size: int = 16
    target_layer_ids: list[int]
    mask_token_id: int
    qk_norm: bool = True
    # default draft tokens per pass at inference (None: block_size - 1); a shipped checkpoint sets it
    # where its held-out per-position acceptance says later slots no longer pay for their verification
    num_speculative_tokens: Optional[int] = None
    # draft vocabulary: at inference the LM head scores only these most frequent response tokens of
    # the training data (buffer `draft_ids`), a sixth of the drafter's work on SmolLM2; None: all
    draft_vocab_size: Optional[int] = None

    @property
    def taps(self) -> tuple[int, ...]:
        return tuple(i + 1 for i in self.target_layer_ids)

    @classmethod
    def for_target(
        cls,
        target,
        num_layers: int = 2,
        block_size: Optional[int] = None,
        num_features: int = 5,
        mask_token_id: Optional[int] = None,
        intermediate_size: Optional[int] = None,
    ) -> "DFlashConfig":
        cfg = target.config
        rope = getattr(cfg, "rope_parameters", None) or {}
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"DFlash drafter supports default RoPE only, target uses {rope.get('rope_type')}")
        theta = rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
        heads = cfg.num_attention_heads
        return cls(
            hidden_size=cfg.hidden_size,
            intermediate_size=intermediate_size or cfg.intermediate_size,
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=getattr(cfg, "num_key_value_heads", heads),
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
            rms_norm_eps=cfg.rms_norm_eps,
            rope_theta=float(theta),
            max_position_embeddings=target.max_context,
            vocab_size=target.vocab_size,
            num_target_layers=target.num_layers,
            block_size=block_size or cls.model_fields["block_size"].default,
            target_layer_ids=default_target_layer_ids(target.num_layers, num_features),
            mask_token_id=mask_token_id if mask_token_id is not None else pick_mask_token(target),
        )

    # -- HF-style config.json (field names as vLLM / SpecForge DFlash checkpoints) ----------------
    def to_hf(self, method: str = "dflash", extra: Optional[dict] = None) -> dict:
        d = {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "hidden_act": "silu",
            "attention_bias": False,
            "tie_word_embeddings": False,
            "is_causal": False,
            "num_target_layers": self.num_target_layers,
            "block_size": self.block_size,
            "dflash_config": {
                "block_size": self.block_size,
                "mask_token_id": self.mask_token_id,
                "target_layer_ids": list(self.target_layer_ids),
            },
            "dcoco_method": method,
            "dcoco_qk_norm": self.qk_norm,
        }
        if self.num_speculative_tokens is not None:
            d["dcoco_num_speculative_tokens"] = self.num_speculative_tokens
        if self.draft_vocab_size is not None:
            d["dcoco_draft_vocab_size"] = self.draft_vocab_size
        d.update(extra or {})
        return d

    @classmethod
    def from_hf(cls, d: dict) -> "DFlashConfig":
        dc = d.get("dflash_config", {})
        try:
            return cls(
                hidden_size=d["hidden_size"],
                intermediate_size=d["intermediate_size"],
                num_hidden_layers=d["num_hidden_layers"],
                num_attention_heads=d["num_attention_heads"],
                num_key_value_heads=d.get("num_key_value_heads", d["num_attention_heads"]),
                head_dim=d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"],
                rms_norm_eps=d.get("rms_norm_eps", 1e-6),
                rope_theta=d.get("rope_theta", d.get("rope_parameters", {}).get("rope_theta", 10000.0)),
                max_position_embeddings=d.get("max_position_embeddings", 8192),
                vocab_size=d["vocab_size"],
                num_target_layers=d["num_target_layers"],
                block_size=dc.get("block_size", d.get("block_size", cls.model_fields["block_size"].default)),
                target_layer_ids=dc["target_layer_ids"],
                mask_token_id=dc["mask_token_id"],
                qk_norm=d.get("dcoco_qk_norm", True),
                num_speculative_tokens=d.get("dcoco_num_speculative_tokens"),
                draft_vocab_size=d.get("dcoco_draft_vocab_size"),
            )
        except KeyError as e:
            raise ModelNotFoundError(f"drafter config.json lacks field {e.args[0]!r}") from None


def pick_mask_token(target) -> int:
    """A token the chat model never needs, used as the MASK slot (its frozen embedding is an input
    the drafter learns to read). Prefer a dedicated mask token, then a rarely used special token."""
    tok = target.tokenizer
    if tok is not None:
        if tok.mask_token_id is not None:
            return int(tok.mask_token_id)
        for name in ("<empty_output>", "<|MASK|>", "<mask>", "<|fim_pad|>"):
            i = tok.convert_tokens_to_ids(name)
            if isinstance(i, int) and i != tok.unk_token_id and 0 <= i < target.vocab_size:
                return i
    return target.vocab_size - 1


class DFlashModel(nn.Module):
    """The DFlash backbone: fuse target features into context, run the block through the layers."""

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.cfg = cfg
        H = cfg.hidden_size
        self.fc = nn.Linear(len(cfg.target_layer_ids) * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(
            DraftDecoderLayer(
                H,
                cfg.intermediate_size,
                cfg.num_attention_heads,
                cfg.num_key_value_heads,
                cfg.head_dim,
                cfg.rms_norm_eps,
                cfg.qk_norm,
            )
            for _ in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        n = cfg.draft_vocab_size
        self.register_buffer("draft_ids", torch.arange(n) if n else None)
        self.apply(self._init)

    def set_draft_vocab(self, ids: torch.Tensor) -> None:
        """Draft only among the target tokens `ids` (distinct; kept sorted). Lossless: verification
        accepts by the target alone, so the vocabulary only decides what can be proposed."""
        ids = ids.long().flatten().sort().values
        if ids.numel() == 0 or ids.unique().numel() != ids.numel() or ids[0] < 0 or ids[-1] >= self.cfg.vocab_size:
            raise ValueError(f"draft vocabulary needs distinct token ids in [0, {self.cfg.vocab_size})")
        self.cfg.draft_vocab_size = ids.numel()
        self.register_buffer("draft_ids", ids.to(self.fc.weight.device))

    def restrict_to_draft_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` (..., V) with -inf off the draft vocabulary (unchanged without one)."""
        if self.draft_ids is None:
            return logits
        keep = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device).index_fill_(
            0, self.draft_ids, True
        )
        return logits.masked_fill(~keep, float("-inf"))

    @property
    def slot_offset(self) -> int:
        """Index of the block slot that predicts the token after the anchor (slot 0 holds the anchor)."""
        return 1

    @property
    def max_draft(self) -> int:
        """Draft tokens one block pass can propose."""
        return self.cfg.block_size - self.slot_offset

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype):
        return rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta, dtype)

    def context_kv(self, features: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer context K/V for target features (N, T, n*H) at `positions` (N, T)."""
        ctx = self.hidden_norm(self.fc(features))
        cos, sin = self.rope(positions, ctx.dtype)
        return [layer.self_attn.kv(ctx, cos, sin) for layer in self.layers]

    def forward(
        self, block_emb: torch.Tensor, positions: torch.Tensor, ctx_kv, mask: Optional[torch.Tensor]
    ) -> torch.Tensor:
        """Hidden states (N, M, H) after the final norm for query embeddings (N, M, H) at `positions`
        (N, M); `mask` (N, 1, M, T + M) as in `ContextAttention` (None: everything visible)."""
        cos, sin = self.rope(positions, block_emb.dtype)
        x = block_emb
        for layer, (k, v) in zip(self.layers, ctx_kv):
            x = layer(x, cos, sin, k, v, mask)
        return self.norm(x)


@torch.no_grad()
def init_from_target(model: DFlashModel, target) -> None:
    """Warm-start the backbone from the target: drafter layer i takes the weights of target layer
    L - n + i (same decoder-layer design, so they already map hidden states to next-token
    predictions), the final norm takes the target's, and the fusion starts as a copy of the highest
    tapped feature. Training from this point converges much faster than from random layers."""
    layers = target.model.model.layers
    n = len(model.layers)
    for i, layer in enumerate(model.layers):
        src = layers[len(layers) - n + i].state_dict()
        shapes_ok = all(k not in layer.state_dict() or layer.state_dict()[k].shape == v.shape for k, v in src.items())
        if shapes_ok:
            layer.load_state_dict({k: v.float() for k, v in src.items()}, strict=False)
    norm = getattr(target.model.model, "norm", None)
    if norm is not None:
        model.norm.weight.copy_(norm.weight.float())
    H = model.cfg.hidden_size
    model.fc.weight.zero_()
    model.fc.weight[:, -H:] = torch.eye(H)


def shortlist(logits: torch.Tensor, k: int, vocab: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k candidate logits and ids per position, best first: (N, P, k) each. With a draft
    vocabulary (sorted target ids) only its columns compete: the same list as at inference, where
    the rest are -inf, found in a sixth of the time."""
    if vocab is None:
        return torch.topk(logits, k, dim=-1)
    cols = logits.reshape(-1, logits.shape[-1]).index_select(1, vocab)  # 2-D: ~15x faster than on the last of 3 dims
    vals, idx = torch.topk(cols.view(*logits.shape[:-1], -1), k, dim=-1)
    return vals, vocab[idx]


def inference_mask(ctx_lens: torch.Tensor, T: int, B: int) -> torch.Tensor:
    """(N, 1, B, T + B): each block sees its request's first ctx_lens[n] context slots and itself."""
    N, dev = ctx_lens.shape[0], ctx_lens.device
    ctx = torch.arange(T, device=dev).unsqueeze(0) < ctx_lens.unsqueeze(1)
    block = torch.ones(N, 1, B, B, dtype=torch.bool, device=dev)
    return torch.cat([ctx.view(N, 1, 1, T).expand(N, 1, B, T), block], dim=-1)


def training_mask(anchors: torch.Tensor, T: int, B: int) -> torch.Tensor:
    """(S, 1, A*B, T + A*B) for A blocks per sequence: block j sees context slots < anchors[s, j]
    (strictly before its anchor; the anchor itself is the block's first token) and, bidirectionally,
    only its own B slots. Anchors < 0 mark padding blocks, which see only themselves."""
    S, A = anchors.shape
    ctx = torch.arange(T).view(1, 1, T) < anchors.unsqueeze(2)  # (S, A, T)
    ctx = ctx.unsqueeze(2).expand(S, A, B, T).reshape(S, A * B, T)
    blk = torch.block_diag(*[torch.ones(B, B, dtype=torch.bool)] * A)  # (A*B, A*B)
    return torch.cat([ctx, blk.unsqueeze(0).expand(S, -1, -1)], dim=-1).unsqueeze(1)


class AnchorGroupAttention:
    """The attention `training_mask` describes, computed group by group where it can be visible.
    A block sees the context before its anchor and its own B slots; one mask over all A blocks makes
    every query meet all T + A*B keys, most of them masked. Taking `group_queries` queries' worth of
    consecutive blocks at a time, a group needs only the context before its last anchor and its own
    slots (correct for any anchors, short for sorted ones, as `sample_anchors` draws them), and the
    query heads that share a K/V head are stacked into one longer query block instead of repeating
    K/V (`dcoco.nn.attention`). On a 2-core Xeon with AMX, one layer of the DFlash stage's step
    (4 sequences x 128 blocks of 8, bf16) spends 144 ms in attention forward and backward against 267
    ms under the one mask (docs/training.md#where-a-steps-time-goes). Used as `ContextAttention`'s
    mask function."""

    def __init__(self, anchors: torch.Tensor, B: int, group_queries: int = 256):
        per = max(1, group_queries // B)
        self.groups = []  # (first query, last query + 1, context keys, mask)
        for lo in range(0, anchors.shape[1], per):
            a = anchors[:, lo : lo + per]
            L = int(a.max().clamp(min=0))
            self.groups.append((lo * B, (lo + a.shape[1]) * B, L, training_mask(a, L, B)))

    def __call__(self, q, kb, vb, ctx_k, ctx_v) -> torch.Tensor:
        S, H, _, D = q.shape
        Hkv = kb.shape[1]
        n = H // Hkv
        out = []
        for q0, q1, L, mask in self.groups:
            k = torch.cat([ctx_k[:, :, :L], kb[:, :, q0:q1]], dim=2)
            v = torch.cat([ctx_v[:, :, :L], vb[:, :, q0:q1]], dim=2)
            rows = q[:, :, q0:q1].reshape(S, Hkv, n * (q1 - q0), D)  # head h = g * n + r reads K/V head g
            o = F.scaled_dot_product_attention(rows, k, v, attn_mask=pack_gqa_mask(mask, n, Hkv))
            out.append(o.reshape(S, H, q1 - q0, D))
        return torch.cat(out, dim=2)


class BlockDrafter(Drafter):
    """Inference for DFlash-family drafters: keeps each request's context K/V, drafts a block for
    the batch in one pass, and leaves token choice to `select` (argmax / sampling for DFlash)."""

    method = "dflash"

    def __init__(self, model: DFlashModel, target):
        self.model = model.eval()
        self.cfg = model.cfg
        self.embed = target.model.get_input_embeddings()
        self.lm_head = target.model.get_output_embeddings()
        # the LM head rows of the draft vocabulary, sliced (and prepacked) once (None: the full head)
        ids = model.draft_ids
        self.draft_head = None if ids is None else linear_of(self.lm_head.weight[ids].detach().contiguous())
        self.tap_layers = self.cfg.taps
        # the checkpoint's default draft length (dcoco_num_speculative_tokens), else every slot
        self.default_num_tokens = min(self.cfg.num_speculative_tokens or model.max_draft, model.max_draft)
        self.dtype = next(model.parameters()).dtype
        self.ctx: dict[int, list[list[torch.Tensor]]] = {}  # request -> per layer [k, v] (1, h, T, d)
        self.ctx_len: dict[int, int] = {}
        # wall time spent choosing tokens from the draft logits (argmax / sampling; DCOCO's corrector
        # and walk), so a benchmark can report the corrector's cost net of DFlash's own selection
        self.select_seconds = 0.0

    # -- compatibility ---------------------------------------------------------------------------
    def check_target(self, target) -> None:
        c = self.cfg
        check_feature_drafter(target, c.vocab_size, c.hidden_size, c.num_target_layers, c.target_layer_ids)

    # -- state ----------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        """Where every tensor of a drafting step is made: the model's (= the target's) device."""
        return self.model.fc.weight.device

    def absorb(self, inp: DraftInput) -> None:
        self._ingest(inp.request_ids, inp.new_features)

    def release(self, request_id: int) -> None:
        self.ctx.pop(request_id, None)
        self.ctx_len.pop(request_id, None)

    @torch.inference_mode()
    def _ingest(self, rids: list[int], feats: list[Optional[torch.Tensor]]) -> None:
        """Append the context K/V of newly committed tokens, for all requests in one batched pass."""
        todo = [(r, f) for r, f in zip(rids, feats) if f is not None and f.shape[0] > 0]
        if not todo:
            return
        n = max(f.shape[0] for _, f in todo)
        x = torch.zeros(len(todo), n, todo[0][1].shape[-1], dtype=self.dtype, device=self.device)
        pos = torch.zeros(len(todo), n, dtype=torch.long, device=self.device)
        for i, (r, f) in enumerate(todo):
            T0 = self.ctx_len.get(r, 0)
            x[i, : f.shape[0]] = f.to(self.dtype)
            pos[i] = torch.arange(T0, T0 + n, device=self.device)
        kv = self.model.context_kv(x, pos)
        for i, (r, f) in enumerate(todo):
            m = f.shape[0]
            if r not in self.ctx:
                self.ctx[r] = [[k[i : i + 1, :, :m], v[i : i + 1, :, :m]] for k, v in kv]
            else:
                for slot, (k, v) in zip(self.ctx[r], kv):
                    slot[0] = torch.cat([slot[0], k[i : i + 1, :, :m]], dim=2)
                    slot[1] = torch.cat([slot[1], v[i : i + 1, :, :m]], dim=2)
            self.ctx_len[r] = self.ctx_len.get(r, 0) + m

    def _batched_context(self, rids: list[int]):
        lens = [self.ctx_len.get(r, 0) for r in rids]
        T = max(lens)
        kv = []
        for layer in range(self.cfg.num_hidden_layers):
            k0 = self.ctx[rids[0]][layer][0]
            K = k0.new_zeros(len(rids), k0.shape[1], T, k0.shape[3])
            Vv = torch.zeros_like(K)
            for b, (r, n) in enumerate(zip(rids, lens)):
                K[b, :, :n] = self.ctx[r][layer][0][0]
                Vv[b, :, :n] = self.ctx[r][layer][1][0]
            kv.append((K, Vv))
        return kv, lens

    # -- drafting -------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, inp: DraftInput) -> DraftOutput:
        rids = inp.request_ids
        self._ingest(rids, inp.new_features)
        N, B = len(rids), self.cfg.block_size
        off = self.model.slot_offset
        k = min(inp.num_tokens, self.model.max_draft)
        kv, lens = self._batched_context(rids)
        dev = self.device
        anchors = torch.tensor([ids[-1] for ids in inp.token_ids], dtype=torch.long, device=dev)
        block = torch.full((N, B), self.cfg.mask_token_id, dtype=torch.long, device=dev)
        block[:, 0] = anchors
        start = torch.tensor([len(ids) - 1 for ids in inp.token_ids], dtype=torch.long, device=dev)
        positions = start.unsqueeze(1) + torch.arange(B, device=dev)
        T = kv[0][0].shape[2]
        mask = None if all(n == T for n in lens) else inference_mask(torch.tensor(lens, device=dev), T, B)
        out = self.model(self.embed(block).to(self.dtype), positions, kv, mask)
        # a fresh copy with standard strides: torch 2.13's CPU linear is ~20x slower on a strided input
        # (and .contiguous() keeps the block stride of a single request's slice)
        hidden = out[:, off : off + k].clone(memory_format=torch.contiguous_format)
        logits = self.draft_logits(hidden)
        t0 = time.perf_counter()
        drafted = self.select(hidden, logits, inp, anchor_hidden=out[:, 0])
        self.select_seconds += time.perf_counter() - t0
        return drafted

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float logits (..., V) of the target's LM head; with a draft vocabulary only its rows are
        computed and every other token gets -inf (never drafted, probability 0 in q)."""
        flat = hidden.reshape(-1, hidden.shape[-1])  # one matrix product, whatever the caller's strides
        if self.draft_head is None:
            return self.lm_head(flat).float().view(*hidden.shape[:-1], -1)
        sub = self.draft_head(flat).float()
        if getattr(self.lm_head, "bias", None) is not None:
            sub = sub + self.lm_head.bias[self.model.draft_ids].float()
        out = sub.new_full((sub.shape[0], self.cfg.vocab_size), float("-inf"))
        return out.index_copy_(1, self.model.draft_ids, sub).view(*hidden.shape[:-1], -1)

    def select(
        self, hidden: torch.Tensor, logits: torch.Tensor, inp: DraftInput, anchor_hidden: Optional[torch.Tensor] = None
    ) -> DraftOutput:
        """DFlash picks each slot independently: argmax at T=0; at T>0 a sample from the request's
        own transformed distribution, reported as q. (`anchor_hidden`, the anchor slot's output, is
        for selectors that condition on the anchor.)"""
        N, k, V = logits.shape
        tokens = logits.argmax(-1)
        sampled = torch.tensor([not sp.greedy for sp in inp.params], device=logits.device)
        lengths = torch.full((N,), k, dtype=torch.long, device=logits.device)
        if not sampled.any():
            return DraftOutput(tokens=tokens, lengths=lengths)
        si = sampled.nonzero().squeeze(1)
        q = target_probs(self.draft_columns(logits[si]), [inp.params[b] for b in si.tolist()])
        u = draw_uniforms([inp.generators[b] for b in si.tolist()], k, logits.device)
        tok, q = self.full_columns(sample_from(q, u), q, V)
        tokens[si] = tok
        return DraftOutput(tokens=tokens, lengths=lengths, probs=mixed_q(tokens, si, q, V))

    def draft_columns(self, logits: torch.Tensor) -> torch.Tensor:
        """(..., V) logits -> the draft vocabulary's columns (the rest are -inf): sampling over
        them costs a sixth of the full vocabulary's."""
        ids = self.model.draft_ids
        if ids is None:
            return logits
        V = logits.shape[-1]
        return logits.reshape(-1, V).index_select(1, ids).view(*logits.shape[:-1], -1)  # 2-D: ~15x faster on CPU

    def full_columns(self, tokens: torch.Tensor, q: torch.Tensor, V: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inverse of `draft_columns` for sampled draft-vocabulary indices (N, k) and their q (N, k, V')."""
        ids = self.model.draft_ids
        if ids is None:
            return tokens, q
        return ids[tokens], q.new_zeros(*q.shape[:-1], V).index_copy_(q.dim() - 1, ids, q)


def mixed_q(tokens: torch.Tensor, sampled: torch.Tensor, q: torch.Tensor, V: int) -> torch.Tensor:
    """The draft q of a batch: `q` for the sampled rows, one-hot on the drafted token for greedy rows."""
    if len(sampled) == tokens.shape[0]:
        return q
    probs = F.one_hot(tokens, V).float()
    probs[sampled] = q
    return probs


# -- checkpoints ---------------------------------------------------------------------------------
def save_dflash(
    path: str | Path,
    model: DFlashModel,
    method: str = "dflash",
    extra: Optional[dict] = None,
    dtype: torch.dtype = torch.bfloat16,
) -> None:
    """A DFlash-family checkpoint: HF-style config.json (`to_hf`, plus `extra`) and the weights."""
    save_checkpoint(path, model.cfg.to_hf(method, extra), model.state_dict(), dtype)
