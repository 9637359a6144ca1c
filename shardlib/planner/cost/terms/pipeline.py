"""Pipeline parallelism: the stacked layers split over the ``stage`` axis, micro-batches
streamed through them (``parallel/pipeline/gpipe.py``, ``parallel/pipeline/one_f_one_b.py``).

What the trainer compiles, and so what this term predicts (p stages, m micro-batches,
v virtual stages, L layers, b = B/(m·replicas) sequences per micro-batch on a device):

* every stage holds L/p blocks (``Step.layers_per_device``) and a copy of the embedding
  and the output head. GPipe and circular run them *outside* the pipeline, replicated over
  ``stage`` (every stage device computes the head on its whole data shard); 1F1B runs them
  inside its loop on every stage, each on its own micro-batch (only stage 0's embedding
  and stage p-1's head count), and sums the stages' copies of their gradients after the
  loop in the data-parallel all-reduce (over data x stage: ``_reductions``);
* the pipeline is one SPMD loop in which every stage computes every iteration, so the
  bubble is real compute: GPipe runs m+p-1 iterations of L/p blocks (FLOPs x (m+p-1)/m),
  circular v·m+p-1 iterations of L/(p·v) blocks (x (v·m+p-1)/(v·m): REFERENCE.md's
  (p-1)/(m·v) bubble, Narayanan et al. 2021). The 1F1B schedule ((interleaved) 1F1B)
  runs v·m+v·p+p-2 trips in three phases and executes v·m+p-1 chunk forwards and as many
  backwards (each layer's forward re-run from its saved input, then its backward): the
  same (p-1)/(m·v) bubble;
* per iteration the stage state (b·s·h) moves along ``stage``. GPipe and circular move it
  whole (activations between blocks are replicated over ``tensor``): 2 collective-permutes
  forward and 3 backward (the roll and the hand-over to the micro-batch buffer), and 2
  all-reduces over ``stage`` (reading the last stage's output into the buffer, and its
  transpose). 1F1B moves Megatron's volume: one permute per executed forward (activations
  up) and backward (cotangents down), 1/t of b·s·h each (split over ``tensor``, then
  all-gathered over it on arrival: ``handover_split``). Measured on jax 0.10.2, CPU, p = 2,
  4, 8, with data, FSDP and tensor axes (``tests/planner/test_planner_pipeline.py``;
  1F1B v = 1, 2 on data 2 x stage 4; ``benchmarks/ptdp_bytes.py`` at 39B and 146B);
* circular and interleaved 1F1B move no weights: the trainer stores the stacked rows in
  stage order (``parallel/pipeline/storage.py``), so each device holds its chunks r·p + s;
* 1F1B keeps each layer's input from its forward to its backward (``stage_inputs_saved``),
  split over ``tensor`` where the plan says so (``split_saved``, a search knob: 1/t of the
  memory for an all-gather per layer and micro-batch).

The loop's arithmetic lives in ``pipeline_loop`` (``trips``, ``executed``, ``layer_runs``,
``gradient_reductions``), which the terms that run something per layer read. ``TERM`` also
declares the search's schedules and virtual stages (``choices``, ``allows``, ``fix``,
``bounds``). Checked against compiled programs (``benchmarks/planner_validation.py``).

``partition`` (``parallel/pipeline/partition.py``, dynamic programming over contiguous
splits minimising the slowest stage, as PipeDream and Alpa do) is the trainer's: it places
the identity slots of uneven stages. The terms cost equal stages only (L divisible by p·v):
the planner does not search uneven ones yet.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shardlib.core.errors import ShardingError
from shardlib.core.mesh import Axis
from shardlib.parallel.pipeline.partition import partition
from shardlib.parallel.pipeline.spec import FUSED_SCHEDULES
from shardlib.parallel.pipeline.stats import check_block_stats
from shardlib.parallel.pipeline.terapipe import check_terapipe
from shardlib.planner.cost.terms.base import MASTER_BYTES, Comm, Contribution, Step
from shardlib.planner.cost.terms.declare import Knob, SearchAxis, Term
from shardlib.planner.cost.terms.model import logits_share
from shardlib.planner.cost.terms.pipeline_loop import (
    HEAD_LOGITS_SPARED,
    VIRTUAL_SCHEDULES,
    bubble_fraction,
    executed,
    extra_flops,
    gradient_reductions,
    handover_split,
    head_batch,
    head_logits_bytes,
    iterations,
    layer_runs,
    layer_sets_saved,
    stage_inputs_saved,
    trips,
)

__all__ = [  # re-exported: the trainer's loop trips and partition, the loop's arithmetic
    "bubble_fraction",
    "executed",
    "gradient_reductions",
    "iterations",
    "layer_runs",
    "partition",
    "stage_inputs_saved",
    "trips",
]

FORWARD_PERMUTES = {"gpipe": 2, "circular": 2, "terapipe": 2}  # per trip (1f1b: per executed chunk)
BACKWARD_PERMUTES = {"gpipe": 3, "circular": 3, "terapipe": 3}
STAGE_ALL_REDUCES = 2
"""Per iteration, of one micro-batch's b·s·h (observed, see the module docstring)."""

