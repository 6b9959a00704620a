"""Model: the decoder (attention, norms, LM head), the MoE block, where each routed expert is
served from (`misses.split`, the one place a miss is decided) and the Flax modules that compose
them. Imports `formats`, `ops` and the step's plan types (`step.plan`)."""
