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

A signal can come before the run's handlers exist (while JAX starts, the model is built or
the step compiles): ``install_early``, called by the CLI at process start and again after
``jax.distributed.initialize`` (whose preemption notifier takes SIGTERM over), keeps it for
the run, which then stops after its first step. JAX's own preemption notice (the
coordination service's, e.g. a cloud maintenance event) is honoured too, through
``multihost_utils.reached_preemption_sync_point``, which agrees on the step by itself.
"""

from __future__ import annotations

import itertools
import os
import signal
import threading
from collections.abc import Sequence
from types import FrameType

from shardlib.distributed.runtime import coordination_client

SIGNALS = (signal.SIGTERM, signal.SIGINT)
MPIRUN_NOTICE = "TERM to mpirun"


def watched() -> tuple[int, ...]:
    """TERM and INT; under ``mpirun`` USR1 and CONT too. ``mpirun`` (Open MPI 4.1) forwards
    USR1 to every rank and carries on: ``shardlib launch`` (``relay``) turns a TERM to the
    launcher command into it. Given a TERM itself, ``mpirun`` sends its ranks CONT at once,
    TERM ``odls_base_sigkill_timeout`` seconds later and KILL as long after that: CONT is the
    only prompt notice a rank gets, so under mpirun it counts as the preemption (a job
    suspended and resumed by hand stops too)."""
    if "OMPI_COMM_WORLD_SIZE" in os.environ:
        return (*SIGNALS, signal.SIGUSR1, signal.SIGCONT)
    return SIGNALS


def _name(signum: int) -> str:
    return MPIRUN_NOTICE if signum == signal.SIGCONT else signal.Signals(signum).name


KEY_PREFIX = "shardlib/preempt"
# Runs in one process are numbered so that a notice from an earlier run (a script that
# trains several times) is never read by a later one; every process counts the same way.
_RUNS = itertools.count()
_EARLY: dict[str, str] = {}  # {"name": "SIGTERM"}: received before a run's handlers
_ORIGINAL: dict[int, object] = {}  # the handlers ``install_early`` replaced


def _early(signum: int, frame: FrameType | None) -> None:
    name = _name(signum)
    if _EARLY.get("name") == name:  # the same signal twice: what it would have done
        signal.signal(signum, _ORIGINAL.get(signum, signal.SIG_DFL))
        signal.raise_signal(signum)
    _EARLY.setdefault("name", name)


def install_early(originals: dict | None = None, seen: Sequence[str] = ()) -> None:
    """From here on a SIGTERM/SIGINT is kept for the next run (main thread only).

    ``seen``: signals already received before this (the entry point's list, which it keeps
    filling until the handlers here replace its own: read after they do); ``originals``:
    the process's own handlers from before that entry point's, restored after the run."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in watched():
        previous = signal.signal(sig, _early)
        if previous is not _early:
            _ORIGINAL[sig] = previous if originals is None else originals.get(sig, previous)
    for name in seen[:1]:
        _EARLY.setdefault("name", name)


def restore_early() -> None:
    """Undo ``install_early`` where no run took the handlers over (a command that failed
    before training, or ``main`` called in-process): the process's own handlers return."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in watched():
        if signal.getsignal(sig) is _early:
            signal.signal(sig, _ORIGINAL.pop(sig, signal.SIG_DFL))
    _EARLY.clear()


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
            self.signal_name = _EARLY.pop("name", None)
            for sig in watched():
                previous = signal.signal(sig, self._handle)
                self._previous[sig] = (
                    _ORIGINAL.pop(sig, signal.SIG_DFL) if previous is _early else previous
                )
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signal_name is None:
            self.signal_name = _name(signum)
        if signum in self._previous:
            signal.signal(signum, self._previous.pop(signum))

    def should_stop(self, step: int) -> bool:
        """Called after step ``step`` finished on this process: stop here?"""
        if self._client is None:
            self.reason = self.signal_name
            return self.signal_name is not None
        import jax

        if _jax_notice(step):
            self.reason = "JAX's preemption notice"
            return True

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


def _jax_notice(step: int) -> bool:
    """Has JAX's preemption sync manager agreed on ``step`` as the place to stop?"""
    from jax.experimental import multihost_utils

    try:
        return multihost_utils.reached_preemption_sync_point(step)
    except RuntimeError:  # the preemption service is disabled
        return False
