"""Chimera (Li and Hoefler, SC21) against 1F1B: the planner next to the compiled train step.

Run:  python benchmarks/chimera.py            # eight tiny plans, 8 simulated devices
      python benchmarks/chimera.py --scale    # Megatron's 39B layout, 512 simulated devices

For each tiny plan (8 simulated CPU devices, fp32, compiled from abstract shapes; nothing
runs) under ``pipeline_schedule=1f1b`` and ``chimera``: per-device memory, the planner's
and the compiled step's (``planner.validate``), and the ``stage`` axis's wire bytes. The
compiled difference chimera - 1f1b is printed in units of W, one stage's fp32 block bytes
on a device (``planner/cost/terms/chimera.stage_weight_bytes``), beside the planner's: 1 W
(both heads take each stage's own targets: ``terms/pipeline_loop.head_logits_bytes``).

``--scale``: the gpt-39b layout of ``planner_scale_validation`` (tensor 8 x stage 2 x data
32, m = 16 micro-batches of b = 3, full recompute) under both schedules: memory as above,
and the per-device activation memory against each paper's count. Activation memory is
measured as what grows with the micro-batch: the compiled step at b and at b - 1 (the
global batch cut to match), (M(b) - M(b-1)) x b; everything else (weights, gradients,
Adam) is the same in both. The papers count Ma, one micro-batch's activations of one
stage; under full recompute the stage keeps each layer's input, k = L/p of b·s·h (fp32
here). Narayanan et al. 2021 (1F1B, PipeDream-Flush) keep at most p of them in flight,
Li and Hoefler's Table 2 (Chimera) between (p/2 + 1) and p; the lockstep loop's ring holds
2p - 1 slots (``stage_work``).

The bubble from compiled FLOPs is ``tests/parallel/test_pipeline_chimera.py``'s
(``pytest -s -k bubble`` prints it beside the paper's).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script too

from shardlib import simulate_cpu_devices  # noqa: E402

SCALE = "--scale" in sys.argv[1:]
simulate_cpu_devices(512 if SCALE else 8)

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
        compiled, booked = {}, {}
        for schedule in ("1f1b", "chimera"):
            plan = candidate(**axes, schedule=schedule)
            c = validate(w, plan)
            compiled[schedule], booked[schedule] = c.compiled_memory, c.predicted_memory
            stage = (c.predicted_wire_by_axes["stage"], c.compiled_wire_by_axes["stage"])
            print(f"{model} b{batch} s{seq} L{layers} {axes} {schedule}: memory "
                  f"{c.predicted_memory / 1e6:.2f}/{c.compiled_memory / 1e6:.2f} = "
                  f"{c.memory_ratio:.3f}; stage wire {stage[0] / 1e6:.3f}/{stage[1] / 1e6:.3f}"
                  f" = {stage[0] / stage[1]:.3f}", flush=True)  # fmt: skip
        step = Step(w, plan, "cpu", PlanView(plan), TERMS, COEFFICIENTS)
        weight = stage_weight_bytes(step)
        extra = (compiled["chimera"] - compiled["1f1b"]) / weight
        ours = (booked["chimera"] - booked["1f1b"]) / weight
        print(f"    compiled chimera - 1f1b = {extra:.2f} W (booked: {ours:.2f} W)")


def scale() -> None:
    """The gpt-39b rows: memory, planner against compiled, and activations against the papers."""
    import dataclasses

    from planner_scale_validation import SCALES

    from shardlib.core.workload import Workload
    from shardlib.planner import candidate
    from shardlib.planner.cost.total import estimate
    from shardlib.planner.validate import validate

    devices, model, overrides, batch, seq, layouts = SCALES["gpt-39b"]
    w = Workload.from_preset(model, batch, seq, "fp32", **overrides)
    gib = 2**30
    print(f"gpt-39b on {devices} simulated devices, fp32, per device (GiB)")
    for axes in layouts:
        plan = candidate(**axes)
        p, m = axes["stage"], axes["microbatches"]
        b = batch // (axes["data"] * m)
        smaller = dataclasses.replace(w, global_batch=batch * (b - 1) // b)
        at_b, at_less = validate(w, plan), validate(smaller, plan)
        grows = (at_b.compiled_memory - at_less.compiled_memory) * b
        booked = (at_b.predicted_memory - estimate(smaller, plan, backend="cpu").memory_bytes) * b
        ma = w.layers // p * b * seq * w.embed * 4  # one micro-batch's saved inputs, one stage
        paper = f"{p} Ma" if axes["schedule"] == "1f1b" else f"{p // 2 + 1}-{p} Ma"
        print(f"{axes['schedule']}: memory planner {at_b.predicted_memory / gib:.1f} / compiled "
              f"{at_b.compiled_memory / gib:.1f} = {at_b.memory_ratio:.3f}; activations "
              f"(grow with b = {b}) compiled {grows / gib:.2f}, planner {booked / gib:.2f}; "
              f"Ma = {ma / gib:.2f}: paper {paper} = {p * ma / gib:.2f}, "
              f"ring {2 * p - 1} Ma = {(2 * p - 1) * ma / gib:.2f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    scale() if SCALE else main()
