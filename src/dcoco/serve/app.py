"""The OpenAI-compatible HTTP API (FastAPI) over an `AsyncEngine`.

Routes: `POST /v1/completions`, `POST /v1/chat/completions` (both non-streaming and SSE streaming:
`data: {chunk}` lines, then `data: [DONE]`), `GET /v1/models`, `GET /health`, `GET /metrics`
(Prometheus text, see `dcoco.serve.metrics`). Errors use OpenAI's body
`{"error": {"message", "type", "param", "code"}}`: 400 bad input (malformed JSON, invalid sampling
values, prompt or max_tokens beyond the context), 404 unknown model or route, 503 queue full or
shutting down, 500 internal error of one request.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from contextlib import asynccontextmanager
from typing import Any, Optional, Sequence

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine import SpeculativeEngine
from ..errors import DcocoError
from .async_engine import AsyncEngine, EngineFault, Event, QueueFullError, ShuttingDownError, Submission
from .metrics import ServerMetrics
from .protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    bad_request,
    chat_messages,
    check_unsupported,
    parse,
    sampling_params,
)

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for the legacy completions endpoint


def _error_json(err: ApiError, headers: Optional[dict] = None) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


def _as_api_error(err: BaseException) -> ApiError:
    if isinstance(err, ApiError):
        return err
    if isinstance(err, (QueueFullError, ShuttingDownError)):
        return ApiError(
            503, str(err), "server_error", None, "queue_full" if isinstance(err, QueueFullError) else "shutting_down"
        )
    if isinstance(err, DcocoError):
        return bad_request(str(err))
    if isinstance(err, EngineFault):
        return ApiError(500, str(err), "server_error", None, "internal_error")
    return ApiError(500, f"internal error: {type(err).__name__}: {err}", "server_error", None, "internal_error")


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _wait_disconnect(request: Request) -> None:
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


def create_app(
    engine: SpeculativeEngine,
    model_name: str,
    *,
    aliases: Sequence[str] = (),
    max_queue: int = 256,
    max_tokens_in_flight: Optional[int] = None,
    default_max_tokens: Optional[int] = None,
    drain_timeout: Optional[float] = None,
) -> FastAPI:
    """An app serving `engine` under the model name `model_name` (and `aliases`). The engine loop
    starts with the app's lifespan and drains in-flight requests when the server shuts down."""
    metrics = ServerMetrics(model_name)
    aeng = AsyncEngine(engine, metrics, max_queue=max_queue, max_tokens_in_flight=max_tokens_in_flight)
    target = engine.target
    names = [model_name, *aliases]
    info = {  # what /health reports about the configuration (the load generator records it)
        "method": engine.drafter.method if engine.drafter is not None else "vanilla",
        "num_speculative_tokens": engine.num_speculative_tokens,
        "draft_policy": repr(aeng.policy) if aeng.policy is not None else None,
        "max_batch_size": engine.max_batch_size,
        "max_queue": max_queue,
        "max_tokens_in_flight": max_tokens_in_flight,
        "dtype": str(target.dtype).replace("torch.", ""),
        "device": str(target.device),
        "max_model_len": target.max_context,
    }
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        aeng.start()
        try:
            yield
        finally:
            await asyncio.to_thread(aeng.shutdown, True, drain_timeout)

    app = FastAPI(title="dcoco", version="0.1.0", lifespan=lifespan)
    app.state.engine = aeng
    app.state.metrics = metrics

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return _error_json(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error_json(ApiError(exc.status_code, str(exc.detail), kind, None, None))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        return _error_json(_as_api_error(exc))

    # -- helpers ----------------------------------------------------------------------------------
    async def body_of(request: Request) -> Any:
        raw = await request.body()
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise bad_request(f"malformed JSON in the request body: {e}") from None

    def check_model(name: Optional[str]) -> str:
        if name is None:
            return model_name
        if name not in names:
            raise ApiError(
                404,
                f"The model `{name}` does not exist. Available: {', '.join(names)}",
                "invalid_request_error",
                "model",
                "model_not_found",
            )
        return name

    def check_length(n_prompt: int, max_tokens: Optional[int], prompt_param: str, tokens_param: str) -> int:
        ctx = target.max_context
        if n_prompt + 1 > ctx:
            raise bad_request(
                f"This model's maximum context length is {ctx} tokens. However, your prompt has "
                f"{n_prompt} tokens, which leaves no room to generate. Please shorten the prompt.",
                prompt_param,
                "context_length_exceeded",
            )
        if max_tokens is not None and max_tokens >= 1 and n_prompt + max_tokens > ctx:
            raise bad_request(
                f"This model's maximum context length is {ctx} tokens. However, you requested "
                f"{n_prompt + max_tokens} tokens ({n_prompt} in the prompt, {max_tokens} for the "
                f"completion). Please reduce the prompt or {tokens_param}.",
                tokens_param,
                "context_length_exceeded",
            )
        return ctx - n_prompt

    def encode(prompt: Any, chat: bool, param: str) -> list[int]:
        try:
            return target.encode(prompt, chat=chat)
        except DcocoError as e:
            raise bad_request(str(e), param) from None

    def submit(prompts: list[list[int]], params, stream: bool) -> Submission:
        try:
            return aeng.submit(prompts, params, stream)
        except (QueueFullError, ShuttingDownError) as e:
            err = _as_api_error(e)
            raise ApiError(err.status, err.message, err.type, err.param, err.code) from None

    async def collect(request: Request, sub: Submission) -> Optional[list[Event]]:
        """Wait for every choice; None when the client went away (its requests are cancelled)."""
        results: dict[int, Event] = {}
        texts: dict[int, list[str]] = {}
        watcher = asyncio.ensure_future(_wait_disconnect(request))
        try:
            while len(results) < len(sub.handles):
                get = asyncio.ensure_future(sub.queue.get())
                done, _ = await asyncio.wait({get, watcher}, return_when=asyncio.FIRST_COMPLETED)
                if get not in done:
                    get.cancel()
                    aeng.abort(sub)
                    return None
                ev = get.result()
                if ev.error is not None:
                    aeng.abort(sub)
                    raise _as_api_error(ev.error)
                texts.setdefault(ev.index, []).append(ev.text)
                if ev.finish_reason is not None:
                    ev.text = "".join(texts[ev.index])
                    results[ev.index] = ev
        except asyncio.CancelledError:
            aeng.abort(sub)
            raise
        finally:
            watcher.cancel()
        return [results[i] for i in range(len(sub.handles))]

    def usage(events: Sequence[Event]) -> dict:
        p = sum(e.prompt_tokens for e in events)
        c = sum(e.completion_tokens for e in events)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def stream_response(sub: Submission, rid: str, name: str, chat: bool, include_usage: bool) -> StreamingResponse:
        obj = "chat.completion.chunk" if chat else "text_completion"
        base = {"id": rid, "object": obj, "created": int(time.time()), "model": name}

        def chunk(choices: list, **extra) -> dict:
            d = dict(base, choices=choices, **extra)
            if include_usage and "usage" not in d:
                d["usage"] = None
            return d

        def choice(index: int, text: str, finish: Optional[str]) -> dict:
            if chat:
                return {
                    "index": index,
                    "delta": {"content": text} if text else {},
                    "logprobs": None,
                    "finish_reason": finish,
                }
            return {"index": index, "text": text, "logprobs": None, "finish_reason": finish}

        async def gen():
            finals: list[Event] = []
            try:
                if chat:
                    for h in sub.handles:
                        yield _sse(
                            chunk(
                                [
                                    {
                                        "index": h.index,
                                        "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None,
                                        "finish_reason": None,
                                    }
                                ]
                            )
                        )
                while len(finals) < len(sub.handles):
                    ev = await sub.queue.get()
                    if ev.error is not None:
                        aeng.abort(sub)
                        yield _sse(_as_api_error(ev.error).body())
                        break
                    if ev.finish_reason is not None:
                        finals.append(ev)
                        if chat and ev.text:
                            yield _sse(chunk([choice(ev.index, ev.text, None)]))
                            yield _sse(chunk([choice(ev.index, "", ev.finish_reason)]))
                        else:
                            yield _sse(chunk([choice(ev.index, ev.text, ev.finish_reason)]))
                    elif ev.text:
                        yield _sse(chunk([choice(ev.index, ev.text, None)]))
                else:
                    if include_usage:
                        yield _sse(chunk([], usage=usage(finals)))
                yield "data: [DONE]\n\n"
            finally:  # the client went away (cancelled) or we are done: free the slots
                aeng.abort(sub)

        return StreamingResponse(
            gen(), media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )

    # -- routes -----------------------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(request: Request):
        req = parse(CompletionRequest, await body_of(request))
        name = check_model(req.model)
        check_unsupported(req)
        p = req.prompt
        if isinstance(p, str) or (isinstance(p, list) and p and all(isinstance(t, int) for t in p)):
            p = [p]
        if not p:
            raise bad_request("prompt must not be empty", "prompt")
        ids = [encode(x, False, "prompt") for x in p]
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
        for i in ids:
            check_length(len(i), max_tokens, "prompt", "max_tokens")
        params = sampling_params(req, max_tokens)
        rid = f"cmpl-{uuid.uuid4().hex}"
        include_usage = bool((req.stream_options or {}).get("include_usage"))
        sub = submit(ids, params, bool(req.stream))
        if req.stream:
            return stream_response(sub, rid, name, False, include_usage)
        events = await collect(request, sub)
        if events is None:
            return JSONResponse({}, status_code=499)
        return {
            "id": rid,
            "object": "text_completion",
            "created": int(time.time()),
            "model": name,
            "choices": [
                {"index": e.index, "text": e.text, "logprobs": None, "finish_reason": e.finish_reason} for e in events
            ],
            "usage": usage(events),
        }

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = parse(ChatCompletionRequest, await body_of(request))
        name = check_model(req.model)
        check_unsupported(req)
        ids = encode(chat_messages(req), True, "messages")
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        room = check_length(len(ids), requested, "messages", param)
        if requested is None:
            requested = room if default_max_tokens is None else min(room, default_max_tokens)
        params = sampling_params(req, requested)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        include_usage = bool((req.stream_options or {}).get("include_usage"))
        sub = submit([ids], params, bool(req.stream))
        if req.stream:
            return stream_response(sub, rid, name, True, include_usage)
        events = await collect(request, sub)
        if events is None:
            return JSONResponse({}, status_code=499)
        return {
            "id": rid,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": name,
            "choices": [
                {
                    "index": e.index,
                    "message": {"role": "assistant", "content": e.text},
                    "logprobs": None,
                    "finish_reason": e.finish_reason,
                }
                for e in events
            ],
            "usage": usage(events),
        }

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": n,
                    "object": "model",
                    "created": created,
                    "owned_by": "dcoco",
                    "root": model_name,
                    "max_model_len": target.max_context,
                }
                for n in names
            ],
        }

    @app.get("/health")
    async def health():
        running, waiting = aeng.load()
        ok = aeng.accepting
        body = {
            "status": "ok" if ok else "unavailable",
            "model": model_name,
            "running": running,
            "waiting": waiting,
            **info,
        }
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app
