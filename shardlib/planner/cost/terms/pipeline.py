"""Pipeline parallelism: the stacked layers split over the ``stage`` axis, micro-batches
streamed through them (``parallel/pipeline/gpipe.py``, ``parallel/pipeline/one_f_one_b.py``).

What the trainer compiles, and so what this term predicts (p stages, m micro-batches,
v virtual stages, L layers, b = B/(m·replicas) sequences per micro-batch on a device):

* every stage holds L/p blocks (``Step.layers_per_device``); the embedding and the
  output head run *outside* the pipeline, replicated over ``stage`` (every stage device
  holds them and, for GPipe/circular, computes the head on its whole data shard);
* the pipeline is one SPMD loop in which every stage computes every iteration, so the
  bubble is real compute: GPipe runs m+p-1 iterations of L/p blocks (FLOPs x (m+p-1)/m),
  circular v·m+p-1 iterations of L/(p·v) blocks (x (v·m+p-1)/(v·m): REFERENCE.md's
  (p-1)/(m·v) bubble, Narayanan et al. 2021). The 1F1B schedule ((interleaved) 1F1B)
  runs v·m+v·p+p-2 trips in three phases and executes v·m+p-1 chunk forwards and as many
  backwards (one recomputed forward and one backward of L/(p·v) blocks): the same
  (p-1)/(m·v) bubble; the head's forward and backward run on each micro-batch once, as
  it leaves the last stage;
* per iteration the stage state (b·s·h, not split by tensor: activations between blocks
  are replicated over ``tensor``) moves along ``stage``: GPipe and circular compile 2
  collective-permutes forward and 3 backward (the roll and the hand-over to the micro-batch
  buffer), and 2 all-reduces over ``stage`` (reading the last stage's output into the
  buffer, and its transpose); 1F1B compiles a permute per executed forward (activations
  up) and backward (cotangents down) and one per head trip (m), and all-reduces of one per
  backward (device 0's cotangent to the embedding) and one per head trip (the last stage's
  output to the head). Measured on jax 0.10.2, CPU, p = 2, 4, 8, with data, FSDP and
  tensor axes (``tests/planner/test_planner_pipeline.py``; 1F1B v = 1, 2 on data 2 x stage 4);
* circular and interleaved 1F1B regroup their weights once forward (compute dtype) and
  once backward (fp32 gradients) from the stored contiguous layout to the round-robin one:
  an all-to-all over min(v, p) devices of the device's L/p blocks, and when v < p a
  collective-permute of them.

The loop's counts are this term's (``trips``, ``executed``, ``layer_runs``,
``gradient_reductions``): a term that runs collectives per layer counts them per
``layer_runs``, in every loop trip, the bubble's too. ``TERM`` also declares the search's
schedules and virtual stages (``choices``, ``allows``, ``fix``, ``bounds``). Checked
against compiled programs (``benchmarks/planner_validation.py``).

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
from shardlib.parallel.pipeline.gpipe import PipelineSpec
from shardlib.parallel.pipeline.partition import partition
from shardlib.parallel.pipeline.stats import check_block_stats
from shardlib.planner.cost.terms.base import (
    MASTER_BYTES,
    Comm,
    Contribution,
    Knob,
    SearchAxis,
    Step,
    Term,
    per_step,
)

__all__ = ["iterations", "partition"]  # re-exported: the trainer's loop trips and partition

FORWARD_PERMUTES = {"gpipe": 2, "circular": 2}  # per trip (1f1b: per executed chunk)
BACKWARD_PERMUTES = {"gpipe": 3, "circular": 3}
STAGE_ALL_REDUCES = 2
"""Per iteration, of one micro-batch's b·s·h (observed, see the module docstring)."""

# Memory of GPipe/circular beyond the formula parts, fitted with the other coefficients on
# the pipeline probes of ``calibrate.fit.PROBES``. The memory report shows why: the
# head runs after the loop on the whole data shard while every trip's residuals are live,
# so its fp32 logits and their gradient do not share buffers with anything
# (``pipe_logits``: extra fp32 logits-sized buffers, vocab / tensor, beyond ``head_vocab``),
# and the embedding/head tables' gradients are live there too (``pipe_tables``: extra fp32
# vocab x embed / tensor tables). Circular keeps the regrouped [p, v, k] copy of the
# device's weights (``regrouped_weights``, by definition) and, fitted, the weight-sized
# buffers of its way back (``pipe_circular_weights``: the gradients' regrouping and
# all-to-all). Per-trip copies of a round's weights are not saved (``pipeline._round_policy``).


