"""Pipeline parallelism: the stacked layers split over the ``stage`` axis, micro-batches
streamed through them (``strategies/pipeline.py``, ``strategies/pipeline_1f1b.py``).

What the trainer compiles, and so what this term predicts (p stages, m micro-batches,
v virtual stages, L layers, b = B/(m·replicas) sequences per micro-batch on a device):

* every stage holds L/p blocks (``Context.layers_per_device``); the embedding and the
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

A ``context`` axis splits the seq dim of the stage state (``Context.local_seq``) and its
ring runs in every loop trip (``terms.context``); an MoE's all-to-alls likewise
(``terms.expert``), and its pipeline runs no data replicas (the router statistics are not
linear in the batch), so its data-axis gradient reductions stay in the loop (``terms.dp``).
Both checked against compiled programs (``benchmarks/planner_validation.py``).

``partition`` (``strategies/pipeline_partition.py``, dynamic programming over contiguous
splits minimising the slowest stage, as PipeDream and Alpa do) is the trainer's: it places
the identity slots of uneven stages. The terms cost equal stages only (L divisible by p·v):
the planner does not search uneven ones yet.
"""

from __future__ import annotations

from shardlib.core.mesh import Axis
from shardlib.parallel.pipeline.gpipe import PipelineSpec
from shardlib.parallel.pipeline.partition import partition
from shardlib.parallel.pipeline.stats import check_block_stats
from shardlib.planner.cost.terms.base import (
    MASTER_BYTES,
    VIRTUAL_SCHEDULES,
    Comm,
    Context,
    Contribution,
    SearchAxis,
    iterations,
)

__all__ = ["iterations", "partition"]  # re-exported: the trainer's loop trips and partition

FORWARD_PERMUTES = {"gpipe": 2, "circular": 2}  # per trip (1f1b: per executed chunk)
BACKWARD_PERMUTES = {"gpipe": 3, "circular": 3}
STAGE_ALL_REDUCES = 2
"""Per iteration, of one micro-batch's b·s·h (observed, see the module docstring)."""

# Memory of GPipe/circular beyond the formula parts, fitted with the other coefficients on
# the pipeline probes of ``planner.calibration.PROBES``. The memory report shows why: the
# head runs after the loop on the whole data shard while every trip's residuals are live,
# so its fp32 logits and their gradient do not share buffers with anything
# (``pipe_logits``: extra fp32 logits-sized buffers, vocab / tensor, beyond ``head_vocab``),
# and the embedding/head tables' gradients are live there too (``pipe_tables``: extra fp32
# vocab x embed / tensor tables). Circular keeps the regrouped [p, v, k] copy of the
# device's weights (``regrouped_weights``, by definition) and, fitted, the weight-sized
# buffers of its way back (``pipe_circular_weights``: the gradients' regrouping and
# all-to-all). Per-trip copies of a round's weights are not saved (``pipeline._round_policy``).


def _admits(workload, cluster, space, chosen, size) -> bool:
    # MoE models and a context axis pipeline too (GPipe/circular carry the router's
    # statistics; ring attention runs inside the stage loop); the 1F1B schedule's MoE
    # refusal is ``_check``'s, per plan
    return space.pipeline and size <= min(space.max_stage, workload.layers)


def _check(workload, view) -> None:
    """The pipeline strategy's own refusals (equal stages, circular m >= p, MoE under the
    1F1B schedule), in the trainer's words."""
    view.plan.pipeline.spec(view.sizes).check(workload.layers, workload.global_batch)
    if workload.experts:
        check_block_stats(view.plan.pipeline.schedule)


SEARCH_AXIS = SearchAxis(
    Axis.STAGE,
    placement=10,  # small point-to-point sends per micro-batch: outer, next to data
    admits=_admits,
    splits_batch=False,
    rule="at most the layer count (and max_stage)",
    check=_check,
)


def bubble_fraction(schedule: str, stages: int, microbatches: int, virtual: int) -> float:
    """Idle (here: computed and discarded) stage work over the ideal: (p-1)/m GPipe and
    1F1B, (p-1)/(m·v) circular and interleaved 1F1B (``PipelineSpec.bubble_ratio``)."""
    if stages == 1:
        return 0.0
    v = virtual if schedule in VIRTUAL_SCHEDULES else 1
    return PipelineSpec(stages, microbatches, v, schedule).bubble_ratio() - 1


def layer_sets_saved(ctx: Context) -> float:
    """How many times its L/p blocks' residuals a device keeps for the backward pass.

    GPipe and circular differentiate the whole loop: every iteration's residuals stay, i.e.
    (m+p-1) and (v·m+p-1)/v sets of L/p blocks. Bounded recomputes a chunk inside its
    backward: one chunk's residuals (L/(p·v) blocks) at a time (its ring of saved inputs is
    ``pipeline``'s).
    """
    p = ctx.p
    if p.stage == 1:
        return 1.0
    if p.schedule == "1f1b":
        return 1.0 / p.virtual
    v = p.virtual if p.schedule == "circular" else 1
    return ctx.trips / v


def stage_inputs_saved(ctx: Context) -> int:
    """Stage inputs (b·s·h each) the 1F1B ring keeps per device: 2·v·p - 1.

    A micro-batch's input waits on its stage from its forward until its backward, 2(p-1)
    trips later for v = 1 (the lockstep schedule); with v virtual stages per device each of
    the v chunks holds its own (Narayanan et al. 2021). The one parameter an interleaved
    1F1B schedule changes in the memory model: the residuals of one stage at a time and the
    accumulated gradients do not grow with v or m.
    """
    p = ctx.p
    return 2 * p.virtual * p.stage - 1


