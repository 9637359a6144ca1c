"""Pipeline data-parallel gradient bytes at GPT-3 scale, from compiled programs (issue 14).

Run:  python benchmarks/pipeline_scale.py [--quick] [--layouts 39b,146b]

Compiles the train step from abstract shapes on simulated CPU devices (nothing is allocated)
for two published layouts, bf16, seq 2048, vocab 51200, full recompute:

* 39B-class: hidden 8192, 64 heads, 48 layers; tensor 8 x stage 2 x data 32 = 512 devices;
* 146B-class: hidden 12288, 96 heads, 80 layers; tensor 8 x stage 8 x data 24 = 1536.

(SwiGLU width 8h/3 rounded to a multiple of 128, so that the parameter counts are the
GPT-3-style 12·h² per layer.) For m = p, 2p, 4p and every schedule it prints the data-axis
wire bytes per device and step (``explain``: each collective times its loop trips) against
PTD-P's one ring reduction of the fp32 gradients a device holds, 2(d-1)/d x their bytes
(REFERENCE.md), how many data-axis collectives run inside a loop, and the temp memory.
CPU backend: a reduce-scatter is compiled as an all-reduce, so for ZeRO these are upper
bounds of the GPU figures.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script too

import argparse
import math

from shardlib import simulate_cpu_devices

simulate_cpu_devices(1536)

import jax  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from shardlib import mesh_spec  # noqa: E402
from shardlib.explain import explain  # noqa: E402
from shardlib.explain.report import format_bytes  # noqa: E402
from shardlib.train.config import train_config  # noqa: E402
from shardlib.train.setup import make_setup  # noqa: E402

console = Console(width=150)

LAYOUTS = {  # name: (model overrides, mesh axes outer to inner, sequences per replica)
    "39b": (
        dict(embed=8192, layers=48, heads=64, kv_heads=64, head_dim=128, mlp=21760),
        {"stage": 2, "data": 32, "tensor": 8},
        8,
    ),
    "146b": (
        dict(embed=12288, layers=80, heads=96, kv_heads=96, head_dim=128, mlp=32768),
        {"stage": 8, "data": 24, "tensor": 8},
        32,
    ),
}
SCHEDULES = {"gpipe": {}, "circular": {"virtual_stages": 2}, "bounded": {}}


def measure(layout: str, schedule: str, m: int) -> dict:
    model, axes, per_replica = LAYOUTS[layout]
    cfg = train_config(
        model="llama-70b",
        **{f"model.{k}": v for k, v in model.items()},
        **{"model.vocab": 51200},
        seq=2048,
        batch=per_replica * axes["data"],
        precision="bf16",
        remat="full",
        pipeline_schedule=schedule,
        pipeline_microbatches=m,
        **SCHEDULES[schedule],
    )
    mesh = mesh_spec(**axes).build(jax.devices()[: math.prod(axes.values())])
    setup = make_setup(cfg, mesh)
    report = explain(setup.train_step, setup.abstract_state(), setup.abstract_batch(), mesh=mesh)
    shapes, shardings = setup.param_shapes, setup.param_shardings
    held = jax.tree.map(lambda s, sh: math.prod(sh.shard_shape(s.shape)) * 4, shapes, shardings)
    d = axes["data"]
    data = [op for op in report.collectives if "data" in op.axes]
    return {
        "wire": sum(op.total_wire_bytes for op in data),
        "ring": 2 * (d - 1) / d * sum(jax.tree.leaves(held)),
        "in_loop": sum(1 for op in data if op.count > 1),
        "temp": report.memory.temp_bytes,
    }


def table(layout: str, ms: list[int], schedules: list[str]) -> Table:
    _, axes, _ = LAYOUTS[layout]
    shape = " x ".join(f"{a} {n}" for a, n in axes.items())
    out = Table(title=f"{layout}-class, {shape}: data-axis gradient bytes per device per step")
    for col in ("schedule", "m", "data wire", "2(d-1)/d x held fp32", "ratio", "in loop", "temp"):
        out.add_column(col, justify="right")
    for schedule in schedules:
        for m in ms:
            r = measure(layout, schedule, m)
            out.add_row(
                schedule,
                str(m),
                format_bytes(r["wire"]),
                format_bytes(r["ring"]),
                f"{r['wire'] / r['ring']:.3f}",
                str(r["in_loop"]),
                format_bytes(r["temp"]),
            )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="bounded schedule, m = p and 2p")
    parser.add_argument("--layouts", default="39b,146b")
    args = parser.parse_args()
    console.print(f"jax {jax.__version__}, backend {jax.default_backend()}, simulated devices")
    for layout in args.layouts.split(","):
        p = LAYOUTS[layout][1]["stage"]
        ms = [p, 2 * p] if args.quick else [p, 2 * p, 4 * p]
        schedules = ["bounded"] if args.quick else list(SCHEDULES)
        console.print(table(layout, ms, schedules))


if __name__ == "__main__":
    main()
