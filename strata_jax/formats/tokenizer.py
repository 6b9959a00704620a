"""Text in and out: a checkpoint's tokenizer (`tokenizer.json`) and its chat template.

Encoding and decoding are the `tokenizers` library's, set up from tokenizer_config.json the
way transformers sets up a fast tokenizer (special tokens, `split_special_tokens`,
`clean_up_tokenization_spaces`; tokenizer.json's own post-processor adds bos/eos); chat
templates are rendered the way transformers renders them: a sandboxed jinja2 environment with
trim_blocks and lstrip_blocks, `raise_exception`, `tojson`, `strftime_now`, and the special
tokens (`bos_token`, ...) as variables. So a prompt gives the ids `AutoTokenizer` gives
(tests/formats/test_tokenizer.py).

Unlike transformers, a truncation or padding setting in tokenizer.json is dropped: a prompt
too long for the engine is refused by its length check, never cut silently.

`byte_level_files` makes the tokenizer of synthetic models: ids 0-2 are `<pad>`, `<s>`,
`</s>`, id 3 + b is the byte b, and the rest of the vocabulary is `<reserved_N>` tokens
(which decode to their own name).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import jinja2.utils
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "chat_template.jinja", "chat_template.json",
                   "tokenizer.model")
"""The Hugging Face files a checkpoint keeps beside its weights (those the source has)."""
SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                 "mask_token")
"""The named special tokens a chat template sees as variables (transformers' list)."""
SOURCE_KEY = "source"
"""config.json key whose `eos_token_id` (the HF model config's) `strata convert hf` records."""


class Tokenizer:
    """A checkpoint's tokenizer: ids <-> text, and its chat template."""

    vocab_size: int
    """Tokens the tokenizer knows (added tokens included); the model's vocabulary may be larger."""
    eos_ids: frozenset[int]
    """Every id that ends generation: eos, and the end-of-turn ids generation_config.json or
    the model config list."""
    bos_id: int | None
    """The beginning-of-sequence id, if the tokenizer has one."""
    has_chat_template: bool
    """Whether `apply_chat_template` works."""
    source: str
    """The folder it was read from (named in errors)."""
    chat_template: str | None
    """The chat template's source text (None: none)."""

    def __init__(self, backend: Backend, *, special: dict[str, str], eos_ids: frozenset[int],
                 bos_id: int | None, chat_template: str | None, clean_up_spaces: bool,
                 source: str) -> None:
        self._backend, self._special, self._clean_up = backend, special, clean_up_spaces
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.eos_ids, self.bos_id, self.source = eos_ids, bos_id, source
        self._template = None if chat_template is None else _compile(chat_template, source)
        self.has_chat_template = self._template is not None
        self.chat_template = chat_template

    @property
    def special_tokens(self) -> dict[str, str]:
        """The named special tokens ("eos_token", "bos_token", ...) it has."""
        return dict(self._special)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """The ids of `text`; `add_special_tokens` adds what the tokenizer adds (e.g. bos)."""
        if not isinstance(text, str):
            raise TypeError(f"encode takes a str, got {type(text).__name__}")
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        text = self._backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)
        return _clean_up(text) if self._clean_up else text

    def id_of(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def apply_chat_template(self, messages: list[dict[str, str]], *,
                            add_generation_prompt: bool = True) -> str:
        """The prompt text of a conversation (encode it with add_special_tokens=False: the
        template writes the special tokens itself)."""
        if self._template is None:
            raise ValueError(
                f"{self.source} has no chat template (neither chat_template.jinja nor a "
                "'chat_template' in tokenizer_config.json): send plain text instead of a chat, "
                "or add the model's template to the checkpoint")
        for m in messages:
            if not isinstance(m, dict):
                raise TypeError(f"chat messages must be dicts with 'role' and 'content', got {m!r}")
        chat = [{k: v for k, v in m.items() if v is not None} for m in messages]
        try:
            return self._template.render(messages=chat, tools=None, documents=None,
                                         add_generation_prompt=add_generation_prompt,
                                         **self._special)
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template of {self.source}: {e}") from e


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """The tokenizer of the Strata checkpoint (or Hugging Face model) folder `path`."""
    folder = Path(path).expanduser().resolve()
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: no such checkpoint folder")
    if not (folder / "tokenizer.json").is_file():
        raise FileNotFoundError(_no_tokenizer(folder))
    try:
        backend = Backend.from_file(str(folder / "tokenizer.json"))
    except Exception as e:  # noqa: BLE001  (the library raises a bare Exception)
        raise ValueError(f"{folder / 'tokenizer.json'}: not a tokenizers file ({e}); "
                         f"{_REFETCH}") from e
    config = _json(folder / "tokenizer_config.json")
    special = _special_tokens(config, _json(folder / "special_tokens_map.json"))
    _configure(backend, config)
    ids = {name: backend.token_to_id(tok) for name, tok in special.items()}
    generation = _json(folder / "generation_config.json")
    source = _json(folder / "config.json").get(SOURCE_KEY, {})
    eos = {ids.get("eos_token")} | _id_set(generation.get("eos_token_id"))
    eos |= _id_set(source.get("eos_token_id") if isinstance(source, dict) else None)
    bos = ids.get("bos_token")
    if bos is None and isinstance(generation.get("bos_token_id"), int):
        bos = generation["bos_token_id"]
    return Tokenizer(
        backend, special=special, eos_ids=frozenset(i for i in eos if i is not None),
        bos_id=bos, chat_template=_chat_template(folder, config),
        clean_up_spaces=bool(config.get("clean_up_tokenization_spaces"))
        and type(backend.model).__name__ != "BPE",  # transformers skips it for BPE
        source=str(folder))


def encode_prompts(tokenizer: Tokenizer | None, prompts: Sequence[str | Sequence[int]], *,
                   chat: bool = False) -> list[list[int]]:
    """Each prompt as ids: text through `tokenizer` (with `chat`, as one user message of the
    chat template), ids as given."""
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            if tokenizer is None:
                raise ValueError(f"prompt {i} is text but the model has no tokenizer; pass ids")
            if chat:
                text = tokenizer.apply_chat_template([{"role": "user", "content": p}])
                out.append(tokenizer.encode(text, add_special_tokens=False))
            else:
                out.append(tokenizer.encode(p))
        else:
            if chat:
                raise ValueError(f"prompt {i} is token ids: a chat template applies to text only")
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in p):
                raise ValueError(f"prompt {i}: expected text or a list of int ids, got {p!r}")
            out.append(list(p))
    return out


