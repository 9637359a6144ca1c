"""The fast-restart tier: local checkpoints every 2 steps next to persistent ones every 10.

A run killed at step 7 resumes from the local step 6 (not from step 0) and continues
bitwise as the uninterrupted run does; the local tier keeps its newest two; a damaged
newest checkpoint of either tier falls back to the previous complete one with a line that
names the tensor and the step; settings that cannot work are refused. One process, one
device, the tiny model of ``tiny_runs`` (one compilation for the whole file).
"""

import gc
import io
import os
import re
import shutil
import signal
import subprocess
import sys
from functools import cache
from pathlib import Path

import numpy as np
import pytest
from checkpoint_damage import DAMAGE, WHAT, snapshot
from fault_runs import chattr, child_env
from rich.console import Console
from tiny_runs import ONE, TINY, scratch_dir, setup

from shardlib.checkpoint.resume import RunCheckpoints
from shardlib.checkpoint.store import CheckpointError, complete_steps
from shardlib.checkpoint.tiers import common_steps
from shardlib.core.errors import ShardingError
from shardlib.train.config import override
from shardlib.train.loop import run
from shardlib.train.setup import TrainSetup, make_setup

# a damaged step's failed reads are collected quietly (no "Exception ignored in" pages);
# "error" here turned another module's leftover orbax coroutines, collected during one of
# these tests, into its failure (seen 3 of 5 runs of tests/checkpoint in one process)
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

TIERS = {"checkpoint_every": 10, "keep": 2, "checkpoint.local_every": 2}


class Killed(Exception):
    """Stands for kill -9: the run ends between two steps, no final save."""


@cache
def tiered(root: str) -> TrainSetup:
    """TINY on one device with both tiers below ``root`` (``persistent/`` and ``local/``)."""
    cfg = override(TINY, {**TIERS, "checkpoint_dir": f"{root}/persistent"})
    return make_setup(override(cfg, {"checkpoint.local_dir": f"{root}/local"}), setup(ONE).mesh)


def dirs(root: Path) -> tuple[Path, Path]:
    return root / "persistent", root / "local"


def killed_at(s: TrainSetup, step: int, monkeypatch) -> None:
    """Run from scratch until ``step``, then end as a kill would once the saves started
    before it have committed (a save in flight at the kill is an unfinished one: ignored)."""
    after_step = RunCheckpoints.after_step

    def then_kill(self, state, done, *, final):
        after_step(self, state, done, final=final)
        if done == step:
            for saver in self._savers():
                saver.check(wait=True)
            raise Killed

    with monkeypatch.context() as m:
        m.setattr(RunCheckpoints, "after_step", then_kill)
        with pytest.raises(Killed):
            run(s, show=False)


@cache
def reference() -> tuple[Path, list[float], dict[str, list[int]]]:
    """The uninterrupted run (40 steps): its directory (the other tests run there too), its
    losses and the steps it left in each tier."""
    root = scratch_dir("shardlib-tiers-")
    losses = run(tiered(str(root)), show=False).losses
    return root, losses, {d.name: complete_steps(d) for d in dirs(root)}


@cache
def killed_run(step: int) -> Path:
    """Both tiers as a run killed at ``step`` left them (copy before changing them)."""
    root = reference()[0]
    shutil.rmtree(root / "persistent")
    shutil.rmtree(root / "local")
    patch = pytest.MonkeyPatch()
    try:
        killed_at(tiered(str(root)), step, patch)
    finally:
        patch.undo()
    copy = scratch_dir(f"shardlib-killed-{step}-")
    for d in dirs(root):
        shutil.copytree(d, copy / d.name)
    return copy


def resume_from(directories: Path, tmp_path: Path, **kw):
    """Resume the run whose tiers ``directories`` holds, in a copy: (result, printed text)."""
    root = reference()[0]
    for d in dirs(root):
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(directories / d.name, d)
    out = io.StringIO()
    try:
        result = run(tiered(str(root)), show=False, console=Console(file=out, width=1000), **kw)
    finally:
        gc.collect()  # anything the fallback left pending shows here, in this test
    return result, out.getvalue()


def test_uninterrupted_run_keeps_two_local_steps_and_saves_no_step_twice():
    _, losses, kept = reference()
    assert len(losses) == 40
    assert kept["persistent"] == [30, 40]  # every 10, keep 2
    assert kept["local"] == [36, 38]  # every 2 but not 10, 20, ... (persistent), keep 2


