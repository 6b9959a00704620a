"""A 2026 family through the server: a tiny DeepSeek-V3 made with transformers (q-LoRA, MLA,
grouped sigmoid routing, a dense first layer, shared experts), a byte-level BPE tokenizer with
a DeepSeek-style chat template beside it, `strata convert hf`, then
`python -m strata_runtime.cli.serve` with most experts offloaded, asked through the official
`openai` client: its chat answers are the Python API's greedy tokens of the prompt the
template renders, and its completions stream the same text as they answer whole."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
openai = pytest.importorskip("openai")

import strata_jax  # noqa: E402
from strata_runtime.cli import main as cli  # noqa: E402
from tests.runtime.served import start_server  # noqa: E402
from tests.text_helpers import write_bpe_tokenizer  # noqa: E402
from tests.tools.test_hf_families import build  # noqa: E402

# DeepSeek-V3's template in miniature: its role markers, the system prompt first, the
# assistant's turn closed by the end-of-sentence marker
DEEPSEEK_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}"
    "{% elif m['role'] == 'user' %}<｜User｜>{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}<｜Assistant｜>{{ m['content'] }}<｜end▁of▁sentence｜>"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<｜Assistant｜>{% endif %}")
VOCAB = 320  # the byte-level BPE's alphabet, its specials and a few merges
NEW = 6
CHATS = [
    [{"role": "user", "content": "Four score and seven years ago"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "We hold"}],
]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek_served")
    build("deepseek_v3-qlora", vocab_size=VOCAB).save_pretrained(root / "hf")
    tok = write_bpe_tokenizer(root / "hf", vocab_size=VOCAB, chat_template=DEEPSEEK_TEMPLATE)
    assert cli.main(["convert", "hf", str(root / "hf"), str(root / "strata")]) == 0
    log = open(root / "server.log", "w+")  # noqa: SIM115
    # 3 of each layer's 8 experts in HBM slots: the others are copied in as they are routed
    proc, base = start_server(root / "strata", ["--batch-capacity", "2", "--max-len", "96",
                                                "--hbm", "1GiB", "--resident-experts", "3"], log)
    client = openai.OpenAI(api_key="none", base_url=base + "/v1", max_retries=0, timeout=120)
    yield root / "strata", tok, client
    proc.kill()
    proc.wait()
    log.close()


def test_chat_answers_are_the_apis_greedy_tokens_of_the_rendered_prompt(served):
    ckpt, tok, client = served
    model = strata_jax.load(ckpt)
    ids = [tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
           for chat in CHATS]
    ids = [list(getattr(i, "input_ids", i)) for i in ids]
    want = strata_jax.generate(model, ids, NEW, batch_capacity=2, max_len=96)
    assert len({tuple(w) for w in want}) == 2  # the prompts lead somewhere different
    for chat, prompt, tokens in zip(CHATS, ids, want, strict=True):
        out = client.chat.completions.create(
            model=Path(ckpt).name, messages=chat, max_tokens=NEW, temperature=0.0,
            extra_body={"ignore_eos": True})
        assert out.usage.prompt_tokens == len(prompt)
        assert out.usage.completion_tokens == NEW
        assert out.choices[0].message.content == tok.decode(tokens)


def test_a_streamed_completion_equals_the_whole_one(served):
    _, _, client = served
    kw = dict(model="strata", prompt="Four score", max_tokens=NEW, temperature=0.0,
              extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw).choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw)
                       if c.choices)
    assert streamed == whole and whole
