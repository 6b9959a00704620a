"""Step: what one compiled program per step takes and gives (StepPlan, Tiers, DecodeState,
StepRecord), the decode / prefill programs, sampling and the expert-parallel programs. Imports
`formats`, `ops`, `model`."""
