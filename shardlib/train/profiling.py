"""A profiler window over the steps, and JAX's persistent compilation cache.

``ProfileWindow`` starts a ``jax.profiler`` trace before step START and stops it after step
END has finished (its results fetched), so the trace holds whole steps and nothing of
compilation (the step is compiled ahead of time, before step 1). The files land in
``DIR/plugins/profile/<timestamp>/*.xplane.pb``, the layout TensorBoard's profile plugin and
xprof open.

``compile_cache`` picks the directory where compiled train steps persist between
processes: a restarted or repeated run with the same program, mesh and flags loads its step
instead of compiling it. ``persistent_cache`` turns JAX's cache on around the step's compile
only and puts JAX's settings back after, so programs compiled later in the same process (a
notebook's, a test's) never go through a cache they did not ask for. Entries are kept
however fast they compiled (JAX's default skips programs that compiled in under a second,
which is every program of a small run).

On CPU with more than one device the cache stays off: an executable JAX loads from its
cache can deadlock in the in-process collectives of a multi-device CPU program (measured on
jax 0.10.2: a 2 stage x 2 fsdp x 2 tensor GPipe step, 16 layers, restarted with the cache,
waits in ``rendezvous.cc`` with one device at an all-gather and seven at a collective
permute, and XLA aborts the process after 40 s; compiled fresh, the same step runs).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import jax

from shardlib.core.errors import ShardingError
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


CPU_MULTI_DEVICE = (
    "the persistent compilation cache is off on CPU with more than one device: executables "
    "loaded from it can deadlock in XLA's in-process collectives (see "
    "shardlib/train/profiling.py). It applies to GPU/TPU runs and one-device CPU runs."
)

_SETTINGS = (
    "jax_enable_compilation_cache",
    "jax_compilation_cache_dir",
    "jax_persistent_cache_min_compile_time_secs",
    "jax_persistent_cache_min_entry_size_bytes",
)


def compile_cache(setting: str, devices: Sequence) -> tuple[Path | None, str]:
    """(directory, why it is off): the cache directory ``run.compile_cache`` gives on these
    devices, checked writable now, before anything is compiled; None where it is off.

    A directory set through JAX itself (``JAX_COMPILATION_CACHE_DIR``) wins over ``auto``.
    """
    directory = cache_directory(setting)
    if directory is None:
        return None, ""
    off = len(devices) > 1 and devices[0].platform == "cpu"
    if setting == "auto":
        if off:  # nothing to check and no per-user directory to create
            return None, CPU_MULTI_DEVICE
        if jax.config.jax_compilation_cache_dir:
            directory = Path(jax.config.jax_compilation_cache_dir)
    writable_dir(directory, "run.compile_cache")  # a bad directory is refused even when off
    return (None, CPU_MULTI_DEVICE) if off else (directory, "")


@contextmanager
def persistent_cache(directory: Path | None) -> Iterator[None]:
    """JAX's persistent cache in ``directory`` for the compiles inside (None: as JAX has it),
    and JAX's own settings back afterwards."""
    if directory is None:
        yield
        return
    saved = {name: getattr(jax.config, name) for name in _SETTINGS}
    _forget_open_cache()
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    try:
        yield
    finally:
        for name, value in saved.items():
            jax.config.update(name, value)
        _forget_open_cache()
