"""One of two processes of a multi-host run on loopback (started by test_multihost.py).

``python multihost_worker.py COORDINATOR PROCESS_ID OUT_DIR SETTINGS...`` trains three times
through the unchanged command line, each on 2 processes x 4 simulated CPU devices: FSDP
(cpu-8-fsdp, with checkpoints), FSDP resumed from them, and data x fsdp x tensor = 2x2x2
(cpu-8-3d, with checkpoints), whose data axis is the one that crosses the processes (plain
data parallelism across processes adds no other path: the launcher tests run it). Process 1,
which prints nothing, plays the scheduler: once process 0 has logged a few steps of a phase
it sends itself SIGTERM, so every phase also tests that both processes agree on the step at
which they stop. Before the resumed phase it also truncates the largest data file of its own
shards of the newest FSDP step (a file only it reads: FSDP shards every tensor over both
processes), so that the processes fall back to the previous step together; that phase asks
for as many steps as the step it falls back to holds, so it restores and ends (nothing to
compile). Process 0 prints each phase's seconds.
"""

import os
import signal
import sys
import threading
import time
from pathlib import Path

PHASES = {"fsdp": "cpu-8-fsdp", "fsdp-resumed": "cpu-8-fsdp", "3d": "cpu-8-3d"}
PREEMPT_AFTER_RECORDS = 3


def preempt_when_logged(metrics: Path, records: int) -> threading.Thread:
    def watch() -> None:
        while not metrics.exists() or len(metrics.read_text().splitlines()) < records:
            time.sleep(0.005)
        os.kill(os.getpid(), signal.SIGTERM)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def damage_own_shards(directory: Path, step: int) -> None:
    """Truncate the largest file of this process's (1's) shards of ``step``, once complete."""
    from shardlib.checkpoint.store import complete_steps

    deadline = time.monotonic() + 60  # process 0 commits the step
    while step not in complete_steps(directory) and time.monotonic() < deadline:
        time.sleep(0.05)
    files = (directory / str(step) / "state").glob("ocdbt.process_1/d/*")
    max(files, key=lambda f: f.stat().st_size).write_bytes(b"")


def main() -> int:
    coordinator, process_id, out, *settings = sys.argv[1:]
    out = Path(out)
    from shardlib.tools.cli import main as cli

    for name, mesh in PHASES.items():
        metrics, t0, watcher = out / f"{name}.jsonl", time.monotonic(), None
        extra = [f"checkpoint_dir={out / 'ckpt'}", "checkpoint_every=2", "keep=0"]
        if name.startswith("fsdp"):
            extra = [f"checkpoint_dir={out / 'ckpt-fsdp'}", "checkpoint_every=2"]
        if name == "fsdp-resumed":  # the fsdp phase saved every 2 steps and where it stopped
            stopped = len((out / "fsdp.jsonl").read_text().splitlines())
            extra += [f"steps={2 * ((stopped - 1) // 2)}", "schedule_steps=40"]  # tiny_runs'
            if process_id == "1":
                damage_own_shards(out / "ckpt-fsdp", stopped)
        elif process_id == "1":
            watcher = preempt_when_logged(metrics, PREEMPT_AFTER_RECORDS)
        code = cli(
            [
                "train",
                "--mesh",
                mesh,
                "--cpu-devices",
                "4",
                "--coordinator",
                coordinator,
                "--num-processes",
                "2",
                "--process-id",
                process_id,
                *settings,
                f"metrics={metrics}",
                *extra,
            ]
        )
        if code:
            return code
        if process_id == "0":
            print(f"phase {name}: {time.monotonic() - t0:.1f} s", flush=True)
        if watcher is not None:
            watcher.join(timeout=60)
    # Which process holds each position of the 2x2x2 mesh (data, fsdp, tensor)?
    import json

    from shardlib.core.mesh import load_mesh

    grid = load_mesh(PHASES["3d"]).build().devices
    owners = [[[d.process_index for d in row] for row in plane] for plane in grid]
    (out / f"mesh{process_id}.json").write_text(json.dumps(owners))
    return 0


if __name__ == "__main__":
    sys.exit(main())
