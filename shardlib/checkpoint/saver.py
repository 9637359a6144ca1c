"""Writing a run's checkpoints with orbax, asynchronously, and hearing at once when it fails.

The format, and reading, are ``shardlib.checkpoint.store``.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from pathlib import Path

import jax

from shardlib.checkpoint.agreement import any_process
from shardlib.checkpoint.quiet import quiet_closed_loop
from shardlib.checkpoint.store import (
    CheckpointError,
    build_meta,
    complete_steps,
    error_summary,
    load_orbax,
)


class _OrbaxSaveErrors(logging.Filter):
    """Keeps the errors orbax's background save threads log, and drops the log (a page of
    traceback): ``Saver`` reports them in one line, at the next step boundary.

    The log is the one place a failure shows without waiting: orbax's finalize thread
    swallows it after logging, and with several processes then waits in a barrier for the
    others, who wait for the failed commit, so ``wait_until_finished`` would hang.
    """

    def __init__(self) -> None:
        super().__init__()
        self.errors: list[BaseException] = []
        self.directories: set[str] = set()
        """The directories of the open savers (a run has one per checkpoint tier)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and f"{os.sep}orbax{os.sep}" in record.pathname:
            self.errors.append(record.exc_info[1])
            return False
        return True

    def take(self, directory: str) -> BaseException | None:
        """The first error of a save to ``directory``: one whose text names it, else one
        that names no open saver's directory (it cannot be told apart)."""

        def names(err: BaseException, d: str) -> bool:
            return f"{d}{os.sep}" in str(err) or str(err).endswith(d)

        for err in self.errors:
            if names(err, directory) or not any(names(err, d) for d in self.directories):
                self.errors.remove(err)
                return err
        return None


_ORBAX_ERRORS = _OrbaxSaveErrors()


def _per_process_manager(options: dict, directory: Path) -> tuple[dict, dict]:
    """Orbax settings under which this process writes, alone, every shard it holds.

    Orbax's own multi-process save writes each array once: a replicated shard by the
    process holding replica 0, metadata and the commit by process 0. A host-local tier
    needs the opposite (each host's disk holds everything that host restores), which is
    what orbax's emergency (P2P) local checkpoint manager configures, taken here as it is:
    no primary host (every process writes its own metadata and commits its own step
    directory), and an array handler that writes every addressable shard, replicas
    included. The processes still meet at orbax's barriers (``local`` keys), so a step is
    written by all or is unfinished everywhere it is not.
    """
    ocp = load_orbax()
    from orbax.checkpoint import type_handlers

    multiprocessing = ocp.options.MultiprocessingOptions(
        primary_host=None, barrier_sync_key_prefix="local"
    )
    arrays = type_handlers.ArrayHandler(
        primary_host=None, replica_id=None, use_replica_parallel=False
    )
    registry = type_handlers.create_type_handler_registry((jax.Array, arrays))
    directory.mkdir(parents=True, exist_ok=True)  # create=False: ours, not process 0's
    options = dict(
        options,
        create=False,
        multiprocessing_options=multiprocessing,
        enable_per_process_directory_creation=True,
    )
    handlers = dict(
        state=ocp.PyTreeCheckpointHandler(
            multiprocessing_options=multiprocessing, type_handler_registry=registry
        ),
        meta=ocp.JsonCheckpointHandler(multiprocessing_options=multiprocessing),
    )
    return options, handlers


def stranded_threads() -> list[threading.Thread]:
    """orbax's background threads still running once its managers are closed.

    A save that fails before its temporary directory exists (``checkpoint_dir`` made
    read-only mid-run) leaves the commit threads of that save waiting for a "directory
    created" signal that never comes, until orbax's async timeout (minutes): being
    non-daemon, they hold the interpreter's exit. The command's entry point ends such a
    process itself once the error is printed (``tools.entry``)."""
    return [
        t
        for t in threading.enumerate()
        if t.is_alive() and not t.daemon and type(t).__module__.startswith("orbax")
    ]