class FileWriter(Protocol):
    def write_file(self, name: str, data: bytes) -> None: ...


def copy_tokenizer_files(src: str | os.PathLike, writer: FileWriter) -> list[str]:
    """Copy the TOKENIZER_FILES that `src` has into the checkpoint `writer` writes."""
    copied = []
    for name in TOKENIZER_FILES:
        path = Path(src) / name
        if path.is_file():
            writer.write_file(name, path.read_bytes())
            copied.append(name)
    return copied


# ------------------------------------------------------------------------------ loading

_REFETCH = "copy the model's tokenizer files again and re-run `strata convert hf`"


def _no_tokenizer(folder: Path) -> str:
    sentencepiece = (" (only a SentencePiece tokenizer.model, which Strata does not read: "
                     "save the model with a fast tokenizer to get tokenizer.json)"
                     if (folder / "tokenizer.model").is_file() else "")
    return (f"{folder} has no tokenizer.json{sentencepiece}: re-run `strata convert hf SRC "
            f"{folder} --overwrite` from a Hugging Face folder that has one, or pass token ids "
            "(--prompt-ids 1,2,3)")


def _json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e}); {_REFETCH}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object; {_REFETCH}")
    return data


def _content(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _special_tokens(config: dict[str, Any], legacy: dict[str, Any]) -> dict[str, str]:
    out = {}
    for name in SPECIAL_NAMES:
        token = _content(config.get(name)) or _content(legacy.get(name))
        if token is not None:
            out[name] = token
    return out


def _configure(backend: Backend, config: dict[str, Any]) -> None:
    """What transformers' fast tokenizer changes on the backend it loads. (It ignores
    tokenizer_config.json's add_bos_token / add_eos_token when tokenizer.json is there: the
    file's post-processor decides.)"""
    backend.no_truncation()
    backend.no_padding()
    backend.encode_special_tokens = bool(config.get("split_special_tokens", False))


def _id_set(value: Any) -> set[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return {value}
    if isinstance(value, list):
        return {v for v in value if isinstance(v, int) and not isinstance(v, bool)}
    return set()


def _chat_template(folder: Path, config: dict[str, Any]) -> str | None:
    """chat_template.jinja, else tokenizer_config.json's (a string, or named templates of
    which "default"), else chat_template.json's (older processors)."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if template is None:
        template = _json(folder / "chat_template.json").get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if "default" not in named:
            raise ValueError(f"{folder / 'tokenizer_config.json'}: named chat templates "
                             f"{sorted(map(str, named))} but no 'default' one")
        template = named["default"]
    if template is not None and not isinstance(template, str):
        raise ValueError(f"{folder}: chat_template must be a string, got {type(template).__name__}")
    return template


def _clean_up(text: str) -> str:
    """transformers' `clean_up_tokenization` (for WordPiece-style tokenizers)."""
    for old, new in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"),
                     (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"),
                     (" 're", "'re")):
        text = text.replace(old, new)
    return text


# ------------------------------------------------------------------------- chat templates


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (assistant-mask markers): rendered as is."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller) -> str:
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """`namespace()` that refuses underscore names (no reaching CPython internals)."""

    def __init__(*args, **kwargs) -> None:  # noqa: N805  (jinja's Namespace signature)
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")


class _Dict:
    """`dict(...)` for templates, without handing them the dict type itself."""

    def __call__(self, *args, **kwargs) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # jinja's own tojson escapes HTML characters; transformers' does not
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _compile(template: str, source: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, namespace=_Namespace, dict=_Dict(),
                       strftime_now=lambda fmt: datetime.now().strftime(fmt))
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"chat template of {source}: line {e.lineno}: {e.message}") from e


# --------------------------------------------------------------- synthetic models' tokenizer

BYTE_SPECIALS = ("<pad>", "<s>", "</s>")
BYTE_OFFSET = len(BYTE_SPECIALS)
BYTE_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}")


