"""Planner at scale: a plan for every GPT-3 style model from 1.7B to 1T on 8 to 3072 GPUs.

    python benchmarks/planner_scale.py                 # the grid on a100-8 (--hosts)
    python benchmarks/planner_scale.py --cluster h100-8
    python benchmarks/planner_scale.py --quick         # two points (what the test runs)

What it checks: for every model from 1B to 1T on 8 to 3072 GPUs of an A100 or H100
preset, ``shardlib plan`` answers in under 10 s, and whenever a published layout
fits (Narayanan et al. 2021 Table 1: 310B on 1920 GPUs, 530B on 2520, 1T on 3072), a plan
is found. Prints, per point, the search time, the plan (or why none fits) and its MFU.
The bound is checked on CPU time (one core: what the command takes on an idle machine);
wall time is printed too, and on a shared machine it is longer.
Seq 2048, vocab 51,200; the global batch is Table 1's at the published points.
"""

from __future__ import annotations

import argparse
import sys
import time

from rich.console import Console
from rich.table import Table

from shardlib.planner import PlanView, Workload, load_cluster
from shardlib.planner.search import Space, search

MODELS = {  # name: (hidden, heads, layers) as in Narayanan et al. 2021 Table 1 and GPT-3
    "1.7B": (2304, 24, 24),
    "7.5B": (4096, 32, 36),
    "39B": (8192, 64, 48),
    "175B": (12288, 96, 96),
    "310B": (16384, 128, 96),
    "530B": (20480, 128, 105),
    "1T": (25600, 160, 128),
}
BATCH = {"1.7B": 512, "7.5B": 512, "39B": 1536, "175B": 1536, "530B": 3072, "1T": 3072}
"""Global batch on the grid (Table 1's, rounded to 2^k·3 so that 3072 GPUs can split it)."""
SIZES = tuple(BATCH)
GRID = [(m, g, BATCH[m]) for m in SIZES for g in (8, 64, 512, 1024, 3072)]
PUBLISHED = [("310B", 1920, 2160), ("530B", 2520, 2520), ("1T", 3072, 3072)]
"""(model, GPUs, global batch) where a published layout ran (Table 1): a plan must be found."""
QUICK = [("1.7B", 32, 512), ("530B", 2520, 2520)]
LIMIT_S = 10.0


def workload(name: str, batch: int) -> Workload:
    h, a, layers = MODELS[name]
    return Workload.from_preset(
        "llama-70b",
        batch,
        2048,
        embed=h,
        heads=a,
        kv_heads=a,
        head_dim=h // a,
        layers=layers,
        mlp=round(8 * h / 3 / 512) * 512,  # SwiGLU at GPT's 4h MLP FLOPs, divisible by 8
        vocab=51_200,
    )


def plan_point(name: str, gpus: int, batch: int, cluster_name: str) -> dict:
    """One search, timed as ``shardlib plan`` runs it (the workload built, then searched)."""
    start, cpu = time.perf_counter(), time.process_time()
    w = workload(name, batch)
    cluster = load_cluster(cluster_name)
    cluster = cluster.with_hosts(max(1, gpus // cluster.devices_per_host))
    result = search(w, cluster, Space(), top=5)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    best = result.best[0] if result.best else None
    return {
        "model": name,
        "gpus": gpus,
        "seconds": seconds,
        "cpu_seconds": cpu,
        "plan": f"{PlanView(best.plan).mesh_text()} {PlanView(best.plan).knobs_text()}"
        if best
        else "no plan fits",
        "mfu": best.mfu if best else None,
        "step_s": best.step_s if best else None,
        "meshes": result.meshes,
        "evaluated": result.evaluated,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", default="a100-8")
    parser.add_argument("--quick", action="store_true", help="two grid points only")
    args = parser.parse_args(argv)
    console = Console(width=150)
    table = Table(title=f"shardlib plan on {args.cluster} (--hosts): time per plan")
    cols = ("model", "GPUs", "batch", "CPU time", "wall", "plan", "step", "MFU", "meshes", "costed")
    for col in cols:
        table.add_column(col, justify="left" if col == "plan" else "right")
    ok = True
    points = QUICK if args.quick else GRID + [p for p in PUBLISHED if p not in GRID]
    with console.status("planning...") as status:
        for name, gpus, batch in points:
            status.update(f"planning {name} on {gpus} GPUs")
            row = plan_point(name, gpus, batch, args.cluster)
            slow = row["cpu_seconds"] >= LIMIT_S
            missing = (name, gpus, batch) in PUBLISHED and row["mfu"] is None
            ok &= not slow and not missing
            console.print(
                f"{name} on {gpus} GPUs: {row['cpu_seconds']:.1f} s CPU "
                f"({row['seconds']:.1f} s wall), {row['plan']}"
            )
            table.add_row(
                name,
                str(gpus),
                str(batch),
                f"[red]{row['cpu_seconds']:.1f} s[/]" if slow else f"{row['cpu_seconds']:.1f} s",
                f"{row['seconds']:.1f} s",
                f"[red]{row['plan']}[/]" if missing else row["plan"],
                f"{row['step_s']:.2f} s" if row["step_s"] else "-",
                f"{row['mfu']:.1%}" if row["mfu"] else "-",
                str(row["meshes"]),
                str(row["evaluated"]),
            )
    console.print(table)
    console.print(
        f"every point under {LIMIT_S:.0f} s and a plan wherever a published layout ran: "
        f"{'yes' if ok else 'NO'}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
