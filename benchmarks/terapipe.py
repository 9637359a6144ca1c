"""TeraPipe (token slices through the stages): its bubble from compiled FLOPs and the
planner next to the compiled train step.

Run:  python benchmarks/terapipe.py   (about 1 min on 2 CPU cores)

Bubble: llama-tiny, 8 layers, batch 1, seq 256, fp32, the layer stack alone
(``_programs.layer_stack_program``), compiled from abstract shapes on simulated devices:
p x FLOPs per device over one device's, all FLOPs and matmul (dot) FLOPs only, against
TeraPipe's executed/ideal (s+p-1)/s. Planner: memory (planner/compiled) and every mesh
axis's wire bytes on four tiny plans (``planner.validate``), batch 2 x seq 256, 4 layers.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script too

from shardlib import simulate_cpu_devices  # noqa: E402

simulate_cpu_devices(8)

import jax  # noqa: E402

from benchmarks._programs import layer_stack_program  # noqa: E402
from shardlib import mesh_spec  # noqa: E402
from shardlib.analysis import hlo, hlo_flops  # noqa: E402
from shardlib.core.mesh import single_device_mesh  # noqa: E402
from shardlib.planner import Workload, candidate  # noqa: E402
from shardlib.planner.validate import validate  # noqa: E402
from shardlib.train.config import train_config  # noqa: E402
from shardlib.train.setup import make_setup  # noqa: E402


def stack_flops(p: int, **overrides) -> tuple[int, int]:
    """(dot FLOPs, all FLOPs) per device of the layer stack, loop trips counted."""
    cfg = train_config(batch=1, seq=256, **{"model.layers": 8}, **overrides)
    mesh = mesh_spec(stage=p).build(jax.devices()[:p]) if p > 1 else single_device_mesh()
    jitted, args = layer_stack_program(make_setup(cfg, mesh))
    module = hlo.parse_module(jitted.lower(*args).compile().as_text())
    mult, dots, total = hlo.call_multipliers(module)[0], 0, 0
    for comp in module.computations.values():
        if k := mult.get(comp.name, 0):
            types = comp.types()
            for inst in comp.instructions:
                f = k * hlo_flops.instruction_flops(inst, types)
                total, dots = total + f, dots + (f if inst.opcode == "dot" else 0)
    return dots, total


def main() -> None:
    one = stack_flops(1)
    print("| p | s | (s+p-1)/s | all FLOPs ratio | matmul ratio |\n|---|---|---|---|---|")
    for p, s in ((2, 2), (2, 4), (4, 4), (4, 8)):
        got = stack_flops(p, pipeline_schedule="terapipe", pipeline_microbatches=s)
        dots, total = (p * g / o for g, o in zip(got, one, strict=True))
        print(f"| {p} | {s} | {(s + p - 1) / s:.4f} | {total:.4f} | {dots:.4f} |")
    print("\n| plan (batch 2, seq 256, 4 layers) | memory planner/compiled | wire by axis |")
    print("|---|---|---|")
    workload = Workload.from_preset("llama-tiny", 2, 256, "fp32", layers=4)
    for axes in (dict(stage=2, data=2, tensor=2), dict(stage=4, data=2)):
        for s in (4, 8):
            c = validate(workload, candidate(**axes, microbatches=s, schedule="terapipe"))
            wire = ", ".join(
                f"{a} {c.predicted_wire_by_axes[a] / b:.3f}"
                for a, b in sorted(c.compiled_wire_by_axes.items())
            )
            print(f"| {axes} s={s} | {c.memory_ratio:.3f} | {wire} |")


if __name__ == "__main__":
    main()
