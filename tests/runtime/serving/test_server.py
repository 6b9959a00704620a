"""`python -m strata_runtime.cli.serve` on a tiny synthetic checkpoint, over localhost,
through the
official `openai` client (and raw HTTP for what a client library would not send).

One server for the module (4 rows, 4 waiting, an API key from the environment); the last test
stops it with SIGTERM while a request is in flight.
"""

import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx2
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

import strata_jax
from strata_jax.tools.synth import synthesize
from strata_runtime.cli.serve import main as server_main
from tests.runtime.served import start_server

KEY = "test-key-123"
ROWS, QUEUE, MAX_LEN = 4, 4, 512
LONG = {"max_tokens": MAX_LEN - 8, "temperature": 0, "extra_body": {"ignore_eos": True}}
MODEL = "tiny"
PROMPTS = ["hello", "abc", "The", "xyz!", "1234", "é", "ok", "moe"]  # <= 8 tokens: one bucket


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("serve") / MODEL
    synthesize("tiny", path, progress=False)  # with its byte-level tokenizer
    return path


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    log = open(tmp_path_factory.mktemp("log") / "server.log", "w+")  # noqa: SIM115
    proc, base = start_server(
        checkpoint, ["--batch-capacity", str(ROWS), "--max-len", str(MAX_LEN), "--max-queue",
                     str(QUEUE), "--drain-seconds", "20"], log, {"STRATA_API_KEY": KEY})
    yield proc, base, log
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    log.close()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(api_key=KEY, base_url=server[1] + "/v1", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(server):
    with httpx2.Client(base_url=server[1], headers={"Authorization": f"Bearer {KEY}"},
                       timeout=60) as c:
        yield c


def metric(http, name: str, **labels) -> float:
    text = http.get("/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    raise KeyError(name)


def complete(client, prompt, stream=False, **kw):
    """(text, finish_reason, usage) of one completion, streamed or not."""
    kw = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0.0, **kw}
    if not stream:
        out = client.completions.create(**kw)
        return out.choices[0].text, out.choices[0].finish_reason, out.usage.completion_tokens
    text, finish, usage = "", None, None
    for chunk in client.completions.create(stream=True, stream_options={"include_usage": True},
                                           **kw):
        if chunk.choices:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
    return text, finish, usage


def test_models_and_health(client, server):
    assert [m.id for m in client.models.list()] == [MODEL]
    assert httpx2.get(server[1] + "/health").json() == {"status": "ok"}  # no key needed


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.9, "top_p": 0.95, "top_k": 50}],
                         ids=["greedy", "seeded"])
def test_concurrent_streams_equal_single_runs(client, sampling):
    def seeded(i):
        if not sampling:
            return {}
        extra = {k: v for k, v in sampling.items() if k in ("top_k",)}
        return {"temperature": sampling["temperature"], "top_p": sampling["top_p"],
                "seed": 100 + i, "extra_body": extra}

    alone = [complete(client, p, **seeded(i)) for i, p in enumerate(PROMPTS)]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(lambda ip: complete(client, ip[1], stream=True, **seeded(ip[0])),
                                 enumerate(PROMPTS)))
    assert together == alone
    # a token limit, or an eos id before it (the random model emits </s> now and then)
    assert all(n == 12 if finish == "length" else finish == "stop" and n < 12
               for _, finish, n in alone), alone


def test_chat_streamed_equals_non_streamed_with_the_same_seed(client):
    kw = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10,
          "temperature": 0.8, "seed": 7}
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(stream=True, **kw))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content
    assert whole.choices[0].message.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 10


def test_stop_string_cuts_the_text(client):
    full, _, _ = complete(client, "hello", max_tokens=24)
    stop = full[6:9]
    for stream in (False, True):
        text, finish, used = complete(client, "hello", stream=stream, max_tokens=24, stop=[stop])
        assert (text, finish) == (full[: full.find(stop)], "stop")
        assert used < 24


