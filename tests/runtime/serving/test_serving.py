"""The engine loop in-process: requests relayed as the engine runs them, a step that raises
fails the requests in flight (and only them) with its message, shutdown refuses new ones."""

import asyncio

import pytest

from strata_runtime.engine.config import EngineConfig
from strata_runtime.engine.offload import Engine
from strata_runtime.serving.loop import EngineLoop, QueueFull, ShuttingDown
from tests.helpers import tiny_config, write_checkpoint

PROMPTS = [[5, 6, 7], [1, 2, 3, 4], [42, 8]]


class FaultyEngine(Engine):
    """A real engine whose next step raises when told to (fault injection)."""

    fail_next = False

    def step(self):
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("injected fault")
        return super().step()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("serving") / "ck"
    write_checkpoint(tiny_config("mixtral"), path, seed=3)
    return path


async def collect(stream) -> tuple[list[int], str | None]:
    tokens, error = [], None
    async for update in stream:
        tokens += update.tokens
        error = update.error
    return tokens, error


def test_requests_faults_and_shutdown(ckpt):
    config = EngineConfig(batch_capacity=2, max_len=64)
    reference = Engine.from_checkpoint(ckpt, config).generate(PROMPTS, 6)
    engine = FaultyEngine.from_checkpoint(ckpt, config)
    loop = EngineLoop(engine, max_queue=1)

    async def run():
        loop.start()
        results = await asyncio.gather(*(collect(loop.submit(p, 6)) for p in PROMPTS))
        assert results == [(r, None) for r in reference]  # 2 rows + 1 waiting: all served
        engine.fail_next = True  # prefilled, then its first decode step raises
        failed = await collect(loop.submit(PROMPTS[0], 6))
        assert failed == (reference[0][:1], "engine error: RuntimeError: injected fault")
        assert await collect(loop.submit(PROMPTS[1], 6)) == (reference[1], None)  # goes on
        streams = [loop.submit(p, 50) for p in PROMPTS]
        with pytest.raises(QueueFull):
            loop.submit(PROMPTS[0], 6)
        loop.cancel(streams[0])
        await asyncio.gather(*(collect(s) for s in streams))
        snap = await asyncio.wrap_future(loop.snapshot())
        assert snap.active_rows == 0 and snap.queue_depth == 0
        assert snap.counters.engine_errors == 1 and snap.counters.cancelled == 1
        await asyncio.to_thread(loop.shutdown, 5.0)
        with pytest.raises(ShuttingDown):
            loop.submit(PROMPTS[0], 6)

    asyncio.run(run())
    assert not loop.alive


def test_the_loop_relays_tokens_and_their_scores_over_the_fake_engine():
    """Eight clients at once on three rows of the fake engine: each stream's tokens are the fake
    model's, and a stream that asked for log-probabilities gets one per token, in order."""
    from strata_jax.batching import fake
    from strata_jax.batching.fake import FakeEngine

    cfg = tiny_config("olmoe")
    loop = EngineLoop(FakeEngine(cfg, capacity=3, max_len=48), max_queue=8)
    prompts = [[i + 1, 2 * i + 3] for i in range(8)]

    async def relay(prompt, scored):
        tokens, logps = [], []
        async for update in loop.submit(prompt, 7, logprobs=scored):
            tokens += update.tokens
            logps += [s.logprob for s in update.logprobs]
            assert len(update.logprobs) == (len(update.tokens) if scored else 0)
        return tokens, logps

    async def run():
        loop.start()
        out = await asyncio.gather(*(relay(p, i % 2 == 1) for i, p in enumerate(prompts)))
        await asyncio.to_thread(loop.shutdown, 5.0)
        return out

    for i, (prompt, (tokens, logps)) in enumerate(zip(prompts, asyncio.run(run()), strict=True)):
        seq, want = list(prompt), []
        for _ in range(7):
            want.append(fake.next_token(seq, cfg.vocab_size))
            if i % 2:
                lp = fake.log_softmax(fake.logits(seq, cfg.vocab_size))[want[-1]]
                assert logps[len(want) - 1] == pytest.approx(float(lp), abs=1e-5)
            seq.append(want[-1])
        assert tokens == want
