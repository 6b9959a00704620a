"""JAX's persistent compilation cache for the command line: a second `strata` call with the
same shapes loads its programs instead of compiling them again.

On by default, in `$STRATA_COMPILE_CACHE` if set, else `$XDG_CACHE_HOME/strata-jax/jax`, else
`~/.cache/strata-jax/jax`. `--no-compile-cache`, or STRATA_COMPILE_CACHE=off (or 0, none,
empty), turns it off. Every program is cached, however small or quick to compile (JAX's
defaults skip those under a second of compilation).
"""

from __future__ import annotations

import os
from pathlib import Path

ENV = "STRATA_COMPILE_CACHE"
OFF = ("", "0", "off", "none", "false", "no")


def cache_dir() -> Path | None:
    """Where the cache lives, or None if the environment turns it off."""
    value = os.environ.get(ENV)
    if value is not None:
        return None if value.strip().lower() in OFF else Path(value).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "strata-jax" / "jax"


def enable_compile_cache(enabled: bool = True) -> Path | None:
    """Point JAX's persistent cache at `cache_dir()` (before anything compiles); returns the
    folder, or None when it stays off."""
    folder = cache_dir() if enabled else None
    if folder is None:
        return None
    import jax

    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"compilation cache {folder}: cannot create it ({e.strerror}); set "
                         f"{ENV} to a writable folder, or pass --no-compile-cache") from e
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    return folder