MALFORMED = [
    ({"model": MODEL, "prompt": "hi", "n": 2}, 400, "n=1"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": MAX_LEN}, 400, "max_len"),
    ({"model": MODEL, "prompt": "hi", "temperature": -1}, 400, "temperature"),
    ({"model": MODEL, "prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ({"model": MODEL, "prompt": "hi", "bogus": 1}, 400, "bogus"),
    ({"model": MODEL, "prompt": [1, 10**6]}, 400, "vocab"),
    ({"model": MODEL, "prompt": []}, 400, "empty"),
    ({"model": MODEL, "prompt": ["a"] * 65}, 400, "give 1 to 64 prompts"),
    ({"model": MODEL, "prompt": ["a", "b"], "stream": True}, 400, "stream takes one prompt"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "without echo"),
    ({"model": MODEL, "prompt": "x" * (MAX_LEN + 10)}, 400, "prompt has"),
    ({"model": "other", "prompt": "hi"}, 404, "does not exist"),
    ({"prompt": "hi"}, 400, "model"),
]


def test_malformed_requests_get_4xx_while_others_proceed(client, http):
    reference = complete(client, "hello", max_tokens=60)
    result = {}
    worker = threading.Thread(target=lambda: result.update(
        out=complete(client, "hello", stream=True, max_tokens=60)))
    worker.start()
    for body, status, words in MALFORMED:
        r = http.post("/v1/completions", json=body)
        assert r.status_code == status, (body, r.text)
        assert words in r.json()["error"]["message"], (body, r.text)
    r = http.post("/v1/completions", content=b"{not json",
                  headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = http.post("/v1/completions", content=b"x" * (2 << 20))
    assert r.status_code == 413
    with pytest.raises(openai.BadRequestError, match="n=1"):
        client.completions.create(model=MODEL, prompt="hi", n=3)
    worker.join()
    assert result["out"] == reference


def _wait_idle(http, timeout=20.0) -> None:
    deadline = time.monotonic() + timeout
    while metric(http, "strata_active_rows") != 0:
        assert time.monotonic() < deadline, "rows were not freed"
        time.sleep(0.05)


def test_disconnect_mid_stream_frees_the_row(client, http):
    _wait_idle(http)
    before = metric(http, "strata_requests_total", state="cancelled")
    stream = client.completions.create(model=MODEL, prompt="hello", stream=True, **LONG)
    chunks = iter(stream)
    got = [next(chunks) for _ in range(3)]
    assert all(c.choices for c in got)
    stream.close()
    with pytest.raises(httpx2.TimeoutException):  # non-streamed: the client gives up
        http.post("/v1/completions", timeout=0.1, json={
            "model": MODEL, "prompt": "abc", "max_tokens": MAX_LEN - 8, "ignore_eos": True})
    _wait_idle(http)
    assert metric(http, "strata_requests_total", state="cancelled") == before + 2
    assert complete(client, "hello")[1] == "length"


def test_full_queue_answers_429(client, http):
    _wait_idle(http)
    body = {"model": MODEL, "prompt": "hi", "max_tokens": MAX_LEN // 2, "temperature": 0,
            "ignore_eos": True}

    def post(_):
        return http.post("/v1/completions", json=body)

    with ThreadPoolExecutor(3 * (ROWS + QUEUE)) as pool:
        answers = list(pool.map(post, range(3 * (ROWS + QUEUE))))
    codes = [r.status_code for r in answers]
    assert set(codes) <= {200, 429} and codes.count(429) >= 1 and codes.count(200) >= ROWS
    refused = next(r for r in answers if r.status_code == 429)
    assert "retry" in refused.json()["error"]["message"]
    done = [r.json()["choices"][0] for r in answers if r.status_code == 200]
    assert all(c["finish_reason"] == "length" and c["text"] == done[0]["text"] for c in done)
    assert metric(http, "strata_requests_total", state="rejected") >= codes.count(429)


def test_metrics_parse_as_prometheus_text(http):
    _wait_idle(http)
    families = {f.name: f for f in text_string_to_metric_families(http.get("/metrics").text)}
    for name in ("strata_decode_steps", "strata_decode_tokens", "strata_step_seconds",
                 "strata_tier0_hit_rate", "strata_h2d_bytes", "strata_queue_depth",
                 "strata_active_rows", "strata_requests", "strata_xla_compiles"):
        assert name in families, name
    assert families["strata_decode_steps"].type == "counter"
    assert families["strata_decode_steps"].samples[0].value > 0
    assert metric(http, "strata_queue_depth") == 0


def test_echo_and_logprobs_score_the_prompt_as_the_python_api(client, checkpoint):
    """lm-eval's loglikelihood request (echo, logprobs 1, max_tokens 1), several prompts in
    one request, and a score-only one (max_tokens 0): each prompt token's log-probability is
    `strata_jax.score`'s."""
    model = strata_jax.load(checkpoint)
    tok = model.tokenizer
    prompts = [tok.encode("Four score and seven"), tok.encode("hello world, hello")]
    out = client.completions.create(model=MODEL, prompt=prompts, echo=True, logprobs=1,
                                    max_tokens=1, temperature=0)
    shape = {"batch_capacity": ROWS, "max_len": MAX_LEN}
    for ids, c in zip(prompts, out.choices, strict=True):
        lp = c.logprobs
        assert len(lp.tokens) == len(ids) + 1 and lp.token_logprobs[0] is None
        want = strata_jax.score(model, [(ids[:1], ids[1:])], **shape)[0]
        assert lp.token_logprobs[1:-1] == pytest.approx(want.token_logprobs, rel=1e-5)
        for value, top in zip(lp.token_logprobs[1:], lp.top_logprobs[1:], strict=True):
            assert value in top.values() and max(top.values()) >= value
        assert c.text.startswith(tok.decode(ids))
    new = strata_jax.generate(model, prompts, 1, **shape)
    assert [c.text for c in out.choices] == [tok.decode(p) + tok.decode(n)
                                             for p, n in zip(prompts, new, strict=True)]
    scored = client.completions.create(model=MODEL, prompt=prompts[0], echo=True, logprobs=2,
                                       max_tokens=0)
    c = scored.choices[0]
    assert c.text == tok.decode(prompts[0]) and scored.usage.completion_tokens == 0
    assert c.logprobs.token_logprobs[1:] == out.choices[0].logprobs.token_logprobs[1:-1]
    assert all(len(t) <= 3 for t in c.logprobs.top_logprobs[1:])


def _full_forward_logprobs(model, prompt: list[int], new: list[int]) -> list[float]:
    """Each of `new`'s log-probabilities after `prompt`, float64 from the full forward."""
    import numpy as np

    logits = strata_jax.logits(model, np.array([prompt + new], np.int32))[0].astype(np.float64)
    at = np.arange(len(prompt) - 1, len(prompt) - 1 + len(new))
    rows = logits[at] - logits[at].max(-1, keepdims=True)
    logp = rows - np.log(np.exp(rows).sum(-1, keepdims=True))
    return list(logp[np.arange(len(new)), new])


def test_generated_tokens_logprobs_completions_and_chat_streamed_or_not(client, http,
                                                                        checkpoint):
    """Each generated token's log-probability, on completions (with and without echo) and chat,
    streamed and not, equals the full forward's in float64; streamed equals whole."""
    model = strata_jax.load(checkpoint)
    tok = model.tokenizer
    prompt = tok.encode("hello world")
    kw = {"model": MODEL, "max_tokens": 6, "temperature": 0, "extra_body": {"ignore_eos": True}}
    whole = client.completions.create(prompt=prompt, logprobs=2, **kw).choices[0]
    shape = {"batch_capacity": ROWS, "max_len": MAX_LEN}
    new = strata_jax.generate(model, [prompt], 6, **shape)[0]
    lp = whole.logprobs
    assert len(lp.token_logprobs) == 6 and "".join(lp.tokens) == whole.text
    assert lp.token_logprobs == pytest.approx(_full_forward_logprobs(model, prompt, new),
                                              rel=1e-4, abs=1e-4)
    assert all(len(t) <= 3 and max(t.values()) == v  # greedy: each token is the best
               for t, v in zip(lp.top_logprobs, lp.token_logprobs, strict=True))
    chunks = list(client.completions.create(prompt=prompt, logprobs=2, stream=True, **kw))
    streamed = [v for c in chunks if c.choices and c.choices[0].logprobs
                for v in c.choices[0].logprobs.token_logprobs]
    assert streamed == lp.token_logprobs
    echoed = client.completions.create(prompt=prompt, logprobs=0, echo=True, **kw).choices[0]
    assert echoed.logprobs.token_logprobs[len(prompt):] == lp.token_logprobs
    assert echoed.logprobs.token_logprobs[0] is None
    messages = [{"role": "user", "content": "hi there"}]
    ids = http.post("/tokenize", json={"model": MODEL, "messages": messages}).json()["tokens"]
    chat = client.chat.completions.create(messages=messages, logprobs=True, top_logprobs=3,
                                          **kw)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == 6
    assert "".join(c.token for c in content) == chat.choices[0].message.content
    new = strata_jax.generate(model, [ids], 6, **shape)[0]
    assert [c.logprob for c in content] == pytest.approx(
        _full_forward_logprobs(model, ids, new), rel=1e-4, abs=1e-4)
    assert all(len(c.top_logprobs) == 3 and c.top_logprobs[0].logprob == c.logprob
               and bytes(c.bytes).decode() == c.token for c in content)
    parts = list(client.chat.completions.create(messages=messages, logprobs=True, stream=True,
                                                **kw))
    values = [c.logprob for p in parts if p.choices and p.choices[0].logprobs
              for c in p.choices[0].logprobs.content]
    assert values == [c.logprob for c in content]
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages,
                                                "top_logprobs": 2})
    assert r.status_code == 400 and "logprobs=true" in r.json()["error"]["message"]


def test_several_prompts_answer_in_order_as_alone(client):
    alone = [complete(client, p, max_tokens=6)[0] for p in PROMPTS[:3]]
    out = client.completions.create(model=MODEL, prompt=PROMPTS[:3], max_tokens=6,
                                    temperature=0)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert [c.text for c in out.choices] == alone


def test_openai_defaults_sent_explicitly_are_accepted(client, http):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
            "logprobs": False, "response_format": {"type": "text"}, "tool_choice": "none",
            "logit_bias": {}, "temperature": None, "top_p": None, "seed": None}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code in (200, 400), r.text  # 400 only where the tiny model has no template
    if r.status_code == 400:
        assert "chat template" in r.json()["error"]["message"]
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 3,
                                           "logprobs": None, "echo": False, "logit_bias": {},
                                           "temperature": None, "best_of": 1})
    assert r.status_code == 200, r.text
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "logit_bias": {"5": 1}})
    assert r.status_code == 400 and "logit_bias" in r.json()["error"]["message"]
    models = http.get("/v1/models").json()["data"][0]
    assert models["root"] == MODEL and models["max_model_len"] == MAX_LEN
    chunks = list(client.completions.create(
        model=MODEL, prompt="hello", max_tokens=5, temperature=0, stream=True,
        stream_options={"continuous_usage_stats": True, "include_usage": True}))
    counts = [c.usage.completion_tokens for c in chunks if c.choices and c.usage]
    assert counts and counts == sorted(counts) and counts[-1] == 5


