"""The training loop's side of checkpoints: resume at the start, save on schedule and at the end.

``cfg.checkpoint.dir`` names the run's directory, ``cfg.checkpoint.local_dir`` an optional
fast-restart tier on the host's own storage (``shardlib.checkpoint.tiers``). At start-up
``resume`` decides between the newest complete checkpoint of either tier (falling back past
damaged ones) and a fresh initialisation (``checkpoint.resume``); during the run a save
starts every ``checkpoint.every`` steps, at the last step and when the run is told to stop
(SIGTERM/SIGINT), and a local one every ``checkpoint.local_every`` steps in between. The
writers are created only after a successful restore, so a run that fails to read its
checkpoint (damaged with nothing older, another model) has not touched either directory.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from shardlib.checkpoint.dirlock import DirectoryLock, RunLock
from shardlib.checkpoint.saver import Saver
from shardlib.checkpoint.store import CheckpointError, jsonable, read_meta
from shardlib.checkpoint.tiers import (
    LOCAL_KEEP,
    candidates,
    check_settings,
    local_directory,
    readable_here,
    restore_newest,
)
from shardlib.core.errors import ShardingError
from shardlib.core.layout import mesh_axes
from shardlib.core.values import flatten_table

RESUME_MODES = ("auto", "require", "never")
# Settings that do not change what a step computes: a resumed run may change them freely.
NOT_TRAJECTORY = {"run.steps", "run.compile_cache", "run.gpu_flags", "run.profile_steps",
                  "run.profile_dir", "checkpoint.dir", "checkpoint.every", "checkpoint.keep",
                  "checkpoint.local_dir", "checkpoint.local_every",
                  "checkpoint.resume", "checkpoint.init_from", "dataset.allow_changed",
                  "dataset.eval_every", "dataset.eval_batches"}  # fmt: skip
NOT_TRAJECTORY_SECTIONS = ("metrics.",)

if TYPE_CHECKING:  # the trainer's side of checkpoints: it reads a TrainSetup, never builds one
    from shardlib.train.setup import TrainSetup


def _changed_settings(saved: dict, setup: TrainSetup) -> list[str]:
    now = flatten_table(jsonable(setup.cfg))
    # recorded before a section was renamed: compare under today's names (data. -> dataset.)
    saved = {setup.cfg.current_key(k): v for k, v in flatten_table(saved).items()}
    return [
        f"{k} {saved.get(k)!r} -> {v!r}"
        for k, v in now.items()
        if k not in NOT_TRAJECTORY
        and not k.startswith(NOT_TRAJECTORY_SECTIONS)
        and k in saved
        and saved[k] != v
    ]


def _check_schedule(saved: dict, setup: TrainSetup, step: int) -> None:
    """Refuse a resume whose new ``run.steps`` would move the learning-rate schedule.

    ``run.steps`` may change on resume (train longer, or stop earlier), but warmup_cosine
    and warmup_linear decay to their final rate at the schedule's last step, and every
    schedule clips its warm-up to it: a resumed run on another length would continue on
    another trajectory while saying it continues. Both schedules are evaluated with today's
    optimizer settings (their own changes are reported as changed settings) and compared
    over the steps still to run: a difference before the checkpoint's step is history."""
    flat = {setup.cfg.current_key(k): v for k, v in flatten_table(saved).items()}
    opt = setup.cfg.optimizer
    was = flat.get("optimizer.schedule_steps") or flat.get("run.steps")
    now = opt.schedule_steps or setup.cfg.run.steps
    if not was or was == now:
        return
    old, new = setup.schedule_of_length(was), setup.schedule_of_length(now)
    differ = [t for t in range(step, max(was, now) + 1) if float(old(t)) != float(new(t))]
    if differ:
        t = differ[0]
        raise ShardingError(
            f"run.steps {flat.get('run.steps')} -> {setup.cfg.run.steps} changes the "
            f"learning-rate schedule ({opt.schedule} over {was} -> {now} steps: lr at step "
            f"{t} {float(old(t)):.3g} -> {float(new(t)):.3g}), so the resumed run would not "
            f"continue the checkpoint's trajectory. Fix: schedule_steps={was} to keep its "
            "schedule (the final rate after its last step), or a new checkpoint_dir to start "
            "over on this one."
        )


