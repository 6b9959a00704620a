"""Engine: the offload engine behind the engine contract (`offload`), its config and plan, what
each device starts with (`shares`), its disk reads and stalls (`disk`), stats, routing traces,
the compile cache and multi-process set-up. Imports `residency`."""
