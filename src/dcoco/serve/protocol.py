"""OpenAI request bodies, their mapping to `SamplingParams`, and OpenAI-style errors.

Supported fields: `model`, `prompt` (completions: a string, a list of token ids, or a list of either,
one choice per prompt) / `messages` (chat), `max_tokens` (chat also `max_completion_tokens`),
`temperature` (default 1.0, as OpenAI), `top_p`, `stop` (a string or a list), `seed`, `n` (only 1),
`stream`, `stream_options.include_usage`; extras as in vLLM: `top_k` (-1 or 0: off), `ignore_eos`,
`stop_token_ids`. Fields dcoco cannot honour (`logprobs`, `echo`, `best_of`, `suffix`, penalties,
`logit_bias`, tools) give 400 when set to anything but their neutral value; unknown fields are ignored.
"""

from __future__ import annotations

from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict, ValidationError

from ..errors import InvalidSamplingParamsError
from ..sampling import SamplingParams


class ApiError(Exception):
    """Becomes `{"error": {"message", "type", "param", "code"}}` with HTTP `status`."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: Optional[str] = None,
        code: Optional[str] = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: Optional[str] = None, code: Optional[str] = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param, code)


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: Optional[str] = None
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    n: Optional[int] = 1
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = None
    stream: Optional[bool] = False
    stream_options: Optional[dict[str, Any]] = None
    # extras (vLLM names)
    top_k: Optional[int] = None
    ignore_eos: Optional[bool] = False
    stop_token_ids: Optional[list[int]] = None
    # OpenAI fields dcoco does not implement: accepted only at their neutral value
    logprobs: Optional[Union[bool, int]] = None
    top_logprobs: Optional[int] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None


class CompletionRequest(_Common):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    echo: Optional[bool] = False
    best_of: Optional[int] = None
    suffix: Optional[str] = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: Optional[Union[str, list[dict[str, Any]]]] = None


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: Optional[int] = None
    tools: Optional[list[Any]] = None


def parse(model: type[BaseModel], body: Any) -> Any:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        # drop the union-member tags pydantic puts in `loc` ("str", "list[int]", ...)
        loc = [str(x) for x in err["loc"] if str(x) not in ("str", "int", "float", "bool") and "[" not in str(x)]
        param = ".".join(loc) or None
        raise bad_request(f"{param + ': ' if param else ''}{err['msg']}", param) from None


def check_unsupported(req: _Common) -> None:
    neutral = {
        "logprobs": (None, False, 0),
        "top_logprobs": (None, 0),
        "presence_penalty": (None, 0.0),
        "frequency_penalty": (None, 0.0),
        "logit_bias": (None, {}),
        "echo": (None, False),
        "best_of": (None, 1),
        "suffix": (None, ""),
        "tools": (None, []),
    }
    for name, ok in neutral.items():
        if hasattr(req, name) and getattr(req, name) not in ok:
            raise bad_request(f"{name} is not supported by this server", name)
    if req.n is not None and req.n != 1:
        raise bad_request("only n=1 is supported", "n")


def chat_messages(req: ChatCompletionRequest) -> list[dict]:
    if not req.messages:
        raise bad_request("messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(req.messages):
        if m.role not in ("system", "user", "assistant", "developer", "tool"):
            raise bad_request(f"messages.{i}.role: unknown role {m.role!r}", f"messages.{i}.role")
        content = m.content
        if isinstance(content, list):
            parts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad_request(f"messages.{i}.content: only text parts are supported", f"messages.{i}.content")
                parts.append(part["text"])
            content = "".join(parts)
        role = "system" if m.role == "developer" else m.role
        out.append({"role": role, "content": content or ""})
    return out


def sampling_params(req: _Common, max_tokens: int) -> SamplingParams:
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    top_k = req.top_k if req.top_k is not None else 0
    if top_k < -1:
        raise bad_request("top_k must be -1 (off), 0 (off) or a positive integer", "top_k")
    kwargs = dict(
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=max(0, top_k),
        seed=req.seed,
        max_tokens=max_tokens,
        stop=stop,
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=bool(req.ignore_eos),
    )
    try:
        return SamplingParams(**kwargs)
    except InvalidSamplingParamsError as e:
        msg = str(e)
        param = next((k for k in kwargs if f"invalid {k}" in msg), None)
        raise bad_request(msg, param) from None
