"""`strata serve CKPT`: an OpenAI-compatible HTTP server on the continuous-batching scheduler.

FastAPI routes on uvicorn: `/v1/completions` and `/v1/chat/completions` (streamed over SSE or
not), `/v1/models`, `/health`, `/metrics` (Prometheus). Every request becomes one scheduler
request on the engine thread (`serving.EngineLoop`), so concurrent clients share the batch;
its tokens come back as text through a `text.TextStream` (stop strings are matched there, and
the request is cancelled when one is found). A client that goes away cancels its request.

Safe by default: it binds 127.0.0.1, refuses any other interface without an API key, checks
the key on every route but /health, caps the body, the prompt and the token limit, and takes
nothing from a request but text, ids and sampling settings.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from strata_jax.batching import packing
from strata_jax.batching.checks import check_tokens
from strata_jax.batching.text import CONTEXT_IDS, TextStream
from strata_runtime.serving import metrics, protocol
from strata_runtime.serving.access import Guard
from strata_runtime.serving.loop import EngineLoop, QueueFull, ShuttingDown, Stream

log = logging.getLogger("strata.serve")



@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    """The HTTP side's settings."""

    model_name: str
    """The id /v1/models lists and requests must name."""
    api_key: str | None = None
    """Required as `Authorization: Bearer KEY` on every route but /health; None: open."""
    max_prompt_tokens: int
    """Longest prompt accepted, in tokens."""
    max_body_bytes: int = 1 << 20
    """Largest request body accepted."""
    drain_s: float = 10.0
    """On shutdown, seconds requests in flight may take to finish before they are cancelled."""


class ApiError(Exception):
    """An error answered with OpenAI's error body."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.code = status, message, kind, code


class GenerationFailed(Exception):
    """The engine failed the request (an unreadable expert, an engine error)."""


@dataclass(frozen=True, kw_only=True)
class Started:
    """A submitted request, as the response needs it."""

    stream: Stream
    """Its updates from the engine thread."""
    text: TextStream
    """Its detokenizer and stop strings."""
    stop_ids: frozenset[int]
    """Ids that end it (the reason is then "stop")."""
    prompt_tokens: int
    """Its prompt's length."""


@dataclass(frozen=True, kw_only=True)
class Piece:
    """New text of a request, and its end."""

    text: str
    """Text safe to show."""
    finish: str | None
    """"stop" or "length" on the last piece, else None."""
    tokens: int
    """Tokens generated so far."""
    ids: tuple[int, ...] = ()
    """The tokens this piece adds."""
    scores: packing.PromptScores | None = None
    """The prompt's scores, on the first piece (requests started with `score_prompt`)."""
    scored: tuple[packing.TokenScore, ...] = ()
    """Each of `ids`' scores (requests started with `logprobs`)."""