MAX_STAGES = 64
"""Largest pipeline degree the search tries (unless ``Space.limits`` says otherwise)."""
VIRTUAL_SCHEDULES = ("circular", "1f1b")  # schedules with v virtual stages per device


def _admits(workload, cluster, chosen, size) -> bool:
    # MoE models and a sequence split pipeline too (GPipe/circular carry the router's
    # statistics; ring attention runs inside the stage loop); the 1F1B schedule's MoE
    # refusal is ``_check``'s, per plan
    return size <= workload.layers


def _check(workload, view) -> None:
    """The pipeline strategy's own refusals (equal stages, circular m >= p, MoE under the
    1F1B schedule), in the trainer's words."""
    view.plan.pipeline.spec(view).check(workload.layers, workload.global_batch)
    if workload.experts:
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


def iterations(schedule: str, stages: int, microbatches: int, virtual: int) -> int:
    """Loop trips: the trainer's own count (``PipelineSpec.iterations``: m+p-1 GPipe,
    v·m+p-1 circular, v·m+v·p+p-2 (interleaved) 1F1B); 1 without stages."""
    if stages == 1:
        return 1
    v = virtual if schedule in VIRTUAL_SCHEDULES else 1
    return PipelineSpec(stages, microbatches, v, schedule).iterations()


@per_step
def trips(step: Step) -> int:
    """Pipeline loop iterations (``iterations``); 1 without stages."""
    view = step.view
    return iterations(view.schedule, view["stage"], view.microbatches, view.virtual)


@per_step
def executed(step: Step) -> int:
    """Chunk forwards (and backwards) a stage executes per step: the trips, except for
    1f1b, whose warm-up trips run only forwards and cool-down only backwards
    (``PipelineSpec.executed``: v·m+p-1); 1 without stages."""
    view = step.view
    if view["stage"] == 1:
        return 1
    v = view.virtual if view.schedule in VIRTUAL_SCHEDULES else 1
    return PipelineSpec(view["stage"], view.microbatches, v, view.schedule).executed()


@per_step
def layer_runs(step: Step) -> float:
    """Block executions on one micro-batch per device and step (forward, say).

    L·m without stages; with them the pipeline loop's executed chunks times the
    L/(p·v) blocks of one (``executed``): the bubble's trips compute too.
    """
    view = step.view
    if view["stage"] == 1:
        return step.layers_per_device * view.microbatches
    v = view.virtual if view.schedule in VIRTUAL_SCHEDULES else 1
    return step.layers_per_device / v * executed(step)


def bubble_fraction(schedule: str, stages: int, microbatches: int, virtual: int) -> float:
    """Idle (here: computed and discarded) stage work over the ideal: (p-1)/m GPipe and
    1F1B, (p-1)/(m·v) circular and interleaved 1F1B (``PipelineSpec.bubble_ratio``)."""
    if stages == 1:
        return 0.0
    v = virtual if schedule in VIRTUAL_SCHEDULES else 1
    return PipelineSpec(stages, microbatches, v, schedule).bubble_ratio() - 1


def layer_sets_saved(step: Step) -> float:
    """How many times its L/p blocks' residuals a device keeps for the backward pass.

    GPipe and circular differentiate the whole loop: every iteration's residuals stay, i.e.
    (m+p-1) and (v·m+p-1)/v sets of L/p blocks. Bounded recomputes a chunk inside its
    backward: one chunk's residuals (L/(p·v) blocks) at a time (its ring of saved inputs is
    ``pipeline``'s).
    """
    view = step.view
    if view["stage"] == 1:
        return 1.0
    if view.schedule == "1f1b":
        return 1.0 / view.virtual
    v = view.virtual if view.schedule == "circular" else 1
    return trips(step) / v


def stage_inputs_saved(step: Step) -> int:
    """Stage inputs (b·s·h each) the 1F1B ring keeps per device: 2·v·p - 1.

    A micro-batch's input waits on its stage from its forward until its backward, 2(p-1)
    trips later for v = 1 (the lockstep schedule); with v virtual stages per device each of
    the v chunks holds its own (Narayanan et al. 2021). The one parameter an interleaved
    1F1B schedule changes in the memory model: the residuals of one stage at a time and the
    accumulated gradients do not grow with v or m.
    """
    view = step.view
    return 2 * view.virtual * view["stage"] - 1


