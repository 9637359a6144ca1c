"""Pipeline and rematerialisation figures, measured from compiled programs (nothing is run).

Run:  python benchmarks/pipeline.py [--quick]

Tables (CPU backend, simulated devices; FLOPs are counted from the optimized HLO with loop
trip counts applied, memory is ``memory_analysis()`` per device):
1. bubble: FLOPs of the layer stack on p stages x p over one device, against (v·m+p-1)/(v·m);
2. memory: temp bytes of the whole train step as m grows at a fixed micro-batch size, for
   GPipe and the 1F1B schedule; per-device parameter bytes against 1/p;
3. remat: temp bytes and FLOPs of the train step per policy (8 layers), and what offload
   moves to host: ``memory_analysis()`` host bytes (0 on CPU: its lowering drops memory
   spaces) and the pinned_host placements of the same program lowered for CUDA;
4. compile time of the train step, 32 layers over 4, with and without the pipeline.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script too

import argparse
import math
import re
import time

from shardlib import simulate_cpu_devices

simulate_cpu_devices(8)

import jax  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from benchmarks._programs import layer_stack_program  # noqa: E402
from shardlib import mesh_spec  # noqa: E402
from shardlib.analysis import hlo, hlo_flops  # noqa: E402
from shardlib.analysis.report import format_bytes  # noqa: E402
from shardlib.core.mesh import single_device_mesh  # noqa: E402
from shardlib.train.config import TrainConfig, train_config  # noqa: E402
from shardlib.train.setup import make_setup  # noqa: E402

console = Console(width=150)


def cfg(layers: int, **fields) -> TrainConfig:
    return train_config(**{"model.layers": layers}, **fields)


def mesh(**axes):
    if math.prod(axes.values()) == 1:
        return single_device_mesh()
    return mesh_spec(**axes).build(jax.devices()[: math.prod(axes.values())])


def compile_step(setup):
    return setup.train_step.lower(setup.abstract_state(), setup.abstract_batch()).compile()


def flops(compiled) -> int:
    module = hlo.parse_module(compiled.as_text())
    return hlo_flops.count_flops(module, hlo.call_multipliers(module)[0])


def stack_flops(config: TrainConfig, p: int) -> int:
    jitted, args = layer_stack_program(make_setup(config, mesh(stage=p)))
    return flops(jitted.lower(*args).compile())


def bubble_table(p: int, ms: list[int]) -> Table:
    base = dict(batch=32, seq=32)
    one = stack_flops(cfg(8, **base), 1)
    table = Table(title=f"1. bubble: layer-stack FLOPs, {p} stages x p / one device (8 layers)")
    for col in ("schedule", "m", "v", "iterations", "measured", "formula", "measured/formula"):
        table.add_column(col, justify="right")
    for schedule, v in (("gpipe", 1), ("circular", 2)):
        for m in ms:
            c = cfg(
                8, **base, pipeline_schedule=schedule, virtual_stages=v, pipeline_microbatches=m
            )
            ratio = p * stack_flops(c, p) / one
            formula = (v * m + p - 1) / (v * m)
            table.add_row(
                schedule, str(m), str(v), str(v * m + p - 1), f"{ratio:.4f}", f"{formula:.4f}",
                f"{ratio / formula:.4f}",
            )  # fmt: skip
    return table


def memory_table(p: int, b: int, ms: list[int]) -> Table:
    table = Table(title=f"2a. temp bytes per device, train step, p={p} stages, micro-batch {b}")
    for col in ("m", "batch", "gpipe temp", "1f1b temp", "1f1b/gpipe", "1f1b FLOPs/gpipe"):
        table.add_column(col, justify="right")
    for m in ms:
        row, fl = [], []
        for schedule in ("gpipe", "1f1b"):
            c = cfg(8, batch=m * b, seq=32, pipeline_schedule=schedule, pipeline_microbatches=m)
            compiled = compile_step(make_setup(c, mesh(stage=p)))
            row.append(compiled.memory_analysis().temp_size_in_bytes)
            fl.append(flops(compiled))
        table.add_row(
            str(m), str(m * b), format_bytes(row[0]), format_bytes(row[1]),
            f"{row[1] / row[0]:.2f}", f"{fl[1] / fl[0]:.2f}",
        )  # fmt: skip
    return table


def param_table() -> Table:
    table = Table(title="2b. parameter bytes per device (stacked blocks), llama-7b shapes")
    for col in ("stages p", "blocks per device", "x p / one device", "all params per device"):
        table.add_column(col, justify="right")
    c = train_config(model="llama-7b")
    sizes = {}
    for p in (1, 2, 4, 8):
        setup = make_setup(c, mesh(stage=p))

        def per_device(shapes, shardings):
            leaves = jax.tree.map(
                lambda s, sh: math.prod(sh.shard_shape(s.shape)) * s.dtype.itemsize,
                shapes,
                shardings,
            )
            return sum(jax.tree.leaves(leaves))

        blocks = per_device(setup.param_shapes["blocks"], setup.param_shardings["blocks"])
        sizes[p] = blocks
        total = per_device(setup.param_shapes, setup.param_shardings)
        table.add_row(
            str(p), format_bytes(blocks), f"{blocks * p / sizes[1]:.4f}", format_bytes(total)
        )
    return table


def host_placements(setup) -> tuple[int, int]:
    """(count, bytes) of values the CUDA lowering of the train step places in pinned_host."""
    traced = setup.train_step.trace(setup.abstract_state(), setup.abstract_batch())
    text = traced.lower(lowering_platforms=("cuda",)).as_text()
    count = nbytes = 0
    for line in text.splitlines():
        if "annotate_device_placement" in line and '"pinned_host"' in line:
            dims = re.search(r"->\s*tensor<([0-9x]+)x(f32|bf16)>", line)
            if dims:
                shape = [int(d) for d in dims.group(1).split("x")]
                nbytes += math.prod(shape) * (4 if dims.group(2) == "f32" else 2)
            count += 1
    return count, nbytes


def remat_table() -> Table:
    table = Table(title="3. remat: train step, 8 layers, batch 8 x seq 128, one device")
    for col in ("remat", "temp", "temp/none", "FLOPs/none", "host bytes (CPU)", "CUDA pinned_host"):
        table.add_column(col, justify="right")
    base = None
    for policy in ("none", "dots", "names:mlp_hidden,attn_context", "full", "offload:mlp_hidden"):
        setup = make_setup(cfg(8, batch=8, seq=128, remat=policy), single_device_mesh())
        compiled = compile_step(setup)
        stats = compiled.memory_analysis()
        temp, fl = stats.temp_size_in_bytes, flops(compiled)
        base = base or (temp, fl)
        host = sum(getattr(stats, f"host_{k}_size_in_bytes", 0) for k in ("argument", "temp"))
        try:
            count, nbytes = host_placements(setup)
            cuda = f"{count} moves, {format_bytes(nbytes)} per layer"
        except Exception as e:  # noqa: BLE001 - cross-lowering is best effort
            cuda = f"n/a ({type(e).__name__})"
        table.add_row(
            policy, format_bytes(temp), f"{temp / base[0]:.2f}", f"{fl / base[1]:.3f}",
            format_bytes(host), cuda,
        )  # fmt: skip
    return table


def compile_table() -> Table:
    table = Table(title="4. compile time of the train step (lower + compile), 32 vs 4 layers")
    for col in ("plan", "4 layers", "32 layers", "ratio (target <= 1.5)"):
        table.add_column(col, justify="right")
    plans = {
        "no pipeline (1 device)": ({}, {}),
        "gpipe, stage 2 x fsdp 2 x tensor 2": ({"stage": 2, "fsdp": 2, "tensor": 2}, {}),
        "1f1b, stage 2 x fsdp 2 x tensor 2": (
            {"stage": 2, "fsdp": 2, "tensor": 2},
            {"pipeline_schedule": "1f1b"},
        ),
    }
    for name, (axes, fields) in plans.items():
        seconds = []
        for layers in (4, 32):
            setup = make_setup(cfg(layers, batch=16, seq=32, **fields), mesh(**axes))
            start = time.perf_counter()
            compile_step(setup)
            seconds.append(time.perf_counter() - start)
        table.add_row(
            name, f"{seconds[0]:.1f} s", f"{seconds[1]:.1f} s", f"{seconds[1] / seconds[0]:.2f}"
        )
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer points per series")
    parser.add_argument("--only", default="1234", help="which tables, e.g. 13")
    args = parser.parse_args()
    console.print(f"jax {jax.__version__}, backend {jax.default_backend()}, 8 simulated devices")
    p = 4
    ms = [p, 4 * p] if args.quick else [p, 2 * p, 4 * p, 8 * p]
    if "1" in args.only:
        console.print(bubble_table(p, ms))
    if "2" in args.only:
        console.print(memory_table(2, 2, [2, 8] if args.quick else [2, 4, 8, 16]))
        console.print(param_table())
    if "3" in args.only:
        console.print(remat_table())
    if "4" in args.only:
        console.print(compile_table())


if __name__ == "__main__":
    main()
