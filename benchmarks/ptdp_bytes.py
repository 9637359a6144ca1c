"""PTD-P at Megatron-LM's bytes: the 1F1B pipeline's stage and tensor traffic per device.

Run:  python benchmarks/ptdp_bytes.py [--quick]

Megatron-LM (Narayanan et al., SC21) moves, per device and step:

* over ``stage``: one activation forward and one gradient backward per micro-batch and
  stage boundary, 1/t of b·s·h each (section 4.1's scatter/gather): 2(v·m + p - 1)·b·s·h·w/t
  counting the bubble's sends (v·m of them per direction with v virtual stages: the
  interleaved schedule sends v times as much, section 2.2.2);
* over ``tensor``: 6 all-reduces of b·s·h per layer and micro-batch under full recompute
  (2 forward, 2 in the recompute, 2 backward): 6·(L/p)·m·2(t-1)/t·b·s·h·w.

Part 1 compiles shardlib's train step from abstract shapes on simulated CPU devices for the
39B (t8 x p2 x d32, micro-batch 4, m 12) and 146B (t8 x p8 x d24, micro-batch 2, m 48)
layouts of SC21 Table 1, 1F1B with full recompute, v = 1 and 2, and counts the bytes of
every collective in the optimized HLO (``explain``: each times its loop trips). It compiles
in fp32 (the CPU backend moves bf16 collectives in fp32 anyway), so w = 4. Beside each:
the planner's prediction of the same plan (``backend="cpu"``) and the memory per device.
A last row keeps the saved layer inputs split over tensor (``split_saved_inputs``): less
memory, one all-gather per layer and micro-batch more on ``tensor``.

Part 2 costs every pipelined row of Table 1 with ``shardlib estimate``'s model (a100-8,
GPUs/8 hosts, bf16), shardlib's program against ``megatron_program`` on the same hardware
model: throughput ratio (>= 0.95 wanted), and the two programs' stage and tensor bytes.
The saved layer inputs are split over tensor (``pipeline.split_saved_inputs``) where the
plan does not fit without it, as the planner would choose.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script too

import argparse

from shardlib import simulate_cpu_devices

simulate_cpu_devices(1536)

import jax  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn  # noqa: E402
from rich.table import Table  # noqa: E402

from shardlib import mesh_spec  # noqa: E402
from shardlib.analysis import explain  # noqa: E402
from shardlib.analysis.report import format_bytes  # noqa: E402
from shardlib.planner import Workload, candidate, estimate, load_cluster  # noqa: E402
from shardlib.planner.calibrate.megatron import megatron_program  # noqa: E402
from shardlib.train.config import train_config  # noqa: E402
from shardlib.train.setup import make_setup  # noqa: E402

console = Console(width=200)
SEQ, VOCAB = 2048, 51200
LAYOUTS = {  # name: (hidden, heads, layers, mlp, tensor, stage, data, micro-batch, m)
    "39B": (8192, 64, 48, 21760, 8, 2, 32, 4, 12),
    "146B": (12288, 96, 80, 32768, 8, 8, 24, 2, 48),
}


def formulas(layout, v: int, w: int) -> tuple[float, float]:
    """(stage, tensor) bytes per device and step of Megatron-LM's program, dtype width w."""
    h, _, layers, _, t, p, _, b, m = layout
    bsh = b * SEQ * h * w
    stage = 2 * (v * m + p - 1) * bsh / t
    tensor = 6 * (layers / p) * m * 2 * (t - 1) / t * bsh
    return stage, tensor


