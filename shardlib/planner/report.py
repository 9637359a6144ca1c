"""Tables, JSON records and the plain-words explanation of a search result or an estimate."""

from __future__ import annotations

from collections import defaultdict

from rich.console import Console
from rich.table import Table

from shardlib.analysis.report import format_bytes
from shardlib.core.workload import Workload
from shardlib.planner.candidate import PlanView
from shardlib.planner.cost.throughput import exposed_strategies, is_exposed
from shardlib.planner.cost.total import MEMORY_HEADROOM, Estimate, collective_seconds
from shardlib.planner.inputs.cluster import Cluster
from shardlib.planner.search import Result, Space, estimate_or_none, knob_groups, meshes, search


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


def lightest(workload: Workload, cluster: Cluster, space: Space) -> Estimate | None:
    """The plan of ``space`` that needs the least memory, fitting or not: per mesh, the
    heaviest remat and offload at the most micro-batches of each (zero, schedule) group."""
    best = None
    for mesh in meshes(workload, cluster, space):
        groups = list(knob_groups(workload, mesh, space))
        most = max((PlanView(g[-1]).microbatches for g in groups), default=0)
        for group in groups:
            if PlanView(group[-1]).microbatches == most:
                est = estimate_or_none(workload, group[-1], cluster)
                if est is not None and (best is None or est.memory_bytes < best.memory_bytes):
                    best = est
    return best


def no_plan_error(workload: Workload, cluster: Cluster, space: Space) -> str:
    """One line: no plan fits, how far the lightest one is, what to change."""
    where = f"{cluster.num_devices} devices of {format_bytes(cluster.memory_bytes)}"
    light = lightest(workload, cluster, space)
    if light is None and space != Space():
        return (
            f"plan: no plan of {workload.model} on {cluster.num_devices} devices has all the "
            "fixed settings together (ZeRO needs a data axis alone; schedule, virtual and "
            "m >= stages need a stage axis; m must divide the batch per replica). Fix: fix "
            "fewer settings (--fix)."
        )
    need = f" (the lightest needs {format_bytes(light.memory_bytes)} per device)" if light else ""
    fixed = " or fix fewer settings (--fix)" if space != Space() else ""
    return (
        f"plan: no layout of {workload.model} (batch {workload.global_batch} x seq "
        f"{workload.seq}) fits on {where}{need}. Fix: more hosts (--hosts), a smaller "
        f"--global-batch or --seq{fixed}."
    )


FAMILIES = (
    ("Plain data parallelism", lambda n: {"data": n}),
    ("Pure FSDP", lambda n: {"fsdp": n}),
    ("Without a pipeline", lambda n: {"stage": 1}),
)
"""The simpler layouts the explanation compares with: each is the search with these sizes
fixed (the knobs still searched), under the same cost model."""


def family_lines(workload: Workload, cluster: Cluster, best: Estimate) -> list[str]:
    """For each simpler family: its best fitting plan and how much slower it is, or why none."""
    n, lines = cluster.num_devices, []
    for name, sizes in FAMILIES:
        fixed = sizes(n)
        if fixed == {"stage": 1} and PlanView(best.plan)["stage"] == 1:
            continue  # the best plan has no pipeline already
        space = Space().fixing(fixed)
        found = search(workload, cluster, space, top=1).best
        what = f"{name} ({', '.join(f'{k}={v}' for k, v in fixed.items())})"
        if found:
            e, p = found[0], PlanView(found[0].plan)
            ratio = e.step_s / best.step_s - 1
            than = f", {abs(ratio):.1%} {'slower' if ratio > 0 else 'faster'}" if ratio else ""
            lines.append(
                f"{what}: best {p.mesh_text()} ({p.knobs_text()}), {e.step_s:.3f} s per step "
                f"(MFU {e.mfu:.1%}){than}."
            )
            continue
        light = lightest(workload, cluster, space)
        if light is None:
            lines.append(f"{what}: over {n} devices it does not divide the batch or the model.")
        else:
            p = PlanView(light.plan)
            lines.append(
                f"{what} needs {format_bytes(light.memory_bytes)} per device even at its "
                f"lightest ({p.mesh_text()}, {p.knobs_text()}): it does not fit."
            )
    return lines


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
                "the tie goes to less exposed communication, then less communication, then "
                "less memory."
            )
    return lines + family_lines(workload, cluster, best)


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


def axis_times(est: Estimate, cluster: Cluster) -> dict[str, dict[str, float]]:
    """Per group of mesh axes (``"data"``, ``"stage,fsdp"``): wire bytes per device and
    step, the seconds they take on their link, and the part on the critical path."""
    out: dict[str, dict[str, float]] = defaultdict(
        lambda: {"wire_bytes": 0.0, "seconds": 0.0, "critical_seconds": 0.0}
    )
    exposed = exposed_strategies(PlanView(est.plan))
    for comm in est.comms:
        row, seconds = out[",".join(comm.axes)], collective_seconds(comm, cluster, est.plan)
        row["wire_bytes"] += comm.wire_bytes
        row["seconds"] += seconds
        row["critical_seconds"] += seconds if is_exposed(comm, exposed) else 0.0
    return dict(out)