def test_kill_at_step_7_resumes_from_local_step_6_bitwise(tmp_path):
    killed = killed_run(7)
    persistent, local = dirs(killed)
    assert complete_steps(persistent) == [] and complete_steps(local) == [4, 6]
    result, text = resume_from(killed, tmp_path)
    assert re.search(r"resumed from \S+/local/6 \(step 6\)", text), text
    assert result.records[0]["step"] == 7  # one step lost: the local interval is 2
    assert result.losses == reference()[1][6:]  # exact float equality, steps 7..40
    root = reference()[0]
    assert complete_steps(root / "local") == [36, 38]  # the resumed run's own retention


KILL_9 = """
import os, signal, sys
from test_local_tier import RunCheckpoints, run, tiered
after_step = RunCheckpoints.after_step
def then_kill(self, state, done, *, final):
    after_step(self, state, done, final=final)
    if done == int(sys.argv[2]):
        for saver in self._savers():
            saver.check(wait=True)
        os.kill(os.getpid(), signal.SIGKILL)
RunCheckpoints.after_step = then_kill
run(tiered(sys.argv[1]), show=False)
"""


@pytest.mark.slow  # the fast subset keeps the inner loop under 3 minutes
def test_kill_9_at_step_7_resumes_from_local_step_6_bitwise(tmp_path):
    """As above, with a real kill -9 in a child process (same XLA flags, so the same machine
    code; about 10 s): no clean exit, both directories' locks left behind and taken over."""
    root = reference()[0]
    for d in dirs(root):
        shutil.rmtree(d, ignore_errors=True)
    env = child_env(tmp_path / "cache")
    here = Path(__file__).resolve().parent
    env["PYTHONPATH"] = f"{here}{os.pathsep}{here.parent}{os.pathsep}{env['PYTHONPATH']}"
    command = [sys.executable, "-c", KILL_9, str(root), "7"]
    child = subprocess.run(command, env=env, capture_output=True, timeout=300)
    assert child.returncode == -signal.SIGKILL, child.stdout + child.stderr
    assert complete_steps(root / "persistent") == [] and complete_steps(root / "local") == [4, 6]
    out = io.StringIO()
    result = run(tiered(str(root)), show=False, console=Console(file=out, width=1000))
    assert out.getvalue().count("took over") == 2, out.getvalue()  # both locks
    assert re.search(r"resumed from \S+/local/6 \(step 6\)", out.getvalue())
    assert result.records[0]["step"] == 7 and result.losses == reference()[1][6:]


@pytest.mark.parametrize("damage", DAMAGE)
def test_damaged_newest_local_step_falls_back_to_the_previous_local_one(tmp_path, damage, caplog):
    killed = tmp_path / "killed"
    shutil.copytree(killed_run(7), killed)
    DAMAGE[damage](killed / "local" / "6")
    damaged = snapshot(killed / "local" / "6")
    result, text = resume_from(killed, tmp_path, stop_after=8)
    named = rf"skipped step 6 \(local, \S+/local/6\): {WHAT[damage]} is damaged; falling back"
    assert re.search(named + r" to step 4 \(local", text), text
    assert "step 6 not saved" in text  # the damaged step is not written over
    assert [r["step"] for r in result.records] == [5, 6, 7, 8]
    assert result.losses == reference()[1][4:8]
    root = reference()[0]
    assert snapshot(root / "local" / "6") == damaged
    assert not [r for r in caplog.records if r.name == "asyncio"]  # one line, not pages


def test_damaged_newest_local_step_falls_back_to_an_older_persistent_one(tmp_path):
    killed = tmp_path / "killed"
    shutil.copytree(killed_run(13), killed)
    assert complete_steps(killed / "persistent") == [10]
    assert complete_steps(killed / "local") == [8, 12]
    DAMAGE["flipped-byte"](killed / "local" / "12")
    result, text = resume_from(killed, tmp_path, stop_after=14)
    assert re.search(r"skipped step 12 \(local, \S+\): tensor \S+ is damaged; falling back "
                     r"to step 10 \(persistent", text), text  # fmt: skip
    assert result.losses == reference()[1][10:14]


def test_damage_with_nothing_older_is_refused_and_left_alone(tmp_path):
    killed = tmp_path / "killed"
    shutil.copytree(killed_run(7), killed)
    shutil.rmtree(killed / "local" / "4")
    DAMAGE["truncated"](killed / "local" / "6")
    before = snapshot(killed / "local")
    with pytest.raises(CheckpointError, match=r"local/6 is damaged or incomplete and cannot be "
                       r"read: tensor \S+.*Fix: restore an earlier step"):  # fmt: skip
        resume_from(killed, tmp_path)
    root = reference()[0]
    assert snapshot(root / "local") == before  # where the run was refused


