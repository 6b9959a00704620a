"""strata_jax.formats.tokenizer against transformers' AutoTokenizer, on real tokenizers made offline
(a trained byte-level BPE, a WordLevel one, the synthetic models' byte tokenizer)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from strata_jax.formats.tokenizer import (
    BYTE_OFFSET,
    byte_level_files,
    encode_prompts,
    load_tokenizer,
)
from tests.text_helpers import CHATML, SPECIALS, TEXT, write_bpe_tokenizer

transformers = pytest.importorskip("transformers")

SAMPLES = [
    "Four score and seven years ago",
    "  leading spaces\tand tabs\n\nblank lines  ",
    "naïve café — “quotes”, 日本語 and 🙂",
    "<|im_start|>user\nspecial tokens inside text<|im_end|><|endoftext|>",
    "",
    TEXT,
]
CHATS = [
    [{"role": "user", "content": "Who wrote the Gettysburg Address?"}],
    [{"role": "system", "content": "  Be brief.  "}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "naïve 🙂"}],
]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("bpe")
    write_bpe_tokenizer(folder)
    return folder


def variant(src: Path, dst: Path, **config) -> Path:
    """A copy of tokenizer folder `src` with tokenizer_config.json keys changed."""
    shutil.copytree(src, dst)
    path = dst / "tokenizer_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    return dst


def assert_same_text(ours, theirs) -> None:
    for text in SAMPLES:
        for special in (True, False):
            ids = theirs(text, add_special_tokens=special)["input_ids"]
            assert ours.encode(text, add_special_tokens=special) == ids, (text[:40], special)
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(
                    ids, skip_special_tokens=skip), (text[:40], skip)


def assert_same_chats(ours, theirs) -> None:
    for chat in CHATS:
        for gen in (True, False):
            text = theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
            assert ours.apply_chat_template(chat, add_generation_prompt=gen) == text
            ids = theirs.apply_chat_template(chat, add_generation_prompt=gen, return_dict=False)
            assert ours.encode(text, add_special_tokens=False) == ids


@pytest.mark.parametrize("change", [
    {}, {"split_special_tokens": True},
    {"add_bos_token": False, "add_eos_token": True},  # ignored beside tokenizer.json
    {"clean_up_tokenization_spaces": True},  # transformers ignores it for BPE; so do we
])  # fmt: skip
def test_bpe_matches_transformers(bpe, tmp_path, change):
    folder = variant(bpe, tmp_path / "tok", **change)
    ours, theirs = load_tokenizer(folder), transformers.AutoTokenizer.from_pretrained(folder)
    assert_same_text(ours, theirs)
    assert ours.vocab_size == len(theirs) == 400
    assert ours.bos_id == theirs.convert_tokens_to_ids(SPECIALS[0])


def test_ids_that_end_generation(bpe):
    tok = load_tokenizer(bpe)
    endoftext, im_end = (tok.id_of(t) for t in (SPECIALS[0], SPECIALS[2]))
    assert tok.eos_ids == {endoftext, im_end}  # eos, and generation_config's end of turn


@pytest.mark.parametrize("where", ["chat_template.jinja", "tokenizer_config.json"])
def test_chat_template_matches_transformers(bpe, tmp_path, where):
    folder = tmp_path / "tok"
    if where == "chat_template.jinja":
        shutil.copytree(bpe, folder)
    else:
        variant(bpe, folder, chat_template=CHATML)
        (folder / "chat_template.jinja").unlink()
    ours, theirs = load_tokenizer(folder), transformers.AutoTokenizer.from_pretrained(folder)
    assert ours.has_chat_template
    assert_same_chats(ours, theirs)
    bad = [{"role": "narrator", "content": "x"}]
    with pytest.raises(ValueError, match=r"chat template of .*tok: unknown role: narrator"):
        ours.apply_chat_template(bad)
    with pytest.raises(Exception, match="unknown role: narrator"):
        theirs.apply_chat_template(bad, tokenize=False)


def test_wordlevel_cleans_up_spaces_as_transformers(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = sorted(set(TEXT.replace(",", " , ").replace(".", " . ").split()))
    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(words)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="[UNK]", clean_up_tokenization_spaces=True,
    ).save_pretrained(tmp_path)
    ours, theirs = load_tokenizer(tmp_path), transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert_same_text(ours, theirs)
    assert "nation, conceived" in ours.decode(ours.encode("a new nation, conceived in Liberty"))
    assert not ours.has_chat_template
    with pytest.raises(ValueError, match=f"{tmp_path} has no chat template"):
        ours.apply_chat_template(CHATS[0])


def test_synthetic_byte_tokenizer(tmp_path):
    files = byte_level_files(512)
    assert files == byte_level_files(512)  # same bytes every time (synth's same-seed test)
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    ours, theirs = load_tokenizer(tmp_path), transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert_same_text(ours, theirs)
    assert_same_chats(ours, theirs)
    assert (ours.vocab_size, ours.bos_id, ours.eos_ids) == (512, 1, {2})
    text = SAMPLES[2]
    assert ours.encode(text, add_special_tokens=False) == [BYTE_OFFSET + b
                                                           for b in text.encode()]
    assert ours.decode(ours.encode(TEXT)) == TEXT
    assert ours.decode([300, 2]) == "<reserved_300>"


def test_missing_tokenizer_names_the_folder_and_the_fix(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=f"{tmp_path} has no tokenizer.json.*--prompt-ids"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer.json: not a tokenizers file"):
        load_tokenizer(tmp_path)


def test_encode_prompts(bpe):
    tok = load_tokenizer(bpe)
    text, ids = "We hold these truths", [5, 6, 7]
    assert encode_prompts(tok, [text, ids]) == [tok.encode(text), ids]
    chat = tok.apply_chat_template([{"role": "user", "content": text}])
    assert encode_prompts(tok, [text], chat=True) == [tok.encode(chat, add_special_tokens=False)]
    with pytest.raises(ValueError, match="prompt 1 is token ids"):
        encode_prompts(tok, [text, ids], chat=True)
    with pytest.raises(ValueError, match="prompt 0 is text but the model has no tokenizer"):
        encode_prompts(None, [text])
