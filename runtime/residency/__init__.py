"""Residency: where each expert lives and what moves it: the HBM / host budget ledger, the tiers,
cache policy, heat, read-ahead from disk, host compute of misses, NUMA placement, the measured
workspace. Imports `strata_jax` only."""
