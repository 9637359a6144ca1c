"""One process of a multi-process run failing must end every process, promptly and audibly.

Left to themselves, the other processes of a run learn of a failure late and badly: they
wait in the step's collectives until gloo gives up, then in JAX's shutdown barrier until
``shutdown_timeout``, and die with SIGABRT and a C++ stack trace that does not mention the
cause. So in a multi-process run:

* a process that fails prints its error prefixed with its rank (every rank prints its own
  errors, not only process 0), posts it in the coordination service's key-value store
  (``shardlib/error/<rank>``) and exits at once, skipping the shutdown barrier;
* every process runs a ``PeerWatch`` thread that reads those keys a few times a second and
  ends its own process with one line naming the failed rank; it also ends its process when
  the coordination service stops answering (process 0 is gone), or when another process
  shows no sign of life for half of ``heartbeat_timeout_s`` (killed, hung, unplugged).

Complete checkpoints are never at risk: orbax renames a step's directory only once every
process has finished writing it.
"""

from __future__ import annotations

import os
import sys
import threading
import time

ERROR_PREFIX = "shardlib/error/"
ALIVE_PREFIX = "shardlib/alive/"
STOPPING_PREFIX = "shardlib/stopping/"  # a process read another's error and is ending
ACK_WAIT_S = 3.0
POLL_S = 0.2
_STARTED_AS: list[int] = []  # the rank this process was started as, before it has joined
_FAILING = threading.Event()
"""Set once this process reports an error of its own (``failing``): its watcher then ends
nothing, so that the error is its one line and its exit code stands, even when the other
processes fail too (a data file missing on every host: each reports it, none says another
failed)."""
_ENDING = threading.Lock()  # one of: this process's own error, or its watcher's verdict


def _state():
    from jax._src import distributed as _dist  # as distributed.coordination_client does

    return _dist.global_state


def multi_process() -> bool:
    """True once this process has joined a run of several processes."""
    return _state().client is not None


def started_as(process_id: int) -> None:
    """Record the rank given on the command line: errors before joining carry it too."""
    _STARTED_AS[:] = [process_id]


def rank_prefix() -> str:
    """``"process 1: "`` in a multi-process run (or one being joined), else empty."""
    if multi_process():
        return f"process {_state().process_id}: "
    return f"process {_STARTED_AS[0]}: " if _STARTED_AS else ""


def failing() -> None:
    """Claim the process's one line for its own error (before printing it): a watcher
    already printing its verdict wins instead, and ends the process before this returns."""
    with _ENDING:
        _FAILING.set()


def publish_error(message: str) -> None:
    """Tell the other processes why this one stops (best effort: it may be the cause).

    Process 0 hosts the coordination service, and the others abort (C++, no word on why)
    the moment it goes: so it waits, up to ``ACK_WAIT_S``, until they have read the error.
    """
    state = _state()
    if state.client is None:
        return
    try:
        state.client.key_value_set(f"{ERROR_PREFIX}{state.process_id}", message[:2000])
        deadline = time.monotonic() + ACK_WAIT_S
        while state.process_id == 0 and time.monotonic() < deadline:
            told = {
                k.rsplit("/", 1)[-1] for k, _ in state.client.key_value_dir_get(STOPPING_PREFIX)
            }
            told |= {k.rsplit("/", 1)[-1] for k, _ in state.client.key_value_dir_get(ERROR_PREFIX)}
            if len(told - {str(state.process_id)}) >= state.num_processes - 1:
                break  # each has read the error, or has failed on its own
            time.sleep(POLL_S / 4)
    except Exception:  # the service may be what failed
        pass


def exit_now(code: int) -> None:
    """End this process now: JAX's shutdown barrier would wait for processes that are gone."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class PeerWatch:
    """A daemon thread that ends this process when another process of the run fails.

    Each process bumps ``shardlib/alive/<rank>`` every ``POLL_S``; a process whose counter
    stands still for ``lost_after_s`` is declared lost. That is half of JAX's own heartbeat
    timeout, because when JAX's coordination service notices first it aborts every process
    with a C++ stack trace and no word on which process it lost.
    """

    def __init__(self, lost_after_s: float) -> None:
        state = _state()
        self._client, self._me, self._n = state.client, state.process_id, state.num_processes
        self._lost_after_s = lost_after_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="shardlib-peers", daemon=True)

    def start(self) -> PeerWatch:
        if self._client is not None:
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def await_verdict(self) -> None:
        """Give the watcher its bound to name a lost or failed process before the caller
        reports its own error: a collective whose peer died (gloo's "Connection closed by
        peer") fails at once, while the watcher names the process within ``lost_after_s``
        and ends this one itself (``_end``). Returns if it names nobody in that time."""
        if self._thread.is_alive():
            self._thread.join(self._lost_after_s + 2 * POLL_S)

    def _end(self, why: str) -> None:
        with _ENDING:
            if self._stop.is_set() or _FAILING.is_set():
                return  # stopped, or the process is on its way out with its own error
            print(f"process {self._me}: stopping: {why}", file=sys.stderr, flush=True)
            try:  # process 0 waits for this before it takes the coordination service down
                self._client.key_value_set(f"{STOPPING_PREFIX}{self._me}", "1", True)
            except Exception:
                pass
            exit_now(1)

    def _watch(self) -> None:
        others = [i for i in range(self._n) if i != self._me]
        seen = {i: (None, time.monotonic()) for i in others}  # rank -> (counter, when it moved)
        beat, unreachable = 0, 0
        while not self._stop.wait(POLL_S):
            beat += 1
            try:
                self._client.key_value_set(f"{ALIVE_PREFIX}{self._me}", str(beat), True)
                errors = self._client.key_value_dir_get(ERROR_PREFIX)
                alive = dict(self._client.key_value_dir_get(ALIVE_PREFIX))
                unreachable = 0
            except Exception as err:  # the coordination service (process 0) is unreachable
                unreachable += 1
                if unreachable * POLL_S >= min(2.0, self._lost_after_s) and self._me != 0:
                    first = (str(err).strip().splitlines() or [""])[0][:200]
                    self._end(f"lost the coordination service: process 0 is gone ({first})")
                continue
            for key, message in errors:
                rank = key.rsplit("/", 1)[-1]
                if rank != str(self._me):
                    self._end(f"process {rank} failed: {message}")
            now = time.monotonic()
            for i in others:
                counter = alive.get(f"{ALIVE_PREFIX}{i}")
                if counter != seen[i][0]:
                    seen[i] = (counter, now)
            lost = [i for i in others if now - seen[i][1] > self._lost_after_s]
            if lost:
                names = ", ".join(f"process {i}" for i in lost)
                self._end(f"lost {names}: no sign of life for {self._lost_after_s:g} s")


def watch_peers(heartbeat_timeout_s: float) -> PeerWatch | None:
    """Start a ``PeerWatch`` in a multi-process run (None otherwise)."""
    return PeerWatch(heartbeat_timeout_s / 2).start() if multi_process() else None
