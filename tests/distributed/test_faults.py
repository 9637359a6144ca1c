"""Faults an operator meets in real runs: each ends with one clear line, promptly, no hang.

Single-process runs here; two processes over gloo in test_faults_multiprocess.py.

Every subprocess runs under a timeout and is killed by PID in ``finally``; everything is on
loopback. The single-process CLI runs share one JAX compilation cache (a module-scoped
directory), so only the first of them compiles the step.
"""

import json
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from fault_runs import (
    assert_one_line_error,
    catches,
    chattr,
    child_env,
    error_lines,
    lock_holder,
    records_of,
    run_1f1b,
    token_file,
    train_command,
    train_until,
    wait_for,
)

from shardlib.checkpoint.dirlock import LOCK_NAME, DirectoryLock, check_directory
from shardlib.checkpoint.store import CheckpointError


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("jax-cache")


# --- point 7: one run per checkpoint directory --------------------------------------------


def test_a_second_run_on_a_directory_is_refused_with_the_owner(tmp_path, cache):
    directory = tmp_path / "run"
    holder = lock_holder(directory, child_env(cache))
    try:
        code, text, seconds = run_1f1b(
            train_command(tmp_path, f"checkpoint_dir={directory}", "steps=5"), child_env(cache), 60
        )
    finally:
        holder.kill()
        holder.wait(timeout=10)
    host = socket.gethostname()
    assert_one_line_error(text, rf"in use by another run \(host {host}, pid {holder.pid}, since")
    assert code == 2 and "compiled" not in text
    print(f"\nsecond run refused in {seconds:.1f} s: {error_lines(text)[0]}")
    lock = DirectoryLock(directory).acquire()  # the holder was SIGKILLed: its lock is stale
    assert f"pid {holder.pid}" in lock.recovered
    lock.release()
    assert not (directory / LOCK_NAME).exists()


def test_a_lock_file_of_another_host_is_refused_with_a_way_out(tmp_path):
    (tmp_path / LOCK_NAME).write_text(json.dumps({"host": "elsewhere", "pid": 1, "since": "x"}))
    with pytest.raises(CheckpointError, match=r"host elsewhere, pid 1.*if it is dead, delete"):
        DirectoryLock(tmp_path).acquire()


def test_a_file_or_a_read_only_directory_is_one_line_before_step_1(tmp_path, cache, monkeypatch):
    (tmp_path / "file").write_text("")
    code, text, _ = run_1f1b(
        train_command(tmp_path, f"checkpoint_dir={tmp_path / 'file'}", "steps=5"),
        child_env(cache),
        60,
    )
    assert code == 2 and "compiled" not in text
    assert_one_line_error(text, r"checkpoint_dir='.*file' is a file, not a directory\. Fix:")
    read_only = tmp_path / "ro"
    read_only.mkdir()
    read_only.chmod(0o555)
    if os.geteuid() == 0:  # root writes anywhere: refuse the write as the filesystem would
        real_open = os.open

        def refuse(path, *args, **kwargs):
            if str(path).startswith(str(read_only)):
                raise PermissionError(13, "Permission denied", str(path))
            return real_open(path, *args, **kwargs)

        monkeypatch.setattr(os, "open", refuse)
    check_directory(read_only)
    with pytest.raises(CheckpointError, match=r"'.*ro' is not writable \(PermissionError: Perm"):
        DirectoryLock(read_only).acquire()


# --- point 6: the data a checkpoint was trained on ----------------------------------------


