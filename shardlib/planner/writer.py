"""Write a plan as a mesh preset that ``shardlib train --mesh`` runs.

The file is the plan itself, in the tables ``ParallelPlan.from_mesh_spec(load_mesh(path))``
reads back: ``[mesh]`` holds the axis sizes in the planner's order (fast axes last) and one
``[parallel.<section>]`` table per strategy section that differs from its defaults
(``ParallelPlan.tables``). ``[train]`` holds the workload (model, batch, seq, precision and
the ``model.NAME`` fields it was planned with), ``[plan]`` a summary and the predictions,
which ``load_mesh`` ignores. Every value is written as its TOML type: nothing is re-parsed
from text on the way back.
"""

from __future__ import annotations

import json
import math

from shardlib.analysis.report import format_bytes
from shardlib.core.workload import Workload
from shardlib.planner.candidate import PlanView
from shardlib.planner.cost.total import Estimate
from shardlib.planner.inputs.cluster import Cluster


def model_fields(workload: Workload) -> dict[str, object]:
    """``model.NAME`` -> value for the model settings the workload was made with, typed as
    the model's config has them (a command line gives strings)."""
    cfg = workload.cfg
    return {
        f"model.{name}": getattr(cfg, name) if cfg is not None and hasattr(cfg, name) else value
        for name, value in workload.overrides
    }


def train_table(workload: Workload) -> dict[str, object]:
    """The [train] table: the ``TrainConfig`` settings of the workload, as dotted keys."""
    return {
        "model": workload.model,
        "dataset.batch": workload.global_batch,
        "dataset.seq": workload.seq,
        "precision.compute": workload.precision,
        **model_fields(workload),
    }


def toml_key(key: str) -> str:
    """Dotted keys are quoted: ``[train]`` keeps ``"model.layers"`` as one flat key."""
    return json.dumps(key) if "." in key else key


def toml_value(value) -> str:
    """A TOML literal of ``value`` (bool, int, float, str), exact (floats as ``repr``)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string: JSON's escapes are TOML's
    raise TypeError(f"no TOML literal for {value!r} ({type(value).__name__})")


def _table(name: str, items: dict) -> list[str]:
    return ["", f"[{name}]"] + [f"{toml_key(k)} = {toml_value(v)}" for k, v in items.items()]


def plan_toml(workload: Workload, est: Estimate, cluster: Cluster) -> str:
    plan, view = est.plan, PlanView(est.plan)
    lines = [
        f"# Use this when: training {workload.model} (global batch {workload.global_batch}, seq "
        f"{workload.seq}) on {cluster.name}.",
        "# Written by `shardlib plan`; predicted per device: "
        f"{format_bytes(est.memory_bytes)}, step {est.step_s:.4g} s, MFU {est.mfu:.1%}.",
        "# Run: shardlib train --mesh <this file>",
    ]
    if cluster.platform:
        lines.append(f"platform = {toml_value(cluster.platform)}")
    lines += _table("mesh", dict(plan.mesh.axes))
    for section, settings in plan.tables().items():
        lines += _table(f"parallel.{section}", settings)
    lines += _table("train", train_table(workload))
    lines += _table(
        "plan",
        {
            "knobs": view.knobs_text(),
            "predicted_memory_bytes": round(est.memory_bytes),
            "predicted_step_s": float(f"{est.step_s:.6g}"),
            "predicted_mfu": round(est.mfu, 4),
            "cluster": cluster.source,
        },
    )
    return "\n".join(lines) + "\n"
