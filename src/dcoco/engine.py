"""The speculative loop over a batch of requests: draft -> verify -> accept -> roll back.

Vanilla decoding is the same loop with no drafter (every pass verifies an empty block), so every
comparison dcoco reports is apples to apples. Requests may join between steps (they are prefilled
together and merged into the running batch) and leave as soon as they finish, so the same engine
serves a static batch and a continuous-batching server.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from .drafters.base import Drafter, DraftInput, DraftOutput
from .errors import InvalidPromptError
from .kv import pad_rows
from .metrics import SpecStats
from .sampling import SamplingParams, make_generator, token_logprobs
from .target import Target
from .verify import sample_tokens, verify


@dataclass
class Request:
    request_id: int
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    output_ids: list[int] = field(default_factory=list)
    finish_reason: Optional[str] = None
    text: Optional[str] = None
    stats: SpecStats = field(default_factory=SpecStats)
    arrival: float = field(default_factory=time.perf_counter)
    new_features: Optional[torch.Tensor] = None  # target features not yet shown to the drafter
    logprobs: Optional[list[float]] = None  # log p of each output token under its sampling distribution (opt-in)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def sequence(self) -> list[int]:
        return self.prompt_ids + self.output_ids


@dataclass
class GenerationOutput:
    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    stats: SpecStats
    logprobs: Optional[list[float]] = None


class SpeculativeEngine:
    """Runs requests through a `Target` with an optional `Drafter`.

    `num_speculative_tokens` is the draft block length (tokens proposed per pass); None takes the
    drafter's default, at most `target.cheap_pass_tokens - 1` (a quantized target's verification
    kernels step up past 4 tokens per pass). `max_batch_size` bounds how many requests run at once;
    others wait.

    `draft_policy(batch_size, default_k) -> k`, when given, picks the draft block length of each
    pass from the current batch size (load-aware drafting, e.g. `dcoco.draft_policy.LoadAwarePolicy`);
    0 means a plain decoding pass. Only the block length changes, so output stays lossless.

    `logprobs=True` records, for every output token, log p(token) under the request's own sampling
    distribution p, read from the target logits the pass already computed (prefill for the first
    token, the verification pass for the others): the rollout policy's log-probabilities that RL
    compares with the trainer's (`dcoco.rl`). Off by default: it costs a log-sum-exp per emitted token.
    """

    def __init__(
        self,
        target: Target,
        drafter: Optional[Drafter] = None,
        num_speculative_tokens: Optional[int] = None,
        max_batch_size: int = 32,
        draft_policy: Optional[Callable[[int, int], int]] = None,
        logprobs: bool = False,
    ):
        self.target = target
        self.drafter = drafter
        if drafter is not None:
            drafter.check_target(target)
            k = num_speculative_tokens
            if k is None:
                k = drafter.default_num_tokens
                if target.cheap_pass_tokens is not None:
                    k = min(k, target.cheap_pass_tokens - 1)
        else:
            k = 0
        if k < 0:
            raise ValueError("num_speculative_tokens must be >= 0")
        self.num_speculative_tokens = int(k)
        self.max_batch_size = int(max_batch_size)
        self.draft_policy = draft_policy
        self.logprobs = logprobs
        target.set_taps(drafter.tap_layers if drafter is not None else ())
        self._ids = itertools.count()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.kv = target.new_batch()
        # observers for serving metrics: called as fn(request, drafted, accepted) after each pass
        self.on_pass: list[Callable[[Request, int, int], None]] = []

    # -- requests ----------------------------------------------------------------------------
    def add_request(
        self, prompt_ids: Sequence[int], params: SamplingParams, request_id: Optional[int] = None
    ) -> Request:
        prompt_ids = [int(t) for t in prompt_ids]
        if not prompt_ids:
            raise InvalidPromptError("the prompt is empty")
        self.target.check_fits(len(prompt_ids))
        req = Request(
            request_id=next(self._ids) if request_id is None else request_id,
            prompt_ids=prompt_ids,
            params=params,
            generator=make_generator(params.seed),
            logprobs=[] if self.logprobs else None,
        )
        self.waiting.append(req)
        return req

    def abort(self, request_id: int) -> None:
        """Cancel a request (e.g. its client went away); its slot is freed at once."""
        for req in list(self.waiting):
            if req.request_id == request_id:
                self.waiting.remove(req)
                req.finish_reason = "abort"
        for req in self.running:
            if req.request_id == request_id and not req.finished:
                req.finish_reason = "abort"
        self._drop_finished()

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- the loop ----------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """Admit waiting requests, run one speculative pass over the batch; return finished requests."""
        finished: list[Request] = []
        if self.waiting and len(self.running) < self.max_batch_size:
            finished += self._admit()
        if self.running:
            finished += self._speculate()
        return finished

    def _admit(self) -> list[Request]:
        n = self.max_batch_size - len(self.running)
        new = [self.waiting.popleft() for _ in range(min(n, len(self.waiting)))]
        kv, out = self.target.prefill([r.prompt_ids for r in new])
        params = [r.params for r in new]
        first = sample_tokens(out.logits, params, [r.generator for r in new])
        lps = (
            token_logprobs(out.logits.unsqueeze(1), first.unsqueeze(1), params)[:, 0].tolist()
            if self.logprobs
            else None
        )
        for b, r in enumerate(new):
            if out.features is not None:
                r.new_features = out.features[b, : len(r.prompt_ids)]
        self.kv.extend(kv)
        self.running += new
        for b, (r, t) in enumerate(zip(new, first.tolist())):
            self._emit(r, [t], None if lps is None else [lps[b]])
        return self._drop_finished()

    def _speculate(self) -> list[Request]:
        reqs = self.running
        B = len(reqs)
        room = self.target.max_context - int(self.kv.lengths.max()) - 1
        k = self.num_speculative_tokens
        if self.draft_policy is not None and self.drafter is not None:
            k = int(self.draft_policy(B, k))
        k = max(0, min(k, room))
        draft = self._draft(reqs, k)
        anchors = torch.tensor([r.output_ids[-1] for r in reqs], dtype=torch.long, device=self.target.device)
        tokens = torch.cat([anchors.unsqueeze(1), draft.tokens], dim=1)
        out = self.target.forward(self.kv, tokens, draft.lengths + 1)
        res = verify(
            out.logits, draft.tokens, draft.lengths, [r.params for r in reqs], [r.generator for r in reqs], draft.probs
        )
        self.kv.commit(res.num_accepted + 1)
        emitted = res.emitted(draft.tokens)
        n_acc = res.num_accepted.tolist()
        lps = self._logprobs(out.logits, emitted, reqs) if self.logprobs else None
        d_len = draft.lengths.tolist()
        for b, r in enumerate(reqs):
            r.stats.record(d_len[b], n_acc[b])
            for fn in self.on_pass:
                fn(r, d_len[b], n_acc[b])
            if out.features is not None:
                f = out.features[b, : n_acc[b] + 1]
                # a pass that drafted nothing (k == 0) never showed the drafter the earlier features
                r.new_features = f if r.new_features is None else torch.cat([r.new_features, f])
            self._emit(r, emitted[b], None if lps is None else lps[b])
        return self._drop_finished()

    def _logprobs(self, logits: torch.Tensor, emitted: list[list[int]], reqs: list[Request]) -> list[list[float]]:
        """log p of the tokens each row emits: token j of a row was chosen at logit position j."""
        width = max(len(e) for e in emitted)
        tokens, _ = pad_rows(emitted, width, logits.device)
        lp = token_logprobs(logits[:, :width], tokens, [r.params for r in reqs]).tolist()
        return [row[: len(e)] for row, e in zip(lp, emitted)]

    def _draft(self, reqs: list[Request], k: int) -> DraftOutput:
        if self.drafter is None or k == 0:
            return DraftOutput.empty(len(reqs), self.target.device)
        inp = DraftInput(
            request_ids=[r.request_id for r in reqs],
            token_ids=[r.sequence for r in reqs],
            new_features=[r.new_features for r in reqs],
            num_tokens=k,
            params=[r.params for r in reqs],
            generators=[r.generator for r in reqs],
            device=self.target.device,
        )
        for r in reqs:
            r.new_features = None
        out = self.drafter.propose(inp)
        # a drafter that ignored `inp.device` (e.g. a model-free one of a user's) still verifies
        out.tokens, out.lengths = out.tokens.to(inp.device), out.lengths.to(inp.device).clamp(max=k)
        if out.tokens.shape[1] > k:
            out.tokens = out.tokens[:, :k]
            out.probs = None if out.probs is None else out.probs[:, :k]
        return out

    def _emit(self, req: Request, tokens: list[int], logprobs: Optional[list[float]] = None) -> None:
        """Append tokens one by one, stopping at EOS, a stop token or string, or a length limit."""
        target = self.target
        p = req.params
        for i, t in enumerate(tokens):
            req.output_ids.append(t)
            if logprobs is not None:
                req.logprobs.append(logprobs[i])
            if (not p.ignore_eos and t in target.eos_token_ids) or t in p.stop_token_ids:
                req.finish_reason = "stop"
            elif len(req.output_ids) >= p.max_tokens:
                req.finish_reason = "length"
            elif len(req.prompt_ids) + len(req.output_ids) >= target.max_context:
                req.finish_reason = "length"
            if p.stop and self._hit_stop_string(req):
                req.finish_reason = "stop"
            if req.finished:
                break

    def _hit_stop_string(self, req: Request) -> bool:
        text = self.target.decode(req.output_ids)
        hits = [text.find(s) for s in req.params.stop if s in text]
        if hits:
            req.text = text[: min(hits)]
            return True
        return False

    def _drop_finished(self) -> list[Request]:
        done = [b for b, r in enumerate(self.running) if r.finished]
        if not done:
            return []
        now = time.perf_counter()
        finished = []
        for b in done:
            r = self.running[b]
            r.stats.output_tokens = len(r.output_ids)
            r.stats.wall_s = now - r.arrival
            if r.text is None:
                r.text = self.target.decode(r.output_ids)
            if self.drafter is not None:
                self.drafter.release(r.request_id)
            finished.append(r)
        self.running = [self.running[b] for b in self.kv.drop(done)]
        return finished

    # -- offline API ---------------------------------------------------------------------------
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams],
        progress: bool = False,
    ) -> tuple[list[GenerationOutput], SpecStats]:
        """Generate for every prompt; returns outputs in prompt order and the run's summed stats."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError("need one SamplingParams per prompt")
        start = time.perf_counter()
        reqs = [self.add_request(p, sp) for p, sp in zip(prompts, params)]
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=sum(sp.max_tokens for sp in params), unit="tok", desc="generating", leave=False)
        done_tokens = 0
        while self.has_unfinished:
            self.step()
            if bar is not None:
                now = sum(len(r.output_ids) for r in reqs)
                bar.update(now - done_tokens)
                done_tokens = now
        if bar is not None:
            bar.close()
        total = SpecStats()
        for r in reqs:
            total.merge(r.stats)
        total.wall_s = time.perf_counter() - start
        outs = [
            GenerationOutput(
                r.request_id, r.prompt_ids, r.output_ids, r.text or "", r.finish_reason or "length", r.stats, r.logprobs
            )
            for r in reqs
        ]
        return outs, total
