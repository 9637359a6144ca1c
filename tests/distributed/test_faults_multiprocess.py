"""Faults of two-process runs (gloo on loopback): one rank fails, dies or is signalled, or
both are killed and resume from their local checkpoint tiers.

The healthy rank must stop promptly naming the peer and the cause, never hang in JAX's
shutdown barrier, and a job on a port another job uses must not harm the running one. Every
subprocess runs under a timeout and is killed by PID in ``finally``.
"""

import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from checkpoint_damage import DAMAGE
from fault_runs import (
    assert_one_line_error,
    catches,
    chattr,
    free_port,
    only_line,
    records_of,
    start_pair,
    start_rank,
    token_file,
    wait_all,
    wait_for,
)


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("jax-cache")


# --- points 2, 3, 5: two processes over gloo on loopback ------------------


@pytest.mark.slow
def test_an_error_on_one_rank_is_printed_by_it_and_ends_the_other(tmp_path, cache):
    data = token_file(tmp_path / "tokens.bin", seed=1)
    port = free_port()
    procs = [
        start_rank(tmp_path, port, 0, "0.log", f"data={data}", "steps=50", cache=cache),
        start_rank(
            tmp_path, port, 1, "1.log", f"data={tmp_path / 'gone.bin'}", "steps=50", cache=cache
        ),
    ]
    try:
        assert procs[1].wait(timeout=120) == 2
        codes, seconds = wait_all(procs, 30)
    finally:
        for p in procs:
            p.kill()
    logs = [(tmp_path / f"{i}.log").read_text() for i in range(2)]
    assert codes == [1, 2], logs
    assert_one_line_error(logs[1], r"^process 1: error: data='.*gone.bin': no such file")
    lines = [line for line in logs[0].splitlines() if line.startswith("process 0:")]
    assert lines == [f"process 0: stopping: process 1 failed: data='{tmp_path}/gone.bin': no "
                     "such file. Fix: pass a flat uint16 token file."], logs[0]  # fmt: skip
    assert "Traceback" not in logs[0] and "stack trace" not in logs[0]
    print(f"\nrank 1's error ended rank 0 {seconds:.1f} s later: {lines[0]}")

    # the file missing on every rank: each prints one line, its own error (exit 2) or, when
    # the other's came first, "stopping: process N failed: <it>" (exit 1); rank 0 used to
    # print both lines and exit 1
    port = free_port()
    gone = f"data={tmp_path / 'gone.bin'}"
    procs = [start_rank(tmp_path, port, i, f"g{i}.log", gone, cache=cache) for i in (0, 1)]
    codes, seconds = wait_all(procs, 60)
    logs = [(tmp_path / f"g{i}.log").read_text() for i in range(2)]
    assert 2 in codes, logs
    for i, code in enumerate(codes):
        own = rf"^process {i}: error: data='.*gone.bin': no such file"
        other = rf"^process {i}: stopping: process {1 - i} failed: data='.*gone.bin'"
        assert code in (1, 2), logs[i]
        said = [line for line in logs[i].splitlines() if line.startswith(f"process {i}:")]
        assert len(said) == 1, logs[i]
        only_line(tmp_path / f"g{i}.log", own if code == 2 else other)


