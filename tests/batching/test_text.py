"""TextStream against decoding the whole sequence at once, on real `tokenizers` tokenizers
(byte-level BPE: characters split over tokens; Metaspace: a decode that depends on what came
before)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from strata_jax.batching.text import TextStream, cut_at_stop, first_stop, stop_prefix


@pytest.fixture(scope="module")
def byte_level() -> Tokenizer:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE({c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["</s>"])
    return tok


@pytest.fixture(scope="module")
def metaspace() -> Tokenizer:
    words = ["<unk>", "▁hello", "▁world", "hello", ",", "▁", "▁the", "re", "</s>"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.decoder = decoders.Metaspace()
    tok.add_special_tokens(["</s>"])
    return tok


def stream_all(tok, ids, stop=(), context=()) -> tuple[list[str], TextStream]:
    stream = TextStream(tok, stop, context=context)
    deltas = [stream.push(t) for t in ids]
    return deltas + [stream.finish()], stream


TEXT = st.text(st.sampled_from("ab c\né🙂漢\t"), max_size=24)


@settings(max_examples=150, deadline=None)
@given(text=TEXT)
def test_byte_level_deltas_are_the_whole_decode_and_whole_characters(byte_level, text):
    ids = byte_level.encode(text).ids
    deltas, stream = stream_all(byte_level, ids)
    assert "".join(deltas) == stream.text == byte_level.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)


def test_a_character_is_emitted_as_soon_as_its_last_byte_arrives(byte_level):
    stream = TextStream(byte_level)
    emitted = ""
    for ch in "a🙂b":
        ids = byte_level.encode(ch).ids
        emitted += "".join(stream.push(t) for t in ids[:-1])
        assert emitted == stream.text and ch not in emitted
        emitted += stream.push(ids[-1])
        assert emitted.endswith(ch)


def test_an_invalid_byte_decodes_as_the_whole_sequence_does(byte_level):
    ids = byte_level.encode("x🙂").ids[:-1]  # the emoji's last byte is missing
    deltas, _ = stream_all(byte_level, ids)
    assert "".join(deltas) == byte_level.decode(ids) == "x\ufffd"


def test_a_prefix_dependent_decode_matches_the_whole_decode(metaspace):
    vocab = metaspace.get_vocab()
    ids = [vocab[w] for w in ["▁hello", ",", "▁world", "▁the", "re", "</s>"]]
    deltas, _ = stream_all(metaspace, ids)
    assert "".join(deltas) == metaspace.decode(ids) == "hello, world there"
    assert deltas[0] == "hello"  # not " hello": the first word's space is dropped
    after, _ = stream_all(metaspace, ids[2:4], context=ids[:2])
    assert "".join(after) == " world the"  # the context keeps the space


@settings(max_examples=150, deadline=None)
@given(text=TEXT, stop=st.text(st.sampled_from("ab é🙂"), min_size=1, max_size=3))
def test_stop_string_cuts_the_text_before_it(byte_level, text, stop):
    ids = byte_level.encode(text).ids
    stream = TextStream(byte_level, (stop,))
    deltas = []
    for i, t in enumerate(ids):
        deltas.append(stream.push(t))
        if stream.finished:
            assert stop in byte_level.decode(ids[: i + 1])  # finished at the first chance
            assert stop not in byte_level.decode(ids[:i])
            break
    deltas.append(stream.finish())
    cut = text.find(stop)
    assert "".join(deltas) == stream.text == (text if cut < 0 else text[:cut])
    assert stream.text == cut_at_stop(text, (stop,))  # the streamed cut is the one-shot cut
    assert stream.finished


def test_the_earliest_stop_string_cuts_text_decoded_at_once():
    stops = ("three", "o t", "two")
    assert first_stop("one two three", stops) == 4
    assert cut_at_stop("one two three", stops) == "one "
    assert first_stop("one", stops) is None and cut_at_stop("one", stops) == "one"
    assert cut_at_stop("abc", ()) == "abc"
    assert stop_prefix("one tw", stops) == 2 and stop_prefix("one", ("STOP",)) == 0
    assert stop_prefix("STOP", ("STOP",)) == 0  # proper prefixes only: a whole one cuts


def test_text_that_may_start_a_stop_string_is_held_back(byte_level):
    stream = TextStream(byte_level, ("STOP",))
    out = [stream.push(t) for t in byte_level.encode("aST").ids]
    assert "".join(out) == "a"
    assert stream.push(byte_level.encode("x").ids[0]) == "STx"
    out = [stream.push(t) for t in byte_level.encode("STOP more").ids]
    assert "".join(out) == "" and stream.finished and stream.text == "aSTx"
    assert stream.push(1) == "" and stream.finish() == ""


def test_first_stop_string_to_complete_wins(byte_level, metaspace):
    ids = byte_level.encode("one two three").ids
    deltas, stream = stream_all(byte_level, ids, stop=("three", "o t", "two"))
    assert "".join(deltas) == "one " and stream.finished
    vocab = metaspace.get_vocab()  # one token completes both: the earlier one cuts
    deltas, _ = stream_all(metaspace, [vocab["▁the"], vocab["▁hello"]], stop=("llo", "e h"))
    assert "".join(deltas) == "th"


def test_finish_releases_a_held_stop_prefix(byte_level):
    deltas, stream = stream_all(byte_level, byte_level.encode("abST").ids, stop=("STOP",))
    assert deltas[-1] == "ST" and "".join(deltas) == "abST"


def test_special_tokens_are_skipped(byte_level):
    ids = byte_level.encode("hi").ids + [byte_level.token_to_id("</s>")]
    deltas, _ = stream_all(byte_level, ids)
    assert "".join(deltas) == "hi"


def test_empty_stop_string_is_refused(byte_level):
    with pytest.raises(ValueError, match="non-empty"):
        TextStream(byte_level, ("",))
