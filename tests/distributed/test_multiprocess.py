"""Real processes: SIGKILL during saves, SIGINT/SIGTERM preemption, and a 2-process run.

Each test starts JAX in subprocesses (a few seconds each), so there is one test per idea:
one chain of killed and restarted training processes, and one launch of two processes that
trains FSDP and 2x2x2 (whose data axis crosses the processes) in turn. They are marked slow
but run in the suite.
"""

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from tiny_runs import CUBE, FSDP8, ONE, STEPS, TINY_ARGS, losses, setup
from xla_test_flags import FAST_COMPILE

from shardlib.checkpoint.store import TMP_MARK, complete_steps, restore
from shardlib.train.loop import run

ROOT = Path(__file__).resolve().parents[2]
KILLS = 4  # each restart is a fresh JAX process, about 6 s on 2 cores
COMPARED = 12  # steps of each 2-process phase compared with one process (they stop earlier)


def _env(tmp_path: Path) -> dict[str, str]:
    return dict(
        os.environ,
        PYTHONPATH=str(ROOT),
        COLUMNS="1000",  # rich wraps long lines at 80 columns when not on a terminal
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=FAST_COMPILE,  # each process sets its own device count
        # Restarted processes load the compiled step instead of compiling it again.
        JAX_COMPILATION_CACHE_DIR=str(tmp_path / "jax-cache"),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
    )


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _wait_for_records(path: Path, more_than: int, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 180
    while len(_records(path)) <= more_than:
        assert proc.poll() is None, f"training process exited early:\n{log.read_text()}"
        assert time.monotonic() < deadline, f"no progress:\n{log.read_text()}"
        time.sleep(0.01)


@pytest.mark.slow
def test_killed_during_saves_resumes_exactly_then_stops_cleanly_on_sigterm(tmp_path):
    """SIGKILL at random moments while saving every step, KILLS times; then SIGTERM.

    Every restart must resume from the newest complete checkpoint, and every loss any of
    the processes logged must equal the uninterrupted run's, bit for bit.
    """
    directory, metrics = tmp_path / "run", tmp_path / "metrics.jsonl"
    mesh = tmp_path / "one.toml"
    mesh.write_text('# Use this when: one CPU device\nplatform = "cpu"\n[mesh]\ndata = 1\n')
    command = [sys.executable, "-m", "shardlib.tools.cli", "train", "--mesh", str(mesh), *TINY_ARGS]
    command += [f"checkpoint_dir={directory}", "checkpoint_every=1", "keep=3"]
    command += [f"metrics={metrics}"]
    reference = losses(ONE)
    rng = random.Random(7)
    unfinished_seen = 0
    for i, sig in enumerate([signal.SIGKILL] * KILLS + [signal.SIGTERM]):
        latest = max(complete_steps(directory), default=None)
        seen = len(_records(metrics))
        log = tmp_path / f"process{i}.log"
        with log.open("w") as out:
            proc = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, env=_env(tmp_path)
            )
            _wait_for_records(metrics, seen, proc, log)
            time.sleep(rng.uniform(0.0, 0.2))
            proc.send_signal(sig)
            code = proc.wait(timeout=120)
        text = log.read_text()
        if latest is None:
            assert "resumed" not in text
        else:
            assert f"resumed from {directory / str(latest)} (step {latest})" in text, text
        if sig == signal.SIGKILL:
            assert code == -signal.SIGKILL
            unfinished_seen += any(TMP_MARK in p.name for p in directory.iterdir())
        else:
            stop = max(complete_steps(directory))
            assert code == 0, text
            saved = f"checkpoint saved to {directory / str(stop)}"
            assert f"stopped by {sig.name} after step {stop}: {saved}" in text, text
    records = _records(metrics)
    assert max(r["step"] for r in records) < STEPS  # every process was stopped, none finished
    for r in records:  # killed processes logged steps past their last checkpoint: all exact
        assert r["loss"] == reference[r["step"] - 1], r
    restored = restore(directory, setup(ONE))
    assert run(setup(ONE), state=restored.state, show=False).losses == list(
        reference[restored.step :]
    )
    print(
        f"\n{KILLS} kills, {unfinished_seen} left an unfinished save behind; "
        f"{len(records)} logged steps all equal the uninterrupted run"
    )
    assert unfinished_seen >= KILLS // 2  # the kills did land during saves


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _max_rel_err(a, b) -> float:
    a, b = np.array(a), np.array(b[: len(a)])
    return float(np.max(np.abs(a - b) / np.abs(b)))


