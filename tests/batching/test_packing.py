"""Packed prefill: which chunks share a program, and that packing changes no token."""

import pytest

import strata_jax
from strata_jax.batching import packing
from strata_jax.batching.packing import Admission, Piece, pack
from strata_jax.batching.resident import ResidentEngine
from strata_jax.batching.scheduler import Scheduler
from strata_jax.step.sampling import GREEDY, SamplingParams
from tests.helpers import random_model, tiny_config


def test_every_chunk_runs_once_after_its_prompts_earlier_chunks():
    lengths, chunk = [70, 5, 33, 16, 1, 64], 32
    programs = pack(lengths, chunk, max_rows=4)
    seen: dict[int, list[Piece]] = {}
    for p in programs:
        assert p.rows & (p.rows - 1) == 0 and p.tokens & (p.tokens - 1) == 0
        assert len(p.pieces) <= p.rows <= 4 and p.rows * p.tokens <= chunk
        assert all(piece.count <= p.tokens for piece in p.pieces)
        assert len({piece.prompt for piece in p.pieces}) == len(p.pieces)
        for piece in p.pieces:
            seen.setdefault(piece.prompt, []).append(piece)
    for i, n in enumerate(lengths):  # the prompt whole, its chunks in order
        pieces = seen[i]
        assert [q.start for q in pieces] == list(range(0, n, chunk))
        assert sum(q.count for q in pieces) == n
    assert len(programs) < sum(len(v) for v in seen.values())  # the short chunks share


def test_one_row_a_program_keeps_every_chunk_alone():
    programs = pack([40, 9, 3], 16, max_rows=1)
    assert all(p.rows == 1 and len(p.pieces) == 1 for p in programs)
    assert [p.tokens for p in programs] == [16, 16, 8, 16, 8]  # round by round
    with pytest.raises(ValueError, match="max_rows"):
        pack([3], 16, max_rows=0)


def test_shapes_cover_every_program_pack_gives():
    shapes = set(packing.shapes(64, 6))
    for lengths in ([1] * 9, [64, 64, 3], [17, 9, 30, 2, 8, 5], [200]):
        for p in pack(lengths, 64, 6):
            assert (p.rows, p.tokens) in shapes


@pytest.fixture(scope="module")
def model():
    return random_model(tiny_config("qwen3_moe"), seed=4)


PROMPTS = [[(3 * i + 1) % 97 for i in range(n)] for n in (37, 6, 12, 1, 20)]


def test_packed_prefill_gives_the_tokens_of_each_prompt_alone(model):
    shape = {"batch_capacity": 8, "max_len": 64, "prefill_chunk": 16}
    alone = strata_jax.generate(model, PROMPTS, 5, prefill_rows=1, **shape)
    packed = strata_jax.generate(model, PROMPTS, 5, **shape)
    assert packed == alone


def test_a_prefill_call_runs_the_packed_programs_and_returns_each_rows_token(model):
    engine = ResidentEngine(model, 8, 64, prefill_chunk=32)
    calls = []
    run = engine._prefill

    def counting(*args, **kw):
        calls.append(args[7].shape)  # the program's tokens [R, T]
        return run(*args, **kw)

    engine._prefill = counting
    results = engine.prefill([Admission(i, p) for i, p in enumerate(PROMPTS)])
    # round 0, longest first: 32 (prompt 0) and 20 alone (a 32-token bucket fills the chunk),
    # 12 and 6 in 2 x 16, 1 in 1 x 8; round 1: prompt 0's tail of 5
    assert calls == [(1, 32), (1, 32), (2, 16), (1, 8), (1, 8)]
    assert [r.error for r in results] == [None] * len(PROMPTS)
    fresh = ResidentEngine(model, 8, 64, prefill_chunk=32, prefill_rows=1)
    alone = [fresh.prefill([Admission(i, p)])[0] for i, p in enumerate(PROMPTS)]
    assert results == alone


def test_running_rows_ride_along_prefill_and_keep_their_tokens(model):
    """Requests join while others run, in prompts of several chunks: the running rows take
    their decode steps inside the prefill programs, and every request's tokens (greedy and
    seeded sampled) are those it gets alone."""
    sampled = SamplingParams(temperature=0.9, top_k=10, seed=7)
    settings = [GREEDY, sampled, GREEDY, sampled, GREEDY]
    shape = {"batch_capacity": 4, "max_len": 64, "prefill_chunk": 16}
    alone = [strata_jax.generate(model, [p], 9, sampling=s, prefill_rows=1, **shape)[0]
             for p, s in zip(PROMPTS, settings, strict=True)]
    engine = ResidentEngine(model, 4, 64, prefill_chunk=16)
    rides: list[tuple[dict[int, int], list[int]]] = []
    prefill = engine.prefill

    def watched(admissions, ride=None):
        def spy(tokens, failed):
            rows = ride(tokens, failed)
            rides.append((dict(tokens), list(rows)))
            return rows
        return prefill(admissions, spy)

    engine.prefill = watched
    sched = Scheduler(engine)
    reqs = [sched.submit(PROMPTS[1], 9, settings[1])]
    for i in (0, 2, 3, 4):  # each joins two steps after the last, the others running
        sched.step()
        sched.step()
        reqs.insert(i, sched.submit(PROMPTS[i], 9, settings[i]))
    sched.run()
    assert [r.tokens for r in reqs] == alone
    took = [t for t, _ in rides if t]
    assert len(took) >= 4 and sum(map(len, took)) > len(took)  # several rows, several times
