"""Write a plan as a mesh preset that ``shardlib train --mesh`` runs.

``[mesh]`` holds the axis sizes in the planner's order (fast axes last), ``[train]`` the
settings ``TrainConfig`` knows (model, batch, seq, micro-batches, precision, and any knob a
merged strategy added a field for), ``[plan]`` the rest of the plan and its predictions:
``load_mesh`` ignores that table, so a knob without a training field yet is recorded, not
lost.
"""

from __future__ import annotations

import dataclasses

from shardlib.explain.report import format_bytes
from shardlib.planner.cluster import Cluster
from shardlib.planner.cost import Estimate
from shardlib.planner.workload import Workload

# plan knob -> TrainConfig field names it may have once its strategy lands (first match)
KNOB_FIELDS = {
    "zero": ("zero", "zero_stage"),
    "schedule": ("pipeline_schedule",),  # not `schedule`: that is the learning-rate schedule
    "virtual": ("virtual_stages", "pipeline_virtual"),
    "remat": ("remat", "remat_policy"),
    "offload": ("offload",),
}
KNOB_DEFAULTS = {"zero": 0, "schedule": "none", "virtual": 1, "remat": "none", "offload": "none"}


def model_overrides(workload: Workload) -> list[str]:
    """``model.NAME=VALUE`` words for the fields that differ from the preset."""
    import models

    preset = models.config(workload.model)
    return [
        f"model.{f.name}={getattr(workload.cfg, f.name)}"
        for f in dataclasses.fields(preset)
        if getattr(workload.cfg, f.name) != getattr(preset, f.name)
    ]


def train_settings(workload: Workload, est: Estimate) -> tuple[dict, dict, list[str]]:
    """([train] table, [plan] knobs, knobs the trainer on this branch cannot run yet)."""
    from shardlib.train.config import TrainConfig

    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    p = est.plan
    train = {
        "model": workload.model,
        "batch": workload.global_batch,
        "seq": workload.seq,
        "microbatches": p.microbatches,
        "precision": workload.precision,
    }
    knobs, unsupported = {}, []
    for knob, names in KNOB_FIELDS.items():
        value = getattr(p, knob)
        field = next((n for n in names if n in fields), None)
        if field is not None:
            train[field] = value
        else:
            knobs[knob] = value
            if value != KNOB_DEFAULTS[knob]:
                unsupported.append(f"{knob}={value}")
    return train, knobs, unsupported


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
    train, knobs, unsupported = train_settings(workload, est)
    extra = " ".join(model_overrides(workload))
    lines = [
        f"# Use this when: training {workload.model} (global batch {workload.global_batch}, seq "
        f"{workload.seq}) on {cluster.name}.",
        "# Written by `shardlib plan`; predicted per device: "
        f"{format_bytes(est.memory_bytes)}, step {est.step_s:.4g} s, MFU {est.mfu:.1%}.",
        f"# Run: shardlib train --mesh <this file>{' ' + extra if extra else ''}",
    ]
    if unsupported:
        lines.append(
            f"# Not runnable by this version's trainer yet: {', '.join(unsupported)} "
            "(formula-only; see [plan])."
        )
    if cluster.platform:
        lines.append(f'platform = "{cluster.platform}"')
    lines += ["", "[mesh]"] + [f"{name} = {size}" for name, size in p.axes]
    lines += ["", "[train]"] + [f"{k} = {_toml_value(v)}" for k, v in train.items()]
    lines += ["", "[plan]"] + [f"{k} = {_toml_value(v)}" for k, v in knobs.items()]
    lines += [
        f"predicted_memory_bytes = {est.memory_bytes:.0f}",
        f"predicted_step_s = {est.step_s:.6g}",
        f"predicted_mfu = {est.mfu:.4f}",
        f'cluster = "{cluster.source}"',
    ]
    return "\n".join(lines) + "\n"