# Memory of GPipe/circular beyond the formula parts, fitted with the other coefficients on
# the pipeline probes of ``calibrate.probes.PROBES``. The memory report shows why: the
# head runs after the loop on the whole data shard while every trip's residuals are live,
# so its fp32 logits and their gradient do not share buffers with anything
# (``pipe_logits``: extra fp32 logits-sized buffers, vocab / tensor, beyond ``head_vocab``),
# and the embedding/head tables' gradients are live there too (``pipe_tables``: extra fp32
# vocab x embed / tensor tables). Circular's [p, v, k] view of the stage-ordered weights
# is a reshape, not a copy; per-trip copies of a round's weights are not saved
# (``pipeline._round_policy``).


MAX_STAGES = 64
"""Largest pipeline degree the search tries (unless ``Space.limits`` says otherwise)."""


def _admits(workload, cluster, chosen, size) -> bool:
    # MoE models and a sequence split pipeline too (GPipe/circular carry the router's
    # statistics; ring attention runs inside the stage loop); the 1F1B schedule's MoE
    # refusal is ``_check``'s, per plan
    return size <= workload.layers


def _check(workload, view) -> None:
    """The pipeline strategy's own refusals (equal stages, circular m >= p, MoE under the
    1F1B schedule), in the trainer's words."""
    spec = view.plan.pipeline.spec(view)
    spec.check(workload.layers, workload.global_batch)
    if spec.schedule == "terapipe":
        stats, context = bool(workload.experts), view[str(Axis.CONTEXT)]
        check_terapipe(spec, seq=workload.seq, block_stats=stats, context=context)
    elif workload.experts:
        check_block_stats(view.plan.pipeline.schedule)


SEARCH_AXIS = SearchAxis(
    Axis.STAGE,
    placement=10,  # small point-to-point sends per micro-batch: outer, next to data
    admits=_admits,
    splits=("layers",),
    largest=lambda cluster: MAX_STAGES,
    rule=f"at most the layer count (and {MAX_STAGES})",
    check=_check,
)


