"""The OpenAI API's request and response shapes, as far as the server implements them.

Requests are validated by pydantic; a field the server does not implement is refused with a
message (never silently ignored): unknown fields, `n` != 1, penalties other than
`repetition_penalty`, tools; sent at OpenAI's defaults (or null) they are accepted. Extra
fields beyond OpenAI's (vLLM's names): `top_k`, `min_p`, `repetition_penalty`,
`stop_token_ids`, `ignore_eos` (generate to the token limit whatever the eos ids; for
benchmarks). Log-probabilities are the model's own softmax (before temperature and filters,
as vLLM gives them): completions' `logprobs` N and chat's `logprobs` / `top_logprobs` give
each generated token's, streamed or not; completions' `echo` adds the prompt's tokens'
(`max_tokens` 0: nothing generated), as evaluation harnesses ask.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator

from strata_jax.step.programs import SCORE_TOP
from strata_jax.step.sampling import SamplingParams

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
NOT_IMPLEMENTED = {
    "top_logprobs": (0,), "logit_bias": ({},), "echo": (False,),
    "suffix": ("",), "best_of": (1,), "frequency_penalty": (0,), "presence_penalty": (0,),
    "tools": ([],), "tool_choice": ("none",), "response_format": ({"type": "text"},),
    "functions": ([],), "function_call": ("none",),
}
"""Fields accepted only at OpenAI's defaults (or null): clients send them explicitly."""
COMPLETION_MAX_TOKENS = 16
"""OpenAI's default `max_tokens` for /v1/completions (chat defaults to the rest of max_len)."""
MAX_PROMPTS = 64
"""Prompts one /v1/completions request may carry."""
IGNORED = ("user", "metadata", "store", "parallel_tool_calls", "service_tier")
"""Fields that do not change the output; accepted and ignored."""


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    """A last chunk carries the usage."""
    continuous_usage_stats: bool = False
    """Every chunk carries the usage so far (vLLM's field)."""


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

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, data: Any) -> Any:
        """A field sent as null takes its default, as OpenAI's API reads it."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data

    @model_validator(mode="after")
    def _supported(self) -> _Common:
        extra = dict(self.model_extra or {})
        for name in IGNORED:
            extra.pop(name, None)
        for name, defaults in NOT_IMPLEMENTED.items():
            if name in extra and extra.pop(name) not in defaults:
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

    @property
    def logprob_top(self) -> int | None:
        """Alternatives each generated token's log-probability comes with (None: none
        asked for)."""
        return None


class CompletionRequest(_Common):
    """POST /v1/completions."""

    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    max_tokens: int | None = Field(default=None, ge=0)
    echo: bool = False
    """The prompt comes back before the completion (its tokens in `logprobs` too)."""
    logprobs: int | None = Field(default=None, ge=0, le=SCORE_TOP)
    """Log-probabilities of the returned tokens with this many alternatives each."""

    @model_validator(mode="after")
    def _prompts(self) -> CompletionRequest:
        count = len(self.prompt_values())
        if not 1 <= count <= MAX_PROMPTS:
            raise ValueError(f"give 1 to {MAX_PROMPTS} prompts, got {count}")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens 0 returns nothing without echo")
        if self.stream and (count > 1 or self.echo):
            raise ValueError("stream takes one prompt, without echo")
        return self

    @property
    def logprob_top(self) -> int | None:
        return self.logprobs

    def prompt_values(self) -> list[str | list[int]]:
        """The prompts, each text or ids."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], str | list):
            return list(p)
        return [p]


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
    logprobs: bool = False
    """Each generated token's log-probability."""
    top_logprobs: int = Field(default=0, ge=0, le=SCORE_TOP)
    """With `logprobs`: this many alternatives each."""

    @model_validator(mode="after")
    def _one_limit(self) -> ChatRequest:
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ValueError("give max_tokens or max_completion_tokens, not both")
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        return self

    @property
    def logprob_top(self) -> int | None:
        return self.top_logprobs if self.logprobs else None


