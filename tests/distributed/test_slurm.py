"""Slurm as a cluster user meets it: ``srun``, ``sbatch`` with ``docs/slurm.sbatch``,
``scancel --signal=TERM``, on a one-node Slurm started on loopback for this module.

Debian's ``slurm-wlm`` and ``munge`` (``.ci/run`` installs them); where they are missing, or
the cluster does not come up, the tests skip with the reason. One cluster serves the module
(it is up in about a second); every job is cancelled and every daemon ended by PID at
the end. The processes run ``shardlib train`` with no rank flags: they join from Slurm's
environment (``shardlib/distributed/launchers.py``).
"""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import slurm_cluster
from fault_runs import TINY, child_env, free_port, records_of, wait_for
from tiny_runs import ONE, STEPS, losses

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ["shardlib", "train", *TINY, f"schedule_steps={STEPS}"]  # tiny_runs' schedule
TWO = '# Use this when: two processes\nplatform = "cpu"\n[mesh]\ndata = 2\n'


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    why = slurm_cluster.missing()
    if why:
        pytest.skip(why)
    root = tmp_path_factory.mktemp("slurm")
    env = child_env(root / "jax-cache")
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env["PATH"]])  # shardlib
    try:
        ports = [free_port()]
        while len(ports) < 2:
            ports += [p for p in [free_port()] if p != ports[0]]
        cluster = slurm_cluster.start(root, env, (ports[0], ports[1]))
    except RuntimeError as err:
        pytest.skip(str(err))
    yield cluster
    cluster.stop()


def _rel_err(got, want) -> float:
    got, want = np.array(got), np.array(want[: len(got)])
    return float(np.max(np.abs(got - want) / np.abs(want)))


@pytest.mark.slow
def test_two_srun_steps_in_one_allocation_each_train_like_one_process(slurm, tmp_path):
    """Two ``srun -N1 -n2`` steps at once in one allocation, no rank flags: ``cpu-8-3d``
    (2 processes x 4 devices) and data=2 (x 1 device; the mesh the scancel test reuses).

    JAX derives the coordinator's port from the job id alone, so two steps met on one
    coordinator and cross-joined (two processes aborted, one trained paired with the other
    step's rank). Each step now has its own port and identity (job and step): both train
    like one process does. The meshes differ so that a cross-join cannot pass: two steps of
    the same mesh that cross-join symmetrically train correctly (seen once on main; with
    these meshes main aborted or cross-joined in both runs tried)."""
    (tmp_path / "two.toml").write_text(TWO)
    meshes = {"a": ["cpu-8-3d", "--cpu-devices", "4"], "b": [str(tmp_path / "two.toml")]}
    meshes["b"] += ["--cpu-devices", "1"]
    granted = slurm.run("salloc", "-n4", "--no-shell")
    job = re.search(r"allocation (\d+)", granted.stderr)
    assert job, granted.stderr + slurm.logs()
    job = job.group(1)
    steps, logs = [], []
    try:
        for name, mesh in meshes.items():
            command = ["srun", f"--jobid={job}", "-N1", "-n2", "--exact", *TRAIN[:2]]
            command += ["--mesh", *mesh, *TRAIN[2:], "steps=4"]
            command += [f"metrics={tmp_path / name}.jsonl"]
            logs.append(tmp_path / f"{name}.log")
            out = logs[-1].open("w")
            steps.append(subprocess.Popen(command, env=slurm.env, stdout=out, stderr=out))
        codes = [p.wait(timeout=240) for p in steps]
    finally:
        for p in steps:
            p.kill()
        slurm.run("scancel", job)
    text = [log.read_text() for log in logs]
    assert codes == [0, 0], text
    got = [[r["loss"] for r in records_of(tmp_path / f"{name}.jsonl")] for name in "ab"]
    errors = [_rel_err(losses_, losses(ONE, 4)) for losses_ in got]
    assert all(len(x) == 4 for x in got) and max(errors) <= 1e-5, (got, losses(ONE, 4))
    assert not any("Traceback" in t for t in text), text
    print(f"\ntwo concurrent srun -n2 steps: max rel err vs one process {errors}")


