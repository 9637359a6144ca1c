"""Subprocess helpers of tests/distributed/test_faults.py: 1F1B runs of the CLI, on loopback.

Every process started here runs under a timeout and is killed by PID when the caller is done.
"""

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from xla_test_flags import FAST_COMPILE

ROOT = Path(__file__).resolve().parent.parent


TINY = ["model.layers=1", "batch=8", "seq=16"]


ONE_DEVICE = '# Use this when: one CPU device\nplatform = "cpu"\n[mesh]\ndata = 1\n'


def child_env(cache: Path) -> dict[str, str]:
    return dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        COLUMNS="1000",  # rich wraps long lines at 80 columns when not on a terminal
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=FAST_COMPILE,  # each process sets its own device count
        JAX_COMPILATION_CACHE_DIR=str(cache),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
    )


def train_command(tmp_path: Path, *settings: str) -> list[str]:
    mesh = tmp_path / "one.toml"
    mesh.write_text(ONE_DEVICE)
    return [
        sys.executable,
        "-m",
        "shardlib.tools.entry",  # the console script's entry point
        "train",
        "--mesh",
        str(mesh),
        *TINY,
        *settings,
    ]


def run_1f1b(command: list[str], env: dict, timeout: float) -> tuple[int, str, float]:
    """(exit code, output, seconds): the process is killed by PID if it outlives ``timeout``."""
    t0 = time.monotonic()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        proc.kill()
    return proc.returncode, out.decode(), time.monotonic() - t0


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if "error" in line.lower()]


def assert_one_line_error(text: str, pattern: str) -> None:

    assert "Traceback" not in text, text
    errors = error_lines(text)
    assert len(errors) == 1 and re.search(pattern, errors[0]), text


HOLD = "from shardlib.checkpoint.dirlock import DirectoryLock as L; import sys, time\n" + (
    "L(sys.argv[1]).acquire(); print('locked', flush=True); time.sleep(60)"
)


def lock_holder(directory: Path, env: dict) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(directory)], stdout=subprocess.PIPE, env=env
    )
    assert proc.stdout.readline().strip() == b"locked"
    return proc


def token_file(path: Path, seed: int, tokens: int = 1 << 17) -> Path:
    np.random.default_rng(seed).integers(0, 256, tokens, dtype=np.uint16).tofile(path)
    return path


def records_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def chattr(flag: str, path: Path) -> bool:
    """``chattr +i``: a directory even root cannot write (False where not supported)."""
    try:
        return subprocess.run(["chattr", flag, str(path)], capture_output=True).returncode == 0
    except FileNotFoundError:
        return False


def train_until(command: list[str], metrics: Path, records: int, env: dict):
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 120
    while len(records_of(metrics)) < records:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(proc.stdout.read().decode())
        time.sleep(0.02)
    return proc


def wait_for(done, procs=(), seconds: float = 120.0, interval: float = 0.02, log=str) -> None:
    """Poll ``done()`` until it is true; every process of ``procs`` must stay alive meanwhile
    and ``seconds`` bound the wait (the assertion shows ``log()``)."""
    deadline = time.monotonic() + seconds
    while not done():
        assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, log()
        time.sleep(interval)


def catches(pid: int, sig: int) -> bool:
    """Has process ``pid`` installed a handler for ``sig`` (Linux: /proc/PID/status)?"""
    status = Path(f"/proc/{pid}/status").read_text()
    caught = int(next(x for x in status.splitlines() if x.startswith("SigCgt:")).split()[1], 16)
    return bool(caught >> (sig - 1) & 1)


def free_port() -> int:
    """A free port whose next port (process 0's join desk) is free too."""
    while True:
        with socket.socket() as s, socket.socket() as desk:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
            try:
                desk.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port


def start_rank(
    tmp_path: Path,
    port: int,
    rank: int,
    log: str,
    *settings: str,
    cache: Path,
    job="j",
    init_timeout: int = 5,
):
    """One of two processes with one CPU device each (a small mesh compiles fast)."""
    mesh = tmp_path / "two.toml"
    mesh.write_text('# Use this when: two processes\nplatform = "cpu"\n[mesh]\ndata = 2\n')
    command = [sys.executable, "-m", "shardlib.tools.cli", "train", "--mesh", str(mesh)]
    command += ["--cpu-devices", "1", "--coordinator", f"127.0.0.1:{port}", "--job-id", job]
    command += ["--num-processes", "2", "--process-id", str(rank), "--heartbeat-timeout", "6"]
    command += ["--init-timeout", str(init_timeout), *TINY, *settings]
    out = (tmp_path / log).open("w")
    return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=child_env(cache))


def start_pair(
    tmp_path: Path, prefix: str, *settings: str, cache: Path, metrics: Path | None = None
) -> list[subprocess.Popen]:
    """Ranks 0 and 1 of one run on a free port, logging to ``<prefix>0.log`` and
    ``<prefix>1.log``; rank 0 alone writes ``metrics`` (where given)."""
    port = free_port()
    own = [f"metrics={metrics}"] if metrics is not None else []
    return [
        start_rank(tmp_path, port, i, f"{prefix}{i}.log", *settings, *(own if i == 0 else []),
                   cache=cache)
        for i in (0, 1)
    ]  # fmt: skip


def wait_all(procs: list, timeout: float) -> tuple[list[int], float]:
    t0, deadline = time.monotonic(), time.monotonic() + timeout
    try:
        codes = [p.wait(timeout=max(deadline - time.monotonic(), 0.1)) for p in procs]
    finally:
        for p in procs:
            p.kill()
    return codes, time.monotonic() - t0


def only_line(log: Path, pattern: str) -> str:

    text = log.read_text()
    assert "Traceback" not in text and "stack trace" not in text, text
    found = [line for line in text.splitlines() if re.search(pattern, line)]
    assert len(found) == 1, text
    return found[0]
