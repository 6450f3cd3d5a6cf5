"""Drafter training on regenerated data: anchors, position-decayed loss, AdamW + warm-up + cosine,
gradient clipping, periodic held-out evaluation, atomic checkpoints and exact resume.

One step takes `batch_size` sequences and `anchors_per_seq` anchor positions in each (sampled
uniformly over response positions). Every anchor a opens a block [x_a, MASK, ..., MASK] whose slot
k predicts x_{a+k}, seeing the target features of positions < a only. All blocks of a sequence
run in one pass (`dflash.training_mask`). Loss: cross-entropy on assistant tokens weighted by
w_k = exp(-(k-1)/gamma) and normalised by the weights present.

Resume: `run.out/state.pt` holds the model, optimizer, scheduler, step, data order and every RNG
state; it is replaced atomically every `checkpoint_every` steps, so a killed run continues from
there and reaches the same weights as an uninterrupted one.
"""

from __future__ import annotations

import hashlib
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from ..bench.system import device_label
from ..drafters.dflash import (
    DFlashConfig,
    DFlashModel,
    init_from_target,
    load_dflash,
    save_dflash,
    shortlist,
    training_mask,
)
from ..errors import ConfigError
from .config import TrainConfig
from .data import RegeneratedUnion
from .runstate import append_log, save_state, truncate_log


def is_eval_sample(sample_id: str, permille: int = 20) -> bool:
    """Fixed hold-out of regenerated samples for training-time evaluation (by a hash of the id, so
    it does not move as the data grows)."""
    return int(hashlib.sha1(f"{sample_id}:heldout".encode()).hexdigest(), 16) % 1000 < permille


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