def pipeline(step: Step) -> Contribution:
    view, w = step.view, step.workload
    if view["stage"] <= 1:
        return Contribution()
    axes, n = (str(Axis.STAGE),), view["stage"]
    loop_trips = trips(step)
    bsh = step.micro_batch * step.local_seq * w.embed * w.compute_bytes
    if view.schedule in FUSED_SCHEDULES:  # per executed forward / backward, 1/t of b·s·h each
        split, sends = handover_split(step), 2 * executed(step)
        comms = [
            Comm("pipeline", "hand-over", "collective-permute", axes, n, bsh / split, sends, True)
        ]
        tensor_axes = (str(Axis.TENSOR),)
        if split > 1:  # and gathered over tensor on arrival
            comms.append(
                Comm("pipeline", "hand-over", "all-gather", tensor_axes, split, bsh, sends, True)
            )
        if view.split_saved:  # each saved layer input, gathered before its recompute
            gathers = layer_runs(step)
            comms.append(
                Comm(
                    "pipeline", "saved inputs", "all-gather", tensor_axes, split, bsh, gathers, True
                )
            )
    else:
        permutes = (FORWARD_PERMUTES[view.schedule] + BACKWARD_PERMUTES[view.schedule]) * loop_trips
        all_reduces = STAGE_ALL_REDUCES * loop_trips
        comms = [
            Comm("pipeline", "activations", "collective-permute", axes, n, bsh, permutes, True),
            Comm("pipeline", "activations", "all-reduce", axes, n, bsh, all_reduces, True),
        ]
    memory = {}
    bubble, recompute = extra_flops(step)
    # 1F1B keeps its ring of saved layer inputs (its accumulated gradients: ``state``);
    # GPipe/circular the fitted parts above
    if view.schedule in FUSED_SCHEDULES:
        # and the per-trip fp32 embedding and head gradients of every stage (each runs its
        # own: the embedding's count on stage 0, the head's on p-1, no hand-over to them),
        # beside the accumulator the state term counts (fitted: ``pipe_1f1b_tables``)
        tables = 2 * w.vocab * w.embed / view["tensor"] * MASTER_BYTES
        buffers = stage_inputs_saved(step) * bsh + step.calib["pipe_1f1b_tables"] * tables
        # the head on each stage's own targets: the one-hot adds in place (``head_logits_bytes``)
        spared = HEAD_LOGITS_SPARED * head_logits_bytes(step)
        memory["head buffers spared (per-stage targets)"] = -spared
    else:
        c = step.calib
        tokens = head_batch(step) * step.local_seq * logits_share(step)
        buffers = (
            (c["pipe_logits"] * tokens + c["pipe_tables"] * w.embed) * w.vocab / view["tensor"] * 4
        )
    return Contribution(
        memory={"pipeline buffers": buffers, **memory},
        comms=tuple(comms),
        flops=bubble + recompute,
        idle_flops=bubble,
    )


def _reductions(step: Step, param) -> tuple:
    """1F1B: the embedding and head gradients, one fp32 copy per stage (each stage runs its
    own: the embedding's counts on stage 0, the head's on p-1), summed over ``stage`` after
    the loop, in the same all-reduce as the data-parallel reduction (``one_f_one_b``)."""
    if step.view.schedule in FUSED_SCHEDULES and not param.per_layer:
        return (((str(Axis.STAGE),), None),)
    return ()


def _settings(view) -> dict[str, Any]:
    """The cost model's one micro-batch count (the pipeline's with stages, 0 in the plan:
    one per stage; else gradient accumulation's), the schedule (``none`` without stages)
    and the virtual stages per device."""
    staged, pipe = view["stage"] > 1, view.plan.pipeline
    return {
        "microbatches": (pipe.microbatches or view["stage"]) if staged else view.accumulation,
        "schedule": pipe.schedule if staged else "none",
        "virtual": pipe.virtual_stages if staged else 1,
        "split_saved": staged and pipe.schedule in FUSED_SCHEDULES and pipe.split_saved_inputs,
    }


def _knobs_text(view) -> str:
    """``circularx2 m=4``: the schedule with stages, and the micro-batch count."""
    pipe = ""
    if view["stage"] > 1:
        pipe = view.schedule + (f"x{view.virtual}" if view.virtual > 1 else "")
        pipe += " split-saved" if view.split_saved else ""
    m = f"m={view.microbatches}" if view.microbatches > 1 else ""
    return " ".join(part for part in (pipe, m) if part)


def _choices(workload, mesh: Mapping[str, int], space) -> list[dict]:
    """(schedule, virtual stages) on a staged mesh: gpipe at v = 1, 1f1b at each v of the
    menu (1 included unless ``--fix virtual=N`` took it out), circular at each v > 1;
    without stages the section stays as it is."""
    if mesh["stage"] == 1:
        return [{"schedule": "gpipe", "virtual": 1, "split_saved": False}]
    schedules, virtual = space.menu("schedule"), space.menu("virtual")
    scheds = [("gpipe", 1, False)] if "gpipe" in schedules else []
    if "1f1b" in schedules:  # v = 1 only where the menu has it (not under --fix virtual=2)
        # the saved inputs split over tensor: memory for bytes, where there is a tensor axis
        splits = space.menu("split_saved") if mesh.get(str(Axis.TENSOR), 1) > 1 else (False,)
        scheds += [("1f1b", v, split) for v in virtual for split in splits]
    if "circular" in schedules:
        scheds += [("circular", v, False) for v in virtual if v > 1]
    if "chimera" in schedules and 1 in virtual:  # not in the default menu: --fix / --set
        scheds += [("chimera", 1, False)]  # (split saved inputs: not checked under chimera)
    if "terapipe" in schedules and 1 in virtual:  # likewise: token slices (terms.terapipe)
        scheds += [("terapipe", 1, False)]
    if "2bw" in schedules and 1 in virtual:  # likewise: stale weights (terms.two_bw)
        scheds += [("2bw", 1, False)]
    return [{"schedule": s, "virtual": v, "split_saved": split} for s, v, split in scheds]