def regrouped_weights(step: Step) -> float:
    """Bytes of the interleaved schedule's round-robin copy of a device's stage weights.

    With v > 1 the device's L/p blocks are regrouped once per step from the stored
    contiguous order to chunks r·p + s ([p, v, k, ...], ``to_stages``); the loop picks its
    chunk from that copy, so it stays live through the loop beside the stored weights: one
    more set of the device's fp32 master weights (the cast to compute dtype is per chunk).
    Seen in the peak live set of the compiled 39B layout (tensor 8 x stage 2, v = 2, fp32):
    9.4 GiB per device, the regrouped copy (a concatenate) beside the stored weights.
    """
    view = step.view
    if view.virtual <= 1 or view["stage"] == 1:
        return 0.0
    return step.layer_elements * step.layers_per_device * MASTER_BYTES


def gradient_reductions(step: Step, axes: tuple[str, ...]) -> tuple[float, float]:
    """Times per step (per-layer gradients: per layer; the rest) gradients are reduced over
    the mesh ``axes``.

    Without stages: once per accumulation micro-batch. With stages, over the axes the
    trainer runs as replicas (``data`` alone under ZeRO 0-2, see
    ``parallel/pipeline/replicas.py``; not for an MoE model, whose router statistics are
    not linear in the batch): once per step, after the loop. Over the others GPipe/circular
    reduce each iteration's L/(p·v) layer gradients inside the loop (m+p-1 or v·m+p-1
    iterations), embedding and head once after it; 1F1B reduces every gradient it carries
    every iteration (m+2(p-1) times).
    """
    view = step.view
    if view["stage"] == 1:
        return step.layers_per_device * view.microbatches, view.microbatches
    replicas = axes == (str(Axis.DATA),) and view.zero < 3 and not step.workload.experts
    if replicas:
        return step.layers_per_device, 1
    if view.schedule == "1f1b":
        return step.layers_per_device * trips(step), trips(step)
    return layer_runs(step), 1


def head_batch(step: Step) -> int:
    """Sequences the output head runs on at once on one device: the whole data shard
    (outside the pipeline), or one micro-batch for 1F1B (inside its loop)."""
    view = step.view
    if view["stage"] > 1 and view.schedule != "1f1b":
        return step.workload.global_batch // view.ways("batch")
    return step.micro_batch


def extra_flops(step: Step) -> tuple[float, float]:
    """(bubble FLOPs, recompute FLOPs) per device the schedule adds to the ideal step."""
    view, w = step.view, step.workload
    if view["stage"] == 1:
        return 0.0, 0.0
    layer = (w.layer_matmul_flops_per_token + w.attention_flops_per_token(w.seq)) / view["tensor"]
    stage_fwd = step.tokens * step.layers_per_device * layer  # one forward over all micro-batches
    frac = bubble_fraction(view.schedule, view["stage"], view.microbatches, view.virtual)
    if view.schedule != "1f1b":
        return 3 * stage_fwd * frac, 0.0
    # 1F1B: fwd + recomputed fwd + bwd (4 units) per executed chunk; the head once per
    # micro-batch (the ideal's), only in the trips where the last stage finishes one
    return 4 * stage_fwd * frac, stage_fwd


def pipeline(step: Step) -> Contribution:
    view, w = step.view, step.workload
    if view["stage"] <= 1:
        return Contribution()
    axes, n = (str(Axis.STAGE),), view["stage"]
    loop_trips = trips(step)
    bsh = step.micro_batch * step.local_seq * w.embed * w.compute_bytes
    if view.schedule == "1f1b":  # per executed forward / backward, per head trip
        permutes, all_reduces = (
            2 * executed(step) + view.microbatches,
            executed(step) + view.microbatches,
        )
    else:
        permutes = (FORWARD_PERMUTES[view.schedule] + BACKWARD_PERMUTES[view.schedule]) * loop_trips
        all_reduces = STAGE_ALL_REDUCES * loop_trips
    comms = [
        Comm("pipeline", "activations", "collective-permute", axes, n, bsh, permutes, True),
        Comm("pipeline", "activations", "all-reduce", axes, n, bsh, all_reduces, True),
    ]
    if view.schedule in VIRTUAL_SCHEDULES and view.virtual > 1:
        layer = step.layer_elements
        held = layer * step.layers_per_device
        group = min(view.virtual, view["stage"])
        for nbytes in (w.compute_bytes, MASTER_BYTES):  # weights forward, gradients back
            # explain's all-to-all M is the device's own share (wire (g-1)/g of it)
            comms.append(
                Comm("pipeline", "weights", "all-to-all", axes, group, held * nbytes, 1, True)
            )
            if view.virtual < view["stage"]:
                comms.append(
                    Comm(
                        "pipeline", "weights", "collective-permute", axes, 2, held * nbytes, 1, True
                    )
                )
    bubble, recompute = extra_flops(step)
    # 1F1B keeps its ring of 2vp-1 saved stage inputs (its accumulated gradients: ``state``);
    # GPipe/circular the fitted parts above
    if view.schedule == "1f1b":
        buffers = stage_inputs_saved(step) * bsh + regrouped_weights(step)
    else:
        c = step.calib
        tokens = head_batch(step) * step.local_seq
        buffers = (
            (c["pipe_logits"] * tokens + c["pipe_tables"] * w.embed) * w.vocab / view["tensor"] * 4
        )
        if view.schedule == "circular":  # the regrouped copy, and what moves it back (fitted)
            regrouped = regrouped_weights(step)
            buffers += (1 + c["pipe_circular_weights"]) * regrouped
    return Contribution(
        memory={"pipeline buffers": buffers},
        comms=tuple(comms),
        flops=bubble + recompute,
        idle_flops=bubble,
    )


