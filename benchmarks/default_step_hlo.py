"""A fingerprint of the default train step's StableHLO: compare two checkouts without running.

    PYTHONPATH=/path/to/a python benchmarks/default_step_hlo.py
    PYTHONPATH=/path/to/b python benchmarks/default_step_hlo.py

Lowers (does not compile) the train step of llama-tiny, batch 8, seq 16, on cpu-8-3d, on
cpu-8-3d with two micro-batches and on cpu-8-pipeline, and prints a SHA-256 of each
program's text with source locations removed. Equal hashes mean the two checkouts hand XLA
the same program, so their losses are bitwise equal: how a change to the model or the step
(packed documents, masked losses) shows that the plain path stayed as it was.
"""

import hashlib
import os
import re

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

from shardlib.core.mesh import load_mesh  # noqa: E402
from shardlib.parallel.plan import ParallelPlan  # noqa: E402
from shardlib.train.config import TrainConfig, override  # noqa: E402
from shardlib.train.setup import make_setup  # noqa: E402

CASES = [("cpu-8-3d", {}), ("cpu-8-3d", {"data_microbatches": 2}), ("cpu-8-pipeline", {})]


def main() -> None:
    for mesh_name, extra in CASES:
        plan = ParallelPlan.from_mesh_spec(load_mesh(mesh_name))
        cfg = override(TrainConfig(parallel=plan), {"batch": 8, "seq": 16, **extra})
        setup = make_setup(cfg, cfg.parallel.with_devices(8).build_mesh())
        lowered = setup.train_step.lower(setup.abstract_state(), setup.abstract_batch())
        text = re.sub(r"loc\(.*?\)", "", lowered.as_text())
        digest = hashlib.sha256(text.encode()).hexdigest()[:16]
        print(f"{mesh_name:15} {str(extra):28} {digest}  ({len(text):,} characters)")


if __name__ == "__main__":
    main()
