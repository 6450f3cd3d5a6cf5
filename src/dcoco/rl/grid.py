"""`dcoco rl` on a grid of processes: the policy's forward and backward split into
`parallel.pipeline` = P stages, each over `parallel.context` = W ranks (rank = stage * W + c), and
the draft loss on the last stage's W ranks, context parallel.

One step, every process in step:
  1. rollouts   rank 0 holds the whole policy and draft (the master copies, their optimizers and
                `state.pt`, exactly as one process does) and generates the rollouts; their tokens,
                advantages and sampling log-probs go to every rank
  2. policy     the rollouts pass through the stages micro-batch by micro-batch (`PolicyStage`):
                zigzag shards, ring attention within a stage, activations forward and their
                gradients back between stages; the last stage computes its share of the GRPO loss.
                Each stage sends the drafter's tapped layers of its shard to the last stage's rank
                of the same shard through a `TapChannel`, outside that schedule
  3. draft      the last stage's ranks run the draft loss on their shards (`ContextShard`: the
                block queries see the rest of the context over the ring)
  4. update     gradients are summed over each stage's ranks and sent to rank 0, which clips and
                steps the master copies as one process would, then sends each rank its new weights

So the losses and gradients are the single-process run's (`tests/parallel/test_rl_grid.py`); what
the grid divides is the policy's and the draft's activations and compute. The optimizer states
stay whole on rank 0 (a sharded optimizer is not part of this).
"""

from __future__ import annotations

import copy
import math
import time
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from ..parallel import ContextShard, TapChannel, ZigzagLayout
from ..parallel.policy_stage import PolicyStage
from ..target import Target
from .config import RLConfig
from .cotrain import DraftCoTrainer
from .grpo import clipped_surrogate, token_weights
from .loop import RLRun, _seeds
from .task import Task


def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors]) if tensors else torch.zeros(0)


def _unflat_into(flat: torch.Tensor, tensors: list[torch.Tensor], add: bool = False) -> None:
    i = 0
    for t in tensors:
        part = flat[i : i + t.numel()].view_as(t)
        t.add_(part) if add else t.copy_(part)
        i += t.numel()


