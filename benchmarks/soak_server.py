"""Soak of `strata serve` (not a CI test): thousands of requests from concurrent clients.

Starts the real server (warm-up on) on a tiny synthetic checkpoint as a subprocess, then
`--concurrency` asyncio clients (httpx2) send `--requests` requests drawn at random:
completions and chats, streamed or not, prompts of random length (text or ids), random
`max_tokens`, greedy or sampled (temperature, top-p, top-k, min-p, repetition penalty, seed),
some with stop strings, some cancelled (a stream closed after a few chunks, or a client that
stops waiting), some malformed (bad JSON, bad fields, too long, too large, wrong model, wrong
key). Checks:

- every well-formed request is answered 200 with a consistent body (finish_reason, usage;
  `length` means exactly max_tokens), every malformed one with its 4xx and an error body;
- repeats agree: every answer to the same greedy or seeded request is the same text, whatever
  shared its batch and whether it was streamed;
- the server's resident memory (VmRSS from /proc) is flat after the first fifth of the run;
- nothing compiles after warm-up (the server's `strata_xla_compiles_total` does not move);
- at the end no row is active and nothing is queued.

Reports p50 / p99 latency (whole request; first token of streams), tok/s, and writes
markdown (machine, date, commit): `python -m benchmarks.soak_server --out benchmarks/results`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import httpx2
import numpy as np

KEY = "soak-key"
MODEL = "tiny"
WORDS = ("the", "expert", "router", "token", "cache", "tier", "ß", "é", "漢字", "🙂", "moe",
         "layer", "batch", "row", "stream", "4096", "\n")


@dataclass(kw_only=True)
class Tally:
    """What the clients saw."""

    by_kind: Counter = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    first_token: list[float] = field(default_factory=list)
    tokens: int = 0
    cancels: int = 0
    answers: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    answered: Counter = field(default_factory=Counter)
    done: int = 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_checkpoint(folder: Path) -> Path:
    from strata_jax.tools.synth import synthesize

    path = folder / MODEL
    synthesize("tiny", path, progress=False)  # with its byte-level tokenizer
    return path


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def metrics(text: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            label = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[s.name + (f"{{{label}}}" if label else "")] = s.value
    return out


# --- the requests -------------------------------------------------------------------------------


def random_text(rng: random.Random, max_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, max_words)))


def sampling(rng: random.Random, seeded_pool: list[int]) -> dict:
    if rng.random() < 0.4:
        return {"temperature": 0}
    out = {"temperature": round(rng.uniform(0.3, 1.5), 2), "seed": rng.choice(seeded_pool)}
    if rng.random() < 0.5:
        out["top_p"] = round(rng.uniform(0.5, 1.0), 2)
    if rng.random() < 0.4:
        out["top_k"] = rng.randint(1, 64)
    if rng.random() < 0.3:
        out["min_p"] = round(rng.uniform(0.0, 0.2), 3)
    if rng.random() < 0.3:
        out["repetition_penalty"] = round(rng.uniform(1.0, 1.5), 2)
    return out


def well_formed(rng: random.Random, max_len: int, repeats: list[dict]) -> dict:
    """A valid request: a repeat of a fixed one (to compare answers) or a fresh one."""
    if rng.random() < 0.3:
        return dict(rng.choice(repeats), stream=rng.random() < 0.5)
    chat = rng.random() < 0.3
    body: dict = {"model": MODEL, "max_tokens": rng.randint(1, 64), "stream": rng.random() < 0.5,
                  **sampling(rng, list(range(1000)))}
    if chat:
        body["messages"] = [{"role": "user", "content": random_text(rng, 12)}]
    elif rng.random() < 0.2:
        body["prompt"] = [rng.randrange(3, 512) for _ in range(rng.randint(1, max_len // 2))]
    else:  # words are at most 7 bytes (byte tokens) with their space
        body["prompt"] = random_text(rng, (max_len - 64 - 8) // 7)
    if rng.random() < 0.15:
        body["stop"] = [rng.choice(("<", "e", "res", "\n", "漢"))]
    if rng.random() < 0.2:
        body["ignore_eos"] = True
    return body


def repeat_pool(rng: random.Random) -> list[dict]:
    """Fixed requests sent many times: their answers must all agree."""
    pool = []
    for i in range(24):
        body = {"model": MODEL, "prompt": random_text(rng, 8), "max_tokens": rng.randint(4, 48),
                **sampling(rng, [7, 11, 13])}
        if i % 3 == 0:
            prompt = body.pop("prompt")
            body["messages"] = [{"role": "user", "content": prompt}]
        pool.append(body)
    return pool


def malformed(rng: random.Random, max_len: int) -> tuple[str, dict | bytes, int, dict]:
    """(endpoint, body, expected status, extra headers)."""
    ok = {"model": MODEL, "prompt": "hi"}
    cases = [
        ("/v1/completions", b"{not json", 400, {}),
        ("/v1/completions", {**ok, "n": 2}, 400, {}),
        ("/v1/completions", {**ok, "temperature": -1}, 400, {}),
        ("/v1/completions", {**ok, "top_p": 0}, 400, {}),
        ("/v1/completions", {**ok, "bogus_field": 1}, 400, {}),
        ("/v1/completions", {**ok, "max_tokens": max_len}, 400, {}),
        ("/v1/completions", {**ok, "prompt": "x" * (max_len + 5)}, 400, {}),
        ("/v1/completions", {**ok, "prompt": [1, 99999]}, 400, {}),
        ("/v1/completions", {**ok, "prompt": []}, 400, {}),
        ("/v1/completions", {**ok, "model": "nope"}, 404, {}),
        ("/v1/completions", b"x" * (2 << 20), 413, {}),
        ("/v1/completions", ok, 401, {"Authorization": "Bearer wrong"}),
        ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, {}),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "x", "content": ""}]},
         400, {}),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user"}],
                                  "logprobs": True}, 400, {}),
    ]
    return rng.choice(cases)


def endpoint(body: dict) -> str:
    return "/v1/chat/completions" if "messages" in body else "/v1/completions"


def identity(body: dict) -> str | None:
    """Requests whose answers must agree: greedy or seeded, the same fields but `stream`."""
    if body.get("temperature", 1.0) != 0 and "seed" not in body:
        return None
    return json.dumps({k: v for k, v in body.items() if k != "stream"}, sort_keys=True)


async def run_well_formed(http: httpx2.AsyncClient, body: dict, tally: Tally,
                          cancel_after: int | None) -> None:
    t0 = time.perf_counter()
    if body["stream"]:
        text, finish, count = await stream_request(http, body, tally, t0, cancel_after)
    else:
        post = http.post(endpoint(body), json=body)
        try:  # with cancel_after, a client that stops waiting after 20 ms
            r = await (post if cancel_after is None else asyncio.wait_for(post, timeout=0.02))
        except TimeoutError:
            tally.cancels += 1
            tally.by_kind["cancelled"] += 1
            return
        if r.status_code != 200:
            tally.failures.append(f"{r.status_code} for a well-formed request: {r.text[:200]}")
            return
        out = r.json()
        choice = out["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        finish, count = choice["finish_reason"], out["usage"]["completion_tokens"]
    if text is None:  # cancelled
        return
    tally.latencies.append(time.perf_counter() - t0)
    tally.tokens += count or 0
    tally.by_kind["ok"] += 1
    check_answer(body, text, finish, count, tally)


async def stream_request(http, body, tally, t0, cancel_after):
    text, finish, count, chunks = "", None, None, 0
    body = {**body, "stream_options": {"include_usage": True}}
    async with http.stream("POST", endpoint(body), json=body) as r:
        if r.status_code != 200:
            tally.failures.append(f"{r.status_code} for a well-formed stream: "
                                  f"{(await r.aread())[:200]!r}")
            return None, None, None
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                tally.failures.append(f"stream error: {event['error']}")
                return None, None, None
            if event.get("usage"):
                count = event["usage"]["completion_tokens"]
            for choice in event["choices"]:
                if chunks == 0:
                    tally.first_token.append(time.perf_counter() - t0)
                chunks += 1
                piece = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                text += piece
                finish = choice["finish_reason"] or finish
            if cancel_after is not None and chunks >= cancel_after:
                tally.cancels += 1
                tally.by_kind["cancelled"] += 1
                return None, None, None  # leaving the block closes the connection
    return text, finish, count


def check_answer(body: dict, text: str, finish: str | None, count: int | None,
                 tally: Tally) -> None:
    limit = body["max_tokens"]
    if finish not in ("stop", "length") or count is None or not 1 <= count <= limit:
        tally.failures.append(f"inconsistent answer {finish!r}, {count} tokens of {limit}")
    elif finish == "length" and count != limit:
        tally.failures.append(f"length after {count} of {limit} tokens")
    elif body.get("ignore_eos") and not body.get("stop") and finish != "length":
        tally.failures.append("ignore_eos request stopped early")
    for stop in body.get("stop") or ():
        if stop in text:
            tally.failures.append(f"stop string {stop!r} in the answer")
    key = identity(body)
    if key is not None:
        tally.answers[key].add(text)
        tally.answered[key] += 1


async def run_malformed(http: httpx2.AsyncClient, rng: random.Random, max_len: int,
                        tally: Tally) -> None:
    path, body, status, headers = malformed(rng, max_len)
    if isinstance(body, bytes):
        r = await http.post(path, content=body, headers={"content-type": "application/json",
                                                          **headers})
    else:
        r = await http.post(path, json=body, headers=headers)
    tally.by_kind["malformed"] += 1
    if r.status_code != status or "message" not in r.json().get("error", {}):
        tally.failures.append(f"malformed {path} {str(body)[:80]}: {r.status_code} "
                              f"(expected {status}) {r.text[:200]}")


async def client(worker: int, http, args, repeats, tally: Tally, todo: asyncio.Queue) -> None:
    rng = random.Random(args.seed * 1000 + worker)
    while True:
        try:
            todo.get_nowait()
        except asyncio.QueueEmpty:
            return
        roll = rng.random()
        try:
            if roll < args.malformed:
                await run_malformed(http, rng, args.max_len, tally)
            else:
                cancel = rng.randint(1, 4) if roll < args.malformed + args.cancel else None
                await run_well_formed(http, well_formed(rng, args.max_len, repeats), tally,
                                      cancel)
        except Exception as e:  # noqa: BLE001  (a failure of the server is a finding)
            tally.failures.append(f"{type(e).__name__}: {e}")
        tally.done += 1


async def sample_rss(pid: int, tally: Tally, samples: list, stop: asyncio.Event) -> None:
    while not stop.is_set():
        samples.append((tally.done, rss_mib(pid)))
        try:
            await asyncio.wait_for(stop.wait(), 1.0)
        except TimeoutError:
            pass


async def soak(args, base: str, pid: int) -> dict:
    headers = {"Authorization": f"Bearer {KEY}"}
    limits = httpx2.Limits(max_connections=args.concurrency + 4)
    async with httpx2.AsyncClient(base_url=base, headers=headers, limits=limits,
                                  timeout=300) as http:
        before = metrics((await http.get("/metrics")).text)
        tally, samples, stop = Tally(), [], asyncio.Event()
        todo: asyncio.Queue = asyncio.Queue()
        for i in range(args.requests):
            todo.put_nowait(i)
        repeats = repeat_pool(random.Random(args.seed))
        sampler = asyncio.create_task(sample_rss(pid, tally, samples, stop))
        t0 = time.perf_counter()
        await asyncio.gather(*(client(w, http, args, repeats, tally, todo)
                               for w in range(args.concurrency)))
        wall = time.perf_counter() - t0
        await asyncio.sleep(1.0)  # cancellations reach the engine thread
        after = metrics((await http.get("/metrics")).text)
        stop.set()
        await sampler
    samples.append((tally.done, rss_mib(pid)))
    return {"tally": tally, "wall": wall, "before": before, "after": after, "rss": samples}


# --- report -------------------------------------------------------------------------------------


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) * 1e3 if values else float("nan")


def judge(result: dict, args) -> list[tuple[str, bool, str]]:
    tally, before, after, rss = (result["tally"], result["before"], result["after"],
                                 result["rss"])
    settle = next(r for d, r in rss if d >= args.requests // 5) if rss else 0.0
    end = rss[-1][1]
    later = [(d, r) for d, r in rss if d >= args.requests // 5]
    slope = (np.polyfit([d for d, _ in later], [r for _, r in later], 1)[0] * 1000
             if len({d for d, _ in later}) > 2 else 0.0)
    compiles = after["strata_xla_compiles_total"] - before["strata_xla_compiles_total"]
    disagree = [k for k, v in tally.answers.items() if len(v) > 1]
    repeated = [k for k, n in tally.answered.items() if n > 1]
    answers = sum(tally.answered[k] for k in repeated)
    return [
        ("every request answered as expected", not tally.failures,
         f"{len(tally.failures)} failures" + (f"; first: {tally.failures[0]}"
                                              if tally.failures else "")),
        ("repeated greedy / seeded requests agree", not disagree,
         f"{len(repeated)} greedy / seeded requests answered more than once ({answers} "
         f"answers, streamed or not, in different batches): {len(disagree)} disagree"),
        ("host RSS flat after the first fifth", end - settle < args.rss_slack_mib
         and slope < args.rss_slack_mib / 4,
         f"{settle:.0f} MiB at {args.requests // 5} requests -> {end:.0f} MiB at the end "
         f"(max {max(r for _, r in rss):.0f}); fit {slope:+.2f} MiB per 1000 requests"),
        ("nothing compiles after warm-up", compiles == 0,
         f"{compiles:.0f} XLA compilations during the soak "
         f"({before['strata_xla_compiles_total']:.0f} at warm-up)"),
        ("idle at the end", after["strata_active_rows"] == 0 and after["strata_queue_depth"] == 0,
         f"active rows {after['strata_active_rows']:.0f}, queued "
         f"{after['strata_queue_depth']:.0f}"),
    ]


def commit(given: str | None) -> str:
    if given:
        return given
    root = Path(__file__).resolve().parent.parent
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                         text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                           capture_output=True, text=True).stdout.strip()
    return sha + (" (working tree modified)" if dirty else "")


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def report(result: dict, args, checks) -> str:
    import jax

    tally, after, before = result["tally"], result["after"], result["before"]
    wall = result["wall"]
    served = after.get("strata_requests_total{state=finished}", 0) - before.get(
        "strata_requests_total{state=finished}", 0)
    cancelled = after.get("strata_requests_total{state=cancelled}", 0) - before.get(
        "strata_requests_total{state=cancelled}", 0)
    generated = (after["strata_generated_tokens_total"]
                 - before["strata_generated_tokens_total"])
    lines = [
        f"# Server soak (`benchmarks/soak_server.py`), {time.strftime('%Y-%m-%d')}",
        "",
        f"Machine: {cpu_name()}, {os.cpu_count()} cores (shared with other work), CPU only "
        f"(JAX {jax.__version__}); commit {commit(args.commit)}.",
        f"Server: `python -m strata_runtime.cli.serve` on a synthetic `tiny` checkpoint "
        f"(byte-level tokenizer), `--batch-capacity {args.batch_capacity} --max-len "
        f"{args.max_len} --max-queue {args.max_queue}`, warm-up on, an API key.",
        f"Clients: {args.concurrency} concurrent asyncio clients (httpx2), {args.requests} "
        f"requests, seed {args.seed}: {args.malformed:.0%} malformed, {args.cancel:.0%} "
        "cancelled (a stream closed after 1-4 chunks, or a non-streamed request abandoned "
        "after 20 ms), the rest completions / chats, streamed or not, greedy or sampled, "
        "some with stop strings or ignore_eos; 30% of the well-formed ones repeat 24 fixed "
        "greedy / seeded requests. Latencies include the wait for a row "
        f"({args.concurrency} clients, {args.batch_capacity} rows).",
        "",
        "| check | result | detail |",
        "|---|---|---|",
        *[f"| {name} | {'PASS' if ok else 'FAIL'} | {detail} |" for name, ok, detail in checks],
        "",
        "| figure | value |",
        "|---|---|",
        f"| wall | {wall:.1f} s |",
        f"| requests by outcome (client) | {dict(tally.by_kind)} |",
        f"| server: finished / cancelled | {served:.0f} / {cancelled:.0f} (clients cancelled "
        f"{tally.cancels}; a cancel after the request finished counts as finished) |",
        f"| latency of answered requests p50 / p99 | {pct(tally.latencies, 50):.0f} / "
        f"{pct(tally.latencies, 99):.0f} ms |",
        f"| first token of streams p50 / p99 | {pct(tally.first_token, 50):.0f} / "
        f"{pct(tally.first_token, 99):.0f} ms |",
        f"| tokens answered (usage) / generated (server) | {tally.tokens} / {generated:.0f} |",
        f"| tok/s (answered tokens / wall) | {tally.tokens / wall:.1f} |",
        f"| server decode tok/s (step time only) | "
        f"{after.get('strata_decode_tokens_per_second', float('nan')):.1f} |",
        f"| step p50 / p99 | {after.get('strata_step_seconds{quantile=0.5}', 0) * 1e3:.2f} / "
        f"{after.get('strata_step_seconds{quantile=0.99}', 0) * 1e3:.2f} ms |",
        "",
        "RSS samples (requests done, MiB): "
        + ", ".join(f"{d}: {r:.0f}" for d, r in result["rss"][:: max(1, len(result["rss"]) // 12)]),
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt", default=None, help="default: synthesize tiny into a temp dir")
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=24)
    parser.add_argument("--batch-capacity", type=int, default=8)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--max-queue", type=int, default=32)
    parser.add_argument("--malformed", type=float, default=0.1)
    parser.add_argument("--cancel", type=float, default=0.1)
    parser.add_argument("--rss-slack-mib", type=float, default=32.0,
                        help="largest RSS growth after the first fifth counted as flat")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="folder for soak_server.md")
    parser.add_argument("--commit", default=None,
                        help="the commit measured, when run from an exported tree (git archive)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(args.ckpt) if args.ckpt else make_checkpoint(Path(tmp))
        port = free_port()
        log = open(Path(tmp) / "server.log", "w+")  # noqa: SIM115
        proc = subprocess.Popen(
            [sys.executable, "-m", "strata_runtime.cli.serve", str(ckpt), "--port", str(port),
             "--batch-capacity", str(args.batch_capacity), "--max-len", str(args.max_len),
             "--max-queue", str(args.max_queue), "--log-level", "warning"],
            stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, STRATA_API_KEY=KEY))
        base = f"http://127.0.0.1:{port}"
        try:
            wait_ready(base, proc, log)
            result = asyncio.run(soak(args, base, proc.pid))
        finally:
            proc.terminate()
            proc.wait(60)
            log.seek(0)
            server_log = log.read()
    checks = judge(result, args)
    text = report(result, args, checks)
    if "Traceback" in server_log:
        text += "\nServer log had a traceback:\n\n```\n" + server_log[-4000:] + "\n```\n"
    print(text)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "soak_server.md").write_text(text)
    return 0 if all(ok for _, ok, _ in checks) else 1


def wait_ready(base: str, proc: subprocess.Popen, log) -> None:
    deadline = time.monotonic() + 600
    while True:
        try:
            if httpx2.get(base + "/health", timeout=1).status_code == 200:
                return
        except httpx2.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            log.seek(0)
            raise RuntimeError(f"the server did not start:\n{log.read()}")
        time.sleep(0.5)


if __name__ == "__main__":
    sys.exit(main())
