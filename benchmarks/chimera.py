"""Chimera (Li and Hoefler, SC21) against 1F1B: the planner next to the compiled train step.

Run:  python benchmarks/chimera.py

For each tiny plan (8 simulated CPU devices, fp32, compiled from abstract shapes; nothing
runs) under ``pipeline_schedule=1f1b`` and ``chimera``: per-device memory, the planner's
and the compiled step's (``planner.validate``), and the ``stage`` axis's wire bytes. The
compiled difference chimera - 1f1b is printed in units of W, one stage's fp32 block bytes
on a device (``planner/cost/terms/chimera.stage_weight_bytes``), which the term books 3 of.

The bubble from compiled FLOPs is ``tests/parallel/test_pipeline_chimera.py``'s
(``pytest -s -k bubble`` prints it beside the paper's).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script too

from shardlib import simulate_cpu_devices  # noqa: E402

simulate_cpu_devices(8)

PLANS = (  # model, batch, seq, layers, mesh axes and micro-batches
    ("llama-tiny", 16, 128, 8, dict(stage=4, tensor=2, microbatches=4)),
    ("llama-tiny", 16, 128, 8, dict(stage=2, data=2, tensor=2, microbatches=4)),
    ("llama-tiny", 16, 128, 8, dict(stage=4, data=2, microbatches=4)),
    ("llama-tiny", 16, 128, 16, dict(stage=2, tensor=4, microbatches=4)),
    ("llama-tiny", 16, 128, 16, dict(stage=2, data=4, microbatches=2)),
    ("llama-small", 16, 256, 8, dict(stage=2, data=2, tensor=2, microbatches=4)),
    ("llama-tiny", 32, 128, 16, dict(stage=4, data=2, microbatches=8)),
    ("llama-tiny", 16, 128, 12, dict(stage=2, fsdp=2, tensor=2, microbatches=2)),
)


def main() -> None:
    from shardlib.core.workload import Workload
    from shardlib.planner import candidate
    from shardlib.planner.candidate import PlanView
    from shardlib.planner.cost.coefficients import COEFFICIENTS
    from shardlib.planner.cost.terms import TERMS
    from shardlib.planner.cost.terms.base import Step
    from shardlib.planner.cost.terms.chimera import stage_weight_bytes
    from shardlib.planner.validate import validate

    print("memory planner/compiled (MB), stage wire planner/compiled (MB), 8 CPU devices, fp32")
    for model, batch, seq, layers, axes in PLANS:
        w = Workload.from_preset(model, batch, seq, "fp32", layers=layers)
        compiled = {}
        for schedule in ("1f1b", "chimera"):
            plan = candidate(**axes, schedule=schedule)
            c = validate(w, plan)
            compiled[schedule] = c.compiled_memory
            stage = (c.predicted_wire_by_axes["stage"], c.compiled_wire_by_axes["stage"])
            print(f"{model} b{batch} s{seq} L{layers} {axes} {schedule}: memory "
                  f"{c.predicted_memory / 1e6:.2f}/{c.compiled_memory / 1e6:.2f} = "
                  f"{c.memory_ratio:.3f}; stage wire {stage[0] / 1e6:.3f}/{stage[1] / 1e6:.3f}"
                  f" = {stage[0] / stage[1]:.3f}", flush=True)  # fmt: skip
        step = Step(w, plan, "cpu", PlanView(plan), TERMS, COEFFICIENTS)
        extra = (compiled["chimera"] - compiled["1f1b"]) / stage_weight_bytes(step)
        print(f"    compiled chimera - 1f1b = {extra:.2f} W (booked: 3 W)")


if __name__ == "__main__":
    main()
