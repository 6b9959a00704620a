"""Real tokenizers made offline for the text tests: a byte-level BPE trained on the shipped
public-domain text, saved the way transformers saves a model's tokenizer."""

from __future__ import annotations

from pathlib import Path

TEXT_FILE = Path(__file__).resolve().parent / "data" / "public_domain.txt"
TEXT = TEXT_FILE.read_text(encoding="utf-8")
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

# ChatML, written across lines as Hub templates are, so trim_blocks / lstrip_blocks matter
CHATML = """{{ bos_token }}
{%- set ns = namespace(turns=0) %}
{%- for message in messages %}
    {%- if message['role'] not in ('system', 'user', 'assistant') %}
        {{- raise_exception('unknown role: ' + message['role']) }}
    {%- endif %}
    {%- set ns.turns = ns.turns + 1 %}
<|im_start|>{{ message['role'] }}
{{ message['content'] | trim }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""


def write_bpe_tokenizer(folder: Path, vocab_size: int = 400, chat_template: str | None = CHATML):
    """Train a byte-level BPE on TEXT and save it with transformers into `folder` (tokenizer
    files and a generation_config.json whose eos ids include <|im_end|>); returns the
    transformers tokenizer."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([TEXT], trainer)
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=SPECIALS[0], eos_token=SPECIALS[0],
        pad_token=SPECIALS[0], add_bos_token=True, chat_template=chat_template)
    hf.save_pretrained(folder)
    eos = [hf.convert_tokens_to_ids(t) for t in (SPECIALS[0], SPECIALS[2])]
    transformers.GenerationConfig(bos_token_id=eos[0], eos_token_id=eos).save_pretrained(folder)
    return hf
