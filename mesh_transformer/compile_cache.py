"""JAX's persistent compilation cache, on by default for the command-line tools: a program compiled once (GPT-J-6B's
prefill or decode step: 20-50 s each on a TPU) is read back from disk by the next run on the same devices, JAX and
flags. The cache key is JAX's own (the program, the devices, the compile options and XLA flags, the JAX version), so a
hit is the executable a compile would have made.

Where the cache lives, first that is set: the tools' `--compilation-cache PATH` (`off` disables it), the environment's
MTJ_COMPILATION_CACHE (likewise), JAX's own JAX_COMPILATION_CACHE_DIR, else a per-user directory by the XDG
convention (`$XDG_CACHE_HOME/mesh-transformer/jax`, `~/.cache/mesh-transformer/jax` without it). A gs:// path works
as JAX allows: through etils' epath (`pip install 'etils[epath]' gcsfs`).

Several processes may share one directory: a local directory of the tools' own (the flag's, MTJ_COMPILATION_CACHE's
or the default) is bounded (MAX_BYTES, least recently used entries evicted), which makes JAX take a file lock around
every read and write (an entry is written in place, so without the lock one process could read another's half-written
file). JAX_COMPILATION_CACHE_DIR keeps JAX's own settings: other JAX programs may write there without the access
times eviction reads. On Cloud Storage an object appears whole or not at all, and JAX's lock there would be a plain
file on the bucket: no bound, no lock.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import logging
import os

from mesh_transformer import config, storage

log = logging.getLogger(__name__)

ENV = "MTJ_COMPILATION_CACHE"
OFF = "off"
MAX_BYTES = 32 << 30  # a local cache's bound: GPT-J-6B's serving warm-up writes about 100 programs of a few MB to
# tens of MB each on a TPU
MIN_COMPILE_S = 0.0  # every program is written, where JAX's default writes those that took 1 s or more: reading one
# back takes milliseconds, and the small programs a run compiles (loading, sampling) add up (the demo model's six on
# the CPU: 2 of them over 1 s, 5.8 s in all)


def default_dir() -> str:
    """The per-user cache directory of the XDG base directory convention."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "mesh-transformer", "jax")


def add_cache_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--compilation-cache", metavar="PATH",
                        help=f"JAX's persistent compilation cache: a directory (local or gs://) or '{OFF}' (default: "
                             f"${ENV}, else $JAX_COMPILATION_CACHE_DIR, else {default_dir()})")


def chosen_dir(flag: str | None) -> str | None:
    """The cache directory the flag and environment choose (module docstring), or None when it is off."""
    for value in (flag, os.environ.get(ENV), os.environ.get("JAX_COMPILATION_CACHE_DIR")):
        if value:
            return None if value == OFF else value
    return default_dir()


def _bounded(flag: str | None, directory: str) -> bool:
    """Whether the cache is bounded and locked: a local directory of the tools' own (module docstring)."""
    jax_own = not (flag or os.environ.get(ENV)) and bool(os.environ.get("JAX_COMPILATION_CACHE_DIR"))
    return not jax_own and not storage.is_gcs(directory)


@dataclasses.dataclass
class CacheStats:
    """What the persistent cache did in this process: programs read from it, programs compiled, compile seconds
    saved (as JAX counts them: each program's compile time when written, less the read)."""
    directory: str | None
    hits: int = 0
    requests: int = 0
    saved_s: float = 0.0

    def summary(self) -> str:
        if self.directory is None:
            return "compilation cache off"
        return (f"compilation cache {self.directory}: {self.hits} of {self.requests} programs read from it "
                f"({self.saved_s:.1f} s of compiling saved)")


def enable(flag: str | None) -> CacheStats:
    """Turn JAX's persistent compilation cache on where `chosen_dir` says (before anything compiles), or off; the
    returned stats count what it does from here on. A gs:// cache without epath is a ConfigError."""
    import jax

    directory = chosen_dir(flag)
    stats = CacheStats(directory)
    if directory is None:
        jax.config.update("jax_enable_compilation_cache", False)
        return stats
    if storage.is_gcs(directory) and importlib.util.find_spec("etils") is None:
        raise config.ConfigError(f"--compilation-cache {directory}: a gs:// cache needs etils' epath "
                                 "(pip install 'etils[epath]' gcsfs), or give a local directory or 'off'")
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", directory)
    if _bounded(flag, directory):
        jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_S)
    _count_into(stats)
    return stats


def _count_into(stats: CacheStats) -> None:
    """JAX's monitoring events of the cache, counted into `stats`."""
    from jax import monitoring

    def on_event(event: str, **_) -> None:
        if event == "/jax/compilation_cache/cache_hits":
            stats.hits += 1
        elif event == "/jax/compilation_cache/compile_requests_use_cache":
            stats.requests += 1

    def on_duration(event: str, seconds: float, **_) -> None:
        if event == "/jax/compilation_cache/compile_time_saved_sec":
            stats.saved_s += seconds

    monitoring.register_event_listener(on_event)
    monitoring.register_event_duration_secs_listener(on_duration)