@pytest.mark.slow
def test_ports_and_job_ids_protect_a_running_job_whose_lost_peer_is_named(tmp_path, cache):
    from shardlib.checkpoint.store import TMP_MARK, complete_steps, read_meta

    # an unrelated program holds the port: process 0 refuses it, process 1 gives up in time
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        procs = [start_rank(tmp_path, port, i, f"x{i}.log", "steps=5", cache=cache) for i in (0, 1)]
        codes, seconds = wait_all(procs, 60)
    assert codes == [2, 2], [(tmp_path / f"x{i}.log").read_text() for i in (0, 1)]
    report = [only_line(tmp_path / "x0.log", f"coordinator port {port} is already in use")]
    report.append(only_line(tmp_path / "x1.log", r"could not join the run .* within 5 s"))
    print(f"\nport held: both exit 2 within {seconds:.1f} s:\n  " + "\n  ".join(report))

    # job B's process 1 reaches job A's coordinator while A is forming: it reads process 0's
    # join desk and stops before joining; A's own process 1 joins later and A trains
    port, directory, metrics = free_port(), tmp_path / "run", tmp_path / "a.jsonl"
    settings = [f"checkpoint_dir={directory}", "checkpoint_every=1", "keep=2", "steps=100000"]
    a0 = start_rank(
        tmp_path,
        port,
        0,
        "a0.log",
        *settings,
        f"metrics={metrics}",
        cache=cache,
        job="A",
        init_timeout=60,
    )
    job_a = [a0]
    try:
        codes, seconds = wait_all(
            [start_rank(tmp_path, port, 1, "s1.log", cache=cache, job="B")], 60
        )
        assert codes == [2] and a0.poll() is None, (tmp_path / "s1.log").read_text()
        line = only_line(tmp_path / "s1.log", r"^process 1: error: .* runs job A, but this process")
        print(f"job B's rank 1 at forming job A: exit 2 in {seconds:.1f} s: {line}")
        job_a.append(start_rank(tmp_path, port, 1, "a1.log", *settings, cache=cache, job="A"))
        log = (tmp_path / "a0.log").read_text
        wait_for(lambda: len(records_of(metrics)) >= 6, job_a, 150, 0.05, log=log)

        # job A runs: job B's process 0 is refused A's port; a process 1 started with A's own
        # command line (same job id) is refused at the desk; A trains on, untouched
        codes, seconds = wait_all(
            [start_rank(tmp_path, port, 0, "b0.log", cache=cache, job="B")], 60
        )
        assert codes == [2], (tmp_path / "b0.log").read_text()
        line = only_line(tmp_path / "b0.log", f"coordinator port {port} is already in use")
        print(f"job B's rank 0 on job A's port: exit 2 in {seconds:.1f} s: {line}")
        codes, seconds = wait_all(
            [start_rank(tmp_path, port, 1, "c1.log", cache=cache, job="A")], 60
        )
        assert codes == [2], (tmp_path / "c1.log").read_text()
        line = only_line(tmp_path / "c1.log", r"already has all its processes; .* untouched")
        print(f"a copy of job A's rank 1 at running job A: exit 2 in {seconds:.1f} s: {line}")
        seen = len(records_of(metrics))
        time.sleep(2)
        assert all(p.poll() is None for p in job_a), (tmp_path / "a0.log").read_text()
        assert len(records_of(metrics)) > seen  # job A trains on, untouched
        # killed while a save is being written (A saves every step): noticed in the same bound
        wait_for(lambda: any(TMP_MARK in p.name for p in directory.iterdir()), job_a, 30, 0.002)
        job_a[1].send_signal(signal.SIGKILL)
        codes, seconds = wait_all(job_a[:1], 30)
    finally:
        for p in job_a:
            p.kill()
    assert codes == [1]
    line = only_line(tmp_path / "a0.log", r"^process 0: stopping: lost process 1")
    print(f"rank 1 killed mid-save: rank 0 exits 1 after {seconds:.1f} s (bound 6 s): {line}")
    assert seconds < 6 + 2
    assert complete_steps(directory) and read_meta(directory)[1]["step"] >= 5