class Service:
    """What the routes share: the engine loop, the tokenizer and the settings."""

    def __init__(self, loop: EngineLoop, tokenizer, config: ServerConfig) -> None:
        self.loop, self.tokenizer, self.config = loop, tokenizer, config
        self.created = int(time.time())
        self._texts: dict[int, str] = {}

    def token_text(self, token: int) -> str:
        """One token's text alone (as log-probabilities name tokens)."""
        text = self._texts.get(token)
        if text is None:
            text = self._texts[token] = self.tokenizer.decode([token])
        return text

    # --- requests -> ids ------------------------------------------------------------------

    def completion_prompts(self, body: protocol.CompletionRequest) -> list[list[int]]:
        return [self.tokenizer.encode(p, add_special_tokens=True) if isinstance(p, str)
                else list(p) for p in body.prompt_values()]

    def chat_prompt(self, body: protocol.ChatRequest) -> list[int]:
        return self._chat_ids(body.messages, add_generation_prompt=True)

    def _chat_ids(self, messages: list[protocol.Message], add_generation_prompt: bool
                  ) -> list[int]:
        if not self.tokenizer.has_chat_template:
            raise ApiError(400, f"model {self.config.model_name} has no chat template: use "
                                "/v1/completions")
        try:
            text = self.tokenizer.apply_chat_template(
                [m.as_dict() for m in messages], add_generation_prompt=add_generation_prompt)
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        return self.tokenizer.encode(text, add_special_tokens=False)

    def check_model(self, model: str | None) -> None:
        """A request naming a model must name this server's (None: any)."""
        if model is not None and model != self.config.model_name:
            raise ApiError(404, f"the model '{model}' does not exist: this server serves "
                                f"'{self.config.model_name}'", code="model_not_found")

    def tokenize(self, body: protocol.TokenizeRequest) -> list[int]:
        self.check_model(body.model)
        if body.prompt is not None:
            return self.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return self._chat_ids(body.messages, body.add_generation_prompt)

    def start(self, body: protocol._Common, prompt: list[int], default_max: int,
              score_prompt: bool = False) -> Started:
        """Check the request and submit it (`score_prompt`: with its prompt's scores; with
        its generated tokens' where `body` asks for log-probabilities)."""
        self.check_model(body.model)
        cap = self.config.max_prompt_tokens
        if len(prompt) > cap:
            raise ApiError(400, f"the prompt has {len(prompt)} tokens; at most {cap} are "
                                "accepted")
        max_tokens = default_max if body.max_tokens is None else max(1, body.max_tokens)
        try:
            sampling = body.sampling(self.tokenizer.eos_ids)
            # the stop strings are matched here, on the text streamed out (`pieces` cancels
            # the request at one), not a second time on the engine thread
            stream = self.loop.submit(prompt, max_tokens,
                                      dataclasses.replace(sampling, stop=()), score_prompt,
                                      logprobs=body.logprob_top is not None)
        except QueueFull as e:
            raise ApiError(429, str(e), "rate_limit_error", "queue_full") from None
        except ShuttingDown as e:
            raise ApiError(503, str(e), "server_error", "shutting_down") from None
        except ValueError as e:
            raise ApiError(400, _plain(str(e))) from None
        text = TextStream(self.tokenizer, sampling.stop, context=prompt[-CONTEXT_IDS:])
        return Started(stream=stream, text=text, stop_ids=sampling.stop_ids,
                       prompt_tokens=len(prompt))

    # --- tokens -> text -------------------------------------------------------------------

    async def pieces(self, started: Started) -> AsyncIterator[Piece]:
        """The request's text as it is generated; cancels the request if left early."""
        stream, text = started.stream, started.text
        count, last, over, scores = 0, None, False, None
        try:
            async for update in stream:
                scores = scores or update.scores
                for j, token in enumerate(update.tokens):
                    count, last = count + 1, token
                    delta = text.push(token)
                    scored = update.logprobs[j : j + 1]
                    if text.finished:  # a stop string: the rest is not wanted
                        over = True
                        self.loop.cancel(stream, stopped=True)
                        yield Piece(text=delta, finish="stop", tokens=count, ids=(token,),
                                    scores=scores, scored=scored)
                        return
                    yield Piece(text=delta, finish=None, tokens=count, ids=(token,),
                                scores=scores, scored=scored)
                    scores = None
                if update.done:
                    over = True
                    if update.cancelled:  # the server shut down first: what was made, ended
                        yield Piece(text=text.finish(), finish="abort", tokens=count)
                        return
                    if update.error is not None:
                        raise GenerationFailed(update.error)
                    finish = "stop" if last in started.stop_ids else "length"
                    yield Piece(text=text.finish(), finish=finish, tokens=count)
                    return
        finally:
            if not over:
                self.loop.cancel(stream)


