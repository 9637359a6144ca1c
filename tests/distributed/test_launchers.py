"""Launchers as a cluster user meets them: Open MPI's ``mpirun`` on loopback.

``mpirun`` comes from Debian's ``openmpi-bin`` (``.ci/run`` installs it); where it cannot
be installed the test that needs it is skipped with the reason. Every process runs under a
timeout and is killed in ``finally``.
"""

import os
import re
import shutil
import signal
import subprocess
import sys
import time

import debian_packages
import pytest
from fault_runs import TINY, child_env, records_of, wait_for

from shardlib.distributed.launchers import launcher_grace_note


def mpirun() -> str:
    """Open MPI's ``mpirun``, installed from Debian's ``openmpi-bin`` if missing (where apt
    and root allow; else the test skips with the reason)."""
    why = debian_packages.ensure(("openmpi-bin",), ("mpirun",))
    if why:
        pytest.skip(why)
    return shutil.which("mpirun")


def test_under_mpirun_the_run_names_the_grace_setting_it_needs(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv("OMPI_MCA_odls_base_sigkill_timeout", raising=False)
    monkeypatch.delenv("OMPI_COMM_WORLD_SIZE", raising=False)
    assert launcher_grace_note() is None  # not under mpirun
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    note = launcher_grace_note()
    assert "2 s after it is sent a TERM" in note and "odls_base_sigkill_timeout 30" in note
    assert "start it as shardlib launch mpirun" in note
    monkeypatch.setenv("OMPI_MCA_odls_base_sigkill_timeout", "30")
    assert launcher_grace_note() is None


def test_launch_passes_a_first_term_on_as_usr1_and_a_second_as_term(tmp_path):
    """``shardlib launch`` with a stand-in launcher that says which signal it got."""
    script = 'trap "echo USR1" USR1; trap "echo TERM; exit 7" TERM; echo up; '
    script += "while :; do sleep 0.02; done"
    command = [sys.executable, "-m", "shardlib.tools.entry", "launch", "bash", "-c", script]
    env = child_env(tmp_path / "cache")
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout.readline() == "up\n"
        proc.send_signal(signal.SIGTERM)
        assert proc.stdout.readline() == "USR1\n" and proc.poll() is None
        proc.send_signal(signal.SIGINT)
        assert proc.stdout.readline() == "TERM\n" and proc.wait(timeout=10) == 7
    finally:
        proc.kill()


@pytest.mark.slow
def test_term_to_shardlib_launch_mpirun_ends_with_a_checkpoint_and_exit_0(tmp_path):
    """A scheduler preempts an MPI job with TERM to its command: here ``shardlib launch
    mpirun ...``, which passes it to mpirun as USR1, a signal mpirun forwards to every rank
    and does not take as its own failure (a TERM to mpirun itself: ranks 0 with a
    checkpoint, mpirun 1 and silent after its timers). The ranks finish their step, save it
    and exit 0; mpirun relays their closing line and exits 0, and so does the command."""
    from shardlib.checkpoint.store import complete_steps

    mesh, metrics, directory = tmp_path / "two.toml", tmp_path / "m.jsonl", tmp_path / "run"
    mesh.write_text('# Use this when: two processes\nplatform = "cpu"\n[mesh]\ndata = 2\n')
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    command = [sys.executable, "-m", "shardlib.tools.entry", "launch", mpirun(), "-n", "2"]
    command += ["--oversubscribe", *root, "--mca", "btl_tcp_if_include", "lo", sys.executable]
    command += ["-m", "shardlib.tools.entry", "train", "--mesh", str(mesh), "--cpu-devices", "1"]
    command += [*TINY, "steps=100000", f"checkpoint_dir={directory}", f"metrics={metrics}"]
    log = tmp_path / "launch.log"
    env = child_env(tmp_path / "cache")
    env.pop("OMPI_MCA_odls_base_sigkill_timeout", None)  # launch's own default applies
    proc = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    try:
        wait_for(lambda: len(records_of(metrics)) >= 5, [proc], 150, 0.05, log.read_text)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=25)
        seconds = time.monotonic() - t0
    finally:
        proc.kill()
    text = log.read_text()
    steps, last = complete_steps(directory), records_of(metrics)[-1]["step"]
    assert code == 0 and steps == [last], (code, steps, text)
    stops = [line for line in text.splitlines() if "stopped by" in line]
    said = rf"stopped by SIGUSR1 on process \d after step {last}: checkpoint saved to {directory}"
    assert len(stops) == 1 and re.match(said, stops[0]), text
    assert "Traceback" not in text and "odls_base_sigkill_timeout" not in text, text
    print(f"\nTERM to shardlib launch mpirun: step {last} saved, exit 0 in {seconds:.1f} s")
