"""Which prompt chunks share a prefill program.

docs/design.md, "Prefill". A prompt is cut into chunks of `chunk` tokens (`step.prefill_chunks`:
the tail in a power-of-two bucket). The j-th chunks of the prompts admitted together run in
programs of R rows x T tokens (`step.prefill`; R and T powers of two, R * T <= `chunk`, R <= the
rows allowed), the longest chunks first, so each expert a program routes to is read (and, where
it is offloaded, copied) once for the tokens of several prompts. A prompt's chunk j + 1 runs in a
later program than its chunk j (it attends over its KV). Every engine packs by `pack`, so the
same admissions give the same programs, and so the same bits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from strata_jax.step.programs import prefill_chunks
from strata_jax.step.sampling import GREEDY, SamplingParams, row_values, stack_values


@dataclass(frozen=True)
class Admission:
    """A prompt (or a kept session's new input) to prefill into a row: the engine contract's
    unit of `prefill`."""

    row: int
    """The batch row it goes into."""
    tokens: Sequence[int]
    """Its ids, written from position `start` on."""
    start: int = 0
    """Where they start in the row's KV (0: a new sequence; later: a resumed one's new input)."""
    sampling: SamplingParams = GREEDY
    """How the row draws its tokens from now on (its seed resolved)."""
    request: int | None = None
    """The request's id, for the routing trace."""
    scores: bool = False
    """Score its tokens and the one it draws, each given those before it (`PromptScores`)."""


@dataclass(frozen=True)
class PromptScores:
    """An admission's tokens 1 .. n-1 and then the token it drew, each scored given those
    before it (`step.Scores`: natural-log probabilities of the model's own softmax)."""

    target: np.ndarray
    """float32 [n]: of the token itself."""
    top: np.ndarray
    """float32 [n, K]: of the most likely tokens at its place, highest first (K: `step.SCORE_TOP`
    or the vocabulary, if smaller)."""
    top_ids: np.ndarray
    """int32 [n, K]: those tokens."""

    def at(self, j: int) -> TokenScore:
        """Entry `j` (-1: the drawn token's)."""
        return TokenScore(logprob=float(self.target[j]), top=self.top[j],
                          top_ids=self.top_ids[j])


@dataclass(frozen=True)
class TokenScore:
    """One token's log-probability given those before it, and the most likely tokens at its
    place (the model's own softmax, float32: no sampling filters)."""

    logprob: float
    """Of the token itself."""
    top: np.ndarray
    """float32 [K]: of the most likely tokens, highest first."""
    top_ids: np.ndarray
    """int32 [K]: those tokens."""


@dataclass(frozen=True)
class Prefilled:
    """What `prefill` gives an admission."""

    token: int | None
    """Its next token (None: it failed)."""
    error: str | None = None
    """Why it failed: an expert it needed could not be read (its row is then free)."""
    scores: PromptScores | None = None
    """With `Admission.scores`."""


@dataclass(frozen=True)
class Piece:
    """One chunk of one admitted prompt."""

    prompt: int
    """Its prompt's index among the admitted ones."""
    start: int
    """Its first token's index within the prompt."""
    count: int
    """Its tokens."""


@dataclass(frozen=True)
class Program:
    """One prefill program: `pieces` in its first rows, the rest of its `rows` padding."""

    pieces: tuple[Piece, ...]
    rows: int
    """R: a power of two >= len(pieces)."""
    tokens: int
    """T: a power-of-two bucket >= every piece's count."""


