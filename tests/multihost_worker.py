"""One of two processes of a multi-host run on loopback (started by test_multihost.py).

``python multihost_worker.py COORDINATOR PROCESS_ID OUT_DIR SETTINGS...`` trains three times
through the unchanged command line, each on 2 processes x 4 simulated CPU devices: data
parallel (cpu-8-dp), FSDP (cpu-8-fsdp) and data x fsdp x tensor = 2x2x2 (cpu-8-3d, with
checkpoints). Process 1, which prints nothing, plays the scheduler: once process 0 has
logged a few steps of a phase it sends itself SIGTERM, so every phase also tests that both
processes agree on the step at which they stop.
"""

import os
import signal
import sys
import threading
import time
from pathlib import Path

PHASES = {"dp": "cpu-8-dp", "fsdp": "cpu-8-fsdp", "3d": "cpu-8-3d"}
PREEMPT_AFTER_RECORDS = 3


def preempt_when_logged(metrics: Path, records: int) -> threading.Thread:
    def watch() -> None:
        while not metrics.exists() or len(metrics.read_text().splitlines()) < records:
            time.sleep(0.005)
        os.kill(os.getpid(), signal.SIGTERM)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def main() -> int:
    coordinator, process_id, out, *settings = sys.argv[1:]
    out = Path(out)
    from shardlib.tools.cli import main as cli

    for name, mesh in PHASES.items():
        metrics = out / f"{name}.jsonl"
        watcher = preempt_when_logged(metrics, PREEMPT_AFTER_RECORDS) if process_id == "1" else None
        extra = [f"checkpoint_dir={out / 'ckpt'}", "checkpoint_every=2", "keep=0"]
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
                *(extra if name == "3d" else []),
            ]
        )
        if code:
            return code
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
