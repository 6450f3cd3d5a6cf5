"""Serving: the continuous-batching `SpeculativeEngine` behind an OpenAI-compatible HTTP server.

- `LoadAwarePolicy` (from `dcoco.draft_policy`, the engine's): load-aware drafting (shorter draft blocks
  as the batch grows), re-exported for the server and its users.
- `async_engine.AsyncEngine`: the background engine loop (queue, cancellation, fault isolation, drain).
- `app.create_app`: the FastAPI app (`/v1/completions`, `/v1/chat/completions`, `/v1/models`,
  `/health`, `/metrics`).
- `server`: `build_engine`, `ServerThread` (in-process uvicorn) and `run_server` (`dcoco serve`).
- `loadgen`: `python -m dcoco.serve.loadgen`, the concurrency sweep benchmark.

FastAPI and uvicorn are imported only by `app` / `server`, so `from dcoco.serve import LoadAwarePolicy`
stays light.
"""

from ..draft_policy import LoadAwarePolicy

__all__ = ["LoadAwarePolicy"]