def pack(lengths: list[int], chunk: int, max_rows: int) -> list[Program]:
    """The prefill programs of prompts of `lengths` tokens admitted together, in the order they
    run: chunks of `chunk` tokens, at most `max_rows` prompts' chunks a program (1: every
    chunk alone, so a prompt's bits do not depend on what else is admitted)."""
    if max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, got {max_rows}")
    rounds: list[list[Piece]] = []
    for i, length in enumerate(lengths):
        for j, (start, _, count) in enumerate(prefill_chunks(length, chunk)):
            if j == len(rounds):
                rounds.append([])
            rounds[j].append(Piece(i, start, count))
    programs = []
    for pieces in rounds:
        pieces = sorted(pieces, key=lambda p: (-p.count, p.prompt))
        while pieces:
            tokens = _bucket(pieces[0].count)
            take = pieces[: min(max_rows, chunk // tokens)]
            pieces = pieces[len(take):]
            programs.append(Program(tuple(take), _bucket(len(take), 1), tokens))
    return programs


def _bucket(n: int, least: int = 8) -> int:
    """The power of two >= n (and >= `least`): the bucket `step.prefill_chunks` gives."""
    return max(least, 1 << (n - 1).bit_length())


def shapes(chunk: int, max_rows: int) -> list[tuple[int, int]]:
    """Every (rows, tokens) a program of `pack` can take: what a server compiles before it
    serves."""
    out = []
    tokens = 8
    while tokens <= chunk:
        rows = 1
        while rows <= min(_bucket(max_rows, 1), chunk // tokens):
            out.append((rows, tokens))
            rows *= 2
        tokens *= 2
    return out


ProgramArgs = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, tuple, np.ndarray,
                    np.ndarray | None]
"""`step.prefill`'s (rows [R], tokens [R, T], starts [R], counts [R], stacked sampling
values, riders bool [capacity], targets [R, T] or None) of one program."""


def program_args(program: Program, admissions: Sequence[Admission], capacity: int,
                 riders: Sequence[int] = ()) -> ProgramArgs:
    """The arguments of `program` over `admissions`, the batch rows `riders` taking a decode
    step in it: padding rows are row `capacity` (past the batch: they write nothing) with no
    tokens."""
    r, t = program.rows, program.tokens
    rows, starts, counts = (np.full(r, capacity, np.int32), np.zeros(r, np.int32),
                            np.zeros(r, np.int32))
    tokens = np.zeros((r, t), np.int32)
    values = [row_values(GREEDY)] * r
    scored = any(admissions[p.prompt].scores for p in program.pieces)
    targets = np.full((r, t), -1, np.int32) if scored else None
    for i, piece in enumerate(program.pieces):
        a = admissions[piece.prompt]
        rows[i], starts[i], counts[i] = a.row, a.start + piece.start, piece.count
        tokens[i, :piece.count] = a.tokens[piece.start : piece.start + piece.count]
        values[i] = row_values(a.sampling)
        if scored and a.scores:  # each position scores the prompt's next token
            nxt = a.tokens[piece.start + 1 : piece.start + piece.count + 1]
            targets[i, : len(nxt)] = nxt
    ride = np.zeros(capacity, np.bool_)
    ride[list(riders)] = True
    return rows, tokens, starts, counts, stack_values(values), ride, targets


ProgramOut = tuple[np.ndarray, np.ndarray, dict[int, str], tuple | None]
"""What one program gives: its tokens [R], the riders' tokens [capacity], the rows that
failed with why, and (with targets) its scores as numpy (target [R, T], top [R, T, K],
top_ids [R, T, K])."""

Call = Callable[[ProgramArgs], ProgramOut]
"""Runs one program."""


def host_scores(scores) -> tuple | None:
    """A program's `step.Scores` as numpy (target, top, top_ids); None stays None."""
    if scores is None:
        return None
    return tuple(np.asarray(x) for x in (scores.target, scores.top, scores.top_ids))


Ride = Callable[[dict[int, int], dict[int, str]], Sequence[int]]
"""Decode steps riding along the programs (docs/design.md, "Prefill"): called with the last
program's riders' tokens {row: token} and the riders that failed {row: why} (once before the
first program with neither), returns the rows that ride the next program."""


def run(admissions: Sequence[Admission], chunk: int, max_rows: int, capacity: int,
        call: Call, ride: Ride | None = None) -> list[Prefilled]:
    """Prefill `admissions` by the programs of `pack`, each through `call`, with the decode
    steps of `ride` riding along: a `Prefilled` per admission. A failed prompt's later chunks
    are dropped from their programs (the shapes stay). With `max_rows` 1 nothing rides: a
    row's bits then depend on no other row's timing (docs/design.md, "Prefill")."""
    results = [Prefilled(None, "not prefilled")] * len(admissions)
    sink: dict[int, PromptScores | None] = {i: None for i, a in enumerate(admissions)
                                            if a.scores}
    failed: set[int] = set()
    ride = ride if max_rows > 1 else None
    riders = list(ride({}, {})) if ride is not None else []
    for program in pack([len(a.tokens) for a in admissions], chunk, max_rows):
        program = replace(program, pieces=tuple(p for p in program.pieces
                                                if p.prompt not in failed))
        if not program.pieces:
            continue
        tokens, ridden, errors, scores = call(program_args(program, admissions, capacity,
                                                           riders))
        if ride is not None:
            riders = list(ride({r: int(ridden[r]) for r in riders if r not in errors},
                               {r: errors[r] for r in riders if r in errors}))
        for i, piece in enumerate(program.pieces):
            a = admissions[piece.prompt]
            if a.row in errors:
                results[piece.prompt] = Prefilled(None, errors[a.row])
                failed.add(piece.prompt)
                continue
            if piece.prompt in sink:
                sink[piece.prompt] = _keep_scores(sink[piece.prompt], len(a.tokens), piece,
                                                  [x[i] for x in scores])
            if piece.start + piece.count == len(a.tokens):
                results[piece.prompt] = Prefilled(int(tokens[i]), None, sink.get(piece.prompt))
    return results


def _keep_scores(into: PromptScores | None, n: int, piece: Piece,
                 row: list[np.ndarray]) -> PromptScores:
    """`into` (None: a new one for a prompt of `n` tokens) with a piece's positions' scores
    copied in (`row`: target [T], top [T, K], top_ids [T, K]); position j scores token j + 1,
    the prompt's last the token drawn after it."""
    target, top, ids = row
    if into is None:
        into = PromptScores(target=np.zeros(n, np.float32),
                            top=np.zeros((n, top.shape[-1]), np.float32),
                            top_ids=np.zeros((n, top.shape[-1]), np.int32))
    n = piece.count
    at = slice(piece.start, piece.start + n)
    into.target[at], into.top[at], into.top_ids[at] = target[:n], top[:n], ids[:n]
    return into
