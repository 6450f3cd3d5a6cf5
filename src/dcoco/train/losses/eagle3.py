"""EAGLE-3's training loss: the training-time test (TTT).

Batch: whole sequences: token ids, the fused-layer features and the last-layer feature of every
position, lengths, prompt lengths and the sampled start slots (`Eagle3Batch`, built by
`Eagle3Loss.make_batch` through the trainer's batch hook). The data order is the trainer's, so EAGLE-3 sees the same
sequences per step as DFlash / DSpark for the same `steps x batch_size`.

Unrolled steps j = 0 .. ttt_steps-1 (`Eagle3Model.unroll`): at step 0 slot t reads the target
feature of token t and the embedding of token t+1; at step j >= 1 it reads the drafter's own
output of step j-1 (not a target feature) and token t+1+j (teacher-forced), at position t+j; the
attention of (t, j) sees the step-0 entries s <= t and its own chain entries (t, 1..j), exactly as
drafting step j at inference. Step j at slot t predicts token t+2+j.

Start slots (`drafter.eagle3.ttt_slots`): None unrolls and trains the chain of every slot, as published.
An integer samples that many start slots per sequence (uniformly over response positions, from the
trainer's RNG, like DFlash's anchors): step 0 still runs on every slot (its K/V are the keys every
chain sees) but steps >= 1 and all loss terms run only on the sampled chains -- an unbiased
subsample of the same objective at a fraction of the cost (2-core CPU, 8 x 1024-token sequences,
bf16 autocast: every slot ~50 s per step, 16-64 slots 11-17 s, a DFlash step 6.5-8 s). Evaluation
always samples start slots (the trainer's 32 eval anchors per sequence).

Loss: soft cross-entropy against the target's next-token distribution (temperature 1) at position
t+1+j restricted to the draft vocabulary and renormalised (logits recomputed from the last-layer
feature with the target's final norm and its LM head rows of the draft vocabulary), averaged over
valid slots of the step, and summed over steps with weights 0.8^j. A slot is valid when token
t+2+j is a response token inside the sequence and lies in the draft vocabulary (for greedily
regenerated data it is the target's argmax; SpecForge masks positions whose target argmax is
outside the draft vocabulary the same way).

Draft vocabulary: the `draft_vocab_size` most frequent response tokens of the training samples
(held-out samples excluded), ties by token id. The drafter's LM head starts from the target's LM
head rows of those tokens; everything else starts fresh (norms at one, linear layers N(0, 0.02)).
(Copying the target's final norm as well starts from a worse loss: ~18.5 vs ~11.7 nats at step 0
on SmolLM2 data.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ...drafters.eagle3 import Eagle3Model
from ...nn.layers import at_least_float32
from ..acceptance import acceptance_from_predictions
from ..batch import sample_anchors
from .target_head import TargetHead


@dataclass
class Eagle3Batch:
    ids: torch.Tensor  # (S, T) token ids, padded with 0
    feats: torch.Tensor  # (S, T, F) features of token t at slot t (drafter taps, then the last layer)
    lengths: torch.Tensor  # (S,)
    prompt_lens: torch.Tensor  # (S,)
    labels: torch.Tensor  # (S, A, steps) the response token each chain step should draft, -100 outside the response
    slots: Optional[torch.Tensor] = None  # (S, A) start slots of the unrolled chains (-1: padding); None: all (A = T)


def make_eagle3_batch(
    samples: list[dict], feats: list[torch.Tensor], steps: int, slots: Optional[list[list[int]]] = None
) -> Eagle3Batch:
    """Whole sequences, with chains of `steps` steps from the start slots `slots` (None: every slot).
    Start slot t reads token t + 1 and its step j drafts token t + 2 + j: a chain starting at slot
    a - 1 is the draft that decoding makes after anchor a (the last committed token)."""
    S = len(samples)
    T = max(len(s["input_ids"]) for s in samples)
    ids = torch.zeros(S, T, dtype=torch.long)
    fx = torch.zeros(S, T, feats[0].shape[-1], dtype=feats[0].dtype)
    response = torch.zeros(S, T + steps + 2, dtype=torch.bool)
    lengths = torch.zeros(S, dtype=torch.long)
    prompt = torch.zeros(S, dtype=torch.long)
    for s, (smp, f) in enumerate(zip(samples, feats)):
        x = torch.tensor(smp["input_ids"])
        ids[s, : len(x)] = x
        fx[s, : f.shape[0]] = f
        lengths[s], prompt[s] = len(x), smp["prompt_len"]
        response[s, smp["prompt_len"] : len(x)] = True
    st = None
    if slots is None:
        start = torch.arange(T).unsqueeze(0).expand(S, T)
    else:
        st = torch.full((S, max(1, max(len(a) for a in slots))), -1, dtype=torch.long)
        for s, a in enumerate(slots):
            st[s, : len(a)] = torch.tensor(a, dtype=torch.long)
        start = st.clamp(min=0)
    tok = start.unsqueeze(-1) + 2 + torch.arange(steps)  # (S, A, steps)
    flat = tok.view(S, -1)
    labels = torch.cat([ids, ids.new_zeros(S, steps + 2)], 1).gather(1, flat).view_as(tok)
    keep = response.gather(1, flat).view_as(tok)
    if st is not None:
        keep &= (st >= 0).unsqueeze(-1)
    return Eagle3Batch(ids, fx, lengths, prompt, labels.masked_fill(~keep, -100), st)


def ttt_weights(steps: int, decay: float) -> torch.Tensor:
    return decay ** torch.arange(steps, dtype=torch.float32)


class Eagle3Loss:
    # under context parallelism (`dcoco.parallel.ContextShard.attach`): step 0 over the ring, the
    # chains through branch attention, the target's distribution from the rank holding its row

    def __init__(
        self,
        model: Eagle3Model,
        embed,
        head: TargetHead,
        split: int,
        steps: int = 7,
        decay: float = 0.8,
        slots: Optional[int] = None,
    ):
        self.model, self.embed, self.head, self.split = model, embed, head, split
        self.steps, self.decay, self.slots = steps, decay, slots
        self.weights = ttt_weights(steps, decay)
        self.shard = None  # context parallelism: this rank's `ContextShard`

    def make_batch(
        self, samples: list[dict], feats: list[torch.Tensor], n_anchors: int, gen: torch.Generator
    ) -> Eagle3Batch:
        """Whole sequences; the chains start at `slots` sampled start slots per sequence while training
        (None: every slot) and at `n_anchors` of them for evaluation (the trainer's eval batches)."""
        n = self.slots if self.model.training else n_anchors
        if n is None:
            return make_eagle3_batch(samples, feats, self.steps)
        # start slot t predicts token t + 2 first: t in [prompt_len - 2, len - 3]
        starts = [sample_anchors(max(0, s["prompt_len"] - 2), len(s["input_ids"]) - 1, n, gen) for s in samples]
        return make_eagle3_batch(samples, feats, self.steps, starts)

    def batch_at(self, samples: list[dict], feats: list[torch.Tensor], anchors: list[list[int]]) -> Eagle3Batch:
        """The chains decoding drafts after the given anchor positions of each sample."""
        return make_eagle3_batch(samples, feats, self.steps, [[a - 1 for a in an] for an in anchors])

    def shard_batch(
        self, samples: list[dict], local: torch.Tensor, n_anchors: int, gen: torch.Generator
    ) -> Eagle3Batch:
        """Under context parallelism (`shard`): this rank's chains, of the start slots `make_batch`
        draws, with the shard's feature rows `local` (T_r, F); ids packed (1, total), slots as packed
        indices (1, A) (-1: a placeholder chain when the rank owns none)."""
        from ...parallel import branch_owners

        layout, K = self.shard.layout, self.steps
        n = self.slots if self.model.training else n_anchors
        chains = [
            list(range(len(s["input_ids"])))
            if n is None
            else sample_anchors(max(0, s["prompt_len"] - 2), len(s["input_ids"]) - 1, n, gen)
            for s in samples
        ]
        seq = torch.tensor([i for i, c in enumerate(chains) for _ in c], dtype=torch.long)
        pos = torch.tensor([t for c in chains for t in c], dtype=torch.long)
        mine = branch_owners(layout, seq, pos) == self.shard.rank if len(seq) else seq.bool()
        seq, pos = seq[mine], pos[mine]
        labels = torch.full((max(1, len(seq)), K), -100, dtype=torch.long)
        for a, (i, t) in enumerate(zip(seq.tolist(), pos.tolist())):
            x, p = samples[i]["input_ids"], samples[i]["prompt_len"]
            for j in range(K):  # step j drafts token t + 2 + j, a response token inside the sequence
                if p <= t + 2 + j < len(x):
                    labels[a, j] = x[t + 2 + j]
        slots = layout.cu_seqlens[seq] + pos if len(seq) else torch.tensor([-1])
        ids = torch.cat([torch.as_tensor(s["input_ids"], dtype=torch.long) for s in samples]).unsqueeze(0)
        lengths = torch.tensor([len(s["input_ids"]) for s in samples])
        plens = torch.tensor([s["prompt_len"] for s in samples])
        return Eagle3Batch(ids, local.unsqueeze(0), lengths, plens, labels.unsqueeze(0), slots.unsqueeze(0))

    def __call__(self, b: Eagle3Batch) -> tuple[torch.Tensor, dict]:
        model, K, shard = self.model, self.steps, self.shard
        S, T = b.ids.shape
        last = b.feats[..., self.split :]
        aux = b.feats[..., : self.split].to(model.fc.weight.dtype)  # the drafter's dtype (autocast does bf16)
        if shard is None:
            outs = model.unroll(self.embed, b.ids, aux, K, b.slots)
        else:
            outs = model.unroll_sharded(self.embed, b.ids, aux, K, b.slots, shard)
        start = torch.arange(T).unsqueeze(0).expand(S, T) if b.slots is None else b.slots.clamp(min=0)
        rows = model.draft_to_target
        full_tl = self.head.logits(last, rows=rows) if b.slots is None else None  # (S, T, Vd), once for all steps
        bidx = torch.arange(S).unsqueeze(1).expand_as(start)
        loss = outs[0].sum() * 0.0  # stays a graph node when no slot has a target
        m: dict = {}
        drafts = []
        for j, h in enumerate(outs):
            nxt = b.labels[..., j]  # the token step j predicts; its target distribution sits one slot before it
            valid = (nxt >= 0) & model.t2d[nxt.clamp(min=0)]
            draft = torch.full_like(nxt, -1)  # -1: no draft this step could match (token outside the draft vocabulary)
            bi, ui = bidx[valid], (start + 1 + j)[valid]
            if shard is None:
                count = valid.sum()
                tl = full_tl[bi, ui] if full_tl is not None else self.head.logits(last[bi, ui], rows=rows)
            else:  # the chains of every rank share the normaliser; the rows come from their owners
                count = shard.global_sum(valid.sum())
                tl = self.head.logits(shard.fetch(last[0], ui.clamp(max=shard.layout.total - 1)), rows=rows)
            if valid.any():
                p = torch.softmax(tl, dim=-1)
                logq = torch.log_softmax(at_least_float32(model.logits(h[valid])), dim=-1)
                ce = -(p * logq).sum() / count.clamp(min=1)
                loss = loss + self.weights[j] * ce
                with torch.no_grad():
                    draft[valid] = rows[logq.argmax(-1)]
                m[f"ttt_loss_{j}"] = ce.item()
                m[f"ttt_acc_{j}"] = (draft[valid] == nxt[valid]).float().mean().item()
            drafts.append(draft)
        return loss, {"drafts": torch.stack(drafts, -1), "outs": outs, "metrics": m}

    @torch.no_grad()
    def slot_acceptance(self, b: Eagle3Batch, extras: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Per chain step, the probability that T=1 verification accepts it, teacher-forced on the
        data: sum_x min(p(x), q(x)) over the draft vocabulary, p the target's distribution over the
        whole vocabulary (not renormalised to the draft one, as the loss's is)."""
        S, T = b.ids.shape
        start = torch.arange(T).unsqueeze(0).expand(S, T) if b.slots is None else b.slots.clamp(min=0)
        bidx = torch.arange(S).unsqueeze(1).expand_as(start)
        last, rows = b.feats[..., self.split :], self.model.draft_to_target
        accept = torch.zeros(b.labels.shape)
        for j, h in enumerate(extras["outs"]):
            lab = b.labels[..., j] >= 0
            if lab.any():
                bi, ui = bidx[lab], (start + 1 + j)[lab]
                p = torch.softmax(self.head.logits(last[bi, ui]), dim=-1)[:, rows]
                q = torch.softmax(self.model.logits(h[lab]).float(), dim=-1)
                accept[..., j][lab] = torch.minimum(p, q).sum(-1)
        return accept, b.labels >= 0

    def predictions(self, extras: dict) -> dict[str, torch.Tensor]:
        """Greedy chain drafts (S, A, steps), teacher-forced on the tokens: up to a chain's first miss
        they are the drafts inference makes."""
        return {"": extras["drafts"]}

    def eval_metrics(self, extras: dict, labels: torch.Tensor) -> dict:
        tau, pp = acceptance_from_predictions(extras["drafts"], labels)
        return {"eval_tau": tau, "eval_per_position": pp, **{f"eval_{k}": v for k, v in extras["metrics"].items()}}