def create_app(service: Service) -> Guard:
    """The routes, with the engine loop started and stopped by the app's lifespan."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if not service.loop.alive:
            service.loop.start()
        yield
        await asyncio.to_thread(service.loop.shutdown, service.config.drain_s)

    app = FastAPI(title="Strata-JAX", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    _add_error_handlers(app)
    name = service.config.model_name

    @app.get("/health")
    async def health() -> Response:
        if not service.loop.alive:
            return JSONResponse({"status": "engine loop stopped"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": name, "object": "model",
                                            "created": service.created, "owned_by": "strata",
                                            "root": name,
                                            "max_model_len": service.loop.max_len}]}

    @app.post("/tokenize")
    async def tokenize(body: protocol.TokenizeRequest) -> dict:
        ids = await asyncio.to_thread(service.tokenize, body)
        return {"count": len(ids), "max_model_len": service.loop.max_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(body: protocol.DetokenizeRequest) -> dict:
        service.check_model(body.model)
        try:
            check_tokens(service.loop.engine.cfg, body.tokens, "tokens")
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        return {"prompt": service.tokenizer.decode(body.tokens)}

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict:
        tok = service.tokenizer
        return {**tok.special_tokens, "chat_template": tok.chat_template,
                "eos_token_ids": sorted(tok.eos_ids), "bos_token_id": tok.bos_id,
                "vocab_size": tok.vocab_size, "model_max_length": service.loop.max_len}

    @app.get("/metrics")
    async def prometheus() -> Response:
        snap = await asyncio.wait_for(asyncio.wrap_future(service.loop.snapshot()), 60)
        return Response(metrics.render(snap), media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(body: protocol.CompletionRequest, request: Request) -> Response:
        prompts = await asyncio.to_thread(service.completion_prompts, body)  # a MiB of text
        if not body.stream:
            return await _complete_all(service, request, body, prompts)
        started = service.start(body, prompts[0], protocol.COMPLETION_MAX_TOKENS)
        return _streamed(service, body, started, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(body: protocol.ChatRequest, request: Request) -> Response:
        prompt = await asyncio.to_thread(service.chat_prompt, body)
        started = service.start(body, prompt, max(1, service.loop.max_len - len(prompt)))
        if body.stream:
            return _streamed(service, body, started, chat=True)
        return await _chat_answer(service, request, body, started)

    return Guard(app, api_key=service.config.api_key,
                 max_body_bytes=service.config.max_body_bytes)


def _streamed(service: Service, body: protocol._Common, started: Started, chat: bool
              ) -> Response:
    rid = protocol.new_id("chatcmpl" if chat else "cmpl")
    events = _events(service, service.pieces(started), rid, body, started.prompt_tokens, chat)
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


async def _chat_answer(service: Service, request: Request, body: protocol.ChatRequest,
                       started: Started) -> Response:
    rid = protocol.new_id("chatcmpl")
    outcome = await _unless_disconnected(request, _gather(service.pieces(started)))
    if outcome is None:  # the client is gone: nobody reads this
        return Response(status_code=499)
    use = protocol.usage(started.prompt_tokens, outcome.count)
    top = body.logprob_top
    scored = None if top is None else protocol.chat_logprobs(
        outcome.ids, outcome.scored, top, service.token_text)
    return JSONResponse(protocol.chat_completion(rid, body.model, outcome.text, outcome.finish,
                                                 use, scored))


@dataclass(frozen=True, kw_only=True)
class _Whole:
    """A whole request's answer."""

    text: str
    finish: str
    count: int
    """Tokens generated."""
    ids: list[int]
    """Those tokens."""
    scores: packing.PromptScores | None
    """The prompt's (`score_prompt`)."""
    scored: list[packing.TokenScore]
    """Each of `ids`' (`logprobs`)."""


async def _gather(pieces: AsyncIterator[Piece]) -> _Whole:
    """A whole request's pieces, gathered."""
    parts, ids, scored, scores, piece = [], [], [], None, None
    async with contextlib.aclosing(pieces):
        async for piece in pieces:
            parts.append(piece.text)
            ids.extend(piece.ids)
            scored.extend(piece.scored)
            scores = scores or piece.scores
    return _Whole(text="".join(parts), finish=piece.finish, count=piece.tokens, ids=ids,
                  scores=scores, scored=scored)


async def _complete_all(service: Service, request: Request, body: protocol.CompletionRequest,
                        prompts: list[list[int]]) -> Response:
    """A completion not streamed, of one or several prompts: every prompt a request of its
    own in the batch, the answers in order."""
    started: list[Started] = []
    try:
        for prompt in prompts:
            started.append(service.start(body, prompt, protocol.COMPLETION_MAX_TOKENS,
                                         score_prompt=body.echo and body.logprobs is not None))
    except ApiError:
        for s in started:
            service.loop.cancel(s.stream)
        raise
    work = asyncio.gather(*(_gather(service.pieces(s)) for s in started))
    outcome = await _unless_disconnected(request, work)
    if outcome is None:
        return Response(status_code=499)
    choices, generated = [], 0
    for i, (prompt, whole) in enumerate(zip(prompts, outcome, strict=True)):
        if body.max_tokens == 0:  # scored only: the drawn token is not returned
            whole = dataclasses.replace(whole, text="", finish="length", count=0, ids=[],
                                        scored=[])
        generated += whole.count
        shown = (service.tokenizer.decode(prompt) if body.echo else "") + whole.text
        choices.append(protocol.choice(i, shown, whole.finish, _logprobs(
            service, body, prompt, whole)))
    use = protocol.usage(sum(map(len, prompts)), generated)
    return JSONResponse(protocol.completions(protocol.new_id("cmpl"), body.model, choices, use))


def _logprobs(service: Service, body: protocol.CompletionRequest, prompt: list[int],
              whole: _Whole) -> dict | None:
    """The choice's `logprobs` object (None when not asked for): the generated tokens', after
    the prompt's with `echo` (its first token has none)."""
    if body.logprobs is None:
        return None
    ids, entries = list(whole.ids), list(whole.scored)
    if body.echo:
        ids = prompt + ids
        entries = [None] + [whole.scores.at(j) for j in range(len(prompt) - 1)] + entries
    return protocol.logprobs(ids, entries, body.logprobs, service.token_text)