def _allows(workload, mesh: Mapping[str, int], knobs: Mapping[str, Any]) -> bool:
    """The trainer's constraints (parallel/pipeline): equal stages; every schedule streams
    at least one micro-batch per stage (m >= p, Narayanan et al.; circular needs it: with
    fewer, stages idle most of the step and GPipe's saved residuals, measured at m = 1, fall
    outside the fitted range, 0.90x); interleaved 1F1B streams whole groups of p."""
    stages, m, virtual = mesh["stage"], knobs["microbatches"], knobs["virtual"]
    if stages == 1:
        return True
    if workload.layers % (stages * virtual) or m < stages:
        return False
    if knobs["schedule"] == "terapipe":  # m equal token slices of every sequence
        context = mesh.get(str(Axis.CONTEXT), 1) > 1
        return virtual == 1 and workload.seq % m == 0 and not workload.experts and not context
    if knobs["schedule"] == "chimera":  # two directions of m/2 over an even stage count
        return virtual == 1 and stages % 2 == 0 and m % 2 == 0
    if knobs["schedule"] == "2bw":  # one chunk per device; a step ends the last one's work
        return virtual == 1 and m >= 2 * stages - 2  # (``PipelineSpec.check``)
    return not (knobs["schedule"] == "1f1b" and virtual > 1 and m % stages)


def _fix(settings: Mapping[str, Any]) -> tuple[dict[str, tuple], tuple[str, ...]]:
    """``--fix schedule=...,virtual=...``: v > 1 goes with circular or interleaved 1F1B,
    v = 1 with gpipe or 1f1b; either needs a stage axis."""
    menus = {k: (v,) for k, v in settings.items()}
    virtual, schedule = settings.get("virtual"), settings.get("schedule")
    if virtual is not None:
        together = VIRTUAL_SCHEDULES if virtual > 1 else ("gpipe", "1f1b")
        chimera = schedule in ("chimera", "terapipe", "2bw") and virtual == 1  # by name
        if schedule is not None and schedule not in together and not chimera:
            raise ShardingError(
                f"--fix schedule={schedule},virtual={virtual}: virtual stages > 1 go with "
                "the circular or 1F1B schedule only. Fix: fix one of the two."
            )
        menus["schedule"] = (schedule,) if schedule else together
    return menus, (str(Axis.STAGE),)


def _bounds(mesh: Mapping[str, int], space, m: int) -> list[dict]:
    """With stages the loop's bubble trips also move bytes, fewest at the most micro-batches
    ``m``: GPipe and circular there bound every schedule (1F1B has more trips and a
    recomputed forward)."""
    if mesh["stage"] == 1:
        return []
    circular = [{"schedule": "circular", "virtual": v} for v in space.menu("virtual") if v > 1]
    return [{"microbatches": m}] + [{**knobs, "microbatches": m} for knobs in circular]


TERM = Term(
    "pipeline",
    cost=pipeline,
    axis=SEARCH_AXIS,
    knobs=(
        Knob("schedule", ("gpipe", "1f1b", "circular")),
        Knob("virtual", (1, 2, 4)),
        Knob("split_saved", (False, True)),
    ),
    settings=_settings,
    unmodelled=lambda view: (
        "gradient accumulation with pipeline stages"
        if view["stage"] > 1 and view.accumulation > 1
        else ""
    ),
    knobs_text=_knobs_text,
    scales_saved=layer_sets_saved,
    reductions=_reductions,
    head_batch=head_batch,
    exposed=lambda view: True,  # hand-overs on the critical path
    choices=_choices,
    allows=_allows,
    fix=_fix,
    bounds=_bounds,
)
