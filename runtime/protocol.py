"""The OpenAI API's request and response shapes, as far as the server implements them.

Requests are validated by pydantic; a field the server does not implement is refused with a
message (never silently ignored): unknown fields, `n` != 1, logprobs, penalties other than
`repetition_penalty`, tools. Extra fields beyond OpenAI's (vLLM's names): `top_k`, `min_p`,
`repetition_penalty`, `stop_token_ids`, `ignore_eos` (generate to the token limit whatever the
eos ids; for benchmarks).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator

from strata_jax.sampling import SamplingParams

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
NOT_IMPLEMENTED = {
    "logprobs": None, "top_logprobs": None, "logit_bias": None, "echo": False, "suffix": None,
    "best_of": None, "frequency_penalty": 0.0, "presence_penalty": 0.0, "tools": None,
    "tool_choice": None, "response_format": None, "functions": None, "function_call": None,
}
"""Fields accepted only at their default (the OpenAI client may send them explicitly)."""
IGNORED = ("user", "metadata", "store", "parallel_tool_calls", "service_tier")
"""Fields that do not change the output; accepted and ignored."""


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    """A last chunk carries the usage."""


class _Common(BaseModel):
    """The fields both endpoints share."""

    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] = Field(default_factory=list, max_length=64)
    ignore_eos: bool = False
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None

    @model_validator(mode="after")
    def _supported(self) -> _Common:
        extra = dict(self.model_extra or {})
        for name in IGNORED:
            extra.pop(name, None)
        for name, default in NOT_IMPLEMENTED.items():
            if name in extra and extra.pop(name) not in (default, None):
                raise ValueError(f"'{name}' is not supported by this server")
        if extra:
            raise ValueError(f"unknown field(s): {', '.join(sorted(extra))}")
        if self.n != 1:
            raise ValueError(f"only n=1 is supported, got n={self.n}")
        stops = self.stop_strings()
        if len(stops) > MAX_STOP_STRINGS or any(not s or len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"stop: at most {MAX_STOP_STRINGS} non-empty strings of at most "
                             f"{MAX_STOP_CHARS} characters")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options needs stream=true")
        return self

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def sampling(self, eos_ids: frozenset[int]) -> SamplingParams:
        eos = frozenset() if self.ignore_eos else eos_ids
        return SamplingParams(
            temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p,
            repetition_penalty=self.repetition_penalty, seed=self.seed,
            stop_ids=eos | frozenset(self.stop_token_ids), stop=self.stop_strings())

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Common):
    """POST /v1/completions."""

    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]

    @model_validator(mode="after")
    def _one_prompt(self) -> CompletionRequest:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], str | list):
            if len(p) != 1:
                raise ValueError(f"one prompt per request (got a batch of {len(p)})")
        return self

    def prompt_value(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], str | list):
            return p[0]
        return p


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_dict(self) -> dict[str, str]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        out = {"role": self.role, "content": content or ""}
        if self.name is not None:
            out["name"] = self.name
        return out


class ChatRequest(_Common):
    """POST /v1/chat/completions."""

    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _one_limit(self) -> ChatRequest:
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ValueError("give max_tokens or max_completion_tokens, not both")
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return self


# --- responses -------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion(rid: str, model: str, text: str, finish: str | None,
               use: dict[str, int] | None) -> dict[str, Any]:
    """A text_completion object: the whole answer, or (use None) one streamed chunk."""
    out: dict[str, Any] = {
        "id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}
    if use is not None:
        out["usage"] = use
    return out


def chat_completion(rid: str, model: str, text: str, finish: str,
                    use: dict[str, int]) -> dict[str, Any]:
    return {
        "id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                     "logprobs": None, "finish_reason": finish}],
        "usage": use}


def chat_chunk(rid: str, model: str, delta: dict[str, str], finish: str | None) -> dict[str, Any]:
    return {
        "id": rid, "object": "chat.completion.chunk", "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}


def usage_chunk(rid: str, model: str, obj: str, use: dict[str, int]) -> dict[str, Any]:
    """The last chunk of a stream with stream_options.include_usage: no choices."""
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model,
            "choices": [], "usage": use}


def error_body(message: str, kind: str = "invalid_request_error", code: str | None = None,
               param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
