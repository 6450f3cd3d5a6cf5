"""EAGLE-3 training with the training-time test (TTT).

Batch: whole sequences (no anchors): token ids, the fused-layer features and the last-layer feature
of every position, lengths and prompt lengths (`Eagle3Batch`, built by `Eagle3Loss.make_batch`
through the trainer's batch hook). The data order is the trainer's, so EAGLE-3 sees the same
sequences per step as DFlash / DSpark for the same `steps x batch_size`.

Unrolled steps j = 0 .. ttt_steps-1 (`Eagle3Model.unroll`): at step 0 slot t reads the target
feature of token t and the embedding of token t+1; at step j >= 1 it reads the drafter's own
output of step j-1 (not a target feature) and token t+1+j (teacher-forced), at position t+j; the
attention of (t, j) sees the step-0 entries s <= t and its own chain entries (t, 1..j), exactly as
drafting step j at inference. Step j at slot t predicts token t+2+j.

Loss: soft cross-entropy against the target's next-token distribution (temperature 1) at position
t+1+j restricted to the draft vocabulary and renormalised (logits recomputed from the last-layer
feature with the target's final norm and its LM head rows of the draft vocabulary), averaged over
valid slots of the step, and summed over steps with weights 0.8^j. A slot is valid when token
t+2+j is a response token inside the sequence and lies in the draft vocabulary (for greedily
regenerated data it is the target's argmax; SpecForge masks positions whose target argmax is
outside the draft vocabulary the same way).

Draft vocabulary: the `draft_vocab_size` most frequent response tokens of the training samples
(held-out samples excluded), ties by token id. The drafter's LM head starts from the target's LM
head rows of those tokens and its final norm from the target's final norm.
"""

from __future__ import annotations

from dataclasses import dataclass
import torch

from ..drafters.eagle3 import Eagle3Config, Eagle3Model, default_eagle_layer_ids, load_eagle3, save_eagle3
from ..errors import ConfigError
from .dspark import TargetHead, attach_target_head
from .trainer import is_eval_sample


@dataclass
class Eagle3Batch:
    ids: torch.Tensor  # (S, T) token ids, padded with 0
    feats: torch.Tensor  # (S, T, F) features of token t at slot t (drafter taps, then the last layer)
    lengths: torch.Tensor  # (S,)
    prompt_lens: torch.Tensor  # (S,)
    labels: torch.Tensor  # (S, T) response tokens, -100 elsewhere (for logging)


def make_eagle3_batch(samples: list[dict], feats: list[torch.Tensor]) -> Eagle3Batch:
    S = len(samples)
    T = max(len(s["input_ids"]) for s in samples)
    ids = torch.zeros(S, T, dtype=torch.long)
    fx = torch.zeros(S, T, feats[0].shape[-1], dtype=feats[0].dtype)
    labels = torch.full((S, T), -100, dtype=torch.long)
    lengths = torch.zeros(S, dtype=torch.long)
    prompt = torch.zeros(S, dtype=torch.long)
    for s, (smp, f) in enumerate(zip(samples, feats)):
        x = torch.tensor(smp["input_ids"])
        ids[s, : len(x)] = x
        fx[s, : f.shape[0]] = f
        lengths[s], prompt[s] = len(x), smp["prompt_len"]
        labels[s, smp["prompt_len"] : len(x)] = x[smp["prompt_len"] :]
    return Eagle3Batch(ids, fx, lengths, prompt, labels)


def ttt_weights(steps: int, decay: float) -> torch.Tensor:
    return decay ** torch.arange(steps, dtype=torch.float32)


