"""JAX's persistent compilation cache for the demos: a second run of the same demo loads its
compiled programs from disk instead of compiling them again.

``dyndepth demo`` (``--task prefix-sums`` and ``sudoku``) and ``dyndepth eval`` point JAX's cache
(``jax_compilation_cache_dir``) at ``$XDG_CACHE_HOME/dyndepth/jax`` (``~/.cache/dyndepth/jax``)
unless ``--no-compilation-cache`` is given, or JAX already has a cache folder
(``JAX_COMPILATION_CACHE_DIR``), which is then kept. JAX stores only programs that took longer
than ``jax_persistent_cache_min_compile_time_secs`` (1 s by default) to compile. The commands
that time compilation (``dyndepth bench``, ``dyndepth demo --task dropout-residual``) leave the
cache off: a cached program would report its load time as its compile time.
"""

from __future__ import annotations

import os


def default_dir() -> str:
    """``$XDG_CACHE_HOME/dyndepth/jax``, or ``~/.cache/dyndepth/jax``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "dyndepth", "jax")


def add_arguments(p) -> None:
    p.add_argument(
        "--no-compilation-cache",
        action="store_true",
        help="do not use JAX's persistent compilation cache (by default compiled programs are "
        f"kept in {default_dir()}, or in JAX_COMPILATION_CACHE_DIR when set, so that the next "
        "run loads them instead of compiling again)",
    )


def enable(a) -> str | None:
    """Turn JAX's persistent compilation cache on for this process, before anything compiles,
    unless ``a.no_compilation_cache``. Returns the cache folder, or None when it is off."""
    if getattr(a, "no_compilation_cache", False):
        return None
    import jax

    if jax.config.jax_compilation_cache_dir:  # the user's own (JAX_COMPILATION_CACHE_DIR)
        return jax.config.jax_compilation_cache_dir
    path = default_dir()
    jax.config.update("jax_compilation_cache_dir", path)
    return path
