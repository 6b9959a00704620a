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

from strata_jax.sampling import GREEDY, SamplingParams, row_values, stack_values
from strata_jax.step import prefill_chunks


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


ProgramArgs = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, tuple, np.ndarray]
"""`step.prefill`'s (rows [R], tokens [R, T], starts [R], counts [R], stacked sampling
values, riders bool [capacity]) of one program."""


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
    for i, piece in enumerate(program.pieces):
        a = admissions[piece.prompt]
        rows[i], starts[i], counts[i] = a.row, a.start + piece.start, piece.count
        tokens[i, :piece.count] = a.tokens[piece.start : piece.start + piece.count]
        values[i] = row_values(a.sampling)
    ride = np.zeros(capacity, np.bool_)
    ride[list(riders)] = True
    return rows, tokens, starts, counts, stack_values(values), ride


Call = Callable[[ProgramArgs], tuple[np.ndarray, np.ndarray, dict[int, str]]]
"""Runs one program: (its tokens [R], the riders' tokens [capacity], the rows that failed
with why)."""

Ride = Callable[[dict[int, int], dict[int, str]], Sequence[int]]
"""Decode steps riding along the programs (docs/design.md, "Prefill"): called with the last
program's riders' tokens {row: token} and the riders that failed {row: why} (once before the
first program with neither), returns the rows that ride the next program."""


def run(admissions: Sequence[Admission], chunk: int, max_rows: int, capacity: int,
        call: Call, ride: Ride | None = None) -> list[tuple[int | None, str | None]]:
    """Prefill `admissions` by the programs of `pack`, each through `call`, with the decode
    steps of `ride` riding along: per admission (its next token, None), or (None, why it
    failed). A failed prompt's later chunks are dropped from their programs (the shapes
    stay). With `max_rows` 1 nothing rides: a row's bits then depend on no other row's
    timing (docs/design.md, "Prefill")."""
    results: list[tuple[int | None, str | None]] = [(None, "not prefilled")] * len(admissions)
    failed: set[int] = set()
    ride = ride if max_rows > 1 else None
    riders = list(ride({}, {})) if ride is not None else []
    for program in pack([len(a.tokens) for a in admissions], chunk, max_rows):
        program = replace(program, pieces=tuple(p for p in program.pieces
                                                if p.prompt not in failed))
        if not program.pieces:
            continue
        tokens, ridden, errors = call(program_args(program, admissions, capacity, riders))
        if ride is not None:
            riders = list(ride({r: int(ridden[r]) for r in riders if r not in errors},
                               {r: errors[r] for r in riders if r in errors}))
        for i, piece in enumerate(program.pieces):
            a = admissions[piece.prompt]
            if a.row in errors:
                results[piece.prompt] = (None, errors[a.row])
                failed.add(piece.prompt)
            elif piece.start + piece.count == len(a.tokens):
                results[piece.prompt] = (int(tokens[i]), None)
    return results