@pytest.mark.slow
def test_two_processes_train_like_one_and_their_checkpoints_restore_in_one(tmp_path):
    """2 processes x 4 CPU devices (gloo over loopback) vs 1 x 8 devices and one device.

    Process 1 sends itself SIGTERM a few steps into each phase: both processes must stop
    after the same step (else the run would hang), and the FSDP and 2x2x2 phases save
    there. Then process 1 truncates a data file of its own shards of the newest FSDP step:
    the resumed phase (each process reads its shards without orbax's barriers, where one
    whose read failed left the other waiting or out of step) skips that step on both
    processes, naming the tensor and process 1, and restores the step before it (its
    fingerprints verified on read).
    """
    coordinator = f"127.0.0.1:{_free_port()}"
    worker = ROOT / "tests" / "multihost_worker.py"
    logs = [tmp_path / f"process{i}.log" for i in range(2)]
    procs = [
        subprocess.Popen(
            [sys.executable, str(worker), coordinator, str(i), str(tmp_path), *TINY_ARGS],
            stdout=logs[i].open("w"),
            stderr=subprocess.STDOUT,
            env=_env(tmp_path) | {"JAX_COMPILATION_CACHE_DIR": ""},
        )
        for i in range(2)
    ]
    try:
        codes = [p.wait(timeout=540) for p in procs]
    finally:
        for p in procs:
            p.kill()
    text = [log.read_text() for log in logs]
    assert codes == [0, 0], text
    assert "loss" not in text[1]  # logs and progress from process 0 only
    for i in range(2):  # hybrid mesh: the data axis crosses processes, fsdp x tensor do not
        owners = json.loads((tmp_path / f"mesh{i}.json").read_text())
        assert owners == [[[0, 0], [0, 0]], [[1, 1], [1, 1]]]
    errors = {}
    for phase, on8 in [
        ("fsdp", losses(FSDP8, COMPARED)),
        ("3d", losses(CUBE, COMPARED)),
    ]:
        got = [r["loss"] for r in _records(tmp_path / f"{phase}.jsonl")]
        assert 3 <= len(got) < STEPS, (phase, len(got))  # stopped early, on both processes
        assert f"stopped by SIGTERM on process 1 after step {len(got)}" in text[0]
        got = got[:COMPARED]
        errors[phase] = (_max_rel_err(got, on8), _max_rel_err(got, losses(ONE)))
        assert max(errors[phase]) <= 1e-5, (phase, errors[phase])
    damaged = len(_records(tmp_path / "fsdp.jsonl"))
    older = 2 * ((damaged - 1) // 2)  # the fsdp phase saved every 2 steps and at the stop
    skipped = [line for line in text[0].splitlines() if line.startswith("checkpoint: skip")]
    assert len(skipped) == 1 and re.match(
        rf"checkpoint: skipped step {damaged} \(persistent, \S+/ckpt-fsdp/{damaged}\): tensor "
        rf"\S+( \(and \d+ more\))? on process 1 is damaged; falling back to step {older} ",
        skipped[0],
    ), text[0]
    assert f"resumed from {tmp_path / 'ckpt-fsdp' / str(older)} (step {older})" in text[0]
    assert f"nothing to do: the checkpoint is already at step {older}" in text[0]
    assert not any("Traceback" in t for t in text), text
    # The 2x2x2 phase saved every 2 steps and at the stop; one process reads them back.
    directory, stopped = tmp_path / "ckpt", len(_records(tmp_path / "3d.jsonl"))
    assert complete_steps(directory)[-1] == stopped
    state_dir = directory / str(stopped) / "state"
    assert {p.name for p in state_dir.glob("ocdbt.process_*")} == {
        "ocdbt.process_0",
        "ocdbt.process_1",
    }  # each process wrote the shards it holds
    start = restore(directory, setup(ONE), step=2)  # fingerprints verified on read
    assert start.meta["mesh"] == {"axes": dict(CUBE), "processes": 2}
    two_process = [r["loss"] for r in _records(tmp_path / "3d.jsonl")]
    continued = run(setup(ONE), state=start.state, show=False, stop_after=stopped).losses
    assert _max_rel_err(continued, two_process[2:]) <= 1e-5
    end = restore(directory, setup(ONE), step=stopped)
    assert int(end.state["step"]) == stopped
    print(f"\nmax relative loss error 2 processes vs (1 x 8, 1 device): {errors}")
    phases = ", ".join(re.findall(r"phase .*", text[0]))
    print(f"{skipped[0]}\n{phases}")
