"""A profiler window over the steps, and JAX's persistent compilation cache.

``ProfileWindow`` starts a ``jax.profiler`` trace before step START and stops it after step
END has finished (its results fetched), so the trace holds whole steps and nothing of
compilation (the step is compiled ahead of time, before step 1). The files land in
``DIR/plugins/profile/<timestamp>/*.xplane.pb``, the layout TensorBoard's profile plugin and
xprof open.

``enable_compile_cache`` points JAX at a directory where compiled executables persist
between processes: a restarted or repeated run with the same program, mesh and flags loads
its step instead of compiling it. Entries are kept however fast they compiled (JAX's
default skips programs that compiled in under a second, which is every program of a small
run).
"""

from __future__ import annotations

import os
from pathlib import Path

import jax

from shardlib.errors import ShardingError
from shardlib.train.metrics import writable_dir


class ProfileWindow:
    """Trace steps START..END (1-based, both included) of a run of ``last`` steps."""

    def __init__(self, steps: str, directory: str, *, first: int, last: int) -> None:
        self.start = self.end = 0
        self.directory = directory
        self.active = False
        if not steps:
            return
        start, sep, end = steps.partition(":")
        try:
            self.start, self.end = int(start), int(end if sep else start)
        except ValueError:
            raise ShardingError(
                f"profile_steps={steps!r} is not START:END. Fix: e.g. profile_steps=5:7."
            ) from None
        if not 2 <= self.start <= self.end:
            raise ShardingError(
                f"profile_steps={steps!r}: need 2 <= START <= END (step 1 warms up). "
                "Fix: e.g. profile_steps=5:7."
            )
        if self.end > last:
            raise ShardingError(
                f"profile_steps={steps!r} ends after the last step ({last}). Fix: choose a "
                f"window inside 2:{last}, or run more steps."
            )
        if self.start <= first:
            raise ShardingError(
                f"profile_steps={steps!r} starts at or before step {first}, where this run "
                "resumes. Fix: choose a later window."
            )
        writable_dir(Path(directory), "profile_dir")

    def before(self, step: int) -> None:
        """Called before running step ``step`` (1-based)."""
        if self.start and step == self.start:
            jax.profiler.start_trace(self.directory)
            self.active = True

    def after(self, step: int) -> None:
        """Called once step ``step``'s results are on the host."""
        if self.active and step == self.end:
            jax.profiler.stop_trace()
            self.active = False

    def close(self) -> None:
        if self.active:  # the run stopped inside the window: keep what was traced
            jax.profiler.stop_trace()
            self.active = False


def _forget_open_cache() -> None:
    """JAX opens its cache once per process, at the first compile; a run in the same process
    with another directory (a notebook, a test) has it reopened there."""
    from jax._src import compilation_cache  # no public way to reopen it (jax <= 0.12)

    reset = getattr(compilation_cache, "reset_cache", None)
    if reset is not None:
        reset()


def cache_directory(setting: str) -> Path | None:
    """The compilation cache directory ``run.compile_cache`` names (None: off)."""
    if setting == "off":
        return None
    if setting == "auto":
        base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
        return Path(base) / "shardlib" / "jax-compile"
    return Path(setting)


def enable_compile_cache(setting: str) -> Path | None:
    """Turn the persistent cache on (or leave it off); returns the directory in use.

    A directory set through JAX itself (``JAX_COMPILATION_CACHE_DIR``) wins over ``auto``.
    """
    directory = cache_directory(setting)
    if directory is None:
        return None
    if setting == "auto" and jax.config.jax_compilation_cache_dir:
        directory = Path(jax.config.jax_compilation_cache_dir)
    writable_dir(directory, "run.compile_cache")
    if jax.config.jax_compilation_cache_dir != str(directory):
        _forget_open_cache()
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return directory
