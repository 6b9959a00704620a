"""Streaming text out of a stream of token ids: incremental detokenization and stop strings.

A token's text is not always known when the token is: a UTF-8 character can span several byte
tokens (a prefix of it decodes to U+FFFD), and some tokenizers decode a token differently
depending on what precedes it (SentencePiece drops the leading space of the first word). So a
`TextStream` decodes a short window of recent ids and emits only what a longer decode will not
change; the concatenation of its deltas is the decode of the whole sequence.

Stop strings are matched on that text, across token boundaries: text that could be the start
of a stop string is held back until it is known not to be one. On a match the text is cut
before the stop string and the stream is finished. This module is the one owner of stop
strings on text: `cut_at_stop` makes the same cut on a text decoded at once (a finished
generation's), for callers that do not stream.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

REPLACEMENT = "\ufffd"
CONTEXT_IDS = 4
"""Ids before the first generated one that its text is decoded with (a SentencePiece word
keeps its leading space)."""


def first_stop(text: str, stops: Sequence[str]) -> int | None:
    """Where in `text` the earliest of the stop strings starts, or None if none is in it."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


def cut_at_stop(text: str, stops: Sequence[str]) -> str:
    """`text` up to (without) the earliest of the stop strings."""
    cut = first_stop(text, stops)
    return text if cut is None else text[:cut]


def stop_prefix(text: str, stops: Sequence[str]) -> int:
    """Length of the longest end of `text` that is a proper prefix of a stop string."""
    longest = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:n]):
                longest = n
                break
    return longest


class Decoder(Protocol):
    """What a `TextStream` needs of a tokenizer."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class TextStream:
    """Feed a request's generated ids with `push`; each call returns the new text that is safe
    to emit. `finish` returns what is left when generation ends. After a stop string,
    `finished` is True and `push` returns "" (the caller stops generating)."""

    def __init__(self, tokenizer: Decoder, stop: Sequence[str] = (), *,
                 context: Sequence[int] = ()) -> None:
        """`context`: ids before the first generated one (e.g. the prompt's last few), which
        decide how the first generated token decodes; their own text is not emitted."""
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self._tokenizer = tokenizer
        self.stop = tuple(stop)
        self._ids: list[int] = list(context)
        self._prefix = 0  # window start: the decode of ids[_prefix:_read] is already emitted
        self._read = len(self._ids)
        self._held = ""  # decoded, not emitted: it may start a stop string
        self.text = ""
        """Everything emitted so far."""
        self.finished = False
        """A stop string was found."""

    def push(self, token: int) -> str:
        """Add one generated id; return the text it makes safe to emit."""
        if self.finished:
            return ""
        self._ids.append(int(token))
        return self._release(self._decoded(final=False))

    def finish(self) -> str:
        """Generation ended: the held-back text (an undecodable tail decodes as U+FFFD)."""
        if self.finished:
            return ""
        out = self._release(self._decoded(final=True), final=True)
        self.finished = True
        return out

    def _decoded(self, final: bool) -> str:
        """The new text of the window, or "" while its last character may be incomplete."""
        if self._read == len(self._ids):
            return ""
        decode = self._tokenizer.decode
        before = decode(self._ids[self._prefix : self._read], skip_special_tokens=True)
        after = decode(self._ids[self._prefix :], skip_special_tokens=True)
        if not final and (len(after) <= len(before) or after.endswith(REPLACEMENT)):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return after[len(before) :]

    def _release(self, new: str, final: bool = False) -> str:
        """Add `new` to the held text; emit all of it but a possible stop-string start."""
        pending = self._held + new
        cut = first_stop(pending, self.stop)
        if cut is not None:
            self.finished = True
            out, self._held = pending[:cut], ""
        else:
            keep = 0 if final else stop_prefix(pending, self.stop)
            out, self._held = pending[: len(pending) - keep], pending[len(pending) - keep :]
        self.text += out
        return out
