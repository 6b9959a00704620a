"""Lab: measurements and predictions: bench, the cost model (bounds and predicted rates), the
simulator and sweeps. Imports `engine`, `residency`."""