def test_timeouts_come_from_flags_over_the_mesh_file_with_stated_defaults(tmp_path):
    from argparse import Namespace

    from shardlib.core.errors import ShardingError
    from shardlib.distributed.runtime import ProcessGroup, check_port_free, process_group

    defaults = ProcessGroup()
    assert (defaults.init_timeout_s, defaults.heartbeat_timeout_s) == (300, 60)
    args = Namespace(coordinator="127.0.0.1:1", num_processes=2, process_id=0)
    args.heartbeat_timeout_s, args.job_id = 7, None
    group = process_group(args, {"heartbeat_timeout_s": 30, "init_timeout_s": 20, "job_id": "x"})
    assert (group.heartbeat_timeout_s, group.init_timeout_s, group.job_id) == (7, 20, "x")
    with pytest.raises(ShardingError, match=r"unknown setting\(s\) heartbeat\. Fix: use"):
        process_group(args, {"heartbeat": 5})
    with pytest.raises(ShardingError, match=r"heartbeat_timeout_s=0 must be >= 1 s"):
        ProcessGroup(heartbeat_timeout_s=0)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(ShardingError, match=f"port {port} is already in use"):
            check_port_free(f"127.0.0.1:{port}")
    check_port_free(f"127.0.0.1:{port}")  # free again


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc")
def test_sigterm_at_start_up_of_one_rank_stops_both_at_one_step(tmp_path, cache):
    from shardlib.checkpoint.store import complete_steps

    directory, port = tmp_path / "run", free_port()
    settings = [f"checkpoint_dir={directory}", "steps=100000"]
    procs = [start_rank(tmp_path, port, i, f"{i}.log", *settings, cache=cache) for i in (0, 1)]
    try:
        wait_for(lambda: catches(procs[1].pid, signal.SIGTERM), procs[1:], 30, 0.005)
        time.sleep(1.0)  # JAX is starting (its preemption notifier takes SIGTERM over)
        procs[1].send_signal(signal.SIGTERM)
        codes, seconds = wait_all(procs, 90)
    finally:
        for p in procs:
            p.kill()
    logs = [(tmp_path / f"{i}.log").read_text() for i in (0, 1)]
    assert codes == [0, 0], logs
    stop = complete_steps(directory)[-1]
    assert f"stopped by SIGTERM on process 1 after step {stop}: checkpoint saved" in logs[0]
    assert stop <= 2
    print(f"\nSIGTERM to rank 1 at start-up: both exit 0 after step {stop}, {seconds:.1f} s")


@pytest.mark.slow
def test_a_failed_save_with_two_processes_ends_both_at_once(tmp_path, cache):
    directory, metrics, port = tmp_path / "run", tmp_path / "m.jsonl", free_port()
    settings = [f"checkpoint_dir={directory}", "checkpoint_every=4", "steps=100000"]
    directory.mkdir()
    if not chattr("+i", directory) or not chattr("-i", directory):
        pytest.skip("chattr +i is not available here")
    procs = [start_rank(tmp_path, port, 0, "0.log", *settings, f"metrics={metrics}", cache=cache)]
    procs.append(start_rank(tmp_path, port, 1, "1.log", *settings, cache=cache))
    try:
        wait_for(lambda: len(records_of(metrics)) >= 10, procs, 120, 0.05)
        assert chattr("+i", directory)
        codes, seconds = wait_all(procs, 60)
    finally:
        chattr("-i", directory)
    assert codes == [2, 1], [(tmp_path / f"{i}.log").read_text() for i in (0, 1)]
    line = only_line(tmp_path / "0.log", r"^process 0: error: checkpoint: saving step \d+ to")
    only_line(tmp_path / "1.log", r"^process 1: stopping: process 0 failed: checkpoint: saving")
    print(f"\n2 processes, failed save: exit 2 and 1 within {seconds:.1f} s: {line}")


@pytest.mark.slow
def test_losing_rank_0_is_one_line_on_the_others_within_the_heartbeat_bound(tmp_path, cache):
    """Process 0 hosts JAX's coordination service in a process that outlives it
    (``distributed/service_host.py``): killed, it is named by the survivor's watcher in
    half the heartbeat timeout (6 s here), not by JAX's C++ abort (exit -6 and an 11-frame
    stack trace, before the service moved out); the service host then ends by itself."""
    metrics, port = tmp_path / "m.jsonl", free_port()
    settings = ["steps=100000"]
    procs = [start_rank(tmp_path, port, 0, "0.log", *settings, f"metrics={metrics}", cache=cache)]
    procs.append(start_rank(tmp_path, port, 1, "1.log", *settings, cache=cache))
    try:
        wait_for(lambda: len(records_of(metrics)) >= 3, procs, 120, 0.05)
        procs[0].send_signal(signal.SIGKILL)
        codes, seconds = wait_all(procs[1:], 30)
    finally:
        for p in procs:
            p.kill()
    assert codes == [1], (tmp_path / "1.log").read_text()
    line = only_line(tmp_path / "1.log", r"^process 1: stopping: lost process 0")
    assert "Check failure" not in (tmp_path / "1.log").read_text()
    print(f"\nrank 0 killed: rank 1 exits 1 after {seconds:.1f} s (bound 6 s): {line}")
    assert seconds < 6
    host = f"service_host .*:{port}"
    wait_for(
        lambda: subprocess.run(["pgrep", "-f", host], capture_output=True).returncode == 1,
        (),
        6 + 5 + 10,
        0.5,
    )


