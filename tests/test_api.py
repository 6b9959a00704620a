"""The resident API takes text or ids: text goes through the checkpoint's tokenizer, stops at
its end-of-sequence ids and is cut at stop strings."""

import numpy as np
import pytest

import strata_jax
from strata_jax.formats.tokenizer import load_tokenizer
from strata_jax.step.sampling import SamplingParams
from strata_jax.tools.synth import synthesize
from tests.helpers import tiny_config, write_checkpoint

SHAPE = {"batch_capacity": 2, "max_len": 64}


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    path = tmp_path_factory.mktemp("api") / "tiny"
    synthesize("tiny", path, seed=2, dtype="float32", progress=False)
    return strata_jax.load(path), load_tokenizer(path)


def test_text_prompts_give_the_decoded_continuation_of_their_ids(synthetic):
    model, tok = synthetic
    texts = ["Four score", "and seven years"]
    ids = [tok.encode(t) for t in texts]
    new = strata_jax.generate(model, ids, 12, **SHAPE,
                              sampling=SamplingParams(stop_ids=tok.eos_ids))
    assert strata_jax.generate(model, texts, 12, **SHAPE) == [tok.decode(o) for o in new]
    raw = strata_jax.generate(model, ids, 12, **SHAPE)
    assert strata_jax.generate(model, texts, 12, ignore_eos=True, **SHAPE) == [
        tok.decode(o) for o in raw]


def test_stop_strings_cut_the_text(synthetic):
    model, tok = synthetic
    full = strata_jax.generate(model, ["abc"], 16, ignore_eos=True, **SHAPE)[0]
    visible = [c for c in full[2:] if c.isprintable()]
    if not visible:
        pytest.skip("the continuation has no printable character to stop at")
    stop = visible[0]
    cut = strata_jax.generate(model, ["abc"], 16, ignore_eos=True, **SHAPE,
                              sampling=SamplingParams(stop=(stop, "never-there")))[0]
    assert cut == full[: full.index(stop)]


def test_mixed_prompts_and_missing_tokenizer_are_refused(synthetic, tmp_path):
    model, _ = synthetic
    with pytest.raises(ValueError, match="every prompt as text or every prompt as token ids"):
        strata_jax.generate(model, ["hi", [1, 2]], 4, **SHAPE)
    with pytest.raises(ValueError, match="chat=True needs text prompts"):
        strata_jax.generate(model, [[1, 2]], 4, chat=True, **SHAPE)
    write_checkpoint(tiny_config("mixtral"), tmp_path / "bare", seed=1)
    bare = strata_jax.load(tmp_path / "bare")
    assert bare.tokenizer is None
    with pytest.raises(ValueError, match="no tokenizer; pass ids"):
        strata_jax.generate(bare, ["hi"], 4, **SHAPE)
    assert np.asarray(strata_jax.generate(bare, [[1, 2]], 4, **SHAPE)).shape == (1, 4)


def test_stop_strings_stop_generation_of_id_prompts_too(synthetic):
    model, tok = synthetic
    ids = [tok.encode("Four score")]
    full = strata_jax.generate(model, ids, 16, **SHAPE)[0]
    text = tok.decode(full)
    stop = next((c for c in text[1:] if c.isascii() and c.isalnum()), None)
    if stop is None:
        pytest.skip("the continuation has no ASCII letter to stop at")
    ends = next(n for n in range(1, len(full) + 1) if stop in tok.decode(full[:n]))
    got = strata_jax.generate(model, ids, 16, sampling=SamplingParams(stop=(stop,)), **SHAPE)
    assert got == [full[:ends]] and ends < len(full)


def test_prompts_given_the_wrong_way_are_refused_or_taken(synthetic, tmp_path):
    model, _ = synthetic
    with pytest.raises(TypeError, match="got one string: pass \\[prompt\\]"):
        strata_jax.generate(model, "hello", 4, **SHAPE)
    with pytest.raises(ValueError, match="request 1: token ids must be integers, got float64"):
        strata_jax.generate(model, [[1, 2], [3.5, 4.0]], 4, **SHAPE)
    with pytest.raises(ValueError, match=r"\[batch, time\] ids, got \(3,\)"):
        strata_jax.generate(model, np.array([1, 2, 3]), 4, **SHAPE)
    lists = strata_jax.generate(model, [[1, 2, 3], [4, 5, 6]], 4, **SHAPE)
    assert strata_jax.generate(model, np.array([[1, 2, 3], [4, 5, 6]]), 4, **SHAPE) == lists
    assert strata_jax.generate(model, [np.array([1, 2, 3], np.int64), (4, 5, 6)], 4,
                               **SHAPE) == lists
    write_checkpoint(tiny_config("mixtral"), tmp_path / "bare", seed=1)
    with pytest.raises(ValueError, match="request 0: stop strings \\['x'\\] need a tokenizer"):
        strata_jax.generate(strata_jax.load(tmp_path / "bare"), [[1, 2]], 4,
                            sampling=SamplingParams(stop=("x",)), **SHAPE)
