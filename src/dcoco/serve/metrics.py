"""Server metrics in the Prometheus text exposition format (no client library needed).

Names follow vLLM's with a `dcoco:` prefix instead of `vllm:`; as with prometheus_client (which vLLM
uses), a counter `dcoco:x` is exposed as the sample `dcoco:x_total`. Every sample carries the label
`model_name`, as in vLLM.

| metric | type | meaning |
| --- | --- | --- |
| `dcoco:num_requests_running` | gauge | requests in the engine batch |
| `dcoco:num_requests_waiting` | gauge | requests queued, not yet in the batch |
| `dcoco:prompt_tokens` | counter | prompt tokens of admitted requests |
| `dcoco:generation_tokens` | counter | tokens generated (equals the sum of `usage.completion_tokens`) |
| `dcoco:request_success` | counter | finished requests, label `finished_reason` (stop, length, abort, error) |
| `dcoco:spec_decode_num_drafts` | counter | verification passes that verified at least one draft token |
| `dcoco:spec_decode_num_draft_tokens` | counter | draft tokens verified |
| `dcoco:spec_decode_num_accepted_tokens` | counter | draft tokens accepted |
| `dcoco:spec_decode_num_accepted_tokens_per_pos` | counter | accepted draft tokens at `position` (0-based) |
| `dcoco:spec_decode_draft_block_size` | gauge | draft block length k of the latest pass (load-aware drafting) |
| `dcoco:time_to_first_token_seconds` | histogram | arrival to first generated token |
| `dcoco:e2e_request_latency_seconds` | histogram | arrival to finish |
| `dcoco:request_queue_time_seconds` | histogram | arrival to admission into the batch |

Mean acceptance length as vLLM reports it: `1 + num_accepted_tokens / num_drafts`.
"""

from __future__ import annotations

import bisect
import threading
from typing import Iterable

LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)


def _fmt(v: float) -> str:
    if v == float("inf"):
        return "+Inf"
    if float(v).is_integer():
        return str(int(v))
    return repr(float(v))


def _labels(**kv) -> str:
    parts = []
    for k, v in kv.items():
        s = str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
        parts.append(f'{k}="{s}"')
    return "{" + ",".join(parts) + "}"


class Histogram:
    def __init__(self, buckets: Iterable[float] = LATENCY_BUCKETS):
        self.bounds = tuple(sorted(buckets))
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, v)] += 1
        self.sum += v
        self.count += 1

    def render(self, name: str, model: str) -> list[str]:
        out, acc = [], 0
        for bound, c in zip(self.bounds + (float("inf"),), self.counts):
            acc += c
            out.append(f"{name}_bucket{_labels(le=_fmt(bound), model_name=model)} {acc}")
        out.append(f"{name}_sum{_labels(model_name=model)} {self.sum!r}")
        out.append(f"{name}_count{_labels(model_name=model)} {self.count}")
        return out


