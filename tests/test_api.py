"""The resident API takes text or ids: text goes through the checkpoint's tokenizer, stops at
its end-of-sequence ids and is cut at stop strings."""

import numpy as np
import pytest

import strata_jax
from strata_jax.sampling import SamplingParams
from strata_jax.synth import synthesize
from strata_jax.tokenizer import load_tokenizer
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