class TokenizeRequest(BaseModel):
    """POST /tokenize (vLLM's shape): text, or a chat through the template."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None
    add_special_tokens: bool = True
    """For `prompt`: add what the tokenizer adds (e.g. bos); a chat's template writes its own."""
    add_generation_prompt: bool = True
    """For `messages`: end with the assistant's turn opening."""

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give 'prompt' or 'messages'")
        return self


class DetokenizeRequest(BaseModel):
    """POST /detokenize."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[StrictInt]


# --- responses -------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion(rid: str, model: str, text: str, finish: str | None,
               use: dict[str, int] | None, logprobs: dict[str, Any] | None = None
               ) -> dict[str, Any]:
    """A text_completion object: the whole answer, or (use None) one streamed chunk."""
    return completions(rid, model, [choice(0, text, finish, logprobs)], use)


def choice(index: int, text: str, finish: str | None,
           logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}


def completions(rid: str, model: str, choices: list[dict[str, Any]],
                use: dict[str, int] | None) -> dict[str, Any]:
    """A text_completion object of several choices (one per prompt)."""
    out: dict[str, Any] = {"id": rid, "object": "text_completion", "created": int(time.time()),
                           "model": model, "choices": choices}
    if use is not None:
        out["usage"] = use
    return out


def logprobs(ids: list[int], entries: list, top: int, text: Callable[[int], str]
             ) -> dict[str, Any]:
    """The completions `logprobs` object of tokens `ids` with their `packing.TokenScore`
    `entries` (None: the prompt's first token, which has none), `top` alternatives each,
    every token named by `text(id)` (the token itself is always among its alternatives)."""
    tokens = [text(t) for t in ids]
    values: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    for token, entry in zip(tokens, entries, strict=True):
        if entry is None:
            values.append(None)
            tops.append(None)
            continue
        values.append(entry.logprob)
        alt = {text(int(t)): float(v) for t, v in zip(entry.top_ids[:top], entry.top[:top],
                                                      strict=True)}
        alt.setdefault(token, entry.logprob)
        tops.append(alt)
    offsets = [0]
    for t in tokens[:-1]:
        offsets.append(offsets[-1] + len(t))
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
            "text_offset": offsets}


def chat_logprobs(ids: list[int], entries: list, top: int, text: Callable[[int], str]
                  ) -> dict[str, Any]:
    """The chat `logprobs` object of generated tokens `ids` with their `packing.TokenScore`
    `entries`, `top` alternatives each."""

    def item(token: int, value: float) -> dict[str, Any]:
        s = text(token)
        return {"token": s, "logprob": value, "bytes": list(s.encode("utf-8"))}

    content = []
    for token, entry in zip(ids, entries, strict=True):
        alternatives = zip(entry.top_ids[:top], entry.top[:top], strict=True)
        content.append({**item(token, entry.logprob),
                        "top_logprobs": [item(int(t), float(v)) for t, v in alternatives]})
    return {"content": content, "refusal": None}


def chat_completion(rid: str, model: str, text: str, finish: str,
                    use: dict[str, int], logprobs: dict[str, Any] | None = None
                    ) -> dict[str, Any]:
    return {
        "id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                     "logprobs": logprobs, "finish_reason": finish}],
        "usage": use}


def chat_chunk(rid: str, model: str, delta: dict[str, str], finish: str | None,
               use: dict[str, int] | None = None, logprobs: dict[str, Any] | None = None
               ) -> dict[str, Any]:
    out: dict[str, Any] = {
        "id": rid, "object": "chat.completion.chunk", "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "delta": delta, "logprobs": logprobs,
                     "finish_reason": finish}]}
    if use is not None:
        out["usage"] = use
    return out


def usage_chunk(rid: str, model: str, obj: str, use: dict[str, int]) -> dict[str, Any]:
    """The last chunk of a stream with stream_options.include_usage: no choices."""
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model,
            "choices": [], "usage": use}


def error_body(message: str, kind: str = "invalid_request_error", code: str | None = None,
               param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