def compiled(name: str, v: int, split: bool = False) -> dict:
    h, heads, layers, mlp, t, p, d, b, m = LAYOUTS[name]
    knobs = {"virtual_stages": v} if v > 1 else {}
    if split:
        knobs["pipeline_split_saved_inputs"] = True
    cfg = train_config(
        model="llama-70b",
        **{"model.embed": h, "model.layers": layers, "model.heads": heads},
        **{"model.kv_heads": heads, "model.head_dim": h // heads, "model.mlp": mlp},
        **{"model.vocab": VOCAB},
        seq=SEQ,
        batch=b * m * d,
        precision="fp32",
        remat="full",
        pipeline_schedule="1f1b",
        pipeline_microbatches=m,
        **knobs,
    )
    axes = {"stage": p, "data": d, "tensor": t}
    mesh = mesh_spec(**axes).build(jax.devices()[: t * p * d])
    setup = make_setup(cfg, mesh)
    state = setup.abstract_state()
    report = explain(
        setup.train_step, state, setup.abstract_batch(), mesh=mesh, params=state["params"]
    )
    wire = {k: row["wire_bytes"] for k, row in report.collective_totals_by_axis.items()}
    w = Workload.from_preset(
        "llama-70b", b * m * d, SEQ, "fp32", embed=h, heads=heads, kv_heads=heads,
        head_dim=h // heads, layers=layers, mlp=mlp, vocab=VOCAB,
    )  # fmt: skip
    plan = candidate(
        **axes, schedule="1f1b", microbatches=m, virtual=v, remat="full", split_saved=split
    )
    est = estimate(w, plan, backend="cpu")
    return {"wire": wire, "memory": report.memory.total_bytes, "est": est, "report": report}


def part1(names: list[str], virtuals: list[int]) -> Table:
    table = Table(title="compiled 1F1B steps (fp32, full recompute): bytes per device and step")
    cols = ("layout", "v", "split", "stage wire", "2(vm+p-1)bshw/t", "ratio", "planner")
    cols += ("tensor wire", "6(L/p)m·2(t-1)/t·bshw", "ratio", "planner", "memory", "planner")
    for col in cols:
        table.add_column(col, justify="right")
    jobs = [(n, v, False) for n in names for v in virtuals] + [(names[0], 1, True)]
    columns = (TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("compiling", total=len(jobs))
        for name, v, split in jobs:
            progress.update(task, description=f"{name} v={v}" + (" split" if split else ""))
            r = compiled(name, v, split)
            stage_f, tensor_f = formulas(LAYOUTS[name], v, 4)
            stage, tensor = r["wire"].get("stage", 0.0), r["wire"].get("tensor", 0.0)
            pw = r["est"].wire_by_axes()
            table.add_row(
                name, str(v), str(split),
                format_bytes(stage), format_bytes(stage_f), f"{stage / stage_f:.3f}",
                format_bytes(pw.get("stage", 0.0)),
                format_bytes(tensor), format_bytes(tensor_f), f"{tensor / tensor_f:.3f}",
                format_bytes(pw.get("tensor", 0.0)),
                format_bytes(r["memory"]), format_bytes(r["est"].memory_bytes),
            )  # fmt: skip
            progress.advance(task)
    return table


def part2() -> Table:
    from benchmarks.planner_calibration import gpt_workload
    from benchmarks.published_runs import HELD_OUT, MEGATRON_2021

    micro = {"39B": 4, "145B": 2, "530B": 1, "1T": 1}  # published (SC21); else 1-2 as below
    table = Table(title="SC21 Table 1, pipelined rows: shardlib's program vs Megatron-LM's")
    cols = ("model", "layout", "split saved", "step shardlib", "step Megatron", "ratio")
    cols += ("stage: shardlib", "2(m+p-1)bsh·2/t", "tensor: shardlib", "6(L/p)m·2(t-1)/t·bsh·2")
    cols += ("memory", "fits")
    for col in cols:
        table.add_column(col, justify="right")
    ratios = []
    for run in HELD_OUT:
        if run.stage == 1:
            continue
        b = micro.get(run.name, 2 if run.layers <= 60 else 1)
        m = run.global_batch // (run.data * b)
        cluster = load_cluster("a100-8").with_hosts(run.gpus // 8)
        w = gpt_workload(run)
        for split in (False, True):
            plan = candidate(**run.mesh(), microbatches=m, remat="full", schedule="1f1b",
                             split_saved=split)  # fmt: skip
            ours = estimate(w, plan, cluster)
            if ours.fits:
                break
        meg = estimate(w, plan, cluster, program=megatron_program(MEGATRON_2021))
        ratio = meg.step_s / ours.step_s
        ratios.append(ratio)
        layout = (run.hidden, run.heads, run.layers, 0, run.tensor, run.stage, run.data, b, m)
        stage_f, tensor_f = formulas(layout, 1, 2)
        wire = ours.wire_by_axes()
        table.add_row(
            run.name, f"t{run.tensor} p{run.stage} d{run.data} mb{b} m{m}", str(split),
            f"{ours.step_s:.2f} s", f"{meg.step_s:.2f} s", f"{ratio:.3f}",
            format_bytes(wire.get("stage", 0.0)), format_bytes(stage_f),
            format_bytes(wire.get("tensor", 0.0)), format_bytes(tensor_f),
            format_bytes(ours.memory_bytes), str(ours.fits),
        )  # fmt: skip
    table.caption = f"throughput ratio shardlib/Megatron: {min(ratios):.3f}-{max(ratios):.3f}"
    return table


def collectives(name: str) -> Table:
    """Where the stage and tensor bytes come from: every stage-axis collective of the
    compiled step (v = 1), and the tensor-axis ones summed by the op they come from."""
    report = compiled(name, 1)["report"]
    table = Table(title=f"{name}, 1F1B v = 1: the stage and tensor collectives of one step")
    for col in ("kind", "axes", "buffer", "executions", "wire", "from"):
        table.add_column(col, justify="left" if col in ("kind", "axes", "from") else "right")
    rows: dict[tuple, list] = {}
    for op in report.collectives:
        if "stage" in op.axes:
            key = (op.kind, ",".join(op.axes), op.buffer_bytes, op.name)
        elif "tensor" in op.axes:
            key = (op.kind, ",".join(op.axes), op.buffer_bytes, op.op_name.split("/")[-2])
        else:
            continue
        row = rows.setdefault(key, [0, 0.0, op.op_name])
        row[0] += op.count
        row[1] += op.total_wire_bytes
    for (kind, axes, buf, _), (count, wire, where) in sorted(rows.items(), key=lambda r: -r[1][1]):
        if wire >= 2**20:
            table.add_row(
                kind, axes, format_bytes(buf), str(count), format_bytes(wire), where[-64:]
            )
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="39B only, v = 1")
    parser.add_argument(
        "--collectives", action="store_true", help="only list the 39B step's collectives"
    )
    args = parser.parse_args()
    console.print(f"jax {jax.__version__}, backend {jax.default_backend()}, simulated devices")
    if args.collectives:
        console.print(collectives("39B"))
        return
    names = ["39B"] if args.quick else list(LAYOUTS)
    console.print(part1(names, [1] if args.quick else [1, 2]))
    console.print(part2())
    console.print(
        "stage: every collective over the stage axis alone (the hand-overs: with v > 1 the "
        "trainer stores the stacked layers in stage order, so no weight moves); the "
        "embedding and head gradients of the stages are summed with the data-parallel "
        "reduction, in one all-reduce over (data, stage), not counted here."
    )


if __name__ == "__main__":
    main()
