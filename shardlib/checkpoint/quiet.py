"""Orbax's noise after a failed read or write, dropped: the run's one line says it all.

When one array of a restore or a save fails, orbax ends the operation while tensorstore's
other reads or writes are still in flight, and each of them, finishing later, leaves a
traceback (a closed event loop, a coroutine never awaited) around the line in which shardlib
names the failure. Only those are dropped; every other error still reaches its hook. And a
reader without a primary host (each process reading alone: ``store._reader``) warns at
every read that it logs no object sizes: that warning is dropped too.
"""

from __future__ import annotations

import gc
import logging
import sys
from contextlib import contextmanager


def quiet_closed_loop() -> None:
    """Drop the ``RuntimeError: Event loop is closed`` of reads or writes that a failed
    restore or save left behind.

    When one read or write fails (a truncated data file; a full disk: tensorstore's
    ``RESOURCE_EXHAUSTED``), orbax ends the operation and closes its event loop while
    tensorstore's others are still in flight; each of them, on completing, calls back into
    the closed loop, and tensorstore reports that through ``sys.unraisablehook`` as a bare
    traceback (about 20 of them, measured on a 64 KiB tmpfs), around the run's one line
    naming the failure. So this filter is installed (once) by each saver and by a failed
    restore; only that error is dropped, every other one reaches the previous hook."""
    previous = sys.unraisablehook
    if getattr(previous, "_drops_closed_loop", False):
        return

    def hook(unraisable) -> None:
        err = unraisable.exc_value
        if isinstance(err, RuntimeError) and str(err) == "Event loop is closed":
            return
        previous(unraisable)

    hook._drops_closed_loop = True
    sys.unraisablehook = hook


@contextmanager
def dropping_failed_reads():
    """Collect the reads orbax leaves pending when one array of a restore fails, quietly, on
    leaving: collected later, each prints a page ("Exception ignored in: <coroutine ...>",
    asyncio's "exception was never retrieved") under the one line that reports the damage."""
    hook, log = sys.unraisablehook, logging.getLogger("asyncio")
    sys.unraisablehook, was_disabled, log.disabled = (lambda _: None), log.disabled, True
    try:
        yield
        gc.collect()
    finally:
        sys.unraisablehook, log.disabled = hook, was_disabled


class _NoSizeLogging(logging.Filter):
    """Drops orbax's ``Global object size logging disabled for `primary_host=None``` (one
    per read, per process), which says nothing about the run."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Global object size logging disabled")


_NO_SIZE_LOGGING = _NoSizeLogging()


def quiet_reads_alone() -> None:
    """Install ``_NoSizeLogging`` on absl's logger (once: the same object)."""
    logging.getLogger("absl").addFilter(_NO_SIZE_LOGGING)
