"""Launchers as a cluster user meets them: Open MPI's ``mpirun`` on loopback.

``mpirun`` comes from Debian's ``openmpi-bin`` (``.ci/run`` installs it); where it cannot
be installed the test that needs it is skipped with the reason. Every process runs under a
timeout and is killed in ``finally``.
"""

import os
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
    monkeypatch.setenv("OMPI_MCA_odls_base_sigkill_timeout", "30")
    assert launcher_grace_note() is None


@pytest.mark.slow
def test_term_to_mpirun_stops_both_ranks_at_a_step_with_a_checkpoint(tmp_path):
    """A scheduler preempts an MPI job with TERM to ``mpirun``, which sends the ranks CONT at
    once and TERM only ``odls_base_sigkill_timeout`` (30 s here) later: the ranks take the
    CONT as the notice, finish their step and save it within the 25 s waited here, long
    before mpirun's own TERM; the checkpoint is the last step trained. (mpirun stops
    relaying the ranks' output once it is killing the job, so their closing line is not
    shown; it then waits out its timers and reports 1.)"""
    from shardlib.checkpoint.store import complete_steps

    mesh, metrics, directory = tmp_path / "two.toml", tmp_path / "m.jsonl", tmp_path / "run"
    mesh.write_text('# Use this when: two processes\nplatform = "cpu"\n[mesh]\ndata = 2\n')
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    command = [mpirun(), "-n", "2", "--oversubscribe", *root, "--mca", "btl_tcp_if_include", "lo"]
    command += ["--mca", "odls_base_sigkill_timeout", "30"]
    command += ["--output-filename", str(tmp_path / "out"), sys.executable, "-m"]
    command += ["shardlib.tools.entry", "train", "--mesh", str(mesh), "--cpu-devices", "1"]
    command += [*TINY, "steps=100000", f"checkpoint_dir={directory}", f"metrics={metrics}"]
    log = (tmp_path / "mpirun.log").open("w")
    env = child_env(tmp_path / "cache")
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        wait_for(lambda: len(records_of(metrics)) >= 5, [proc], 150, 0.05)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        wait_for(lambda: complete_steps(directory), [], 25, 0.1)
        seconds = time.monotonic() - t0
        time.sleep(1)  # a second save would show here
    finally:
        proc.kill()  # mpirun waits out its own TERM and KILL timers after the ranks end
    text = (tmp_path / "mpirun.log").read_text()
    text += "".join(p.read_text() for p in sorted((tmp_path / "out").rglob("std*")))
    steps = complete_steps(directory)
    assert len(steps) == 1 and steps[0] == records_of(metrics)[-1]["step"], (steps, text)
    assert "Traceback" not in text and "odls_base_sigkill_timeout" not in text, text
    print(
        f"\nTERM to mpirun: the ranks stop after step {steps[0]} with a checkpoint, {seconds:.1f} s"
    )