def _settings(view) -> dict[str, Any]:
    """The cost model's one micro-batch count (the pipeline's with stages, 0 in the plan:
    one per stage; else gradient accumulation's), the schedule (``none`` without stages)
    and the virtual stages per device."""
    staged, pipe = view["stage"] > 1, view.plan.pipeline
    return {
        "microbatches": (pipe.microbatches or view["stage"]) if staged else view.accumulation,
        "schedule": pipe.schedule if staged else "none",
        "virtual": pipe.virtual_stages if staged else 1,
    }


def _knobs_text(view) -> str:
    """``circularx2 m=4``: the schedule with stages, and the micro-batch count."""
    pipe = ""
    if view["stage"] > 1:
        pipe = view.schedule + (f"x{view.virtual}" if view.virtual > 1 else "")
    m = f"m={view.microbatches}" if view.microbatches > 1 else ""
    return " ".join(part for part in (pipe, m) if part)


def _choices(workload, mesh: Mapping[str, int], space) -> list[dict]:
    """(schedule, virtual stages) on a staged mesh: gpipe and 1f1b at v = 1, circular and
    interleaved 1f1b at each v of the menu; without stages the section stays as it is."""
    if mesh["stage"] == 1:
        return [{"schedule": "gpipe", "virtual": 1}]
    schedules, virtual = space.menu("schedule"), space.menu("virtual")
    scheds = [(s, 1) for s in schedules if s != "circular"]
    for interleaved in ("circular", "1f1b"):
        if interleaved in schedules:
            scheds += [(interleaved, v) for v in virtual if v > 1]
    return [{"schedule": s, "virtual": v} for s, v in scheds]


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
    return not (knobs["schedule"] == "1f1b" and virtual > 1 and m % stages)


def _fix(settings: Mapping[str, Any]) -> tuple[dict[str, tuple], tuple[str, ...]]:
    """``--fix schedule=...,virtual=...``: v > 1 goes with circular or interleaved 1F1B,
    v = 1 with gpipe or 1f1b; either needs a stage axis."""
    menus = {k: (v,) for k, v in settings.items()}
    virtual, schedule = settings.get("virtual"), settings.get("schedule")
    if virtual is not None:
        together = VIRTUAL_SCHEDULES if virtual > 1 else ("gpipe", "1f1b")
        if schedule is not None and schedule not in together:
            raise ShardingError(
                f"--fix schedule={schedule},virtual={virtual}: virtual stages > 1 go with "
                "the circular or 1F1B schedule only. Fix: fix one of the two."
            )
        menus["schedule"] = (schedule,) if schedule else together
        if virtual == 1:
            menus.pop("virtual")
    return menus, (str(Axis.STAGE),)


def _bounds(mesh: Mapping[str, int], space, m: int) -> list[dict]:
    """With stages the loop's bubble trips also move bytes, fewest at the most micro-batches
    ``m``: GPipe and circular there bound every schedule (1F1B has more trips and a
    recomputed forward)."""
    if mesh["stage"] == 1:
        return []
    circular = [{"schedule": "circular", "virtual": v} for v in space.menu("virtual")]
    return [{"microbatches": m}] + [{**knobs, "microbatches": m} for knobs in circular]


TERM = Term(
    "pipeline",
    cost=pipeline,
    axis=SEARCH_AXIS,
    knobs=(Knob("schedule", ("gpipe", "1f1b", "circular")), Knob("virtual", (2, 4))),
    settings=_settings,
    unmodelled=lambda view: (
        "gradient accumulation with pipeline stages"
        if view["stage"] > 1 and view.accumulation > 1
        else ""
    ),
    knobs_text=_knobs_text,
    scales_saved=layer_sets_saved,
    head_batch=head_batch,
    exposed=lambda view: True,  # hand-overs on the critical path
    choices=_choices,
    allows=_allows,
    fix=_fix,
    bounds=_bounds,
)
