"""SIGTERM / SIGINT -> stop at the next step boundary, the same boundary on every process.

Schedulers announce preemption with SIGTERM (Kubernetes, SLURM with ``--signal``, cloud
spot VMs) and give the job a grace period; a person presses Ctrl-C (SIGINT). Either way the
step in flight finishes, a checkpoint is written and the process exits with status 0.

With several processes a signal usually reaches one of them first, yet all of them must
stop after the same step or the others would wait forever in the next step's collectives.
The process that saw the signal at boundary ``t`` publishes "stop at ``t + 1``" in the
coordination service's key-value store and runs one more step. Every process reads the
store at every boundary; no process can finish step ``t + 1`` before the publisher has
started it (the step's collectives need every process), so all of them see the notice by
boundary ``t + 1`` and stop there. Several notices: the earliest wins.
"""

from __future__ import annotations

import itertools
import signal
import threading
from types import FrameType

from shardlib.distributed import coordination_client

SIGNALS = (signal.SIGTERM, signal.SIGINT)
KEY_PREFIX = "shardlib/preempt"
# Runs in one process are numbered so that a notice from an earlier run (a script that
# trains several times) is never read by a later one; every process counts the same way.
_RUNS = itertools.count()


class Preemption:
    """Context manager: installs the handlers, answers ``should_stop(step)`` each boundary.

    A second signal of the same kind gets the previous handler (Ctrl-C twice interrupts at
    once). Handlers can only be installed from the main thread; elsewhere this is inert.
    """

    def __init__(self) -> None:
        self.signal_name: str | None = None
        """Name of the first signal this process received (None: none yet)."""
        self.reason: str | None = None
        """Why the run stops, once ``should_stop`` said so (e.g. "SIGTERM on process 1")."""
        self._previous: dict[int, object] = {}
        self._published = False
        self._client = None
        self._prefix = f"{KEY_PREFIX}/{next(_RUNS)}/"

    def __enter__(self) -> Preemption:
        self._client = coordination_client()
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signal_name is None:
            self.signal_name = signal.Signals(signum).name
        if signum in self._previous:
            signal.signal(signum, self._previous.pop(signum))

    def should_stop(self, step: int) -> bool:
        """Called after step ``step`` finished on this process: stop here?"""
        if self._client is None:
            self.reason = self.signal_name
            return self.signal_name is not None
        import jax

        if self.signal_name is not None and not self._published:
            notice = f"{step + 1}:{self.signal_name}"
            self._client.key_value_set(f"{self._prefix}{jax.process_index()}", notice)
            self._published = True
        notices = self._client.key_value_dir_get(self._prefix)
        if not notices:
            return False
        stop_at, origin = min(
            (int(at), f"{name} on process {key.rsplit('/', 1)[-1]}")
            for key, value in notices
            for at, name in [value.split(":", 1)]
        )
        if stop_at > step:
            return False
        self.reason = origin
        return True