class Eagle3Loss:
    def __init__(self, model: Eagle3Model, embed, head: TargetHead, split: int, steps: int = 7, decay: float = 0.8):
        self.model, self.embed, self.head, self.split = model, embed, head, split
        self.steps, self.decay = steps, decay
        self.weights = ttt_weights(steps, decay)

    def make_batch(self, samples: list[dict], feats: list[torch.Tensor], n_anchors: int, gen: torch.Generator) -> Eagle3Batch:
        return make_eagle3_batch(samples, feats)  # every position is trained: no anchors

    def valid_mask(self, b: Eagle3Batch, j: int) -> torch.Tensor:
        """(S, T): slot t at step j has a target (token t+2+j is a response token in the draft vocabulary)."""
        S, T = b.ids.shape
        tok = torch.arange(T) + 2 + j
        ok = (tok.unsqueeze(0) < b.lengths.unsqueeze(1)) & (tok.unsqueeze(0) >= b.prompt_lens.unsqueeze(1))
        nxt = torch.cat([b.ids, torch.zeros(S, j + 2, dtype=torch.long)], 1)[:, 2 + j : 2 + j + T]
        return ok & self.model.t2d[nxt]

    def __call__(self, b: Eagle3Batch) -> tuple[torch.Tensor, dict]:
        model, K = self.model, self.steps
        S, T = b.ids.shape
        aux, last = b.feats[..., : self.split], b.feats[..., self.split:]
        with torch.no_grad():
            emb = self.embed(torch.cat([b.ids, torch.zeros(S, K + 1, dtype=torch.long)], 1))
            step_emb = [emb[:, 1 + j : 1 + j + T] for j in range(K)]
            tl = self.head.logits(last, rows=model.draft_to_target)  # (S, T, Vd) target logits at u
            pt_all = torch.softmax(torch.cat([tl, tl.new_zeros(S, K + 1, tl.shape[-1])], 1), dim=-1)
        outs = model.unroll(step_emb, aux.to(torch.float32))
        loss = outs[0].sum() * 0.0  # stays a graph node when no slot has a target
        m: dict = {}
        matches, valids = [], []
        to_target = model.draft_to_target
        for j, h in enumerate(outs):
            valid = self.valid_mask(b, j)
            valids.append(valid)
            match = torch.zeros(S, T, dtype=torch.bool)
            if valid.any():
                logq = torch.log_softmax(model.logits(h[valid]).float(), dim=-1)
                p = pt_all[:, 1 + j : 1 + j + T][valid]
                ce = -(p * logq).sum(-1).mean()
                loss = loss + self.weights[j] * ce
                with torch.no_grad():
                    nxt = torch.cat([b.ids, torch.zeros(S, j + 2, dtype=torch.long)], 1)[:, 2 + j : 2 + j + T][valid]
                    match[valid] = to_target[logq.argmax(-1)] == nxt
                m[f"ttt_loss_{j}"] = ce.item()
                m[f"ttt_acc_{j}"] = match[valid].float().mean().item()
            matches.append(match)
        return loss, {"matches": torch.stack(matches, -1), "valid": torch.stack(valids, -1), "metrics": m}

    def eval_metrics(self, extras: dict, labels: torch.Tensor) -> dict:
        """Simulated greedy chain from every start slot: accepted = leading steps whose argmax is the
        next data token (teacher-forced tokens equal the drafted ones up to the first miss)."""
        start = extras["valid"][..., 0]
        acc = torch.cumprod((extras["matches"] & extras["valid"]).long(), dim=-1)[start]
        if acc.numel() == 0:
            return {"eval_tau": 1.0, "eval_per_position": []}
        return {"eval_tau": 1.0 + acc.sum(-1).float().mean().item(), "eval_per_position": acc.float().mean(0).tolist(),
                **{f"eval_{k}": v for k, v in extras["metrics"].items()}}


# -- trainer hooks ---------------------------------------------------------------------------------
def response_token_counts(trainer) -> torch.Tensor:
    """Counts (V,) of response tokens over the training samples (held-out samples excluded)."""
    cfg = trainer.cfg
    counts = torch.zeros(trainer.target.vocab_size, dtype=torch.long)
    for s in trainer.data.samples():
        if is_eval_sample(s["id"], cfg.data.eval_permille):
            continue
        ids = s["input_ids"][s["prompt_len"] : cfg.data.max_length]
        if ids:
            counts += torch.bincount(torch.tensor(ids), minlength=counts.numel())
    return counts


def top_tokens(counts: torch.Tensor, n: int) -> torch.Tensor:
    """The n most frequent token ids (ties by lower id), sorted by id."""
    order = torch.sort(-counts, stable=True).indices
    return order[:n].sort().values


def build_eagle3_model(trainer) -> Eagle3Model:
    d, target = trainer.cfg.drafter, trainer.target
    if d.init_from:
        model, _ = load_eagle3(d.init_from)
        return model.float().train()
    taps = trainer.data.manifest["taps"]
    try:
        ids = list(d.eagle_layer_ids) if d.eagle_layer_ids else default_eagle_layer_ids(target.num_layers, taps)
    except ValueError as e:
        raise ConfigError(f"{trainer.data.root}: {e}") from None
    cfg = Eagle3Config.for_target(target, ids, d.draft_vocab_size, d.intermediate_size,
                                  d.num_speculative_tokens or d.ttt_steps)
    model = Eagle3Model(cfg)
    model.set_vocab(top_tokens(response_token_counts(trainer), cfg.draft_vocab_size))
    model.init_lm_head_from(target.model.get_output_embeddings())
    head = TargetHead(target)
    with torch.no_grad():
        model.norm.weight.copy_(head.norm.weight.float())
    return model.float().train()


def build_eagle3_loss(trainer) -> Eagle3Loss:
    d = trainer.cfg.drafter
    split = attach_target_head(trainer)
    return Eagle3Loss(trainer.model, trainer.embed, TargetHead(trainer.target), split, d.ttt_steps, d.ttt_decay)


def export_eagle3(trainer, path) -> None:
    save_eagle3(path, trainer.model, extra={"dcoco_ttt_steps": trainer.cfg.drafter.ttt_steps, **trainer.provenance()})


__all__ = ["Eagle3Batch", "Eagle3Loss", "build_eagle3_loss", "build_eagle3_model", "export_eagle3",
           "make_eagle3_batch", "response_token_counts", "top_tokens", "ttt_weights"]
