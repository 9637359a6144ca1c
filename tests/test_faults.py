"""Faults an operator meets in real runs: each ends with one clear line, promptly, no hang.

Every subprocess runs under a timeout and is killed by PID in ``finally``; everything is on
loopback. The single-process CLI runs share one JAX compilation cache (a module-scoped
directory), so only the first of them compiles the step.
"""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardlib.checkpoint import CheckpointError
from shardlib.train.dirlock import LOCK_NAME, DirectoryLock, check_directory

ROOT = Path(__file__).resolve().parent.parent
TINY = ["model.layers=1", "batch=8", "seq=16"]
ONE_DEVICE = '# Use this when: one CPU device\nplatform = "cpu"\n[mesh]\ndata = 1\n'


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("jax-cache")


def _env(cache: Path) -> dict[str, str]:
    return dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        COLUMNS="1000",  # rich wraps long lines at 80 columns when not on a terminal
        JAX_PLATFORMS="cpu",
        XLA_FLAGS="",
        JAX_COMPILATION_CACHE_DIR=str(cache),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
    )


def _train_command(tmp_path: Path, *settings: str) -> list[str]:
    mesh = tmp_path / "one.toml"
    mesh.write_text(ONE_DEVICE)
    return [sys.executable, "-m", "shardlib.cli", "train", "--mesh", str(mesh), *TINY, *settings]


def _run(command: list[str], env: dict, timeout: float) -> tuple[int, str, float]:
    """(exit code, output, seconds): the process is killed by PID if it outlives ``timeout``."""
    t0 = time.monotonic()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        proc.kill()
    return proc.returncode, out.decode(), time.monotonic() - t0


def _error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if "error" in line.lower()]


def _assert_one_line_error(text: str, pattern: str) -> None:
    import re

    assert "Traceback" not in text, text
    errors = _error_lines(text)
    assert len(errors) == 1 and re.search(pattern, errors[0]), text


# --- point 7: one run per checkpoint directory --------------------------------------------

HOLD = "from shardlib.train.dirlock import DirectoryLock as L; import sys, time\n" + (
    "L(sys.argv[1]).acquire(); print('locked', flush=True); time.sleep(60)"
)


def _holder(directory: Path, env: dict) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(directory)], stdout=subprocess.PIPE, env=env
    )
    assert proc.stdout.readline().strip() == b"locked"
    return proc


def test_a_second_run_on_a_directory_is_refused_with_the_owner(tmp_path, cache):
    directory = tmp_path / "run"
    holder = _holder(directory, _env(cache))
    try:
        code, text, seconds = _run(
            _train_command(tmp_path, f"checkpoint_dir={directory}", "steps=5"), _env(cache), 60
        )
    finally:
        holder.kill()
        holder.wait(timeout=10)
    host = socket.gethostname()
    _assert_one_line_error(text, rf"in use by another run \(host {host}, pid {holder.pid}, since")
    assert code == 2 and "compiled" not in text
    print(f"\nsecond run refused in {seconds:.1f} s: {_error_lines(text)[0]}")
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
    code, text, _ = _run(
        _train_command(tmp_path, f"checkpoint_dir={tmp_path / 'file'}", "steps=5"), _env(cache), 60
    )
    assert code == 2 and "compiled" not in text
    _assert_one_line_error(text, r"checkpoint_dir='.*file' is a file, not a directory\. Fix:")
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