class Saver:
    """Writes one run's checkpoints: every ``every`` steps, on demand, keeping ``keep``.

    Saves are asynchronous: ``save`` returns once the arrays are copied to host memory
    (the next step may then overwrite the device buffers) and a background thread writes
    them; ``close`` waits for the last one. A save that fails in the background is raised
    by ``check`` (called at every step boundary) as one ``CheckpointError`` naming the step,
    and the manager is closed however the run ends, so that no orbax thread outlives it.
    ``per_process`` (the local tier of a multi-process run): each process writes its own
    complete copy of what it holds into its own ``directory`` (``_per_process_manager``).
    """

    def __init__(
        self,
        directory: str | Path,
        *,
        every: int,
        keep: int,
        setting: str = "checkpoint_dir",
        per_process: bool = False,
    ) -> None:
        ocp = load_orbax()
        logging.getLogger("absl").addFilter(_ORBAX_ERRORS)  # once: the same object
        quiet_closed_loop()  # before: they come before the failure is seen
        self.directory = Path(directory)
        if not _ORBAX_ERRORS.directories:  # the run's first saver: no earlier run's errors
            _ORBAX_ERRORS.errors.clear()
        _ORBAX_ERRORS.directories.add(str(self.directory.absolute()))
        options = dict(
            save_interval_steps=max(every, 1),
            max_to_keep=keep or None,
            enable_async_checkpointing=True,
            cleanup_tmp_directories=True,  # unfinished saves of a crashed run
        )
        self._per_process = per_process and jax.process_count() > 1
        if self._per_process:
            options, handlers = _per_process_manager(options, self.directory)
            self._manager = ocp.CheckpointManager(
                self.directory.absolute(),
                options=ocp.CheckpointManagerOptions(**options),
                item_handlers=handlers,
            )
        else:
            self._manager = ocp.CheckpointManager(
                self.directory.absolute(),
                options=ocp.CheckpointManagerOptions(**options),
                item_names=("state", "meta"),
            )
        self._every = every
        self._setting = setting
        """The setting that names the directory (its error says what to fix)."""
        self._saving: int | None = None
        """The step of the newest save started (its error names it)."""
        self._reported = False

    def due(self, step: int) -> bool:
        return self._every > 0 and step % self._every == 0

    def _failed(self, err: Exception) -> CheckpointError:
        kept = complete_steps(self.directory)
        last = f"step {kept[-1]}" if kept else "none yet"
        return CheckpointError(
            f"checkpoint: saving step {self._saving} to {self.directory} failed "
            f"({type(err).__name__}: {error_summary(err)}). Fix: make {self._setting} writable "
            f"with room to spare, then run the same command to resume from the last complete "
            f"checkpoint ({last})."
        )

    def check(self, *, wait: bool = False) -> None:
        """Raise the error of the last save if it failed (``wait``: wait for it to end first).

        Waiting polls rather than blocks in orbax: with several processes a failed save never
        ends (see ``_OrbaxSaveErrors``), but its error shows here and the run can stop.
        """
        while True:
            err = _ORBAX_ERRORS.take(str(self.directory.absolute()))
            if err is not None:
                self._reported = True
                raise self._failed(err)
            if self._saving is None or not self._manager.is_saving_in_progress():
                break
            if not wait:
                return
            time.sleep(0.02)
        try:  # the save has ended: returns at once, or raises the error it ended with
            self._manager.wait_until_finished()
            self._manager.check_for_errors()
        except Exception as err:  # orbax re-raises whatever the writer raised
            self._reported = True
            raise self._failed(err) from None

    def save(self, setup, state: dict, step: int, data: dict | None = None) -> Path | None:
        """Start saving ``state`` as step ``step``; None if that step is already saved."""
        self.check(wait=True)  # orbax waits for the previous save anyway: name its failure
        have = step in self._manager.all_steps()
        if self._per_process:  # each process lists its own directory: decide together, or
            # one process enters the save's barrier while another runs the next step
            if not any_process(not have):
                return None  # every process holds the step
            if have:  # a resumed run recomputes a step only some processes kept: this
                shutil.rmtree(self.directory / str(step))  # process's copy goes, alone
            self._manager.reload()  # (orbax's own delete would wait for the others)
        elif have:
            return None
        ocp = load_orbax()
        meta = build_meta(setup, state, step, data)
        self._saving = step
        try:
            self._manager.save(
                step,
                args=ocp.args.Composite(
                    state=(ocp.args.PyTreeSave if self._per_process else ocp.args.StandardSave)(
                        state
                    ),
                    meta=ocp.args.JsonSave(meta),
                ),
                force=True,
            )
        except Exception as err:
            raise self._failed(err) from None
        return self.directory / str(step)

    def close(self) -> None:
        """Wait for the save in flight (it commits or fails here), then release threads.

        A failed save raises ``CheckpointError`` after the manager is closed. Once a failure
        has been reported in a multi-process run, nothing is waited for: orbax's threads wait
        for the other processes, and the process is about to exit (``shardlib.distributed.peers``).
        """
        try:
            self._close()
        finally:
            _ORBAX_ERRORS.directories.discard(str(self.directory.absolute()))

    def _close(self) -> None:
        if self._reported and jax.process_count() > 1:
            return
        failure = None
        try:
            if not self._reported:  # else the run is already on its way out with the error
                self.check(wait=True)
        except CheckpointError as err:
            failure = err
        try:
            self._manager.close()  # waits again: the failed save's error is raised again
        except Exception:
            self._manager.close()  # its thread has been joined: this one closes the rest
        if failure is not None:
            raise failure