@pytest.mark.slow
def test_scancel_term_ends_the_batch_job_with_a_checkpoint_and_exit_0(slurm, tmp_path):
    """``sbatch docs/slurm.sbatch``, then ``scancel --signal=TERM`` (a preemption): both
    tasks stop after the same step, that step's checkpoint is complete, the job exits 0."""
    from shardlib.checkpoint.store import complete_steps

    mesh, metrics, directory = tmp_path / "two.toml", tmp_path / "m.jsonl", tmp_path / "run"
    mesh.write_text(TWO)
    command = ["sbatch", "--parsable", "-N1", "-n2", "--ntasks-per-node=2"]
    command += ["--output", str(tmp_path / "job.out"), str(ROOT / "docs" / "slurm.sbatch")]
    command += ["--mesh", str(mesh), "--cpu-devices", "1", *TRAIN[2:], "steps=100000"]
    command += [f"checkpoint_dir={directory}", f"metrics={metrics}"]
    submitted = slurm.run(*command)
    job = submitted.stdout.strip().split(";")[0]
    assert submitted.returncode == 0 and job.isdigit(), submitted.stderr
    out = tmp_path / "job.out"
    try:
        log = lambda: (out.read_text() if out.exists() else "") + slurm.logs()  # noqa: E731
        wait_for(lambda: len(records_of(metrics)) >= 3, [], 150, 0.05, log)
        t0 = time.monotonic()
        assert slurm.run("scancel", "--signal=TERM", job).returncode == 0
        wait_for(lambda: slurm.job_state(job)[0] not in ("RUNNING", "COMPLETING"), [], 60, 0.1)
        seconds = time.monotonic() - t0
    finally:
        slurm.run("scancel", job)
    text = out.read_text()
    assert slurm.job_state(job) == ("COMPLETED", "0:0"), text
    last = records_of(metrics)[-1]["step"]
    assert complete_steps(directory) == [last], (complete_steps(directory), text)
    assert re.search(rf"stopped by SIGTERM (on process \d )?after step {last}: checkpoint", text)
    assert "Traceback" not in text, text
    print(f"\nscancel --signal=TERM: stopped after step {last} with a checkpoint, {seconds:.1f} s")


@pytest.mark.slow
def test_a_batch_script_of_two_tasks_without_srun_is_told_to_use_srun(slurm, tmp_path):
    script = tmp_path / "job.sh"
    script.write_text(f"#!/bin/bash\nexec {' '.join(TRAIN)} --mesh cpu-8-3d --cpu-devices 4\n")
    out = tmp_path / "job.out"
    job = slurm.run("sbatch", "--parsable", "-n2", "--output", str(out), str(script)).stdout
    job = job.strip().split(";")[0]
    try:  # polled: sbatch --wait looks only every few seconds
        wait_for(lambda: slurm.job_state(job)[0] in ("COMPLETED", "FAILED"), [], 120, 0.1)
    finally:
        slurm.run("scancel", job)
    text = out.read_text()
    assert slurm.job_state(job)[0] == "FAILED" and "Traceback" not in text, text
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 1 and "start it with srun (srun shardlib train" in lines[0], text
    assert "coordinator_address" not in text


def _task(marker: str, rank: int) -> tuple[int, str]:
    """(PID, job id) of task ``rank`` of the step whose command line holds ``marker``."""
    for proc in Path("/proc").iterdir():
        try:
            words = (proc / "cmdline").read_bytes().split(b"\0")
            environ = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if marker.encode() in words and b"srun" not in words[0]:
            if f"SLURM_PROCID={rank}".encode() in environ:
                job = next(w for w in environ if w.startswith(b"SLURM_JOB_ID="))
                return int(proc.name), job.decode().partition("=")[2]
    raise AssertionError(f"no task {rank} runs {marker}")


@pytest.mark.slow
def test_losing_rank_0_under_srun_is_one_line_within_the_heartbeat_bound(slurm, tmp_path):
    """Under srun, with no rank flags, process 0 also hosts the coordination service in a
    process of its own: SIGKILL to it ends the other with one line within half the
    heartbeat timeout (6 s here), not JAX's C++ abort, and the srun step ends with it (the
    service's host, which lingers to serve the survivors, holds nothing of the step's: no
    ``--kill-on-bad-exit`` is needed)."""
    (tmp_path / "two.toml").write_text(TWO)
    metrics, out = tmp_path / "m.jsonl", tmp_path / "step.out"
    command = ["srun", "-N1", "-n2", *TRAIN[:2], "--mesh", str(tmp_path / "two.toml")]
    command += ["--cpu-devices", "1", "--heartbeat-timeout", "6", *TRAIN[2:], "steps=100000"]
    command += [f"metrics={metrics}"]
    step = subprocess.Popen(command, env=slurm.env, stdout=out.open("w"), stderr=subprocess.STDOUT)
    job = None
    try:
        wait_for(lambda: len(records_of(metrics)) >= 3, [step], 150, 0.05, out.read_text)
        (first, job), (second, _) = _task(f"metrics={metrics}", 0), _task(f"metrics={metrics}", 1)
        os.kill(first, 9)
        t0 = time.monotonic()
        wait_for(lambda: not Path(f"/proc/{second}").exists(), [], 30, 0.05, out.read_text)
        seconds = time.monotonic() - t0
        code = step.wait(timeout=30)
        ended = time.monotonic() - t0
    finally:
        step.kill()
        if job:
            slurm.run("scancel", job)
    text = out.read_text()
    lost = [line for line in text.splitlines() if "lost process 0" in line]
    assert lost == ["process 1: stopping: lost process 0: no sign of life for 3 s"], text
    assert not re.search(r"Traceback|stack trace|Check failure|client\.h|coordination_se", text)
    assert code == 128 + 9, (code, text)  # srun's status: task 0's SIGKILL
    print(f"\nrank 0 killed under srun: rank 1 ended {seconds:.1f} s later, srun {ended:.1f} s")
    assert seconds < 6 and ended < 6
