"""Ops: the array kernels a step runs (layers, the expert pool, the expert kernels with their int4
/ int8 variants) and the host kernel that computes misses on the CPU, with its worker registry.
Imports `formats` only."""