class RunCheckpoints:
    """Resume, then save: used by ``loop.run`` as a context manager around the steps."""

    def __init__(self, setup: TrainSetup, say: Callable[[str], None]) -> None:
        cfg = setup.cfg.checkpoint
        if cfg.resume not in RESUME_MODES:
            raise ShardingError(
                f"config: resume={cfg.resume!r}; use one of {', '.join(RESUME_MODES)}."
            )
        check_settings(cfg)
        self.setup = setup
        self.directory = Path(cfg.dir)
        self.local_directory = local_directory(cfg.local_dir) if cfg.local_dir else None
        self.say = say
        self.last: Path | None = None
        """The step directory of the newest save started by this run."""
        self._saver: Saver | None = None
        self._local: Saver | None = None
        self.damaged: set[Path] = set()
        """Step directories skipped on resume as damaged: never written over by this run."""
        self.data: dict | None = None
        """What the run reads (``data_identity``): recorded in saves, compared on resume."""
        self.loader_state: Callable[[], dict] | None = None
        """The data loader's position (a prepared dataset's), recorded in every save."""
        self.saved_loader: dict | None = None
        """The loader position of the checkpoint resumed from (None: none recorded)."""

    @contextmanager
    def locked(self):
        """The directories' locks (``with ckpt.locked():``): one run per directory."""
        with ExitStack() as stack:
            stack.enter_context(RunLock(self.directory, say=self.say))
            if self.local_directory is not None:
                # several processes: each its own directory (a refusal on one rank ends the
                # others, as any error of one rank does)
                local = self.local_directory != Path(self.setup.cfg.checkpoint.local_dir)
                lock = DirectoryLock(self.local_directory) if local else None
                stack.enter_context(lock or RunLock(self.local_directory, say=self.say))
            yield

    def resume(self) -> dict | None:
        """The restored state, or None to start from initialisation."""
        mode = self.setup.cfg.checkpoint.resume
        found = candidates(self.directory, self.local_directory)
        found = readable_here(found, mesh_axes(self.setup.mesh), self.say)
        if mode == "never":
            if found:
                where = ", ".join(f"{c.tier} step {c.step}" for c in found)
                raise ShardingError(
                    f"checkpoint_dir={str(self.directory)!r} (or checkpoint.local_dir) already "
                    f"holds checkpoints ({where}) and resume=never. Fix: resume=auto to "
                    "continue, or choose new directories; existing checkpoints are never "
                    "overwritten."
                )
            return None
        if not found:
            if mode == "auto":
                return None
            read_meta(self.directory)  # resume=require: says why there is none

        def accept(meta: dict) -> None:
            saved_data = meta.get("data", {})
            self._check_data(saved_data)
            self.saved_loader = (saved_data.get("identity") or {}).get("loader")

        restored, skipped = restore_newest(found, self.setup, accept, self.say)
        self.damaged = {c.path for c in skipped}
        self.say(f"resumed from {restored.path} (step {restored.step})")
        _check_schedule(restored.meta.get("config", {}), self.setup, restored.step)
        changed = _changed_settings(restored.meta.get("config", {}), self.setup)
        if changed:
            self.say("settings changed since that checkpoint: " + ", ".join(changed))
        return restored.state

    def _check_data(self, saved: dict) -> None:
        """Refuse to resume on other data than the checkpoint's, unless allowed."""
        was, now = saved.get("identity"), self.data
        if not was or not now or self.setup.cfg.dataset.allow_changed:
            return
        keys = ("bytes", "sample_sha256")
        if all(was.get(k) == now.get(k) for k in keys):
            if was.get("path") != now.get("path"):
                self.say(f"data moved: {was.get('path')} -> {now.get('path')} (same content)")
            return
        what = "size" if was.get("bytes") != now.get("bytes") else "sampled content"
        raise ShardingError(
            f"data={now.get('path') or 'embedded'} is not what the checkpoint in "
            f"{str(self.directory)!r} was trained on (was {was.get('path') or 'embedded'}: "
            f"{was.get('bytes')} bytes, modified {_when(was.get('mtime'))}; now "
            f"{now.get('bytes')} bytes, modified {_when(now.get('mtime'))}; the {what} "
            "differs). Fix: restore that data, or resume on this data on purpose with "
            "dataset.allow_changed=true."
        )

    def __enter__(self) -> RunCheckpoints:
        cfg = self.setup.cfg.checkpoint
        self._saver = Saver(self.directory, every=cfg.every, keep=cfg.keep)
        if self.local_directory is not None:
            self._local = Saver(
                self.local_directory,
                every=cfg.local_every,
                keep=LOCAL_KEEP,
                setting="checkpoint.local_dir",
                per_process=True,
            )
        return self

    def _savers(self) -> list[Saver]:
        return [s for s in (self._saver, self._local) if s is not None]

    def after_step(self, state: dict, step: int, *, final: bool) -> None:
        """Start a save of the state after ``step`` steps if it is due (or ``final``); raise the
        error of an earlier save that failed in the background."""
        for saver in self._savers():
            saver.check()
        persistent = final or self._saver.due(step)
        local = self._local is not None and not persistent and self._local.due(step)
        if persistent or local:
            saver = self._saver if persistent else self._local
            data = self.data
            if self.loader_state is not None:  # every process's, gathered: all call this
                data = {**(data or {}), "loader": self.loader_state()}
            path = saver.directory / str(step)
            saved = saver.save(self.setup, self.setup.saved_form(state), step, data)
            if self.setup.plan.offload.nvme_path:  # the next step rewrites the files it reads
                saver.check(wait=True)
            if saved is None and path in self.damaged:
                self.say(
                    f"checkpoint: step {step} not saved: {path} is the damaged step skipped "
                    "on resume (left as it is; move it away to save there)"
                )
            self.last = path

    def __exit__(self, exc_type, exc, tb) -> None:
        failure = None
        for saver in self._savers():  # each is closed, whatever the other did
            try:
                saver.close()
            except CheckpointError as err:
                failure = failure or err
        if failure is not None:
            if exc is None:
                raise failure
            self.say(f"also: {failure}")  # the error already on its way out says it first


def _when(mtime: float | None) -> str:
    import time

    return "?" if mtime is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(mtime))
