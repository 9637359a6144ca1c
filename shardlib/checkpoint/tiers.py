"""Two tiers of checkpoints, and a resume from the newest complete one of either.

The *persistent* tier (``checkpoint.dir``, every ``checkpoint.every`` steps, ``keep`` of
them) is the run's history on shared storage. The *local* tier (``checkpoint.local_dir``,
every ``checkpoint.local_every`` steps) is for a fast restart, as MaxText's emergency
checkpoints and Megatron-LM's local checkpoints are: frequent saves to storage on the host
itself, of which only the newest ``LOCAL_KEEP`` are kept, so that a kill between two
persistent checkpoints loses at most ``local_every`` steps. Both tiers are orbax step
directories of the same format (``shardlib.checkpoint.store``), written by the same
``Saver``.

A resume lists the complete steps of both tiers, newest first (at one step, the local copy
first: it is the faster read), and restores the first that reads back as saved. A damaged
one (unreadable metadata or arrays, a tensor whose fingerprint differs) is skipped with one
line naming what is damaged and the step, and the next older one is tried; it is left on
disk as it is. Only when no older complete step exists is the damage an error.

Several processes: each process writes its local tier into its own directory
(``local_directory``: ``<local_dir>/process-<i>-of-<n>``, on its host's disk; the names keep
processes apart where hosts share a path, and a run of another process count away from
steps it cannot read), every shard it holds, replicated ones included
(``saver._per_process_manager``), so that it restores from its own disk alone. A step counts
only where it is complete on every process (``agreed_steps``: the steps all processes list),
and the processes agree on each candidate's fate before moving on (``agreement``): a step
damaged on one host is skipped by all, named by what that host could not read. The
persistent tier's steps, shared by all processes, are read the same way: each process its
own shards, and any one's failure is every one's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np

from shardlib.checkpoint.agreement import any_process, first_said, on_this_process
from shardlib.checkpoint.store import (
    DamagedCheckpoint,
    Restored,
    complete_steps,
    read_meta,
)
from shardlib.checkpoint.store import restore as restore_step
from shardlib.core.errors import ShardingError

LOCAL_KEEP = 2
"""Local checkpoints kept: the newest, and one to fall back to if it is damaged."""
AGREED_MAX = 8
"""Newest local steps each process reports when the processes agree on a step."""


@dataclass(frozen=True)
class Candidate:
    """One complete checkpoint of one tier."""

    step: int
    directory: Path
    tier: str
    """``local`` or ``persistent``."""

    @property
    def path(self) -> Path:
        return self.directory / str(self.step)


def check_settings(cfg) -> None:
    """Refuse tier settings that cannot work, before anything is read or written."""
    if cfg.every < 0 or cfg.keep < 0:
        raise ShardingError("config: checkpoint.every and checkpoint.keep must be >= 0.")
    if cfg.local_dir is None:
        return
    if cfg.local_every < 1:
        raise ShardingError(
            f"config: checkpoint.local_every={cfg.local_every} must be >= 1. Fix: "
            "checkpoint.local_every=10 (a save to the local tier every 10 steps)."
        )
    if not cfg.dir:
        raise ShardingError(
            "config: checkpoint.local_dir needs a persistent tier as well. Fix: set "
            "checkpoint_dir (shared storage) next to checkpoint.local_dir."
        )
    persistent, local = Path(cfg.dir).absolute(), Path(cfg.local_dir).absolute()
    if persistent == local or persistent in local.parents or local in persistent.parents:
        raise ShardingError(
            f"config: checkpoint.local_dir={cfg.local_dir!r} and checkpoint.dir={cfg.dir!r} "
            "are the same directory or one holds the other; the tiers keep their steps apart. "
            "Fix: a local_dir on the host's own disk, outside checkpoint_dir."
        )


def local_directory(local_dir: str | Path) -> Path:
    """This process's local tier: ``local_dir`` itself with one process, else its own
    ``process-<i>-of-<n>`` directory below it."""
    if jax.process_count() == 1:
        return Path(local_dir)
    return Path(local_dir) / f"process-{jax.process_index()}-of-{jax.process_count()}"


def agreed_steps(steps: list[int]) -> list[int]:
    """The steps of ``steps`` that every process also lists (each lists its own disk)."""
    if jax.process_count() == 1:
        return list(steps)
    from jax.experimental import multihost_utils

    newest = np.full(AGREED_MAX, -1, np.int64)
    mine = sorted(steps)[-AGREED_MAX:]
    newest[: len(mine)] = mine
    every = np.asarray(multihost_utils.process_allgather(newest))  # [processes, AGREED_MAX]
    return common_steps(every)


def common_steps(every: np.ndarray) -> list[int]:
    """[processes, n] step lists padded with -1 -> the steps in every row, ascending."""
    common = set(every[0].tolist())
    for row in every[1:]:
        common &= set(row.tolist())
    return sorted(s for s in common if s >= 0)


def candidates(persistent: Path, local: Path | None) -> list[Candidate]:
    """Complete checkpoints of both tiers, newest first; at one step the local one first."""
    found = [Candidate(s, persistent, "persistent") for s in complete_steps(persistent)]
    if local is not None:
        found += [Candidate(s, local, "local") for s in agreed_steps(complete_steps(local))]
    return sorted(found, key=lambda c: (-c.step, c.tier != "local"))


def readable_here(found: list[Candidate], axes: dict[str, int], say) -> list[Candidate]:
    """``found`` less the local steps of a multi-process run written on another mesh.

    Each process's local copy holds only the shards its devices held when it was written;
    on another mesh a process needs others, which its disk does not have (the persistent
    tier has them all). Every process decides alike: a step any of them drops is dropped.
    """
    if jax.process_count() == 1:
        return found
    kept = []
    for c in found:
        other = None
        if c.tier == "local":
            try:
                other = read_meta(c.directory, c.step)[1].get("mesh", {}).get("axes")
            except DamagedCheckpoint:  # reported, and skipped, by restore_newest
                other = None
            other = other if other is not None and other != axes else None
        if c.tier == "local" and any_process(other is not None):
            say(
                f"checkpoint: local step {c.step} ({c.path}) was written on mesh {other}, "
                f"this run's is {axes}: each host's local copy holds only its own shards "
                "of that mesh; an older or persistent step is restored instead."
            )
            continue
        kept.append(c)
    return kept


def restore_newest(
    found: list[Candidate],
    setup,
    accept: Callable[[dict], None],
    say: Callable[[str], None],
) -> tuple[Restored, list[Candidate]]:
    """The newest of ``found`` that reads back as saved, and the damaged ones skipped.

    ``accept(meta)`` checks a candidate before its arrays are read (the data it was trained
    on): its error ends the resume, as an error of another model does. Damage moves on to the
    next older candidate; the oldest one's damage is raised. Nothing on disk is changed.
    """
    skipped = []
    for i, candidate in enumerate(found):
        try:
            try:  # the metadata is read by every process from its own copy (local tier)
                meta = read_meta(candidate.directory, candidate.step)[1]
                damaged = None
            except DamagedCheckpoint as err:
                damaged = err
            what = first_said(f"{damaged.what}{on_this_process()}" if damaged else "")
            if what:  # on this process or another: every process skips the step
                damaged = damaged or DamagedCheckpoint(
                    f"checkpoint {candidate.path}: {what} is damaged. Fix: restore an earlier "
                    "step, or delete this step directory.",
                    step=candidate.step,
                    what=what,
                )
                damaged.what = what  # the first process's words, on every process
                raise damaged
            accept(meta)
            restored = restore_step(candidate.directory, setup, candidate.step)
            return restored, skipped
        except DamagedCheckpoint as err:
            if i + 1 == len(found):
                raise
            older = found[i + 1]
            skipped.append(candidate)
            say(
                f"checkpoint: skipped step {candidate.step} ({candidate.tier}, "
                f"{candidate.path}): {err.what} is damaged; falling back to step {older.step} "
                f"({older.tier}, {older.path}). The damaged step is left as it is."
            )
    raise AssertionError("restore_newest needs at least one candidate")
