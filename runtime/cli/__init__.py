"""CLI: the `strata` command, one module per command group, and the flags generated from the engine
and server configs. Imports everything; nothing imports it."""