def _byte_chars() -> list[str]:
    """GPT-2's printable stand-in for each byte value (what the ByteLevel steps use)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in kept:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def byte_level_tokenizer(vocab_size: int) -> Backend:
    """The synthetic models' tokenizer (module doc) over `vocab_size` ids."""
    if vocab_size < BYTE_OFFSET + 256:
        raise ValueError(f"a byte-level tokenizer needs vocab_size >= {BYTE_OFFSET + 256}, "
                         f"got {vocab_size}")
    vocab = {t: i for i, t in enumerate(BYTE_SPECIALS)}
    vocab.update({c: BYTE_OFFSET + b for b, c in enumerate(_byte_chars())})
    vocab.update({f"<reserved_{i}>": i for i in range(BYTE_OFFSET + 256, vocab_size)})
    backend = Backend(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t in BYTE_SPECIALS])
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    return backend


def byte_level_files(vocab_size: int, max_len: int | None = None) -> dict[str, bytes]:
    """tokenizer.json, tokenizer_config.json and generation_config.json of the synthetic
    models' tokenizer (deterministic bytes)."""
    pad, bos, eos = BYTE_SPECIALS
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos,
              "pad_token": pad, "clean_up_tokenization_spaces": False,
              "chat_template": BYTE_CHAT_TEMPLATE}
    if max_len is not None:
        config["model_max_length"] = max_len
    generation = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    tok = json.loads(byte_level_tokenizer(vocab_size).to_str())
    return {name: json.dumps(doc, indent=1, sort_keys=True, ensure_ascii=False).encode()
            for name, doc in (("tokenizer.json", tok), ("tokenizer_config.json", config),
                              ("generation_config.json", generation))}
