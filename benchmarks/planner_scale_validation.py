"""The planner's memory model at published scale: held-out plans, compiled.

    python benchmarks/planner_scale_validation.py               # every scale below
    python benchmarks/planner_scale_validation.py --scales gpt3-13b,gpt3-175b  # the GPT block
    python benchmarks/planner_scale_validation.py --scales 7b   # one scale
    python benchmarks/planner_scale_validation.py --scales glam-64b-64e  # GLaM's 1.2T MoE
    python benchmarks/planner_scale_validation.py --scales gpt-39b  # 1F1B and Chimera
    python benchmarks/planner_scale_validation.py --json rows.json

For each scale: the plan ``shardlib plan`` picks (``a100-8`` preset with ``--hosts``, searched
here with the model as it stands, so a change to the cost model changes the plan that is
checked) and published-style layouts (Megatron tensor 8 x pipeline x data, ZeRO, FSDP),
all at the full depth of the model. None is a calibration probe
(``planner.calibrate.probes.PROBES`` are 2-6 layers on 8 devices): this is held-out.

Each plan is compiled from abstract shapes on simulated CPU devices (``planner.validate``:
nothing is allocated) and compared with ``cost.estimate(..., backend="cpu")``. The honest
comparison is in fp32: the CPU backend upcasts bf16 matmuls and collectives (a bf16
program's tensor-axis all-reduces compile at fp32 width), so a bf16 compile on CPU is not
the program a GPU runs, while an fp32 compile is that program with 4-byte activations. The
planner's bf16 prediction differs from its fp32 one only by the bytes per activation
element. Plans above ``validate.MAX_SIMULATED`` devices compile with fewer data replicas
(the per-device program is the same but for the data-axis group size; said in the table).
Target: memory within 10%; collective bytes per axis are printed beside it.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script too

import argparse
import json
import time

GPT_175B = dict(embed=12288, layers=96, heads=96, kv_heads=96, head_dim=128, mlp=32768)
GPT_175B["vocab"] = 51200
LLAMA_70B_MHA = dict(kv_heads=64, vocab=51200)  # 69B, multi-head: Megatron's GPT shapes

# scale: (devices, model preset, overrides, global batch, seq, plans); "pick" = the search's
SCALES = {
    "7b": (
        64,
        "llama-7b",
        {},
        512,
        2048,
        [
            "pick",
            dict(data=8, tensor=8, microbatches=8, remat="selective"),
            dict(data=16, fsdp=4, remat="full"),
        ],
    ),
    "70b": (
        512,
        "llama-70b",
        LLAMA_70B_MHA,
        1024,
        2048,
        [
            "pick",
            dict(data=16, stage=4, tensor=8, schedule="1f1b", microbatches=8, remat="full"),
            dict(data=8, fsdp=8, tensor=8, microbatches=2, remat="selective"),
        ],
    ),
    "175b": (
        1024,
        "llama-70b",
        GPT_175B,
        1536,
        2048,
        [
            "pick",
            dict(data=16, stage=8, tensor=8, schedule="1f1b", microbatches=16, remat="full"),
            dict(data=8, stage=16, tensor=8, schedule="1f1b", microbatches=24, remat="full"),
        ],
    ),
    # the GPT block itself (models/gpt), vocabulary padded to 50304 as Megatron pads
    # GPT-2's 50257 (a multiple of 128, so tensor 8 splits the tied table)
    "gpt3-13b": (
        64,
        "gpt3-13b",
        {"vocab": 50304},
        1024,
        2048,
        [
            "pick",
            dict(data=8, tensor=8, microbatches=8, remat="selective"),
            dict(data=8, fsdp=4, tensor=2, microbatches=8),  # remat none (the pick before)
        ],
    ),
    "gpt3-175b": (
        1024,
        "gpt3-175b",
        {"vocab": 50304},
        1536,
        2048,
        [
            "pick",
            dict(data=16, stage=8, tensor=8, schedule="1f1b", microbatches=16, remat="full"),
        ],
    ),
    # Megatron's 39B row (Narayanan et al. 2021, Table 1: width 8192, 48 layers, 64 heads;
    # tensor 8 x pipeline 2 x data 32, batch 1536 = 32 replicas x 16 micro-batches of 3),
    # under 1F1B and under Chimera (two pipelines, ``planner/cost/terms/chimera.py``)
    "gpt-39b": (
        512,
        "gpt3-13b",
        dict(embed=8192, layers=48, heads=64, head_dim=128, vocab=51200),
        1536,
        2048,
        [
            dict(data=32, stage=2, tensor=8, schedule="1f1b", microbatches=16, remat="full"),
            dict(data=32, stage=2, tensor=8, schedule="chimera", microbatches=16, remat="full"),
        ],
    ),
    # GLaM 64B/64E (models/glam): 1.16T parameters, 96.6B activated per token, on
    # the paper's 1024 chips with its 1M-token batches of 1024-token sequences; beside the
    # pick, the paper's 2D sharding (experts over 64 devices, the hidden dims over 16)
    "glam-64b-64e": (
        1024,
        "glam-64b-64e",
        {},
        1024,
        1024,
        ["pick", dict(expert=64, tensor=16, remat="full")],
    ),
}


def picked(workload, devices: int):
    """The plan ``shardlib plan --cluster a100-8 --hosts devices/8`` writes (bf16)."""
    from shardlib.planner.inputs.cluster import load_cluster
    from shardlib.planner.search import search

    cluster = load_cluster("a100-8").with_hosts(devices // 8)
    result = search(workload, cluster, top=1)
    return result.best[0].plan if result.best else None


def run(scales: list[str], progress) -> list[dict]:
    from shardlib.planner import PlanView, Workload, candidate
    from shardlib.planner.validate import simulable, validate

    cases = [(s, plan) for s in scales for plan in SCALES[s][-1]]
    task = progress.add_task("compiling", total=len(cases))
    rows = []
    for scale, plan in cases:
        devices, model, overrides, batch, seq, _ = SCALES[scale]
        workload = Workload.from_preset(model, batch, seq, "bf16", **overrides)
        what = "pick" if plan == "pick" else "layout"
        progress.update(task, description=f"{scale}: {'searching' if what == 'pick' else ''}")
        plan = picked(workload, devices) if plan == "pick" else candidate(**plan)
        view = PlanView(plan)
        progress.update(task, description=f"{scale}: compiling {view.mesh_text()}")
        small_w, small_plan, note = simulable(workload, plan)
        start = time.perf_counter()
        check = validate(small_w, small_plan)
        rows.append(
            {
                "scale": scale,
                "what": what,
                "model": f"{model} {workload.param_count / 1e9:.0f}B",
                "plan": view.mesh_text(),
                "knobs": view.knobs_text(),
                "compiled_on": PlanView(small_plan).size,
                "note": note,
                "predicted_memory": check.predicted_memory,
                "compiled_memory": check.compiled_memory,
                "predicted_wire_by_axes": check.predicted_wire_by_axes,
                "compiled_wire_by_axes": check.compiled_wire_by_axes,
                "seconds": time.perf_counter() - start,
            }
        )
        progress.advance(task)
    return rows


def render(rows: list[dict], console) -> bool:
    from rich.table import Table

    from shardlib.analysis.report import format_bytes

    table = Table(title="planner memory (cpu backend, fp32) vs compiled, per device, full depth")
    for col in ("scale", "", "plan", "knobs", "predicted", "compiled", "ratio", "bytes/axis"):
        right = col in ("predicted", "compiled", "ratio")
        table.add_column(col, justify="right" if right else "left")
    worst = 0.0
    for r in rows:
        ratio = r["predicted_memory"] / r["compiled_memory"]
        worst = max(worst, abs(ratio - 1))
        pred, comp = r["predicted_wire_by_axes"], r["compiled_wire_by_axes"]
        axes = sorted(set(pred) | set(comp))
        wire = "\n".join(
            f"{a}: {format_bytes(pred.get(a, 0))} / {format_bytes(comp.get(a, 0))}" for a in axes
        )
        on = f"\n(on {r['compiled_on']})" if r["note"] else ""
        table.add_row(
            r["scale"],
            r["what"],
            r["plan"] + on,
            r["knobs"],
            f"{r['predicted_memory'] / 2**30:.1f} GiB",
            f"{r['compiled_memory'] / 2**30:.1f} GiB",
            f"{ratio:.3f}",
            wire,
        )
    console.print(table)
    console.print("bytes/axis: predicted / compiled wire bytes per device and step")
    ok = worst <= 0.10
    console.print(
        f"{len(rows)} plans; worst memory error {worst:.1%} (target 10%): "
        f"{'OK' if ok else 'MISSED'}"
    )
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--scales", default=",".join(SCALES), help="comma-separated: " + ",".join(SCALES)
    )
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args()
    scales = args.scales.split(",")
    unknown = [s for s in scales if s not in SCALES]
    if unknown:
        parser.error(f"unknown scale {unknown}; known: {', '.join(SCALES)}")
    import shardlib
    from shardlib.planner.validate import MAX_SIMULATED

    shardlib.simulate_cpu_devices(min(MAX_SIMULATED, max(SCALES[s][0] for s in scales)))
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(width=160)
    columns = (TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console) as progress:
        rows = run(scales, progress)
    ok = render(rows, console)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