BAD = {
    "local_every=0": ({"checkpoint.local_every": 0}, r"local_every=0 must be >= 1"),
    "local_every=-2": ({"checkpoint.local_every": -2}, r"local_every=-2 must be >= 1"),
    "same dir": ({"checkpoint.local_dir": "{root}/persistent"}, r"the same directory"),
    "inside dir": ({"checkpoint.local_dir": "{root}/persistent/l"}, r"one holds the other"),
    "no dir": ({"checkpoint_dir": None}, r"local_dir needs a persistent tier"),
}


@pytest.mark.parametrize("bad", BAD)
def test_bad_tier_settings_are_refused_before_anything_is_written(tmp_path, bad):
    settings, message = BAD[bad]
    settings = {k: v.format(root=tmp_path) if isinstance(v, str) else v
                for k, v in settings.items()}  # fmt: skip
    cfg = override(TINY, {**TIERS, "checkpoint_dir": f"{tmp_path}/persistent"})
    cfg = override(cfg, {"checkpoint.local_dir": f"{tmp_path}/local", **settings})
    with pytest.raises(ShardingError, match=message):
        RunCheckpoints(make_setup(cfg, setup(ONE).mesh), print)
    assert list(tmp_path.iterdir()) == []


def test_processes_agree_on_the_newest_step_every_one_holds():
    every = np.array([[4, 6, -1], [6, 8, 4], [2, 4, 6]])  # [processes, steps], -1: padding
    assert common_steps(every) == [4, 6]
    assert common_steps(np.array([[4, -1], [6, -1]])) == []


def test_local_steps_of_another_mesh_are_passed_over_by_a_multi_process_run(monkeypatch):
    """With several processes each local copy holds only its own shards of the mesh it was
    written on: on another mesh the step is passed over, with a line, for the persistent
    tier (one process stands for them: every process drops what any of them drops)."""
    from shardlib.checkpoint import tiers

    killed = killed_run(7)  # local steps 4 and 6, written on data=1 (a copy: read only)
    local = tiers.candidates(killed / "persistent", killed / "local")
    assert [c.step for c in local] == [6, 4]
    found = [*local, tiers.Candidate(0, killed / "persistent", "persistent")]  # not read
    said = []
    monkeypatch.setattr(tiers.jax, "process_count", lambda: 2)
    monkeypatch.setattr(tiers, "any_process", lambda flag: flag)
    assert tiers.readable_here(found, {"data": 1}, said.append) == found
    left = tiers.readable_here(found, {"fsdp": 1}, said.append)
    assert left == [c for c in found if c.tier == "persistent"]
    assert len(said) == len(local) and re.match(
        rf"checkpoint: local step {local[0].step} \(\S+/local/{local[0].step}\) was written on "
        r"mesh \{'data': 1\}, this run's is \{'fsdp': 1\}: each host's local copy holds only "
        "its own shards",
        said[0],
    ), said


FAILED_SAVE = """
import os, sys
from pathlib import Path
from fault_runs import chattr
from test_local_tier import RunCheckpoints, run, tiered
from shardlib.checkpoint.store import CheckpointError
root = Path(sys.argv[1])
after_step = RunCheckpoints.after_step
def then_freeze(self, state, done, *, final):
    if done == 1 and not chattr("+i", root / "local"):
        print("no chattr", flush=True)
        os._exit(3)
    after_step(self, state, done, final=final)
RunCheckpoints.after_step = then_freeze
try:
    run(tiered(sys.argv[1]), show=False)
except CheckpointError as err:
    print(err, flush=True)
    os._exit(0)  # orbax's abandoned save would hold the exit for minutes
os._exit(1)
"""


def test_a_failed_local_save_names_the_local_tier_and_its_step(tmp_path):
    """The local directory turns read-only after step 1 (``chattr +i``): the run stops with
    the local save of step 2 named, not the persistent tier. In a child process: the failed
    save leaves orbax's background signalling behind, which would time out the next save of
    whatever test ran after it in the same process."""
    root = tmp_path / "tiers"
    env = child_env(tmp_path / "cache")
    here = Path(__file__).resolve().parent
    env["PYTHONPATH"] = f"{here}{os.pathsep}{here.parent}{os.pathsep}{env['PYTHONPATH']}"
    try:
        child = subprocess.run(
            [sys.executable, "-c", FAILED_SAVE, str(root)], env=env, capture_output=True,
            text=True, timeout=300,
        )  # fmt: skip
    finally:
        chattr("-i", root / "local")
    if child.returncode == 3:
        pytest.skip("chattr +i is not available here")
    assert child.returncode == 0, child.stdout + child.stderr
    pattern = r"saving step 2 to \S+/local failed.*Fix: make checkpoint.local_dir writable"
    assert re.search(pattern, child.stdout.replace("\n", " ")), child.stdout
