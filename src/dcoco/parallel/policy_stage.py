"""One process's part of a policy under pipeline x context parallelism: the decoder layers of one
pipeline stage, run on one rank's zigzag shard of packed sequences.

`PolicyStage` wraps an HF causal LM of the Llama layout (`model.model.embed_tokens`, `.layers`,
`.norm`, `.rotary_emb`, `lm_head`; Llama, Qwen2/3, SmolLM2, ...) and keeps only stage `s` of `P`:
decoder layers [s L / P, (s+1) L / P), the embeddings on the first stage, the final norm and LM head
on the last (with the embeddings too: the draft loss there embeds its blocks). Its self-attention
runs through transformers' attention interface as zigzag ring attention over the stage's context-
parallel group (`dcoco_zigzag_ring`), so each rank attends its shard's queries to every earlier key
of their sequence, wherever it lives; RoPE takes the tokens' own positions. Activations between
stages and their gradients are plain point-to-point tensors, sized from the layout every rank knows;
the drafter's tapped layers leave through `TapChannel`s.

Tied embeddings (SmolLM2) live on the first and the last stage: `tied` names them, and their
gradients are summed over the two before any update, so both copies stay equal.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..nn.layers import at_least_float32
from .zigzag import ZigzagLayout

__all__ = ["PolicyStage", "RING_ATTENTION"]

#: the attention implementation a stage's layers run (registered with transformers on first use)
RING_ATTENTION = "dcoco_zigzag_ring"


def _ring_attention_interface(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention signature: (1, heads, T_r, d) shard queries/keys/values in, (1, T_r,
    heads, d) out. The shard's layout and group come in the forward's `zigzag=(layout, group)`."""
    from .ring import zigzag_ring_attention

    layout, group = kwargs["zigzag"]

    def rows(x):
        return x[0].transpose(0, 1).contiguous()

    out, _ = zigzag_ring_attention(rows(query), rows(key), rows(value), layout, group=group, scale=scaling)
    return out.unsqueeze(0), None


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(RING_ATTENTION, _ring_attention_interface)


class PolicyStage:
    """Stage `stage` of `num_stages` of `model` (modified in place: the other stages' layers are
    dropped), attending over `group` (this stage's context-parallel ranks, None: one rank)."""

    def __init__(self, model: nn.Module, stage: int, num_stages: int, group=None, context: int = 1):
        _register()
        self.model, self.stage, self.num_stages = model, stage, num_stages
        self.group, self.context = group, context
        self.rank = dist.get_rank(group) if context > 1 else 0
        layers = model.model.layers
        L = len(layers)
        if not 1 <= num_stages <= L:
            raise ValueError(f"{num_stages} pipeline stages for {L} decoder layers")
        self.lo, self.hi = stage * L // num_stages, (stage + 1) * L // num_stages
        self.first, self.last = stage == 0, stage == num_stages - 1
        for i in range(L):
            if not self.lo <= i < self.hi:
                layers[i] = nn.Identity()  # another stage's: its weights are freed here
        embed, head = model.get_input_embeddings(), model.get_output_embeddings()
        self.tied = embed.weight is head.weight
        keep_embed = self.first or self.last  # the last stage's draft loss embeds its blocks
        keep_head = self.last or (self.tied and self.first)
        if not keep_embed:
            embed.weight = nn.Parameter(torch.empty(0), requires_grad=False)
        if not keep_head:
            head.weight = nn.Parameter(torch.empty(0), requires_grad=False)
        if not self.last:
            model.model.norm = nn.Identity()
        model.config._attn_implementation = RING_ATTENTION
        #: what this stage trains (a tied embedding: on the first and the last stage, once each)
        self.params = {n: p for n, p in model.named_parameters() if p.requires_grad and p.numel()}

    @property
    def hidden_size(self) -> int:
        return self.model.config.hidden_size

    @staticmethod
    def taps_of(stage: int, num_stages: int, num_layers: int, taps: Sequence[int]) -> list[int]:
        """The taps (hidden-state indices: 0 the embeddings, i the output of layer i-1) that stage
        `stage` makes."""
        lo, hi = stage * num_layers // num_stages, (stage + 1) * num_layers // num_stages
        return [t for t in taps if (t == 0 and stage == 0) or lo < t <= hi]

    def forward(
        self, layout: ZigzagLayout, ids: torch.Tensor, x: Optional[torch.Tensor], taps: Sequence[int] = ()
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """This rank's shard through the stage: the packed token ids (total,) of every sequence (the
        first stage embeds its shard's) or the previous stage's output `x` (T_r, H). Returns the
        output (T_r, H) (before the final norm) and the `taps` this stage makes, by index."""
        pos = layout.local_positions(self.rank).view(1, -1)
        h = self.model.get_input_embeddings()(ids[layout.local_indices(self.rank)]) if self.first else x
        h = h.unsqueeze(0)
        out = {0: h[0]} if 0 in taps and self.first else {}
        cos_sin = self.model.model.rotary_emb(h, position_ids=pos)
        zigzag = (layout, self.group if self.context > 1 else None)
        for i in range(self.lo, self.hi):
            h = self.model.model.layers[i](h, position_ids=pos, position_embeddings=cos_sin, zigzag=zigzag)
            if i + 1 in taps:
                out[i + 1] = h[0]
        return h[0], out

    def completion_logprobs(
        self, layout: ZigzagLayout, ids: torch.Tensor, h: torch.Tensor, prompt_lens: Sequence[int], temperature: float
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Last stage: log pi(x_{t+1} | x_<=t) at `temperature` for this rank's positions t that
        predict a completion token (prompt_len - 1 <= t < len - 1), with their sequence ids and
        positions t: `dcoco.rl.grpo.completion_logprobs`'s figures for the shard's rows."""
        seq = layout.local_seq_ids(self.rank)
        pos = layout.local_positions(self.rank)
        lens = torch.tensor(layout.seqlens)
        plens = torch.as_tensor(list(prompt_lens))
        rows = (pos >= plens[seq] - 1) & (pos < lens[seq] - 1)
        logits = at_least_float32(self.model.get_output_embeddings()(self.model.model.norm(h[rows]))) / temperature
        nxt = ids[layout.local_indices(self.rank)[rows] + 1].unsqueeze(1)
        lp = logits.gather(1, nxt).squeeze(1) - torch.logsumexp(logits, dim=-1)
        return lp, seq[rows], pos[rows]