@pytest.mark.slow
def test_data_truncated_mid_run_then_changed_data_is_refused_on_resume(tmp_path, cache):
    from shardlib.checkpoint.store import complete_steps, read_meta

    data, directory, metrics = tmp_path / "tokens.bin", tmp_path / "run", tmp_path / "m.jsonl"
    original = token_file(data, seed=1).read_bytes()
    settings = [f"data={data}", f"checkpoint_dir={directory}", "checkpoint_every=5"]
    command = train_command(tmp_path, *settings, f"metrics={metrics}", "steps=100000")
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=child_env(cache)
    )
    try:
        # the child's output once it has ended (read() on a live child would block)
        log = lambda: proc.stdout.read() if proc.poll() is not None else "timed out"  # noqa: E731
        wait_for(lambda: len(records_of(metrics)) >= 7, [proc], 120, log=log)
        t0 = time.monotonic()
        with data.open("r+b") as f:  # truncated in place: a memory map would SIGBUS here
            f.truncate(len(original) // 4)
        out, _ = proc.communicate(timeout=60)
        seconds = time.monotonic() - t0
    finally:
        proc.kill()
    text = out.decode()
    assert proc.returncode == 2, text
    assert_one_line_error(text, rf"data='{data}' changed during the run: its size changed")
    print(f"\ntruncation -> exit 2 in {seconds:.1f} s: {error_lines(text)[0]}")
    steps = complete_steps(directory)
    assert steps and steps[-1] >= 5  # the saves made before it are complete
    step, meta = read_meta(directory)
    assert meta["data"]["identity"]["bytes"] == len(original)
    assert not (directory / LOCK_NAME).exists()
    # each resume below: a refusal before compiling, or one step trained and saved
    data.write_bytes(token_file(tmp_path / "other", seed=2).read_bytes())
    code, text, seconds = run_1f1b(
        train_command(tmp_path, *settings, "steps=100000"), child_env(cache), 90
    )
    assert code == 2, text
    assert_one_line_error(text, r"is not what the checkpoint in .* was trained on")
    assert "compiled" not in text
    print(f"other tokens: resume refused in {seconds:.1f} s: {error_lines(text)[0]}")
    resumed = tmp_path / "resumed.jsonl"
    allowed = [*settings, "steps=100000", "dataset.allow_changed=true", f"metrics={resumed}"]
    proc = train_until(train_command(tmp_path, *allowed), resumed, 1, child_env(cache))
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0 and f"resumed from {directory}" in out.decode(), out.decode()


def test_a_token_file_rewritten_or_replaced_mid_run_is_named(tmp_path):
    from shardlib.core.errors import ShardingError
    from shardlib.dataset.tokens import load_tokens

    path = token_file(tmp_path / "tokens.bin", seed=1, tokens=4096)
    tokens = load_tokens(str(path))
    tokens.check()
    assert list(tokens[10:13]) == list(np.fromfile(path, np.uint16)[10:13])
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # rewritten in place
    with pytest.raises(ShardingError, match=r"tokens.bin' changed during the run: it was rewr"):
        tokens.check()
    tokens = load_tokens(str(path))
    token_file(tmp_path / "new.bin", seed=2, tokens=4096).rename(path)  # replaced
    with pytest.raises(ShardingError, match=r"tokens.bin' changed during the run: it was repl"):
        tokens.check()


# --- point 1: a save that fails ------------------------------------------------------------


@pytest.mark.slow
def test_a_failed_save_ends_the_run_at_once_naming_the_step(tmp_path, cache):
    from shardlib.checkpoint.store import complete_steps, read_meta

    directory, metrics = tmp_path / "run", tmp_path / "m.jsonl"
    settings = [f"checkpoint_dir={directory}", "checkpoint_every=4", f"metrics={metrics}"]
    directory.mkdir()
    if not chattr("+i", directory):
        pytest.skip("chattr +i is not available here")
    chattr("-i", directory)
    proc = train_until(
        train_command(tmp_path, *settings, "steps=100000"), metrics, 10, child_env(cache)
    )
    try:
        deadline = time.monotonic() + 60
        while not complete_steps(directory) and time.monotonic() < deadline:
            time.sleep(0.02)  # a save committed before the fault, to check it survives
        assert chattr("+i", directory)  # from now on nothing in it can be created or renamed
        t0 = time.monotonic()
        out, _ = proc.communicate(timeout=60)
        seconds = time.monotonic() - t0
    finally:
        proc.kill()
        chattr("-i", directory)
    text = out.decode()
    assert proc.returncode == 2, text
    assert_one_line_error(text, r"checkpoint: saving step \d+ to .* failed \(PermissionError")
    failed = int(text.split("saving step ")[1].split()[0])
    stopped = records_of(metrics)[-1]["step"]
    assert failed <= stopped <= failed + 8, (failed, stopped)  # not one save later
    print(f"\nfailed save -> exit 2 in {seconds:.1f} s at step {stopped}: {error_lines(text)[0]}")
    kept = complete_steps(directory)
    assert kept and kept[-1] <= failed  # (== when only deleting an older step failed)
    assert read_meta(directory)[0] == kept[-1]  # the complete ones are intact


@pytest.mark.slow
def test_a_full_disk_ends_the_run_at_the_first_save_naming_it(tmp_path, cache):
    """``checkpoint_dir`` on a 64 KiB tmpfs (the checkpoint needs more): the first save fails
    and the run stops at once with one line naming the step and the fix. The contract is
    "the disk is full", whichever writer meets it first: tensorstore's array writes report
    ``RESOURCE_EXHAUSTED``, orbax's Python-level metadata writes ``OSError`` ENOSPC ("No
    space left on device"); which one gets there first varies from run to run. (The save's
    other writes, ending after orbax closed its event loop, printed about 20 ``Event loop is
    closed`` tracebacks before that line; ``saver`` drops them.)"""
    directory = tmp_path / "full"
    directory.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(directory)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        settings = [f"checkpoint_dir={directory}", "checkpoint_every=2", "steps=100000"]
        code, text, seconds = run_1f1b(train_command(tmp_path, *settings), child_env(cache), 120)
    finally:
        subprocess.run(["umount", "-l", str(directory)], capture_output=True)
    assert code == 2, text
    assert_one_line_error(
        text, r"saving step 2 to .* failed \(.*(RESOURCE_EXHAUSTED|No space left on device)"
    )
    assert "Fix: make checkpoint_dir writable with room to spare" in text
    print(f"\ndisk full -> exit 2 in {seconds:.1f} s: {error_lines(text)[0]}")


# --- point 4: signals from process start ---------------------------------------------------


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc")
def test_sigterm_during_start_up_stops_after_the_first_step_with_a_checkpoint(tmp_path, cache):

    from shardlib.checkpoint.store import complete_steps

    directory = tmp_path / "run"
    command = train_command(tmp_path, f"checkpoint_dir={directory}", "steps=100000")
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=child_env(cache)
    )
    try:
        wait_for(lambda: catches(proc.pid, signal.SIGTERM), [proc], 30, 0.005)  # CLI's 1st act
        proc.send_signal(signal.SIGTERM)  # JAX is not even imported yet
        t0 = time.monotonic()
        out, _ = proc.communicate(timeout=90)
        seconds = time.monotonic() - t0
    finally:
        proc.kill()
    text = out.decode()
    assert proc.returncode == 0, text
    assert f"stopped by SIGTERM after step 1: checkpoint saved to {directory / '1'}" in text
    assert complete_steps(directory) == [1]
    print(f"\nSIGTERM at start-up -> stopped after step 1, exit 0 in {seconds:.1f} s")


@pytest.mark.slow
@pytest.mark.parametrize("delay", [0.5, 2.0, 4.0])
def test_sigterm_at_a_fixed_time_after_start_exits_0_with_nothing_partial(tmp_path, cache, delay):
    """TERM 0.5, 2 and 4 s after the process starts (while JAX loads, while the model is
    built, while the step compiles: ``shardlib.tools.entry`` keeps it from the first line):
    exit 0, no traceback, the step it stopped after saved whole, nothing unfinished."""
    from shardlib.checkpoint.store import TMP_MARK, complete_steps

    directory = tmp_path / "run"
    command = train_command(tmp_path, f"checkpoint_dir={directory}", "steps=100000")
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=child_env(cache)
    )
    try:
        time.sleep(delay)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    text = out.decode()
    assert proc.returncode == 0 and "Traceback" not in text, text
    stopped = re.search(r"stopped by SIGTERM after step (\d+)", text)
    assert stopped, text  # the step it stopped after was saved, complete
    assert complete_steps(directory)[-1] == int(stopped.group(1))
    unfinished = list(directory.rglob(f"*{TMP_MARK}*")) if directory.exists() else []
    assert not unfinished, unfinished
