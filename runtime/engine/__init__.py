"""Engine: the offload engine behind the engine contract, its stats, traces, timeline, compile
cache and multi-process set-up. Imports `residency`."""