def _grads(params: list[torch.Tensor]) -> list[torch.Tensor]:
    """The parameters' gradients, zeros where a parameter has none yet."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    return [p.grad for p in params]


def _share_parameters(module: nn.Module, master: nn.Module) -> None:
    """Make every parameter of `module` (a copy of `master`) the very tensor of `master`, tied ones
    included: rank 0's stage then trains the master's own weights."""
    theirs = dict(master.named_parameters(remove_duplicate=False))
    for name, _ in list(module.named_parameters(remove_duplicate=False)):
        path, _, leaf = name.rpartition(".")
        module.get_submodule(path)._parameters[leaf] = theirs[name]


class GridRLRun(RLRun):
    """An `RLRun` on P x W processes (this one's rank from torch.distributed)."""

    def __init__(self, cfg: RLConfig, policy: Target, task: Optional[Task] = None):
        P, W = cfg.parallel.pipeline, cfg.parallel.context
        self.P, self.W = P, W
        self.rank = dist.get_rank()
        self.stage_index, self.c = divmod(self.rank, W)
        self.lead = self.rank == 0
        # collective: every rank creates every group, in the same order
        self.cp_groups = [dist.new_group([s * W + j for j in range(W)]) for s in range(P)]
        has_draft = cfg.draft.method != "none"
        if self.lead:
            super().__init__(cfg, policy, task)  # the master copies, as one process holds them
            stage_model = copy.deepcopy(self.model)
            _share_parameters(stage_model, self.model)
        else:
            self.cfg, self.policy, self.model = cfg, policy, policy.model
            policy.set_taps(())
            self.step = 0
            self.draft = None
            stage_model = self.model
        self.last = self.stage_index == P - 1
        if has_draft and self.last and not self.lead:
            self.draft = DraftCoTrainer(cfg.draft, policy)  # its weights come from rank 0 below
        taps = [self.draft.feature_taps if self.lead and has_draft else []]
        dist.broadcast_object_list(taps, 0)
        self.taps = taps[0]  # the policy layers the draft loss reads
        self.stage = PolicyStage(stage_model, self.stage_index, P, self.cp_groups[self.stage_index], W)
        # which parameters each rank holds, for the gradients to rank 0 and the weights back
        self.names = [None] * dist.get_world_size()
        dist.all_gather_object(self.names, list(self.stage.params))
        self.draft_ranks = [(P - 1) * W + j for j in range(W)] if has_draft else []
        self.channels = self._tap_channels(policy.hidden_size, policy.dtype)
        step = torch.tensor([self.step])
        dist.broadcast(step, 0)  # a resumed run: every rank continues at rank 0's step ...
        self.step = int(step)
        self.send_weights()  # ... with rank 0's weights

    def _tap_channels(self, hidden: int, dtype) -> dict:
        """(stage, c) -> the channel from that stage's rank c to the last stage's rank c, for the
        stages before the last that make any tap."""
        r, g, par = self.cfg.rollout, self.cfg.grpo, self.cfg.parallel
        per_step = math.ceil(r.prompts_per_step * r.group_size / g.micro_batch)
        seq = par.max_prompt_tokens + r.max_new_tokens
        rows = min(r.prompts_per_step * r.group_size, g.micro_batch) * (seq // self.W + 2)
        out = {}
        for s in range(self.P - 1):
            owned = PolicyStage.taps_of(s, self.P, self.policy.num_layers, self.taps)
            if not owned:
                continue
            for j in range(self.W):
                out[(s, j)] = TapChannel(
                    s * self.W + j,
                    (self.P - 1) * self.W + j,
                    (rows, len(owned) * hidden),
                    dtype,
                    num_slots=per_step,
                    transport="p2p",
                    timeout=600,
                    name=f"tap[stage{s},cp{j}]",
                )
        return out

    # -- weights ------------------------------------------------------------------------------------
    def send_weights(self) -> None:
        """Rank 0's policy (and draft) weights to the ranks that hold a part of them."""
        with torch.no_grad():
            master = dict(self.model.named_parameters()) if self.lead else None
            mine = self.stage.params
            for r in range(1, dist.get_world_size()):
                if self.lead:
                    dist.send(_flat([master[n].detach() for n in self.names[r]]), r)
                elif r == self.rank:
                    buf = torch.empty(sum(mine[n].numel() for n in self.names[r]), dtype=self.policy.dtype)
                    dist.recv(buf, 0)
                    _unflat_into(buf, [mine[n] for n in self.names[r]])
            for r in self.draft_ranks:
                if r == 0:
                    continue
                if self.lead:
                    dist.send(_flat([p.detach() for p in self.draft.model.parameters()]), r)
                elif r == self.rank:
                    params = list(self.draft.model.parameters())
                    buf = torch.empty(sum(p.numel() for p in params), dtype=params[0].dtype)
                    dist.recv(buf, 0)
                    _unflat_into(buf, params)

    def gather_gradients(self) -> None:
        """Each stage's gradients summed over its ranks, then into rank 0's master copies (a tied
        embedding adds the first and the last stage's); the draft's likewise."""
        own = _grads(list(self.stage.params.values()))
        flat = _flat(own)
        if self.W > 1:
            dist.all_reduce(flat, group=self.cp_groups[self.stage_index])
        if self.lead:  # rank 0's stage trains the master's own tensors
            _unflat_into(flat, own)
        master = dict(self.model.named_parameters()) if self.lead else {}
        for s in range(1, self.P):
            src = s * self.W
            if self.rank == src:
                dist.send(flat, 0)
            elif self.lead:
                grads = _grads([master[n] for n in self.names[src]])
                buf = torch.empty(sum(g.numel() for g in grads), dtype=flat.dtype)
                dist.recv(buf, src)
                _unflat_into(buf, grads, add=True)
        if self.draft is None or not self.cfg.draft.cotrain:
            return
        grads = _grads(self.draft.params)
        if self.rank in self.draft_ranks:
            dflat = _flat(grads)
            if self.W > 1:
                dist.all_reduce(dflat, group=self.cp_groups[-1])
            if self.lead:
                _unflat_into(dflat, grads)
            elif self.rank == self.draft_ranks[0]:
                dist.send(dflat, 0)
        elif self.lead:
            buf = torch.empty(sum(g.numel() for g in grads), dtype=grads[0].dtype)
            dist.recv(buf, self.draft_ranks[0])
            _unflat_into(buf, grads)

    # -- one step -------------------------------------------------------------------------------------
    def collect(self, step: int) -> dict:
        """Rank 0's rollouts (`RLRun.collect`); every rank gets their tokens, advantages and log-probs."""
        ro = super().collect(step) if self.lead else {}
        box = [None]
        if self.lead:
            outs = ro["outs"]
            box = [
                {
                    "seqs": [o.prompt_token_ids + o.token_ids for o in outs],
                    "plens": [len(o.prompt_token_ids) for o in outs],
                    "adv": ro["adv"],
                    "rollout_lp": [list(o.logprobs) for o in outs],
                }
            ]
        dist.broadcast_object_list(box, 0)
        return {**ro, **box[0]}

    def micro_batches(self, n_seq: int) -> list[slice]:
        mb = self.cfg.grpo.micro_batch
        return [slice(i, min(i + mb, n_seq)) for i in range(0, n_seq, mb)]

    def grid_policy_pass(self, ro: dict) -> tuple[torch.Tensor, float, list[torch.Tensor]]:
        """Forward and backward of the GRPO loss through the stages, micro-batch by micro-batch.
        Returns this rank's sums (loss, clipped tokens, tokens, KL(rollout || policy) k3 sum), the
        largest log-prob gap to the rollout's, and (last stage) its shard's draft features per
        micro-batch."""
        g, T, H = self.cfg.grpo, self.cfg.rollout.temperature, self.policy.hidden_size
        seqs, plens, adv = ro["seqs"], ro["plens"], ro["adv"]
        comp = torch.tensor([len(s) - p for s, p in zip(seqs, plens)])
        n_seq, n_tok = len(seqs), int(comp.sum())
        mine = PolicyStage.taps_of(self.stage_index, self.P, self.policy.num_layers, self.taps)
        prev, nxt = self.rank - self.W, self.rank + self.W
        sums, gap, feats = torch.zeros(4, dtype=torch.float64), 0.0, []
        batches = self.micro_batches(n_seq)
        for m, mb in enumerate(batches):
            layout = ZigzagLayout([len(s) for s in seqs[mb]], self.W)
            ids = torch.tensor([t for s in seqs[mb] for t in s])
            stamp = self.step * len(batches) + m
            x = None
            if not self.stage.first:
                x = torch.empty(layout.local_len(self.c), H, dtype=self.policy.dtype)
                dist.recv(x, prev)
                x.requires_grad_(True)
            h, tapped = self.stage.forward(layout, ids, x, mine)
            if mine and not self.stage.last:
                self.channels[(self.stage_index, self.c)].send(torch.cat([tapped[t] for t in mine], -1).detach(), stamp)
            if self.stage.last:
                lp, sq, pos = self.stage.completion_logprobs(layout, ids, h, plens[mb], T)
                sq = sq + mb.start
                w = token_weights(sq, comp, g.loss_type, n_seq, n_tok).to(lp.dtype)
                loss, st = clipped_surrogate(lp, lp.detach(), adv[sq], w, g.clip_eps, g.clip_eps_high)
                loss.backward()
                roll = [ro["rollout_lp"][q][t - plens[q] + 1] for q, t in zip(sq.tolist(), pos.tolist())]
                d = lp.detach().double() - torch.tensor(roll, dtype=torch.float64)
                sums += torch.tensor([loss.item(), st["clipped_tokens"], st["tokens"], float((d.exp() - d - 1).sum())])
                gap = max(gap, float(d.abs().max())) if d.numel() else gap
                if self.taps:
                    feats.append(self._features(stamp, {t: f.detach() for t, f in tapped.items()}))
            else:
                dist.send(h.detach().contiguous(), nxt)
                grad = torch.empty_like(h)
                dist.recv(grad, nxt)
                h.backward(grad)
            if not self.stage.first:
                dist.send(x.grad.contiguous(), prev)
        return sums, gap, feats

    def _features(self, stamp: int, own: dict[int, torch.Tensor]) -> torch.Tensor:
        """The last stage's shard of the draft's features (T_r, F) for one micro-batch: its own taps
        and those the earlier stages sent, in the draft's order."""
        parts = dict(own)
        for s in range(self.P - 1):
            if (s, self.c) in self.channels:
                got = self.channels[(s, self.c)].recv(stamp)
                taps = PolicyStage.taps_of(s, self.P, self.policy.num_layers, self.taps)
                parts.update(zip(taps, got.split(self.policy.hidden_size, dim=-1)))
        return torch.cat([parts[t] for t in self.taps], -1)

    def grid_draft_pass(self, ro: dict, feats: list[torch.Tensor]) -> torch.Tensor:
        """The draft loss on this last-stage rank's shard (its share, `ContextShard`), backward into
        the draft. Returns its sums: loss, (tau - 1) x labelled blocks, labelled blocks."""
        seqs, plens, g = ro["seqs"], ro["plens"], self.cfg.grpo
        samples = [{"input_ids": s, "prompt_len": p} for s, p in zip(seqs, plens)]
        gen = torch.Generator().manual_seed(_seeds("draft", g.seed, self.step).getrandbits(63))
        local = torch.cat(feats)  # micro-batches' shards in order: the whole step's shard (per-sequence zigzag)
        n = self.cfg.draft.anchors_per_seq
        if self.W == 1:
            out = self.draft.backward(samples, list(local.split([len(s) for s in seqs])), gen)
            return torch.tensor([out["draft_loss"], out["draft_tau_teacher_forced"] - 1.0, 1.0], dtype=torch.float64)
        shard = ContextShard(ZigzagLayout([len(s) for s in seqs], self.W), self.cp_groups[-1],
                             attention=self.cfg.parallel.attention)  # fmt: skip
        shard.attach(self.draft.loss)
        self.draft.model.train()  # EAGLE-3's start slots follow the training flag
        batch = self.draft.loss.shard_batch(samples, local, n, gen)
        out = self.draft.backward_on(batch)
        blocks = float((batch.labels[..., 0] != -100).sum())
        return torch.tensor([out["draft_loss"], (out["draft_tau_teacher_forced"] - 1.0) * blocks, blocks],
                            dtype=torch.float64)  # fmt: skip

    def train_step(self) -> dict:
        g = self.cfg.grpo
        t0 = time.perf_counter()
        ro = self.collect(self.step)
        m = self._rollout_metrics(ro) if self.lead else {}
        t1 = time.perf_counter()
        sums, gap, feats = self.grid_policy_pass(ro)
        td = time.perf_counter()
        draft = torch.zeros(3, dtype=torch.float64)
        if self.draft is not None and self.rank in self.draft_ranks:
            draft = self.grid_draft_pass(ro, feats)
        ts = time.perf_counter()
        total = torch.cat([sums, draft, torch.tensor([td - t1, ts - td], dtype=torch.float64)])
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        gap_t = torch.tensor([gap])
        dist.all_reduce(gap_t, op=dist.ReduceOp.MAX)
        self.gather_gradients()
        if self.lead:
            loss, clipped, tokens, k3, d_loss, d_tau, d_blocks, policy_s, draft_s = total.tolist()
            # mean seconds per rank: the pipelined policy pass (all ranks), the draft loss (its ranks)
            m.update(policy_s=round(policy_s / dist.get_world_size(), 3))
            m.update(draft_s=round(draft_s / max(1, len(self.draft_ranks)), 3))
            m.update(train_infer_kl=k3 / max(1.0, tokens), train_infer_max_logp_diff=float(gap_t))
            m.update(policy_loss=loss, clip_frac=clipped / max(1.0, tokens))
            if self.draft is not None:
                m.update(draft_loss=d_loss, draft_tau_teacher_forced=1.0 + d_tau / max(1.0, d_blocks))
                m.update(self.draft.update())
            gnorm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), g.grad_clip)
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            m["policy_grad_norm"] = gnorm.item()
        else:
            for p in self.stage.params.values():
                p.grad = None
            if self.draft is not None:
                self.draft.model.zero_grad(set_to_none=True)
        self.send_weights()
        self.step += 1
        now = time.perf_counter()
        if self.lead:
            m.update(sync_s=round(now - ts, 3))  # gradients to rank 0, its update, weights back
            m.update(step=self.step, update_s=round(now - t1, 3), step_s=round(now - t0, 3))
            m["step_tps"] = round(ro["stats"].output_tokens / max(now - t0, 1e-9), 3)
        return m

    # -- the run: rank 0 validates, logs and saves ------------------------------------------------------
    def run(self, progress: bool = True) -> None:
        if self.lead:
            super().run(progress)
        else:
            while self.step < self.cfg.grpo.steps:
                self.train_step()
        for ch in self.channels.values():  # both ends, after the last step (a killed rank just exits)
            ch.close()
