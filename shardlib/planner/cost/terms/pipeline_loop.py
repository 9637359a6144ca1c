"""The pipeline loop's arithmetic the cost terms share: trips, executed chunks, block runs,
bubble, what the 1F1B schedule keeps and moves, and how often gradients are reduced.

The trainer's own counts (``parallel/pipeline``: ``PipelineSpec``, ``timetable.Schedule``),
read by every term that runs something per layer or per loop trip (tensor, context, expert,
FSDP, data): a term that runs collectives per layer counts them per ``layer_runs``, in
every loop trip, the bubble's too. ``terms.pipeline`` costs the pipeline itself.
"""

from __future__ import annotations

from shardlib.core.mesh import Axis
from shardlib.parallel.pipeline.spec import FUSED_SCHEDULES, PipelineSpec
from shardlib.planner.cost.terms.base import Step, per_step
from shardlib.planner.cost.terms.model import head_rows, logits_share

VIRTUAL_SCHEDULES = ("circular", "1f1b")  # schedules with v virtual stages per device
ONE_HOT, SECOND_LAYOUT = 1, 1  # fp32 logits-sized buffers of a shared-targets head backward
HEAD_LOGITS_SPARED = ONE_HOT + SECOND_LAYOUT  # that a per-stage-targets head does not keep


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
    (m+p-1) and (v·m+p-1)/v sets of L/p blocks. 1F1B re-runs each layer's forward from
    its saved input right before its backward: one layer's residuals at a time (the ring of
    saved layer inputs is ``pipeline``'s).
    """
    view = step.view
    if view["stage"] == 1:
        return 1.0
    if view.schedule in FUSED_SCHEDULES:  # one layer's at a time (``stage_work``); inputs: the ring
        return 1.0 / step.layers_per_device
    v = view.virtual if view.schedule == "circular" else 1
    return trips(step) / v


def stage_inputs_saved(step: Step) -> float:
    """Layer inputs (b·s·h each) the 1F1B ring keeps per device: (2·v·p - 1) slots of a
    chunk's L/(p·v) layer inputs (``stage_work``: each layer's forward re-runs from its
    own), each split t ways under ``split_saved_inputs``.

    A micro-batch's input waits on its stage from its forward until its backward, 2(p-1)
    trips later for v = 1 (the lockstep schedule); with v virtual stages per device each of
    the v chunks holds its own (Narayanan et al. 2021). The one parameter an interleaved
    1F1B schedule changes in the memory model: the residuals of one stage at a time and the
    accumulated gradients do not grow with v or m.
    """
    view = step.view
    slots = (2 * view.virtual * view["stage"] - 1) * step.layers_per_device / view.virtual
    return slots / (view["tensor"] if view.split_saved else 1)


def handover_split(step: Step) -> int:
    """Ways a 1F1B hand-over is split before it moves between stages: the tensor degree
    (SC21 section 4.1's scatter/gather; the residual stream is replicated over ``tensor``,
    ``stage_work.handover``)."""
    return step.view["tensor"]


def gradient_reductions(step: Step, axes: tuple[str, ...]) -> tuple[float, float]:
    """Times per step (per-layer gradients: per layer; the rest) gradients are reduced over
    the mesh ``axes``.

    Without stages: once per accumulation micro-batch. With stages, over the axes the
    trainer runs as replicas (``data`` alone under ZeRO 0-2, see
    ``parallel/pipeline/replicas.py``; MoE models too, whose router statistics' batch
    means the replicas complete): once per step, after the loop. Over the others GPipe/circular
    reduce each iteration's L/(p·v) layer gradients inside the loop (m+p-1 or v·m+p-1
    iterations), embedding and head once after it. The fused loops (1F1B, Chimera, 2BW)
    reduce, in each trip that runs a backward, the L/(p·v) layer gradients of the chunk it
    ran (their accumulator is pinned there): once per executed backward chunk, as GPipe's
    (``layer_runs``); the head's gradient in each trip that runs the head, once per
    micro-batch, not every carried gradient in every trip (llama-tiny, 12 layers, stage 2 x
    fsdp 2 x tensor 2, interleaved 1F1B v = 2, m = 2: 15 layer reductions in the compiled step).
    """
    view = step.view
    if view["stage"] == 1:
        return step.layers_per_device * view.microbatches, view.microbatches
    replicas = axes == (str(Axis.DATA),) and view.zero < 3
    if replicas:
        return step.layers_per_device, 1
    if view.schedule in FUSED_SCHEDULES and str(Axis.STAGE) in axes:  # ``_reductions``: once
        return step.layers_per_device, 1
    if view.schedule in FUSED_SCHEDULES:
        return layer_runs(step), view.microbatches
    return layer_runs(step), 1


def head_batch(step: Step) -> int:
    """Sequences the output head runs on at once on one device: the whole data shard
    (outside the pipeline), or one micro-batch for 1F1B (inside its loop)."""
    view = step.view
    if view["stage"] > 1 and view.schedule not in FUSED_SCHEDULES:
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
    if view.schedule not in FUSED_SCHEDULES:
        return 3 * stage_fwd * frac, 0.0
    # 1F1B: fwd + recomputed fwd + bwd (4 units) per executed chunk; the head once per
    # micro-batch (the ideal's), only in the trips where the last stage finishes one. Each
    # layer's forward runs again in its backward whatever the policy: under ``full`` that is
    # the remat term's recompute, else the schedule's own
    return 4 * stage_fwd * frac, 0.0 if view.remat == "full" else stage_fwd


def head_logits_bytes(step: Step) -> float:
    """One fp32 logits-sized buffer of the loss head on one device: the rows it runs on
    (one micro-batch inside the loop), the tokens whose logits are live at once
    (``logits_share``), the vocabulary split over ``tensor``.

    The fused loops (1F1B, Chimera, 2BW) book ``HEAD_LOGITS_SPARED`` of them fewer than
    the fitted counts (``head_vocab``, ``pipe_1f1b_tables``) did when they were fitted,
    when 1F1B's head took one micro-batch's targets for all stages (``vmap`` with
    ``in_axes=None``): the gradient of the target's log-probability (the transpose of
    ``take_along_axis``, a scatter of the one-hot) then had no stage dim, was a buffer of
    its own scheduled ahead of the head and was added to the softmax's gradient once per
    matmul layout, 4 logits-sized buffers live at once in XLA's live ranges
    (``--xla_dump_to``: llama-tiny stage 4 x tensor 2, llama-small stage 2 x data 2 x
    tensor 2). Each stage now takes its own micro-batch's targets (``in_axes=0``): the
    scatter adds in place into the softmax's gradient, 2 live. It counts where the head's
    backward is the step's peak (a large vocabulary per device): under 1F1B llama-small
    (vocab 8192 / 2) stage 2 x data 2 x tensor 2 compiles 123.14 -> 106.88 MB (1.94 of
    these buffers), stage 4 x tensor 2 143.07 -> 112.42 MB (1.83), and 2BW stage 2 x data
    2 x tensor 2 192.41 -> 175.64 MB (2.0); where a layer's backward is the peak
    (llama-tiny, vocab 256) the compiled step does not move and the booking reads up to
    4% low (stage 4 x data 2: 0.975 -> 0.933 of compiled).
    """
    w, view = step.workload, step.view
    tokens = head_rows(step) * step.local_seq * logits_share(step)
    return tokens * w.vocab / view["tensor"] * 4
