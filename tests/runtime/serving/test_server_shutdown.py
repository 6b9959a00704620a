"""SIGTERM past `--drain-seconds`: every request in flight ends with a well-formed answer
(finish_reason "abort", a stream's last chunk and [DONE]) and the log has no traceback."""

import signal
import threading
import time

import httpx2
import openai
import pytest

from strata_jax.tools.synth import synthesize
from tests.runtime.served import start_server

MAX_LEN = 8192  # long enough to outlast the drain on a fast CPU
LONG = {"max_tokens": MAX_LEN - 8, "temperature": 0, "extra_body": {"ignore_eos": True}}


def test_requests_past_the_drain_end_with_abort(tmp_path):
    synthesize("tiny", tmp_path / "tiny", progress=False)
    log = open(tmp_path / "server.log", "w+")  # noqa: SIM115
    proc, base = start_server(tmp_path / "tiny", ["--batch-capacity", "2", "--max-len",
                                                  str(MAX_LEN), "--drain-seconds", "1"], log)
    client = openai.OpenAI(api_key="x", base_url=base + "/v1", max_retries=0, timeout=120)
    started, chunks, whole = threading.Event(), [], {}

    def stream():
        for chunk in client.completions.create(model="tiny", prompt="abc", stream=True, **LONG):
            chunks.append(chunk.choices[0])
            started.set()

    def plain():
        whole["out"] = client.completions.create(model="tiny", prompt="xyz", **LONG)

    workers = [threading.Thread(target=stream), threading.Thread(target=plain)]
    for w in workers:
        w.start()
    assert started.wait(60)
    time.sleep(0.5)  # the plain request is generating too
    proc.send_signal(signal.SIGTERM)
    for w in workers:
        w.join(90)
    try:
        assert chunks[-1].finish_reason == "abort"  # the stream's last chunk, then [DONE]
        out = whole["out"].choices[0]
        assert out.finish_reason == "abort" and 0 < whole["out"].usage.completion_tokens < (
            MAX_LEN - 8)
        assert proc.wait(60) == -signal.SIGTERM
        log.seek(0)
        text = log.read()
        assert "Traceback" not in text, text
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    with pytest.raises(httpx2.TransportError):
        httpx2.get(f"{base}/health", timeout=1)
