"""Building and running the server: `dcoco serve` and an in-process `ServerThread` (tests, benchmarks)."""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
from typing import Optional

from ..draft_policy import LoadAwarePolicy
from ..engine import SpeculativeEngine
from ..errors import ConfigError
from ..families import MODEL_FREE
from ..speculative import SpeculativeConfig, config_of_args, load_drafter
from ..target import Target


def build_engine(
    model: Optional[str] = None,
    dtype: str = "auto",
    device: str = "cpu",
    speculative_config: "SpeculativeConfig | dict | None" = None,
    max_batch_size: int = 32,
    load_aware: bool = False,
    draft_token_budget: int = 32,
    target: Optional[Target] = None,
    quantization: str = "none",
    exact: bool = False,
) -> SpeculativeEngine:
    """A `SpeculativeEngine` for serving (validated the same way as `dcoco generate`); the speculative
    config defaults to the model-free method."""
    cfg = SpeculativeConfig.parse(speculative_config or {"method": MODEL_FREE.name})
    if max_batch_size < 1:
        raise ConfigError(f"--max-batch-size must be >= 1, got {max_batch_size}")
    if load_aware and draft_token_budget < 1:
        raise ConfigError(f"--draft-token-budget must be >= 1, got {draft_token_budget}")
    if target is None:
        target = Target.from_pretrained(model, dtype=dtype, device=device, quantization=quantization, exact=exact)
    d = load_drafter(cfg, target)
    policy = LoadAwarePolicy(draft_token_budget) if load_aware and d is not None else None
    return SpeculativeEngine(target, d, cfg.num_speculative_tokens, max_batch_size, draft_policy=policy)


def model_name_for(model: Optional[str]) -> str:
    if model is None:
        from ..models import DEFAULT_MODEL_NAME

        return DEFAULT_MODEL_NAME
    return os.path.basename(os.path.normpath(model)) or str(model)


class ServerThread:
    """Runs an ASGI app under uvicorn in a background thread on `host:port` (port 0: a free one).

    with ServerThread(app) as srv:
        requests.get(srv.url + "/health")
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        import uvicorn

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = host, self.sock.getsockname()[1]
        config = uvicorn.Config(app, log_level=log_level, lifespan="on", timeout_keep_alive=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 60.0) -> None:
        """Graceful: in-flight requests finish first (uvicorn waits for them, then the engine drains)."""
        self.server.should_exit = True
        self.thread.join(timeout)
        self.sock.close()

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def run_server(args) -> int:
    """`dcoco serve`: load the model and drafter, then serve until interrupted (SIGINT / SIGTERM drain
    in-flight requests before exiting)."""
    import uvicorn

    from .app import create_app

    if args.max_queue < 1:
        raise ConfigError(f"--max-queue must be >= 1, got {args.max_queue}")
    if not 0 <= args.port <= 65535:  # checked before the model loads, not by the socket after it
        raise ConfigError(f"--port must be 0-65535, got {args.port}")
    for flag, v in (
        ("--max-tokens-in-flight", args.max_tokens_in_flight),
        ("--default-max-tokens", args.default_max_tokens),
    ):
        if v is not None and v < 1:
            raise ConfigError(f"{flag} must be >= 1, got {v}")
    engine = build_engine(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        speculative_config=config_of_args(args),
        max_batch_size=args.max_batch_size,
        load_aware=args.load_aware,
        draft_token_budget=args.draft_token_budget,
        quantization=args.quantization,
        exact=args.exact,
    )
    name = args.served_model_name or model_name_for(args.model)
    k = engine.num_speculative_tokens
    policy = engine.draft_policy
    how = f"load-aware {policy.table(k)} (batch size, k)" if policy is not None else f"k={k}"
    app = create_app(
        engine,
        name,
        max_queue=args.max_queue,
        max_tokens_in_flight=args.max_tokens_in_flight,
        default_max_tokens=args.default_max_tokens,
    )
    print(
        f"dcoco serve: model {name} ({engine.target.dtype}, {engine.target.device}), method {args.method}, {how}, "
        f"max batch {engine.max_batch_size}, max queue {args.max_queue}; http://{args.host}:{args.port}/v1",
        file=sys.stderr,
    )
    logging.basicConfig(level=logging.WARNING)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_keep_alive=5)
    return 0