def test_tokenize_detokenize_and_tokenizer_info(http, checkpoint):
    tok = strata_jax.load(checkpoint).tokenizer
    r = http.post("/tokenize", json={"model": MODEL, "prompt": "hello there"})
    ids = tok.encode("hello there")
    assert r.json() == {"count": len(ids), "max_model_len": MAX_LEN, "tokens": ids}
    r = http.post("/detokenize", json={"tokens": ids})
    assert r.json() == {"prompt": tok.decode(ids)}
    assert http.post("/detokenize", json={"tokens": [10**6]}).status_code == 400
    assert http.post("/tokenize", json={"model": "other", "prompt": "x"}).status_code == 404
    assert http.post("/tokenize", json={"model": MODEL}).status_code == 400
    info = http.get("/tokenizer_info").json()
    assert info["eos_token_ids"] == sorted(tok.eos_ids) and info["model_max_length"] == MAX_LEN
    assert info["chat_template"] == tok.chat_template


def test_api_key_is_enforced(server):
    base = server[1]
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        for path in ("/v1/models", "/metrics"):
            r = httpx2.get(base + path, headers=headers)
            assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
        r = httpx2.post(base + "/v1/completions", headers=headers, content=b"{")
        assert r.status_code == 401
    bad = openai.OpenAI(api_key="nope", base_url=base + "/v1", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL, prompt="hi")


def test_other_interfaces_need_an_api_key(checkpoint, monkeypatch, capsys):
    monkeypatch.delenv("STRATA_API_KEY", raising=False)
    assert server_main([str(checkpoint), "--host", "0.0.0.0"]) == 2
    assert "API key" in capsys.readouterr().err


def test_sigterm_drains_in_flight_requests_and_exits(client, server):
    proc, _, log = server
    started, chunks = threading.Event(), []

    def stream():
        for chunk in client.completions.create(model=MODEL, prompt="abc", stream=True, **LONG):
            chunks.append(chunk.choices[0])
            started.set()

    worker = threading.Thread(target=stream)
    worker.start()
    assert started.wait(30)
    proc.send_signal(signal.SIGTERM)
    worker.join(60)
    assert chunks[-1].finish_reason == "length"  # finished, not cut off
    assert proc.wait(60) == -signal.SIGTERM  # uvicorn re-raises the signal once shut down
    log.seek(0)
    assert "Traceback" not in log.read()
