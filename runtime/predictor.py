"""Route prediction: which experts the next layer will need, before its routing is known.

`next-gate` applies layer L+1's router to layer L's hidden state (after attention); `history`
repeats the experts layer L+1 used at the previous step; `both` takes the union. Precision and
recall are kept per layer, over the experts that would have to move (not already resident).
"""

from __future__ import annotations

from dataclasses import dataclass, field

PREDICTORS = ("none", "history", "next-gate", "both")


def check_predictor(kind: str) -> None:
    if kind not in PREDICTORS:
        raise ValueError(f"predictor must be one of {PREDICTORS}, got {kind!r}")


def combine(kind: str, next_gate: set[int], history: set[int]) -> set[int]:
    """The predicted expert set for `kind` from the two sources."""
    return {
        "none": set(),
        "history": history,
        "next-gate": next_gate,
        "both": next_gate | history,
    }[kind]


@dataclass
class PredictorStats:
    """Per-layer counts: correctly predicted, predicted, actually needed (non-resident)."""

    hits: dict[int, int] = field(default_factory=dict)
    predicted: dict[int, int] = field(default_factory=dict)
    needed: dict[int, int] = field(default_factory=dict)

    def record(self, layer: int, predicted: set[int], needed: set[int]) -> None:
        self.hits[layer] = self.hits.get(layer, 0) + len(predicted & needed)
        self.predicted[layer] = self.predicted.get(layer, 0) + len(predicted)
        self.needed[layer] = self.needed.get(layer, 0) + len(needed)

    def precision(self, layer: int) -> float | None:
        p = self.predicted.get(layer, 0)
        return self.hits.get(layer, 0) / p if p else None

    def recall(self, layer: int) -> float | None:
        n = self.needed.get(layer, 0)
        return self.hits.get(layer, 0) / n if n else None

    def summary(self) -> dict[int, dict[str, float | None]]:
        layers = sorted(set(self.needed) | set(self.predicted))
        return {i: {"precision": self.precision(i), "recall": self.recall(i)} for i in layers}