async def _unless_disconnected(request: Request, work):
    """`work`'s result, or None if the client disconnects first (`work` is then cancelled)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, watch):
            if not t.done():
                t.cancel()
    if task.done() and not task.cancelled():
        return task.result()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return None


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _events(service: Service, pieces: AsyncIterator[Piece], rid: str,
                  body: protocol._Common, prompt_tokens: int, chat: bool) -> AsyncIterator[str]:
    """The SSE stream: chunks, an optional usage chunk, then [DONE]. A chunk's log-
    probabilities are those of the tokens since the last chunk (a token whose text is held
    back, e.g. part of a stop string or of a character, goes with the next)."""
    model, count, top = body.model, 0, body.logprob_top
    ids: list[int] = []
    scored: list[packing.TokenScore] = []
    async with contextlib.aclosing(pieces):
        try:
            if chat:
                yield _sse(protocol.chat_chunk(rid, model, {"role": "assistant", "content": ""},
                                               None))
            running = body.stream_options is not None and \
                body.stream_options.continuous_usage_stats
            async for piece in pieces:
                count = piece.tokens
                ids.extend(piece.ids)
                scored.extend(piece.scored)
                if not piece.text and piece.finish is None:
                    continue
                use = protocol.usage(prompt_tokens, count) if running else None
                yield _sse(_chunk(service, rid, model, piece, use, chat, top, ids, scored))
                ids, scored = [], []
            if body.include_usage:
                obj = "chat.completion.chunk" if chat else "text_completion"
                yield _sse(protocol.usage_chunk(rid, model, obj,
                                                protocol.usage(prompt_tokens, count)))
        except GenerationFailed as e:
            yield _sse(protocol.error_body(str(e), "server_error", "generation_failed"))
    yield "data: [DONE]\n\n"


def _chunk(service: Service, rid: str, model: str, piece: Piece, use: dict | None, chat: bool,
           top: int | None, ids: list[int], scored: list[packing.TokenScore]) -> dict:
    """One streamed chunk of `piece`, with the log-probabilities of tokens `ids`."""
    if chat:
        logprobs = None if top is None else protocol.chat_logprobs(ids, scored, top,
                                                                   service.token_text)
        delta = {"content": piece.text} if piece.text else {}
        return protocol.chat_chunk(rid, model, delta, piece.finish, use, logprobs)
    logprobs = None if top is None else protocol.logprobs(ids, scored, top, service.token_text)
    return protocol.completion(rid, model, piece.text, piece.finish, use, logprobs)


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _plain(message: str) -> str:
    """check_request's messages name an internal index ("request 0: ..."): drop it."""
    head, sep, rest = message.partition(": ")
    return rest if sep and head.startswith("request ") else message


def _add_error_handlers(app: FastAPI) -> None:
    def answer(status: int, message: str, kind: str = "invalid_request_error",
               code: str | None = None) -> JSONResponse:
        return JSONResponse(protocol.error_body(message, kind, code), status_code=status)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError) -> JSONResponse:
        return answer(e.status, e.message, e.kind, e.code)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        return answer(400, _validation_message(e))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> JSONResponse:
        return answer(e.status_code, str(e.detail))

    @app.exception_handler(GenerationFailed)
    async def failed(request: Request, e: GenerationFailed) -> JSONResponse:
        return answer(500, str(e), "server_error", "generation_failed")

    @app.exception_handler(Exception)
    async def crashed(request: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error in %s", request.url.path)
        return answer(500, f"internal error: {type(e).__name__}", "server_error")


def _validation_message(e: RequestValidationError) -> str:
    """pydantic's errors as one line: "field: problem; ..." (the first few)."""
    parts = []
    for err in e.errors()[:5]:
        if err.get("type") == "json_invalid":
            return f"the body is not valid JSON: {err.get('ctx', {}).get('error', '')}".strip()
        where = ".".join(str(x) for x in err.get("loc", ())[1:])
        msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
        parts.append(f"{where}: {msg}" if where else msg)
    return "; ".join(parts) or "invalid request"


GRACE_S = 5
"""Seconds uvicorn waits for connections past the drain: requests the drain cancelled end
their responses (finish_reason "abort") in that time."""


class DrainingServer(uvicorn.Server):
    """uvicorn's server that starts the engine loop's drain on SIGINT/SIGTERM, so the
    requests in flight end with a well-formed answer before uvicorn waits for them (it runs
    the app's shutdown only after its connections have closed)."""

    def __init__(self, config: uvicorn.Config, loop: EngineLoop, drain_s: float) -> None:
        super().__init__(config)
        self._engine_loop, self._drain_s = loop, drain_s

    def handle_exit(self, sig, frame) -> None:
        self._engine_loop.begin_shutdown(self._drain_s)
        super().handle_exit(sig, frame)