def position_weights(block_size: int, gamma: float) -> torch.Tensor:
    """w_k = exp(-(k-1)/gamma) for slots k = 1..B-1 (slot 0 is the anchor and has no loss)."""
    k = torch.arange(1, block_size, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


@dataclass
class Batch:
    ids: torch.Tensor  # (S, T) token ids, padded
    feats: torch.Tensor  # (S, T, F) target features (position t holds token t's features)
    anchors: torch.Tensor  # (S, A) anchor positions, -1 = padding block
    labels: torch.Tensor  # (S, A, B-1) token at anchor + k, -100 where not an assistant token


def sample_anchors(prompt_len: int, length: int, n: int, gen: torch.Generator) -> list[int]:
    """Up to n distinct anchors in [prompt_len, length - 2] (each needs a label after it)."""
    lo, hi = prompt_len, length - 2
    if hi < lo:
        return []
    count = hi - lo + 1
    if count <= n:
        return list(range(lo, hi + 1))
    return sorted((torch.randperm(count, generator=gen, device=gen.device)[:n] + lo).tolist())


def make_batch(samples: list[dict], feats: list[torch.Tensor], anchors: list[list[int]], block_size: int) -> Batch:
    S = len(samples)
    T = max(len(s["input_ids"]) for s in samples)
    A = max(1, max(len(a) for a in anchors))
    Fdim = feats[0].shape[-1]
    ids = torch.zeros(S, T, dtype=torch.long)
    fx = torch.zeros(S, T, Fdim, dtype=feats[0].dtype)
    anc = torch.full((S, A), -1, dtype=torch.long)
    labels = torch.full((S, A, block_size - 1), -100, dtype=torch.long)
    for s, (smp, f, a) in enumerate(zip(samples, feats, anchors)):
        x = torch.tensor(smp["input_ids"])
        ids[s, : len(x)] = x
        fx[s, : f.shape[0]] = f
        for j, pos in enumerate(a):
            anc[s, j] = pos
            tgt = x[pos + 1 : pos + block_size]
            labels[s, j, : len(tgt)] = tgt
    return Batch(ids, fx, anc, labels)


class DrafterLoss:
    """Forward a batch through a DFlash backbone and compute the decayed cross-entropy."""

    def __init__(self, model: DFlashModel, embed, lm_head, gamma: float):
        self.model, self.embed, self.lm_head = model, embed, lm_head
        self.gamma = gamma
        self.weights = position_weights(model.cfg.block_size, gamma)

    def hidden(self, b: Batch) -> torch.Tensor:
        """Block hidden states (S, A, B, H)."""
        cfg = self.model.cfg
        S, A = b.anchors.shape
        B, T = cfg.block_size, b.ids.shape[1]
        anc = b.anchors.clamp(min=0)
        block = torch.full((S, A, B), cfg.mask_token_id, dtype=torch.long)
        block[:, :, 0] = b.ids.gather(1, anc)
        positions = (anc.unsqueeze(2) + torch.arange(B)).view(S, A * B)
        ctx_pos = torch.arange(T).unsqueeze(0).expand(S, T)
        with torch.no_grad():
            emb = self.embed(block.view(S, A * B))
        kv = self.model.context_kv(b.feats.to(emb.dtype), ctx_pos)
        mask = training_mask(b.anchors, T, B)
        h = self.model(emb, positions, kv, mask)
        return h.view(S, A, B, -1)

    def __call__(self, b: Batch) -> tuple[torch.Tensor, dict]:
        h = self.hidden(b)
        logits = self.lm_head(h[:, :, 1:])  # (S, A, B-1, V)
        return self.loss_from_logits(logits, b.labels), {"hidden": h, "logits": logits}

    def batch_at(self, samples: list[dict], feats: list[torch.Tensor], anchors: list[list[int]]) -> Batch:
        """Blocks at the given anchor positions of each sample."""
        return make_batch(samples, feats, anchors, self.model.cfg.block_size)

    def predictions(self, extras: dict) -> dict[str, torch.Tensor]:
        """Greedy drafts (S, A, P) as inference makes them, by eval-metric suffix ("" = the method's own)."""
        return {"": self.draft_argmax(extras["logits"])}

    def eval_metrics(self, extras: dict, labels: torch.Tensor) -> dict:
        tau, pp = acceptance_from_predictions(self.predictions(extras)[""], labels)
        return {"eval_tau": tau, "eval_per_position": pp}

    def draft_argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Greedy drafts as inference makes them: within the draft vocabulary when there is one."""
        return shortlist(logits, 1, self.model.draft_ids)[1].squeeze(-1)

    def loss_from_logits(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        V = logits.shape[-1]
        ce = F.cross_entropy(logits.reshape(-1, V).float(), labels.reshape(-1), ignore_index=-100, reduction="none")
        ce = ce.view(labels.shape)
        w = self.weights.view(1, 1, -1) * (labels != -100)
        return (ce * w).sum() / w.sum().clamp_min(1e-6)


class DCOCOLoss(DrafterLoss):
    """DFlash loss plus the corrector's: cross-entropy over the K candidates of S_p(a*, .) towards
    the target's next token b*, with the target's own previous token a* as predecessor (teacher
    forcing). Pairs whose target token is missing from either shortlist are excluded; pair p is
    weighted exp(-p/gamma), since an early rejection wastes more of the block.

    With `l1_weight` > 0 (and `head`, the target's final norm and LM head on the last-layer feature
    columns from `split` on) the corrector also matches the target's T=1 distribution:
    l1_weight * ||q - p_target||_1 over the pairs that reach the first `num_speculative_tokens`
    slots, q the distribution the T > 0 walk draws the slot from given a* (`distribution_loss`).
    The walk's acceptance there is sum min(q, p_target) = 1 - ||q - p_target||_1 / 2 (over the
    vocabulary; over the shortlist the target's mass off it is lost either way), so the term
    trains exactly what T > 0 verification accepts; cross-entropy alone sharpens q on the greedy
    token. It needs a predecessor in the shortlist, not the target token."""

    def __init__(
        self,
        model,
        embed,
        lm_head,
        gamma: float,
        corrector_weight: float,
        l1_weight: float = 0.0,
        head=None,
        split: Optional[int] = None,
    ):
        super().__init__(model, embed, lm_head, gamma)
        self.corrector_weight, self.l1_weight = corrector_weight, l1_weight
        self.head, self.split = head, split
        if l1_weight > 0 and head is None:
            raise ValueError("the corrector's L1 term needs the target head and the last-layer features")

    def __call__(self, b: Batch) -> tuple[torch.Tensor, dict]:
        full = b
        if self.split is not None:  # the last layer's columns feed p_target, not the drafter
            b = Batch(b.ids, b.feats[..., : self.split], b.anchors, b.labels)
        h = self.hidden(b)
        logits = self.lm_head(h[:, :, 1:])
        base = self.loss_from_logits(logits, b.labels)
        S, A, P, V = logits.shape
        labels = b.labels.reshape(S * A, P)
        anchor = anchor_hidden = None
        if self.model.lead:  # anchor_pair: the anchor is the walk's position 0, its own (always present) label
            anchor = b.ids.gather(1, b.anchors.clamp(min=0)).reshape(-1)
            anchor_hidden = h[:, :, 0].reshape(S * A, -1)
            labels = torch.cat([torch.where(labels[:, :1] != -100, anchor.view(-1, 1), -100), labels], dim=1)
        ids, vals, scores, hot = self.model.pair_scores(
            h[:, :, 1:].reshape(S * A, P, -1),
            logits.reshape(S * A, P, V),
            self.embed,
            anchor=anchor,
            anchor_hidden=anchor_hidden,
        )
        corr, pred, valid_from, m = self.corrector_loss(ids, scores, labels)
        if self.l1_weight > 0:  # on the T > 0 walks' scores (the same as the greedy ones without a sampled head)
            n = min(P, self.model.cfg.num_speculative_tokens or P)
            pt = self.head.next_token_probs(full, self.split, n).reshape(S * A, n, -1)
            l1, m["t1_accept_est"] = self.distribution_loss(
                ids, rows_at(hot, pred), labels, valid_from, pt, logits.reshape(S * A, P, V)
            )
            m["corrector_l1"] = l1.item()
            corr = corr + self.l1_weight * l1
        m["dflash_loss"] = base.item()
        return base + self.corrector_weight * corr, {
            "hidden": h,
            "logits": logits,
            "ids": ids,
            "scores": scores,
            "sampled_scores": hot,
            "metrics": m,
        }

    def corrector_loss(self, ids: torch.Tensor, scores: torch.Tensor, labels: torch.Tensor):
        """Cross-entropy of S_p(a*, .) towards b*; also returns a*'s shortlist index (n, P-1) and
        whether it is shortlisted (n, P-1), for the distribution term."""
        hit = ids == labels.unsqueeze(-1)  # (n, P, K)
        present = hit.any(-1) & (labels != -100)
        where = hit.float().argmax(-1)  # shortlist index of the target token (0 if absent)
        a, b = where[:, :-1], where[:, 1:]
        valid = present[:, :-1] & present[:, 1:]
        rows = rows_at(scores, a)  # S_p(a*, .)
        ce = F.cross_entropy(rows.reshape(-1, rows.shape[-1]).float(), b.reshape(-1), reduction="none").view(b.shape)
        w = self.pair_weights(b.shape[1]) * valid
        loss = (ce * w).sum() / w.sum().clamp_min(1e-6)
        lead = self.model.lead  # the anchor row of anchor_pair is always present: not a recall
        labelled = labels[:, lead:] != -100
        m = {
            "recall_at_k": (present[:, lead:].sum() / labelled.sum().clamp_min(1)).item(),
            "selector_acc": ((rows.argmax(-1) == b) & valid).sum().item() / max(1, int(valid.sum())),
            "corrector_loss": loss.item(),
        }
        return loss, a, present[:, :-1], m

    def pair_weights(self, pairs: int) -> torch.Tensor:
        """exp(-p / gamma) for pairs p = 0..pairs-1, as (1, pairs)."""
        return position_weights(pairs + 1, self.gamma).view(1, -1)

    def distribution_loss(
        self,
        ids: torch.Tensor,
        rows: torch.Tensor,
        labels: torch.Tensor,
        pred_present: torch.Tensor,
        pt: torch.Tensor,
        logits: torch.Tensor,
    ) -> tuple[torch.Tensor, float]:
        """Weighted ||q - p_target||_1 over the pairs whose destination slot has p_target (pt (n, m, V)
        for slots 1..m), and the mean expected T=1 acceptance sum min(q, p). q is what the configured
        T > 0 walk draws from: softmax(S_p(a*, .)) over the K candidates, or with `vocab_walk` the
        drafter's softmax over the draft vocabulary (`logits` (n, P, V)) with those K rescored."""
        first = 1 - self.model.lead  # pair p ends at slot p + 1 + first, i.e. pt index p + first
        pairs = pt.shape[1] - first
        dest = ids[:, 1 : 1 + pairs]  # candidates of each pair's destination
        rows = rows[:, :pairs].float()
        if self.model.dcfg.vocab_walk:
            full = self.model.restrict_to_draft_vocab(logits[:, first : first + pairs].float())
            q, p = torch.softmax(full.scatter(2, dest, rows), -1), pt[:, first:]
        else:
            q, p = torch.softmax(rows, -1), pt[:, first:].gather(2, dest)  # (n, pairs, K)
        valid = pred_present[:, :pairs] & (labels[:, 1 : 1 + pairs] != -100)
        l1 = (q - p).abs().sum(-1)
        w = self.pair_weights(pairs) * valid
        accept = (torch.minimum(q, p).sum(-1) * valid).sum() / valid.sum().clamp_min(1)
        return (l1 * w).sum() / w.sum().clamp_min(1e-6), accept.item()

    def predictions(self, extras: dict) -> dict[str, torch.Tensor]:
        """The corrected walk's drafts, and the same drafts uncorrected ("_dflash")."""
        from ..drafters.dcoco import walk_greedy

        lead, (S, A, P) = self.model.lead, extras["logits"].shape[:3]
        ids = extras["ids"]
        corrected = ids.gather(2, walk_greedy(extras["scores"]).unsqueeze(2)).squeeze(2)[:, lead:].reshape(S, A, P)
        return {"": corrected, "_dflash": self.draft_argmax(extras["logits"])}

    def eval_metrics(self, extras: dict, labels: torch.Tensor) -> dict:
        S, A, P = labels.shape
        pred = self.predictions(extras)
        tau_c, pp = acceptance_from_predictions(pred[""], labels)
        tau_d, _ = acceptance_from_predictions(pred["_dflash"], labels)
        ids = extras["ids"][:, self.model.lead :]
        oracle = torch.where((ids == labels.view(S * A, P, 1)).any(-1).view(S, A, P), labels, -1)
        tau_o, _ = acceptance_from_predictions(oracle, labels)
        return {
            "eval_tau": tau_c,
            "eval_per_position": pp,
            "eval_tau_dflash": tau_d,
            "eval_tau_oracle": tau_o,
            **{f"eval_{k}": v for k, v in extras["metrics"].items()},
        }


def rows_at(scores: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """S_p(a_p, .) (n, P-1, K) of transition scores (n, P-1, K, K) at predecessor indices a (n, P-1)."""
    return scores.gather(2, a.view(*a.shape, 1, 1).expand(-1, -1, 1, scores.shape[-1])).squeeze(2)


def accepted_prefix(pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """1 at each draft slot (last dim) whose slot and all before it match a label, else 0."""
    return torch.cumprod(((pred == labels) & (labels != -100)).long(), dim=-1)


def acceptance_from_predictions(pred: torch.Tensor, labels: torch.Tensor) -> tuple[float, list[float]]:
    """Simulated acceptance length tau = 1 + mean accepted prefix, and per-position acceptance,
    from greedy predictions (S, A, B-1) against the (greedy) target continuation."""
    acc = accepted_prefix(pred, labels)[labels[..., 0] != -100]  # (n, B-1) over blocks with a label
    if acc.numel() == 0:
        return 1.0, []
    return 1.0 + acc.sum(-1).float().mean().item(), acc.float().mean(0).tolist()


def decode_acceptance(pred: torch.Tensor, labels: torch.Tensor, k: int) -> tuple[int, int]:
    """(verification passes, tokens) of greedy decoding over one answer, from drafts (A, P) and labels
    (A, P) at each of its anchor positions in order, the last one's label being the answer's last
    token: each block opens where the previous one ended (anchor + accepted + 1), drafts k tokens and
    yields its accepted prefix plus the target's token, which must be one of the answer's."""
    accepted = accepted_prefix(pred[:, :k], labels[:, :k]).sum(-1).tolist()
    a = passes = tokens = 0
    while a < len(accepted):
        n = min(accepted[a], len(accepted) - a - 1)
        passes += 1
        tokens += n + 1
        a += n + 1
    return passes, tokens


def loss_batch(loss, samples: list[dict], feats: list[torch.Tensor], n_anchors: int, gen: torch.Generator):
    """The batch a drafter loss trains on, from samples (`input_ids`, `prompt_len`) and their target
    features: the loss's own layout when it has a `make_batch` hook (EAGLE-3), else DFlash
    blocks (`batch_at`) at `n_anchors` anchors per sequence sampled from `gen`."""
    if hasattr(loss, "make_batch"):
        return loss.make_batch(samples, feats, n_anchors, gen)
    return loss.batch_at(
        samples, feats, [sample_anchors(s["prompt_len"], len(s["input_ids"]), n_anchors, gen) for s in samples]
    )


def build_block_model(method: str, d, target) -> DFlashModel:
    """A DFlash-family model (dflash, dcoco, dspark) for `target` from a `DrafterSection`: warm-started
    from `d.init_from` or fresh (from the target's last layers when `d.init_from_target`), plus a
    zero-initialised corrector (DCOCO) or fresh Markov / confidence heads (DSpark) when the
    checkpoint lacks them. float32, in training mode."""
    from ..drafters.dcoco import DCOCOConfig, DCOCOModel

    if method == "dspark":
        from .dspark import load_dspark_init

        resumed = load_dspark_init(d.init_from)  # None unless init_from is a DSpark checkpoint
        if resumed is not None:
            return resumed.float().train()
    if d.init_from:
        model, _ = load_dflash(d.init_from)
        mcfg = model.cfg
    else:
        mcfg = DFlashConfig.for_target(
            target,
            num_layers=d.num_layers,
            block_size=d.block_size,
            num_features=d.num_features,
            intermediate_size=d.intermediate_size,
        )
        model = DFlashModel(mcfg)
        if d.init_from_target:
            init_from_target(model, target)
    if method == "dcoco" and not isinstance(model, DCOCOModel):
        # every corrector setting has a field of the same name in the drafter section (hidden: corrector_hidden)
        dcfg = DCOCOConfig(
            **{f: getattr(d, "corrector_hidden" if f == "hidden" else f) for f in DCOCOConfig.model_fields}
        )
        backbone = model
        model = DCOCOModel(mcfg, dcfg)
        model.load_state_dict(backbone.state_dict(), strict=False)
    elif method == "dcoco":  # a trained corrector: its shape comes with it, the inference defaults from the config
        dcfg = model.dcfg.model_copy(
            update={
                "sampled_walk": d.sampled_walk,
                "vocab_walk": d.vocab_walk,
                "sampled_head": model.dcfg.sampled_head or d.sampled_head,
            }
        )
        trained = model
        model = DCOCOModel(mcfg, dcfg)  # a sampled head added here starts at zero
        missing, unexpected = model.load_state_dict(trained.state_dict(), strict=False)
        if set(missing) - {"corrector.out_sampled.weight", "corrector.out_sampled.bias"} or unexpected:
            raise ConfigError(
                f"{d.init_from}: its weights do not fit its own config (missing {missing[:3]}, unexpected {unexpected[:3]})"
            )
    if method == "dspark":
        from .dspark import dspark_from_backbone

        model = dspark_from_backbone(model, d)
    if d.num_speculative_tokens is not None:  # the inference default stored in the checkpoint
        model.cfg.num_speculative_tokens = d.num_speculative_tokens
    if not d.train_backbone:
        if method != "dcoco":
            raise ConfigError(
                "drafter.train_backbone: false only applies to method dcoco (it trains the corrector alone)"
            )
        for name, p in model.named_parameters():
            p.requires_grad_(name.startswith("corrector."))
    return model.float().train()


class Trainer:
    def __init__(self, cfg: TrainConfig, target, data: RegeneratedUnion):
        self.cfg = cfg
        self.target = target
        self.data = data
        self.out = Path(cfg.run.out)
        self.out.mkdir(parents=True, exist_ok=True)
        o = cfg.optim
        torch.manual_seed(o.seed)
        man = data.manifest
        if man["target_vocab_size"] != target.vocab_size or man["target_hidden_size"] != target.hidden_size:
            raise ConfigError(f"{data.root} was regenerated with another target")
        self.online = cfg.data.features == "online"
        if not self.online and not data.has_features:
            raise ConfigError(
                f"{data.root}: no stored target features (regenerated with --no-features); "
                "train with data.features=online"
            )
        self.device = target.device
        self.data_taps = list(man["taps"])
        with torch.device(self.device):  # the drafter, its heads and the loss buffers live by the target
            self.model = self.build_model().to(self.device)
        taps = list(self.model.cfg.taps)
        if self.online:  # any layer can be recomputed: the data's taps, the drafter's and the last layer
            self.data_taps = sorted(set(self.data_taps) | set(taps) | {target.num_layers})
        elif not set(taps) <= set(man["taps"]):
            raise ConfigError(f"drafter needs target taps {taps}, data has {man['taps']}")
        self.tap_index = [self.data_taps.index(t) * target.hidden_size for t in taps]
        samples = [s for s in data.samples() if len(s["input_ids"]) - s["prompt_len"] >= 2]
        held = [is_eval_sample(s["id"], cfg.data.eval_permille) for s in samples]
        self.eval_samples = [s for s, h in zip(samples, held) if h][: cfg.data.eval_samples]
        self.train_samples = [s for s, h in zip(samples, held) if not h]
        if not self.train_samples:
            raise ConfigError(f"no training samples in {data.root}")
        size = min(cfg.drafter.draft_vocab_size, target.vocab_size)
        if isinstance(self.model, DFlashModel) and self.model.draft_ids is None and size < target.vocab_size:
            self.model.set_draft_vocab(top_tokens(response_token_counts(self), size))
        self.embed = target.model.get_input_embeddings()
        self.lm_head = target.model.get_output_embeddings()
        for p in target.model.parameters():
            p.requires_grad_(False)
        with torch.device(self.device):
            self.loss = self.build_loss()  # DSpark / EAGLE-3 append the last layer's tap here
        # the drafter's feature columns within the data's (n, n_data_taps * H) features
        self.feature_cols = torch.cat([torch.arange(i, i + target.hidden_size) for i in self.tap_index])
        params = [p for p in self.model.parameters() if p.requires_grad]
        decay = [p for p in params if p.ndim >= 2]
        no_decay = [p for p in params if p.ndim < 2]
        self.opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=o.lr,
            betas=(0.9, 0.95),
        )
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, self.lr_lambda)
        self.step = 0
        self.gen = torch.Generator().manual_seed(o.seed)
        self.epoch, self.order, self.cursor = 0, None, 0
        self.train_seconds = 0.0  # wall time of the training steps so far (kept across resumes)
        self.budget_fixed = False  # optim.time_budget_s: steps already set from the measured pace
        self.log_path = self.out / "log.jsonl"
        self._resume()

    # -- hooks for drafter families -------------------------------------------------------------
    def build_model(self) -> DFlashModel:
        """The backbone (fresh or warm-started), plus a zero-initialised corrector for DCOCO or fresh
        Markov / confidence heads for DSpark (train/dspark.py); EAGLE-3 builds its own (train/eagle3.py)."""
        if self.cfg.method == "eagle3":
            from .eagle3 import build_eagle3_model

            return build_eagle3_model(self)
        return build_block_model(self.cfg.method, self.cfg.drafter, self.target)

    def build_loss(self):
        o = self.cfg.optim
        if self.cfg.method in ("dspark", "eagle3"):  # these also read the target's last-layer feature
            from .dspark import build_dspark_loss
            from .eagle3 import build_eagle3_loss

            return build_dspark_loss(self) if self.cfg.method == "dspark" else build_eagle3_loss(self)
        if self.cfg.method == "dcoco":
            head = split = None
            if o.corrector_l1_weight > 0:  # p_target from the last layer's features (as DSpark's)
                from .dspark import TargetHead, attach_target_head

                split, head = attach_target_head(self), TargetHead(self.target)
            return DCOCOLoss(
                self.model,
                self.embed,
                self.lm_head,
                o.loss_decay_gamma,
                o.corrector_weight,
                o.corrector_l1_weight,
                head,
                split,
            )
        return DrafterLoss(self.model, self.embed, self.lm_head, o.loss_decay_gamma)

    def export(self, path: Path) -> None:
        if self.cfg.method in ("dspark", "eagle3"):
            from .dspark import export_dspark
            from .eagle3 import export_eagle3

            return (export_dspark if self.cfg.method == "dspark" else export_eagle3)(self, path)
        save_dflash(path, self.model, method=self.cfg.method, extra=self.provenance())

    def provenance(self) -> dict:
        return {
            "dcoco_training": {
                "step": self.step,
                "train_samples": len(self.train_samples),
                "train_seconds": round(self.train_seconds),
                "threads": torch.get_num_threads(),
                "device": device_label(str(self.device)),
                "data": str(self.cfg.data.path),
                "config": self.cfg.model_dump(),
            }
        }

    # -- schedule and data -------------------------------------------------------------------
    def lr_lambda(self, step: int) -> float:
        o = self.cfg.optim
        if step < o.warmup_steps:
            return (step + 1) / o.warmup_steps
        t = (step - o.warmup_steps) / max(1, o.steps - o.warmup_steps)
        return o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))

    def _columns(self, f: torch.Tensor) -> torch.Tensor:
        """The drafter's taps out of the data's (n, n_data_taps * H) features."""
        cols = self.feature_cols
        return f[:, cols.to(f.device)] if f.shape[1] != len(cols) else f

    def _features(self, samples: list[dict]) -> list[torch.Tensor]:
        """Per sample, the target features of its tokens: stored, or recomputed by one batched target
        forward over the (truncated) sequences at the data's taps (`data.features: online`)."""
        if not self.online:
            return [self._columns(self.data.features(s))[: len(s["input_ids"])] for s in samples]
        with self.target.tapping(self.data_taps):
            _, out = self.target.prefill([s["input_ids"] for s in samples])
        feats = out.features.clone()  # out of inference mode: the drafter's inputs need autograd-able tensors
        return [self._columns(f[: len(s["input_ids"])]) for f, s in zip(feats, samples)]

    def _truncate(self, s: dict) -> dict:
        L = self.cfg.data.max_length
        if len(s["input_ids"]) <= L:
            return s
        return dict(s, input_ids=s["input_ids"][:L])

    def next_batch(self) -> Batch:
        o = self.cfg.optim
        chosen = []
        while len(chosen) < o.batch_size:
            if self.order is None or self.cursor >= len(self.order):
                self.order = torch.randperm(len(self.train_samples), generator=self.gen, device="cpu").tolist()
                self.cursor = 0
                if chosen or self.step:
                    self.epoch += 1
            chosen.append(self.train_samples[self.order[self.cursor]])
            self.cursor += 1
        return self._batch([self._truncate(s) for s in chosen], o.anchors_per_seq, self.gen)

    def _batch(self, samples: list[dict], n_anchors: int, gen: torch.Generator) -> Batch:
        return loss_batch(self.loss, samples, self._features(samples), n_anchors, gen)

    # -- loop --------------------------------------------------------------------------------
    def autocast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.cfg.optim.autocast_bf16)

    def train_step(self) -> dict:
        with torch.device(self.device):  # tensors the batch and the loss create go where the model is
            return self._train_step()

    def _train_step(self) -> dict:
        self.model.train()
        batch = self.next_batch()
        with self.autocast():
            loss, extras = self.loss(batch)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.optim.grad_clip)
        self.opt.step()
        self.sched.step()
        self.step += 1
        out = {"loss": loss.item(), "grad_norm": gnorm.item(), "lr": self.sched.get_last_lr()[0]}
        out.update(extras.get("metrics", {}))
        return out

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Teacher-forced simulated acceptance on held-out samples, greedy predictions against the
        target's own tokens: `eval_tau` over 32 random anchors per sample, and `eval_tau_decode`, the
        τ greedy decoding gets (`_decode_tau`). Random anchors overstate it: a stretch the drafter
        predicts well counts once per anchor in it, but decoding crosses it in one block."""
        with torch.device(self.device):
            return self._evaluate()

    def _evaluate(self) -> dict:
        self.model.eval()
        gen = torch.Generator().manual_seed(1234)
        rows = []
        for i in range(0, len(self.eval_samples), 4):
            samples = [self._truncate(s) for s in self.eval_samples[i : i + 4]]
            batch = self._batch(samples, 32, gen)
            with self.autocast():
                loss, extras = self.loss(batch)
            rows.append({"eval_loss": loss.item(), **self.loss.eval_metrics(extras, batch.labels)})
        decoded = self._decode_tau()
        self.model.train()
        out = {}
        for key in rows[0]:
            vals = [r[key] for r in rows]
            if isinstance(vals[0], list):
                n = max(len(v) for v in vals)
                out[key] = [round(sum(v[k] for v in vals if len(v) > k) / len(vals), 4) for k in range(n)]
            else:
                out[key] = round(sum(vals) / len(vals), 4)
        return {**out, **decoded}

    def _decode_tau(self, chunk: int = 64) -> dict:
        """τ as greedy decoding realizes it on the held-out samples (per suffix of `predictions`):
        drafts at every response position, then each sample walked block by block with the drafter's
        default draft length (`decode_acceptance`). With the target's greedy answers as data this is
        what `dcoco bench` measures on those prompts, up to bf16 rounding."""
        k = self.model.cfg.num_speculative_tokens or self.model.max_draft  # at most the drafts' width
        totals: dict[str, list[int]] = {}
        for smp in self.eval_samples:
            smp = self._truncate(smp)
            anchors = list(range(smp["prompt_len"], len(smp["input_ids"]) - 1))
            if not anchors:
                continue
            feats = self._features([smp])
            preds: dict[str, list[torch.Tensor]] = {}
            labels = []
            for i in range(0, len(anchors), chunk):
                b = self.loss.batch_at([smp], feats, [anchors[i : i + chunk]])
                with self.autocast():
                    _, extras = self.loss(b)
                for key, p in self.loss.predictions(extras).items():
                    preds.setdefault(key, []).append(p[0])
                labels.append(b.labels[0])
            for key, p in preds.items():
                passes, tokens = decode_acceptance(torch.cat(p), torch.cat(labels), k)
                t = totals.setdefault(key, [0, 0])
                t[0], t[1] = t[0] + passes, t[1] + tokens
        return {f"eval_tau_decode{key}": round(t[1] / max(1, t[0]), 4) for key, t in totals.items()}

    def run(self, progress: bool = True) -> None:
        from tqdm import tqdm

        o, r = self.cfg.optim, self.cfg.run
        bar = tqdm(
            total=o.steps,
            initial=self.step,
            desc=f"train {self.cfg.method}",
            unit="step",
            file=sys.stderr,
            disable=not progress,
        )
        last_eval = None
        finished_on_start = self.step >= o.steps
        budget_from = (
            (self.step, time.time()) if o.time_budget_s and not self.budget_fixed and not finished_on_start else None
        )
        try:
            while self.step < o.steps:
                t0 = time.time()
                m = self.train_step()
                self.train_seconds += time.time() - t0
                m.update(step=self.step, epoch=self.epoch, step_s=round(time.time() - t0, 3))
                if budget_from is not None and self.step - budget_from[0] >= o.time_budget_probe:
                    self._fit_time_budget(budget_from)
                    m["steps_from_time_budget"] = o.steps
                    bar.total, budget_from = o.steps, None
                if self.eval_samples and (self.step % r.eval_every == 0 or self.step == o.steps):
                    last_eval = self.evaluate()
                    m.update(last_eval)
                self._log(m)
                bar.set_postfix(loss=f"{m['loss']:.3f}", tau=f"{last_eval['eval_tau']:.2f}" if last_eval else "-")
                bar.update(1)
                if self.step % r.checkpoint_every == 0 or self.step == o.steps:
                    self.save()
        except KeyboardInterrupt:
            print(f"\ninterrupted at step {self.step}; resume with the same command", file=sys.stderr)
            raise
        finally:
            bar.close()
        if finished_on_start:  # started again after the last step: re-export (e.g. new inference defaults)
            self.export(self.out / "drafter")
        self.plot()

    def _fit_time_budget(self, since: tuple[int, float]) -> None:
        """Set `optim.steps` so that training ends about `time_budget_s` after it started (evaluation
        and checkpoints included), from the pace of the steps since `since` (step, wall time)."""
        o = self.cfg.optim
        elapsed = time.time() - since[1]
        pace = elapsed / (self.step - since[0])
        o.steps = max(self.step + 1, self.step + int((o.time_budget_s - elapsed) / pace))
        self.budget_fixed = True
        print(f"time budget {o.time_budget_s:.0f}s at {pace:.3f}s/step: training for {o.steps} steps", file=sys.stderr)

    # -- persistence -----------------------------------------------------------------------------
    def _log(self, m: dict) -> None:
        append_log(self.log_path, m)

    def state(self) -> dict:
        return {
            "model": self.model.state_dict(),
            "opt": self.opt.state_dict(),
            "sched": self.sched.state_dict(),
            "step": self.step,
            "epoch": self.epoch,
            "order": self.order,
            "cursor": self.cursor,
            "train_seconds": self.train_seconds,
            "budget_steps": self.cfg.optim.steps if self.budget_fixed else None,
            "gen": self.gen.get_state(),
            "torch_rng": torch.get_rng_state(),
            "py_rng": random.getstate(),
            "config": self.cfg.model_dump(),
        }

    def save(self) -> None:
        save_state(self.out, self.state())
        self.export(self.out / "drafter")

    def _resume(self) -> None:
        path = self.out / "state.pt"
        if not path.exists():
            return
        st = torch.load(path, weights_only=False, map_location="cpu")
        missing, unexpected = self.model.load_state_dict(st["model"], strict=False)
        if set(missing) - {"draft_ids"} or unexpected:  # runs saved before draft vocabularies keep the new one
            raise ConfigError(
                f"{path}: saved model does not match the config (missing {missing[:3]}, unexpected {unexpected[:3]})"
            )
        self.opt.load_state_dict(st["opt"])
        self.sched.load_state_dict(st["sched"])
        self.step, self.epoch, self.order, self.cursor = st["step"], st["epoch"], st["order"], st["cursor"]
        self.train_seconds = st.get("train_seconds", 0.0)
        if self.cfg.optim.time_budget_s and st.get("budget_steps"):  # the steps fixed before the stop
            self.cfg.optim.steps, self.budget_fixed = st["budget_steps"], True
        self.gen.set_state(st["gen"])
        torch.set_rng_state(st["torch_rng"])
        random.setstate(st["py_rng"])
        truncate_log(self.log_path, self.step)
        print(f"resumed from step {self.step}", file=sys.stderr)

    def plot(self) -> Optional[Path]:
        from .plots import training_curve

        return training_curve(self.log_path, self.out / "curve.png", title=f"{self.cfg.method} training")
