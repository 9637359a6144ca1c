"""Tables and the plain-words explanation of a search result."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from shardlib.errors import ShardingError
from shardlib.explain.report import format_bytes
from shardlib.planner.candidate import PlanView, candidate
from shardlib.planner.cluster import Cluster
from shardlib.planner.cost import Estimate, estimate
from shardlib.planner.search import Result
from shardlib.planner.workload import Workload


def plans_table(result: Result, cluster: Cluster, title: str) -> Table:
    table = Table(title=title)
    for col in (
        "#",
        "mesh (outer -> inner)",
        "knobs",
        "mem/device",
        "step",
        "MFU",
        "tokens/s",
        "exposed comm",
        "bubble",
    ):
        table.add_column(
            col, justify="left" if col in ("mesh (outer -> inner)", "knobs") else "right"
        )
    for i, e in enumerate(result.best, 1):
        p = PlanView(e.plan)
        table.add_row(
            str(i),
            p.mesh_text(),
            p.knobs_text(),
            f"{format_bytes(e.memory_bytes)} / {format_bytes(cluster.memory_bytes)}",
            f"{e.step_s:.3f} s",
            f"{e.mfu:.1%}",
            f"{e.tokens_per_s:,.0f}",
            f"{e.exposed_comm_s:.3f} s",
            f"{e.bubble_s:.3f} s",
        )
    return table


def _baseline(workload: Workload, cluster: Cluster, mesh: dict[str, int]) -> Estimate | None:
    """The fastest fitting micro-batch count on ``mesh``, else its smallest memory."""
    options = []
    for m in (1, 2, 4, 8, 16, 32, 64, 128):
        try:
            options.append(estimate(workload, candidate(**mesh, microbatches=m), cluster))
        except ShardingError:
            continue
    fitting = [e for e in options if e.fits]
    if fitting:
        return min(fitting, key=lambda e: e.step_s)
    return min(options, key=lambda e: e.memory_bytes, default=None)


def explain_choice(result: Result, workload: Workload, cluster: Cluster) -> list[str]:
    """Why the best plan wins, in sentences: its time split, the runner-up, the baselines."""
    if not result.best:
        return [
            "No plan fits: every candidate needs more memory per device than the cluster "
            "has. Try a smaller global batch or sequence, or more devices."
        ]
    best = result.best[0]
    p = PlanView(best.plan)
    lines = [
        f"Best: {p.mesh_text()} ({p.knobs_text()}). Step {best.step_s:.3f} s = compute "
        f"{best.compute_s:.3f} s + exposed communication {best.exposed_comm_s:.3f} s (of "
        f"{best.comm_s:.3f} s in all; the rest hides behind compute) + bubble "
        f"{best.bubble_s:.3f} s + host {best.host_s:.3f} s; {format_bytes(best.memory_bytes)} "
        f"of {format_bytes(cluster.memory_bytes)} per device; MFU {best.mfu:.1%}.",
    ]
    parts = sorted(best.memory.items(), key=lambda kv: -kv[1])[:3]
    lines.append("Memory is mostly " + ", ".join(f"{k} {format_bytes(v)}" for k, v in parts) + ".")
    if len(result.best) > 1:
        second = result.best[1]
        runner_up = PlanView(second.plan)
        deltas = {
            "compute": second.compute_s - best.compute_s,
            "exposed communication": second.exposed_comm_s - best.exposed_comm_s,
            "pipeline bubble": second.bubble_s - best.bubble_s,
            "host transfers": second.host_s - best.host_s,
        }
        why = max(deltas, key=lambda k: deltas[k])
        if second.step_s > best.step_s:
            lines.append(
                f"Runner-up {runner_up.mesh_text()} ({runner_up.knobs_text()}) is "
                f"{second.step_s / best.step_s - 1:.1%} slower, mostly {why} "
                f"(+{deltas[why]:.3g} s)."
            )
        else:
            lines.append(
                f"Runner-up {runner_up.mesh_text()} ({runner_up.knobs_text()}) is as fast; "
                "the tie goes to less exposed communication, then less memory."
            )
    n = cluster.num_devices
    for name, mesh in (("Plain data parallelism", {"data": n}), ("Pure FSDP", {"fsdp": n})):
        est = _baseline(workload, cluster, mesh)
        if est is None:
            lines.append(f"{name} over {n} devices does not divide the batch or the model.")
        elif not est.fits:
            lines.append(
                f"{name} needs {format_bytes(est.memory_bytes)} per device even with "
                f"{PlanView(est.plan).microbatches} micro-batches: it does not fit."
            )
        else:
            lines.append(
                f"{name} fits with {PlanView(est.plan).microbatches} micro-batch(es) but takes "
                f"{est.step_s:.3f} s per step (MFU {est.mfu:.1%})."
            )
    return lines


def render(
    result: Result, workload: Workload, cluster: Cluster, console: Console, seconds: float
) -> None:
    title = (
        f"{workload.model} ({workload.param_count / 1e9:.2f} B params), global batch "
        f"{workload.global_batch} x seq {workload.seq}, {workload.precision}, on {cluster.name} "
        f"({cluster.num_devices} devices)"
    )
    wide = Console(file=console.file, width=max(console.width, 150))  # a table, not prose
    wide.print(plans_table(result, cluster, title))
    console.print(
        f"searched {result.meshes} meshes ({result.meshes_visited} not pruned by the bound), "
        f"costed {result.evaluated} plans in {seconds:.1f} s"
    )
    for line in explain_choice(result, workload, cluster):
        console.print(line, highlight=False)