def regrouped_weights(ctx: Context) -> float:
    """Bytes of the interleaved schedule's round-robin copy of a device's stage weights.

    With v > 1 the device's L/p blocks are regrouped once per step from the stored
    contiguous order to chunks r·p + s ([p, v, k, ...], ``to_stages``); the loop picks its
    chunk from that copy, so it stays live through the loop beside the stored weights: one
    more set of the device's fp32 master weights (the cast to compute dtype is per chunk).
    Seen in the peak live set of the compiled 39B layout (tensor 8 x stage 2, v = 2, fp32):
    9.4 GiB per device, the regrouped copy (a concatenate) beside the stored weights.
    """
    p = ctx.p
    if p.virtual <= 1 or p.stage == 1:
        return 0.0
    return ctx.layer_elements * ctx.layers_per_device * MASTER_BYTES


def gradient_reductions(ctx: Context, *, per_replica: bool = False) -> tuple[float, float]:
    """Times per step (per-layer gradients: per layer; the rest) gradients are reduced.

    Without stages: once per accumulation micro-batch. With stages, over the axes the
    trainer runs as replicas (``per_replica``: ``data`` under ZeRO 0-2, see
    ``strategies/pipeline_replicas.py``): once per step, after the loop. Over the others
    (``fsdp``, context) GPipe/circular reduce each iteration's L/(p·v) layer gradients
    inside the loop (m+p-1 or v·m+p-1 iterations), embedding and head once after it;
    1F1B reduces every gradient it carries every iteration (m+2(p-1) times).
    """
    p = ctx.p
    if p.stage == 1:
        return ctx.layers_per_device * p.microbatches, p.microbatches
    if per_replica:
        return ctx.layers_per_device, 1
    if p.schedule == "1f1b":
        return ctx.layers_per_device * ctx.trips, ctx.trips
    return ctx.layer_runs, 1


def head_batch(ctx: Context) -> int:
    """Sequences the output head runs on at once on one device: the whole data shard
    (outside the pipeline), or one micro-batch for 1F1B (inside its loop)."""
    p = ctx.p
    if p.stage > 1 and p.schedule != "1f1b":
        return ctx.w.global_batch // p.batch_ways
    return ctx.micro_batch


def extra_flops(ctx: Context) -> tuple[float, float]:
    """(bubble FLOPs, recompute FLOPs) per device the schedule adds to the ideal step."""
    p, w = ctx.p, ctx.w
    if p.stage == 1:
        return 0.0, 0.0
    tokens = w.tokens / (p.batch_ways * p.context)
    layer = (w.layer_matmul_flops_per_token + w.attention_flops_per_token(w.seq)) / p.tensor
    stage_fwd = tokens * ctx.layers_per_device * layer  # one forward over all micro-batches
    frac = bubble_fraction(p.schedule, p.stage, p.microbatches, p.virtual)
    if p.schedule != "1f1b":
        return 3 * stage_fwd * frac, 0.0
    # 1F1B: fwd + recomputed fwd + bwd (4 units) per executed chunk; the head once per
    # micro-batch (the ideal's), only in the trips where the last stage finishes one
    return 4 * stage_fwd * frac, stage_fwd


def pipeline(ctx: Context) -> Contribution:
    p, w = ctx.p, ctx.w
    if p.stage <= 1:
        return Contribution()
    axes, n = (str(Axis.STAGE),), p.stage
    trips = ctx.trips
    bsh = ctx.micro_batch * ctx.local_seq * w.embed * w.compute_bytes
    if p.schedule == "1f1b":  # per executed forward / backward, per head trip
        permutes, all_reduces = 2 * ctx.executed + p.microbatches, ctx.executed + p.microbatches
    else:
        permutes = (FORWARD_PERMUTES[p.schedule] + BACKWARD_PERMUTES[p.schedule]) * trips
        all_reduces = STAGE_ALL_REDUCES * trips
    comms = [
        Comm("pipeline", "activations", "collective-permute", axes, n, bsh, permutes, True),
        Comm("pipeline", "activations", "all-reduce", axes, n, bsh, all_reduces, True),
    ]
    if p.schedule in VIRTUAL_SCHEDULES and p.virtual > 1:
        layer = ctx.layer_elements
        held = layer * ctx.layers_per_device
        group = min(p.virtual, p.stage)
        for nbytes in (w.compute_bytes, MASTER_BYTES):  # weights forward, gradients back
            # explain's all-to-all M is the device's own share (wire (g-1)/g of it)
            comms.append(
                Comm("pipeline", "weights", "all-to-all", axes, group, held * nbytes, 1, True)
            )
            if p.virtual < p.stage:
                comms.append(
                    Comm(
                        "pipeline", "weights", "collective-permute", axes, 2, held * nbytes, 1, True
                    )
                )
    bubble, recompute = extra_flops(ctx)
    # 1F1B keeps its ring of 2vp-1 saved stage inputs (its accumulated gradients: ``state``);
    # GPipe/circular the fitted parts above
    if p.schedule == "1f1b":
        buffers = stage_inputs_saved(ctx) * bsh + regrouped_weights(ctx)
    else:
        c = ctx.calib
        tokens = head_batch(ctx) * ctx.local_seq
        buffers = (c["pipe_logits"] * tokens + c["pipe_tables"] * w.embed) * w.vocab / p.tensor * 4
        if p.schedule == "circular":  # the regrouped copy, and what moves it back (fitted)
            regrouped = regrouped_weights(ctx)
            buffers += (1 + c["pipe_circular_weights"]) * regrouped
    return Contribution(
        memory={"pipeline buffers": buffers}, comms=tuple(comms), flops=bubble + recompute
    )
