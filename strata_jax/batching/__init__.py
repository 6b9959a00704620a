"""Batching: the engine contract (prefill / step / read / free over rows), prefill packing, the
resident engine, the continuous-batching scheduler, stop strings and scoring: the one generation
loop every engine runs. Imports `formats`, `ops`, `model`, `step`."""