def estimate_record(est: Estimate, workload: Workload, cluster: Cluster) -> dict:
    """One plan's figures as plain JSON values (bytes, seconds), for ``--json``."""
    view = PlanView(est.plan)
    return {
        "model": workload.model,
        "params": workload.param_count,
        "global_batch": workload.global_batch,
        "seq": workload.seq,
        "cluster": cluster.name,
        "devices": cluster.num_devices,
        "mesh": dict(view.axes),
        "parallel": est.plan.tables(),
        "knobs": view.knobs_text(),
        "memory_bytes": dict(est.memory),
        "memory_total_bytes": est.memory_bytes,
        "device_memory_bytes": cluster.memory_bytes,
        "fits": est.fits,
        "axes": axis_times(est, cluster),
        "compute_s": est.compute_s,
        "compute_efficiency": est.compute_efficiency,
        "compute_parts_s": est.compute_parts,
        "comm_s": est.comm_s,
        "exposed_comm_s": est.exposed_comm_s,
        "bubble_s": est.bubble_s,
        "host_s": est.host_s,
        "step_s": est.step_s,
        "tokens_per_s": est.tokens_per_s,
        "mfu": est.mfu,
    }


def result_record(
    result: Result, workload: Workload, cluster: Cluster, space: Space, seconds: float
) -> dict:
    """A search result as JSON values: the plans fastest first, the search's counts and the
    explanation's sentences."""
    return {
        "fixed": dict(space.fixed),
        "plans": [estimate_record(e, workload, cluster) for e in result.best],
        "meshes": result.meshes,
        "meshes_visited": result.meshes_visited,
        "evaluated": result.evaluated,
        "search_s": seconds,
        "explanation": explain_choice(result, workload, cluster),
    }


def render_estimate(est: Estimate, workload: Workload, cluster: Cluster, console: Console):
    """``shardlib estimate``'s tables: memory by part, communication by mesh axis, time."""
    view = PlanView(est.plan)
    wide = Console(file=console.file, width=max(console.width, 120))
    console.print(
        f"{workload.model} ({workload.param_count / 1e9:.2f} B params), global batch "
        f"{workload.global_batch} x seq {workload.seq}, {workload.precision}, on {cluster.name} "
        f"({cluster.num_devices} devices): {view.mesh_text()} ({view.knobs_text()})",
        highlight=False,
    )
    memory = Table(title="memory per device")
    memory.add_column("part")
    memory.add_column("bytes", justify="right")
    for part, size in sorted(est.memory.items(), key=lambda kv: -kv[1]):
        memory.add_row(part, format_bytes(size))
    limit = MEMORY_HEADROOM * cluster.memory_bytes  # the limit ``est.fits`` applies
    fits = (
        f"{'fits' if est.fits else 'does NOT fit'} ({format_bytes(est.memory_bytes)} against "
        f"the {MEMORY_HEADROOM:.0%} of {format_bytes(cluster.memory_bytes)} the planner allows, "
        f"{format_bytes(limit)})"
    )
    memory.add_row(
        "total (device)", f"{format_bytes(est.memory_bytes)} / {format_bytes(cluster.memory_bytes)}"
    )
    wide.print(memory)
    compute = Table(title="compute per device and step, by part (planner.cost.throughput)")
    for col in ("part", "time", "share"):
        compute.add_column(col, justify="left" if col == "part" else "right")
    for part, seconds in est.compute_parts.items():
        compute.add_row(part, f"{seconds:.4f} s", f"{seconds / max(est.compute_s, 1e-30):.0%}")
    wide.print(compute)
    comms = Table(title="communication per mesh axis, per device and step")
    for col in ("axes", "wire bytes", "time", "on the critical path"):
        comms.add_column(col, justify="left" if col == "axes" else "right")
    for axes, row in sorted(axis_times(est, cluster).items()):
        comms.add_row(
            axes,
            format_bytes(row["wire_bytes"]),
            f"{row['seconds']:.4f} s",
            f"{row['critical_seconds']:.4f} s",
        )
    wide.print(comms)
    console.print(
        f"step {est.step_s:.4f} s = compute {est.compute_s:.4f} s (at "
        f"{est.compute_efficiency:.0%} of peak on these matmul shapes) + exposed communication "
        f"{est.exposed_comm_s:.4f} s (of {est.comm_s:.4f} s) + bubble {est.bubble_s:.4f} s + "
        f"host {est.host_s:.4f} s; {est.tokens_per_s:,.0f} tokens/s; MFU {est.mfu:.1%}; "
        f"memory {fits}.",
        highlight=False,
    )
    for note in est.notes:  # what the terms and the estimate add (the attention kernel costed)
        console.print(f"note: {note}", highlight=False, soft_wrap=True)
