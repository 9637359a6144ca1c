"""Write a plan as a mesh preset that ``shardlib train --mesh`` runs.

``[mesh]`` holds the axis sizes in the planner's order (fast axes last), ``[train]`` the
``TrainConfig`` fields that run the plan (model, batch, seq, precision and every knob:
``Plan.train_overrides``), ``[plan]`` a summary and the predictions, which ``load_mesh``
ignores.
"""

from __future__ import annotations

import dataclasses

from shardlib.explain.report import format_bytes
from shardlib.planner.candidate import Plan
from shardlib.planner.cluster import Cluster
from shardlib.planner.cost import Estimate
from shardlib.planner.workload import Workload


def model_fields(workload: Workload) -> dict[str, object]:
    """``model.NAME`` -> value for the model fields that differ from the preset."""
    import models

    preset = models.config(workload.model)
    return {
        f"model.{f.name}": getattr(workload.cfg, f.name)
        for f in dataclasses.fields(preset)
        if getattr(workload.cfg, f.name) != getattr(preset, f.name)
    }


def train_table(workload: Workload, plan: Plan) -> dict[str, object]:
    """The [train] table that runs ``plan``: the workload, every knob of the plan as its
    ``TrainConfig`` field (``Plan.train_overrides``) and the model fields that differ."""
    return {
        "model": workload.model,
        "batch": workload.global_batch,
        "seq": workload.seq,
        "precision": workload.precision,
        **plan.train_overrides(),
        **model_fields(workload),
    }


def _toml_key(k: str) -> str:
    return f'"{k}"' if "." in k else k


def _toml_value(v) -> str:
    if isinstance(v, str):
        return f'"{v}"'
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


def plan_toml(workload: Workload, est: Estimate, cluster: Cluster) -> str:
    p = est.plan
    train = train_table(workload, p)
    lines = [
        f"# Use this when: training {workload.model} (global batch {workload.global_batch}, seq "
        f"{workload.seq}) on {cluster.name}.",
        "# Written by `shardlib plan`; predicted per device: "
        f"{format_bytes(est.memory_bytes)}, step {est.step_s:.4g} s, MFU {est.mfu:.1%}.",
        "# Run: shardlib train --mesh <this file>",
    ]
    if cluster.platform:
        lines.append(f'platform = "{cluster.platform}"')
    lines += ["", "[mesh]"] + [f"{name} = {size}" for name, size in p.axes]
    lines += ["", "[train]"] + [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in train.items()]
    lines += [
        "",
        "[plan]",
        f'knobs = "{p.knobs_text()}"',
        f"predicted_memory_bytes = {est.memory_bytes:.0f}",
        f"predicted_step_s = {est.step_s:.6g}",
        f"predicted_mfu = {est.mfu:.4f}",
        f'cluster = "{cluster.source}"',
    ]
    return "\n".join(lines) + "\n"
