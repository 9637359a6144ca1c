"""Pipelines at GPT-3 scale, from compiled programs: bytes per axis, bubble, memory.

Run:  python benchmarks/pipeline_scale.py [--quick] [--layouts 39b,146b]
          [--schedules 1f1b,gpipe,circular] [--precision bf16|fp32] [--virtual 1,2]

Compiles the train step from abstract shapes on simulated CPU devices (nothing is allocated)
for two published layouts, bf16, seq 2048, vocab 51200, full recompute:

* 39B-class: hidden 8192, 64 heads, 48 layers; tensor 8 x stage 2 x data 32 = 512 devices;
* 146B-class: hidden 12288, 96 heads, 80 layers; tensor 8 x stage 8 x data 24 = 1536.

(SwiGLU width 8h/3 rounded to a multiple of 128, so that the parameter counts are the
GPT-3-style 12·h² per layer.) For m = p, 2p, 4p and every schedule (1f1b: each v of
``--virtual``; circular: v = 2), two tables:

1. Wire bytes per device and step on each mesh axis (``explain``: each collective times its
   loop trips) against REFERENCE.md: data, PTD-P's one ring reduction of the fp32 gradients
   a device holds, 2(d-1)/d x their bytes; tensor, Megatron's all-reduces of b·s·h per layer
   and micro-batch, 2 forward + 2 backward + 1 recomputed (full remat), 2(t-1)/t each;
   stage, b·s·h per micro-batch per boundary forward and backward. The planner's prediction
   (``cost.estimate``, ``backend="cpu"``) beside each. The CPU backend upcasts bf16
   collectives of activations to fp32: the tensor and stage formulas use the compiled width.
2. The bubble from all compiled FLOPs (loop bodies times their trip counts) against the
   single-stage ideal, a compile of the same model without stages (tensor x data over the
   same per-replica batch) whose FLOPs per device are divided by p, beside (p-1)/(v·m)
   (GPipe v = 1, circular, (interleaved) 1F1B). The measured number is not the bubble
   alone: it also counts the output head and the embedding, which every stage device
   computes (SPMD) where the ideal splits them p ways, and whatever else differs between
   the two compiles (``interleaved_1f1b.py`` counts the stage work alone: that is the
   bubble to hold against the formula). Then memory per device by
   part: parameters + optimizer state (the step's arguments, exact) and temp (gradients,
   activations, buffers), against the formulas (4+8 bytes per held parameter; fp32
   gradients and their accumulator; Korthikanti's full-recompute 2sbh per layer plus the
   ring of stage inputs) and the planner's estimate by part.

``--precision fp32`` compiles in fp32: the honest comparison of the memory model (the CPU
backend's bf16 program keeps fp32 copies a GPU would not; see ``planner.validate``).
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
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn  # noqa: E402
from rich.table import Table  # noqa: E402

from shardlib import mesh_spec  # noqa: E402
from shardlib.analysis import explain  # noqa: E402
from shardlib.analysis.report import format_bytes  # noqa: E402
from shardlib.train.config import train_config  # noqa: E402
from shardlib.train.setup import make_setup  # noqa: E402

console = Console(width=170)

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
SCHEDULES = {"gpipe": {}, "circular": {"virtual_stages": 2}, "1f1b": {}}  # 1f1b: --virtual
SEQ, VOCAB = 2048, 51200


def config(layout: str, schedule: str | None, m: int, precision: str, v: int = 1):
    """The ``TrainConfig`` of one layout (``schedule`` None: the same without stages)."""
    model, axes, per_replica = LAYOUTS[layout]
    staged = {} if schedule is None else {**SCHEDULES[schedule]}
    if schedule == "1f1b" and v > 1:
        staged["virtual_stages"] = v
    knobs = {} if schedule is None else dict(pipeline_schedule=schedule, pipeline_microbatches=m)
    return train_config(
        model="llama-70b",
        **{f"model.{k}": v for k, v in model.items()},
        **{"model.vocab": VOCAB},
        seq=SEQ,
        batch=per_replica * axes["data"],
        precision=precision,
        remat="full",
        **knobs,
        **staged,
    )


def compile_report(cfg, axes: dict):
    mesh = mesh_spec(**axes).build(jax.devices()[: math.prod(axes.values())])
    setup = make_setup(cfg, mesh)
    state = setup.abstract_state()
    return setup, explain(
        setup.train_step, state, setup.abstract_batch(), mesh=mesh, params=state["params"]
    )


def predicted(layout: str, schedule: str, m: int, precision: str, v: int):
    from shardlib.planner import Workload, candidate
    from shardlib.planner.cost.total import estimate

    model, axes, per_replica = LAYOUTS[layout]
    w = Workload.from_preset(
        "llama-70b", per_replica * axes["data"], SEQ, precision, **model, vocab=VOCAB
    )
    plan = candidate(**axes, schedule=schedule, microbatches=m, virtual=v, remat="full")
    return w, estimate(w, plan, backend="cpu")


def measure(layout: str, schedule: str, m: int, precision: str, v: int) -> dict:
    model, axes, per_replica = LAYOUTS[layout]
    setup, report = compile_report(config(layout, schedule, m, precision, v), axes)
    shapes, shardings = setup.param_shapes, setup.param_shardings
    held = jax.tree.map(lambda s, sh: math.prod(sh.shard_shape(s.shape)), shapes, shardings)
    held = sum(jax.tree.leaves(held))  # parameter elements on one device
    d, t, p = axes["data"], axes["tensor"], axes["stage"]
    by_axis = {k: v["wire_bytes"] for k, v in report.collective_totals_by_axis.items()}
    # activations' collectives compile at fp32 width on CPU (bf16 upcast): the formulas too
    act = 4
    bsh = per_replica // m * SEQ * model["embed"] * act
    w, est = predicted(layout, schedule, m, precision, v)
    data = [op for op in report.collectives if "data" in op.axes]
    mem = report.memory
    layers = model["layers"] // p
    return {
        "m": m,
        "v": v,
        "wire": by_axis,
        "predicted_wire": est.wire_by_axes(),
        "ring": 2 * (d - 1) / d * held * 4,
        "tensor_formula": layers * m * 5 * 2 * (t - 1) / t * bsh,
        # Megatron's p2p: 1/t of b·s·h per executed chunk and direction under 1F1B (its
        # scatter/gather); GPipe/circular here move whole b·s·h (2 per micro-batch)
        "stage_formula": 2 * (v * m + p - 1) * bsh / t if schedule == "1f1b" else 2 * m * bsh,
        "in_loop": sum(1 for op in data if op.count > 1),
        "flops": report.flops_per_device,
        "arguments": mem.argument_bytes,
        "temp": mem.temp_bytes,
        "total": mem.total_bytes,
        "held": held,
        # formulas: 4 + 8 bytes per held parameter (fp32 master + Adam); temp: fp32 grads
        # (+ the 1F1B loop's accumulator), full recompute's 2sbh per layer (compute dtype)
        # for the layers in flight, the ring of 2vp-1 slots of layer inputs (1F1B)
        "grads_formula": held * 4 * (2 if schedule == "1f1b" else 1),
        "activations_formula": _activations_formula(layout, schedule, m, v, w.compute_bytes),
        "predicted": est.memory,
        "predicted_total": est.memory_bytes,
    }


def _activations_formula(layout: str, schedule: str, m: int, v: int, nbytes: int) -> float:
    model, axes, per_replica = LAYOUTS[layout]
    p, h = axes["stage"], model["embed"]
    sbh = per_replica // m * SEQ * h * nbytes  # one micro-batch's layer input
    layers = model["layers"] // p
    if schedule == "1f1b":  # the ring of 2vp-1 slots of a chunk's layer inputs (stage_work)
        return (2 * v * p - 1) * (layers // v) * sbh
    return layers * sbh * (m + p - 1)  # every trip's residuals (GPipe; circular about so)


def single_stage_flops(layout: str, precision: str) -> float:
    """FLOPs per device of the layout without stages (tensor x data, same per-replica batch)."""
    _, axes, _ = LAYOUTS[layout]
    flat = {"data": axes["data"], "tensor": axes["tensor"]}
    _, report = compile_report(config(layout, None, 1, precision), flat)
    return report.flops_per_device


def _wire_cell(r: dict, axis: str) -> str:
    return format_bytes(r["wire"].get(axis, 0.0))


def tables(layout: str, rows: dict, ideal: float) -> tuple[Table, Table]:
    _, axes, _ = LAYOUTS[layout]
    shape = " x ".join(f"{a} {n}" for a, n in axes.items())
    p = axes["stage"]
    wire = Table(title=f"{layout}-class, {shape}: wire bytes per device per step, by mesh axis")
    cols = ("schedule", "v", "m", "data wire", "2(d-1)/d x held fp32", "ratio", "planner")
    cols += ("tensor wire", "Megatron 5/layer", "planner", "stage wire", "Megatron p2p", "planner")
    cols += ("in loop", "temp")
    for col in cols:
        wire.add_column(col, justify="right")
    parts = Table(title=f"{layout}-class, {shape}: bubble and memory per device by part")
    cols = ("schedule", "v", "m", "all FLOPs / ideal - 1", "bubble (p-1)/(v·m)")
    cols += ("params+opt", "12 B/param", "planner")
    cols += ("temp", "grads+acts formula", "planner", "total", "planner", "ratio")
    for col in cols:
        parts.add_column(col, justify="right")
    for (schedule, v, m), r in rows.items():
        pw = r["predicted_wire"]
        wire.add_row(
            schedule,
            str(v),
            str(m),
            _wire_cell(r, "data"),
            format_bytes(r["ring"]),
            f"{r['wire'].get('data', 0.0) / r['ring']:.3f}",
            format_bytes(pw.get("data", 0.0)),
            _wire_cell(r, "tensor"),
            format_bytes(r["tensor_formula"]),
            format_bytes(pw.get("tensor", 0.0)),
            _wire_cell(r, "stage"),
            format_bytes(r["stage_formula"]),
            format_bytes(pw.get("stage", 0.0)),
            str(r["in_loop"]),
            format_bytes(r["temp"]),
        )
        bubble = (p - 1) / (v * m)
        pred = r["predicted"]
        held_state = pred.get("params", 0) + pred.get("optimizer", 0)
        parts.add_row(
            schedule,
            str(v),
            str(m),
            f"{r['flops'] / (ideal / p) - 1:.3f}",
            f"{bubble:.3f}",
            format_bytes(r["arguments"]),
            format_bytes(r["held"] * 12),
            format_bytes(held_state),
            format_bytes(r["temp"]),
            format_bytes(r["grads_formula"] + r["activations_formula"]),
            format_bytes(r["predicted_total"] - held_state),
            format_bytes(r["total"]),
            format_bytes(r["predicted_total"]),
            f"{r['predicted_total'] / r['total']:.3f}",
        )
    return wire, parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1f1b schedule, m = p and 2p")
    parser.add_argument("--layouts", default="39b,146b")
    parser.add_argument("--schedules", default=",".join(SCHEDULES))
    parser.add_argument("--precision", default="bf16", choices=("bf16", "fp32"))
    parser.add_argument("--virtual", default="1", help="1f1b schedule's v, e.g. 1,2")
    args = parser.parse_args()
    console.print(f"jax {jax.__version__}, backend {jax.default_backend()}, simulated devices")
    layouts = args.layouts.split(",")
    schedules = ["1f1b"] if args.quick else args.schedules.split(",")

    def virtuals(schedule: str) -> list[int]:
        if schedule == "1f1b":
            return [int(v) for v in args.virtual.split(",")]
        return [SCHEDULES[schedule].get("virtual_stages", 1)]

    plan = []
    for layout in layouts:
        p = LAYOUTS[layout][1]["stage"]
        ms = [p, 2 * p] if args.quick else [p, 2 * p, 4 * p]
        plan += [(layout, s, v, m) for s in schedules for v in virtuals(s) for m in ms]
    columns = (TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn())
    results: dict[str, dict] = {layout: {} for layout in layouts}
    ideals: dict[str, float] = {}
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("compiling", total=len(plan) + len(layouts))
        for layout in layouts:
            progress.update(task, description=f"{layout}: single-stage ideal")
            ideals[layout] = single_stage_flops(layout, args.precision)
            progress.advance(task)
        for layout, schedule, v, m in plan:
            progress.update(task, description=f"{layout}: {schedule} v={v} m={m}")
            results[layout][(schedule, v, m)] = measure(layout, schedule, m, args.precision, v)
            progress.advance(task)
    for layout in layouts:
        for t in tables(layout, results[layout], ideals[layout]):
            console.print(t)
    console.print(
        "planner: cost.estimate(backend='cpu') of the same plan and precision. 'all FLOPs / "
        "ideal - 1': compiled FLOPs per device / (single-stage FLOPs / p) - 1, not the bubble "
        "alone: it includes the output head and embedding, which every stage device runs where "
        "the ideal splits them p ways (interleaved_1f1b.py measures the stage work alone, the "
        "number to hold against (p-1)/(v·m)). Tensor and stage "
        "bytes: the planner counts the compute dtype; the CPU backend upcasts bf16 activations' "
        "collectives to fp32 (2x). Tensor: the 1F1B loop executes v·m + p - 1 chunk forwards "
        "and backwards (the bubble's too), each layer's forward re-run once before its "
        "backward: 5 all-reduces per layer, as Megatron's. Stage: 1F1B's formula is "
        "2(v·m+p-1)·bsh/t (hand-overs split over tensor); GPipe/circular's 2·m·bsh."
    )


if __name__ == "__main__":
    main()