@pytest.mark.slow
def test_kill_9_of_both_ranks_resumes_from_their_local_tiers_exactly(tmp_path, cache):
    """The fast-restart tier with two processes (data=2: every parameter is replicated, so
    under orbax's own multi-process save process 1 would write none of it): each writes
    its whole copy into its own ``process-<i>-of-2`` directory. Both are killed (-9) a few
    local saves past the persistent step 10; the restart agrees on the newest local step
    both hold, restores each process from its own copy, and recomputes the lost steps with
    the killed run's losses, bit for bit."""
    from shardlib.checkpoint.store import complete_steps

    persistent, local = tmp_path / "persistent", tmp_path / "local"
    settings = [f"checkpoint_dir={persistent}", f"checkpoint.local_dir={local}"]
    settings += ["checkpoint_every=10", "checkpoint.local_every=2"]
    settings += ["steps=30"]
    first = tmp_path / "first.jsonl"
    procs = start_pair(tmp_path, "k", *settings, metrics=first, cache=cache)
    try:
        wait_for(lambda: len(records_of(first)) >= 17, procs, 120, 0.01)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    killed = {r["step"]: r["loss"] for r in records_of(first)}
    assert max(killed) < 30, "the first run ended before it was killed"
    dirs = [local / f"process-{i}-of-2" for i in (0, 1)]
    steps = [complete_steps(d) for d in dirs]
    assert complete_steps(persistent) == [10], steps
    newest = max(set(steps[0]) & set(steps[1]))
    assert newest >= 14, steps  # saved every 2 steps, 2 kept, on both hosts
    for d in dirs:  # each process holds its own copy of the replicated parameters
        assert list((d / str(newest) / "state").glob("ocdbt.process_*/d/*")), d
    # process 1's copy of the newest step is damaged: both pass over it, to the next older
    # step both hold (local), else the persistent step 10
    DAMAGE["truncated"](dirs[1] / str(newest))
    older = max((set(steps[0]) & set(steps[1])) - {newest}, default=10)
    origin = dirs[0] if older > 10 else persistent

    second = tmp_path / "second.jsonl"
    procs = start_pair(tmp_path, "r", *settings, metrics=second, cache=cache)
    codes, seconds = wait_all(procs, 120)
    logs = [(tmp_path / f"r{i}.log").read_text() for i in (0, 1)]
    assert codes == [0, 0], logs
    skipped = only_line(tmp_path / "r0.log", r"^checkpoint: skipped step ")
    assert skipped.startswith(f"checkpoint: skipped step {newest} (local, {dirs[0]}/{newest}): ")
    assert f"is damaged; falling back to step {older} " in skipped, skipped
    line = only_line(tmp_path / "r0.log", r"^resumed from ")
    assert line == f"resumed from {origin}/{older} (step {older})", logs[0]
    resumed = {r["step"]: r["loss"] for r in records_of(second)}
    assert min(resumed) == older + 1 and max(resumed) == 30
    overlap = sorted(set(resumed) & set(killed))
    assert overlap and all(resumed[s] == killed[s] for s in overlap), (resumed, killed)
    print(f"\nkilled at step {max(killed)}: {skipped}\n{line}; steps {overlap} equal bit "
          f"for bit; restart ran {seconds:.1f} s")  # fmt: skip
