"""``shardlib plan``: search, print, explain, write the plan, optionally compile it."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from shardlib.planner.cluster import load_cluster
from shardlib.planner.search import Space, search
from shardlib.planner.workload import Workload


def add_plan_command(sub) -> argparse.ArgumentParser:
    c = sub.add_parser("plan", help="choose the layout for a model on a cluster")
    c.add_argument(
        "--model", default="llama-small", help="registered model name or package.module:function"
    )
    c.add_argument("--cluster", required=True, help="cluster preset file or name")
    c.add_argument("--hosts", type=int, default=None, help="override the preset's host count")
    c.add_argument("--global-batch", type=int, default=1024, help="sequences per step")
    c.add_argument("--seq", type=int, default=4096, help="tokens per sequence")
    c.add_argument("--precision", default="bf16", choices=("bf16", "fp32"))
    c.add_argument("--top", type=int, default=5, help="plans to show")
    c.add_argument("--out", default="plan.toml", help="where to write the chosen plan")
    c.add_argument(
        "--validate",
        type=int,
        nargs="?",
        const=3,
        default=0,
        metavar="K",
        help="compile the top K plans on simulated CPU devices and compare (default K=3)",
    )
    c.add_argument("overrides", nargs="*", metavar="model.NAME=VALUE", help="model fields")
    return c


def _model_overrides(words: list[str]) -> dict[str, str]:
    from shardlib.errors import ShardingError

    out = {}
    for word in words:
        key, sep, value = word.partition("=")
        if not sep or not key.startswith("model."):
            raise ShardingError(f"plan: {word!r} is not model.NAME=VALUE (e.g. model.layers=4).")
        out[key.removeprefix("model.")] = value
    return out


def cmd_plan(args, console: Console) -> int:
    from shardlib.planner.report import render
    from shardlib.planner.writer import plan_toml

    cluster = load_cluster(args.cluster)
    if args.hosts:
        cluster = cluster.with_hosts(args.hosts)
    overrides = _model_overrides(args.overrides)
    workload = Workload.from_preset(
        args.model, args.global_batch, args.seq, args.precision, **overrides
    )
    space = Space()
    start = time.perf_counter()
    result = search(workload, cluster, space, top=args.top)
    render(result, workload, cluster, console, time.perf_counter() - start)
    if not result.best:
        return 1
    out = Path(args.out)
    out.write_text(plan_toml(workload, result.best[0], cluster))
    console.print(f"wrote {out}: shardlib train --mesh {out}")
    if args.validate:
        _validate(result, workload, args.validate, console)
    return 0


def _validate(result, workload: Workload, k: int, console: Console) -> None:
    """Compile the top ``k`` plans (fp32) on as many simulated CPU devices as they need."""
    from shardlib.explain.report import format_bytes
    from shardlib.mesh import simulate_cpu_devices
    from shardlib.planner.candidate import PlanView
    from shardlib.planner.validate import validate

    simulate_cpu_devices(PlanView(result.best[0].plan).size)
    table = Table(title="predicted (cpu backend, fp32) vs compiled, per device and step")
    cols = ("mesh", "knobs", "memory pred", "compiled", "ratio", "wire pred", "compiled", "ratio")
    for col in cols:
        table.add_column(col, justify="left" if col in ("mesh", "knobs") else "right")
    for est in result.best[:k]:
        check = validate(workload, est.plan)
        view = PlanView(est.plan)
        table.add_row(
            view.mesh_text(),
            view.knobs_text(),
            format_bytes(check.predicted_memory),
            format_bytes(check.compiled_memory),
            f"{check.memory_ratio:.3f}",
            format_bytes(check.predicted_wire),
            format_bytes(check.compiled_wire),
            f"{check.wire_ratio:.3f}",
        )
    Console(file=console.file, width=max(console.width, 150)).print(table)