class ServerMetrics:
    """Thread-safe counters the engine thread updates and `/metrics` renders."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.lock = threading.Lock()
        self.running = 0
        self.waiting = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished: dict[str, int] = {r: 0 for r in ("stop", "length", "abort", "error")}
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos: list[int] = []
        self.block_size = 0
        self.ttft = Histogram()
        self.e2e = Histogram()
        self.queue_time = Histogram()

    # -- updates (engine thread) ---------------------------------------------------------------
    def on_pass(self, drafted: int, accepted: int) -> None:
        with self.lock:
            if drafted:
                self.num_drafts += 1
                self.num_draft_tokens += drafted
                self.num_accepted_tokens += accepted
                if len(self.accepted_per_pos) < drafted:
                    self.accepted_per_pos += [0] * (drafted - len(self.accepted_per_pos))
                for i in range(accepted):
                    self.accepted_per_pos[i] += 1

    def add_generated(self, n: int) -> None:
        with self.lock:
            self.generation_tokens += n

    def add_prompt(self, n: int) -> None:
        with self.lock:
            self.prompt_tokens += n

    def finish(self, reason: str, e2e_s: float) -> None:
        with self.lock:
            self.finished[reason] = self.finished.get(reason, 0) + 1
            self.e2e.observe(e2e_s)

    def first_token(self, ttft_s: float) -> None:
        with self.lock:
            self.ttft.observe(ttft_s)

    def admitted(self, queue_s: float) -> None:
        with self.lock:
            self.queue_time.observe(queue_s)

    def set_load(self, running: int, waiting: int) -> None:
        with self.lock:
            self.running, self.waiting = running, waiting

    # -- exposition ----------------------------------------------------------------------------
    def render(self) -> str:
        m = self.model_name
        L: list[str] = []

        def head(name: str, kind: str, text: str) -> None:
            L.append(f"# HELP {name} {text}")
            L.append(f"# TYPE {name} {kind}")

        with self.lock:
            head("dcoco:num_requests_running", "gauge", "Number of requests in the engine batch.")
            L.append(f"dcoco:num_requests_running{_labels(model_name=m)} {self.running}")
            head("dcoco:num_requests_waiting", "gauge", "Number of requests waiting to join the batch.")
            L.append(f"dcoco:num_requests_waiting{_labels(model_name=m)} {self.waiting}")
            head("dcoco:prompt_tokens", "counter", "Number of prefill tokens processed.")
            L.append(f"dcoco:prompt_tokens_total{_labels(model_name=m)} {self.prompt_tokens}")
            head("dcoco:generation_tokens", "counter", "Number of generation tokens processed.")
            L.append(f"dcoco:generation_tokens_total{_labels(model_name=m)} {self.generation_tokens}")
            head("dcoco:request_success", "counter", "Count of finished requests by finish reason.")
            for reason, n in self.finished.items():
                L.append(f"dcoco:request_success_total{_labels(finished_reason=reason, model_name=m)} {n}")
            head("dcoco:spec_decode_num_drafts", "counter", "Number of spec decoding drafts.")
            L.append(f"dcoco:spec_decode_num_drafts_total{_labels(model_name=m)} {self.num_drafts}")
            head("dcoco:spec_decode_num_draft_tokens", "counter", "Number of draft tokens.")
            L.append(f"dcoco:spec_decode_num_draft_tokens_total{_labels(model_name=m)} {self.num_draft_tokens}")
            head("dcoco:spec_decode_num_accepted_tokens", "counter", "Number of accepted tokens.")
            L.append(f"dcoco:spec_decode_num_accepted_tokens_total{_labels(model_name=m)} {self.num_accepted_tokens}")
            head("dcoco:spec_decode_num_accepted_tokens_per_pos", "counter", "Accepted tokens per draft position.")
            for i, n in enumerate(self.accepted_per_pos):
                L.append(f"dcoco:spec_decode_num_accepted_tokens_per_pos_total{_labels(model_name=m, position=i)} {n}")
            head("dcoco:spec_decode_draft_block_size", "gauge", "Draft block length of the latest verification pass.")
            L.append(f"dcoco:spec_decode_draft_block_size{_labels(model_name=m)} {self.block_size}")
            head("dcoco:time_to_first_token_seconds", "histogram", "Histogram of time to first token in seconds.")
            L += self.ttft.render("dcoco:time_to_first_token_seconds", m)
            head(
                "dcoco:e2e_request_latency_seconds", "histogram", "Histogram of end to end request latency in seconds."
            )
            L += self.e2e.render("dcoco:e2e_request_latency_seconds", m)
            head("dcoco:request_queue_time_seconds", "histogram", "Histogram of time spent waiting to join the batch.")
            L += self.queue_time.render("dcoco:request_queue_time_seconds", m)
        return "\n".join(L) + "\n"


def parse_prometheus(text: str) -> dict[str, float]:
    """`{"name{labels}": value}` for every sample line (labels kept verbatim, `model_name` dropped),
    for tests and the load generator."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, val = line.rpartition(" ")
        if "{" in key:
            name, _, rest = key.partition("{")
            labels = [p for p in rest.rstrip("}").split(",") if p and not p.startswith("model_name=")]
            key = name + ("{" + ",".join(labels) + "}" if labels else "")
        out[key] = float(val)
    return out
