"""FSDP (ZeRO-3): weights gathered just in time, gradients reduced to their shards.

Per micro-batch, each layer's weights are all-gathered over the ``fsdp`` axis in the forward
pass and again in the backward pass (XLA does not keep the gathered copy across the scan),
and each layer's gradient is reduced: REFERENCE.md's 3Ψ on the wire against DP's 2Ψ. The
GPU/TPU pipelines emit a reduce-scatter; the CPU backend an all-reduce of the full gradient
followed by a slice (2x the wire bytes of a reduce-scatter), which is what ``backend="cpu"``
predicts. Outside the layer loop the embedding table and the output projection are split
on vocab (``vocab_tables``): neither is gathered; four batch-sized activation
collectives per micro-batch replace their gathers and gradient reductions. Where vocab does
not divide (or under a pipeline) the compiled program gathers the embedding table once and
the output projection twice when it is also tensor-split, but once when it is not (XLA
keeps the gathered copy for the backward pass then: observed on jax 0.10.2, CPU). The final
norm is gathered in forward and backward. Gathered weights live briefly: the layer's and
the outer ones are the transient memory.
"""

from __future__ import annotations

import functools
import math

from shardlib.core.mesh import Axis
from shardlib.core.param_info import ParamInfo
from shardlib.core.workload import Workload
from shardlib.parallel.fsdp import vocab_parallel_pays
from shardlib.parallel.pipeline.spec import FUSED_SCHEDULES
from shardlib.planner.cost.terms.base import (
    MASTER_BYTES,
    Comm,
    Contribution,
    Step,
    param_splits,
    per_step,
)
from shardlib.planner.cost.terms.declare import SearchAxis, Term
from shardlib.planner.cost.terms.pipeline_loop import gradient_reductions, layer_runs
from shardlib.planner.cost.terms.remat import segmented

FSDP = str(Axis.FSDP)


def _admits(workload, cluster, chosen, size) -> bool:
    return workload.embed % size == 0


SEARCH_AXIS = SearchAxis(
    Axis.FSDP,
    placement=20,  # per-layer gathers that prefetch behind compute: outside the per-layer
    admits=_admits,  # all-to-alls and ring passes, inside the once-per-step traffic
    splits=("batch",),
    rule="divides the embed width",
)


@functools.lru_cache(maxsize=4096)
def _gathered(w: Workload, axes: tuple[tuple[str, int], ...]) -> tuple:
    splits = param_splits(w, axes)
    return tuple(
        (param, math.prod(n for a, n in splits[param.name].items() if a != FSDP))
        for param in w.params
    )


def gathered(step: Step) -> tuple[tuple[ParamInfo, int], ...]:
    """(param, ways split by the axes other than fsdp) per parameter: a weight as FSDP
    gathers it, a gradient before FSDP reduces it to its shard."""
    return _gathered(step.workload, step.view.axes)


@per_step
def layer_elements_gathered(step: Step) -> float:
    """One layer's parameter elements on one device as FSDP gathers them (every split but
    the fsdp axis's): a layer's gradient as computed, before it is reduced."""
    return sum(param.numel / ways for param, ways in gathered(step) if param.per_layer)


@per_step
def vocab_tables(step: Step) -> tuple[str, ...]:
    """The vocab-sized tables FSDP splits on vocab, its lookup and logits vocab-parallel
    (``ParallelPlan.for_workload``, ``parallel.fsdp.vocab_parallel_pays``): this term costs
    their activation collectives instead of table gathers, and the tensor term and the
    replicas' reductions leave out what those replace. Never under a pipeline (the
    trainer's choice: the head runs outside the stage loop)."""
    view, w = step.view, step.workload
    tokens = w.global_batch * w.seq // max(view.ways("batch") // view["fsdp"], 1)
    if view["fsdp"] <= 1 or view["stage"] > 1:
        return ()
    if not vocab_parallel_pays(tokens, w.vocab, view["fsdp"], view["tensor"]):
        return ()
    return ("embedding", "lm_head")


_GATHERS_OUTSIDE = {"embedding": 1, "lm_head": 2, "final_norm.scale": 2}
_GATHERS_OUTSIDE_NO_TENSOR = {**_GATHERS_OUTSIDE, "lm_head": 1}
_GATHERS_OTHER = 2
"""Any other weight outside the layer loop (GPT's position table and final norm bias,
small next to the tables): gathered for the forward and again for the backward, as the
final norm's scale (an upper bound: a bias's gradient does not read it)."""


def fsdp(step: Step) -> Contribution:
    view, w = step.view, step.workload
    if view["fsdp"] <= 1:
        return Contribution()
    axes, n = (str(Axis.FSDP),), view["fsdp"]
    m = view.microbatches if view["stage"] == 1 else 1
    # gradients: per layer and micro-batch, or inside the pipeline loop with stages
    # (``pipeline.gradient_reductions``). Gathers with stages: each trip runs its L/(p·v)
    # blocks in an inner scan and gathers per block and trip, unless that is one block of
    # fixed weights (v = 1): then XLA hoists the gather out of the loop. GPipe/circular
    # gather forward and backward, 1F1B forward, recomputed forward and backward. Under
    # remat=full GPipe/circular gather some weights a third time, for the recompute (outside
    # a pipeline one gather serves recompute and backward, inside its loop not: the stacked
    # gate/up under GPipe, all but the down projection under circular, llama-small on 8
    # devices; 0.76 of a pass at 175B): counted as a whole pass, as for 1F1B
    layer_grads, outer_grads = gradient_reductions(step, axes)
    recompute = view.schedule in FUSED_SCHEDULES or view.remat == "full"
    passes = 3 if view["stage"] > 1 and recompute else 2
    if view["stage"] == 1:  # segments (remat=sqrt): the segment's recompute gathers again
        layer_gathers = (3 if segmented(view.remat) else 2) * step.layers_per_device * m
    elif view.virtual == 1 and step.layers_per_device == 1:
        layer_gathers = passes * step.layers_per_device
    else:
        layer_gathers = passes * layer_runs(step)
    grad_kind = step.scatter_kind
    weight_bytes = w.compute_bytes
    outside = _GATHERS_OUTSIDE if view["tensor"] > 1 else _GATHERS_OUTSIDE_NO_TENSOR
    # the per-layer tensors travel as separate collectives: listed once, ``ops`` of them
    layer = [param.numel / ways for param, ways in gathered(step) if param.per_layer]
    gathered_layer = sum(layer) * weight_bytes
    # without stages a layer's forward gather hides behind the forward pass only, its
    # backward gather(s) and its gradient reduction behind the backward pass only (a
    # gradient does not exist before it): each phase is a window of its own
    phased = view["stage"] == 1
    forward = step.layers_per_device * m if phased else 0
    back = "backward prefetch" if phased else ""
    comms = [
        Comm("fsdp", "weights", "all-gather", axes, n, gathered_layer, forward, True,
             len(layer), "forward"),
        Comm("fsdp", "weights", "all-gather", axes, n, gathered_layer, layer_gathers - forward,
             True, len(layer), back),
        # a layer's gradients leave together, once per layer and micro-batch
        Comm("fsdp", "grads", grad_kind, axes, n, sum(layer) * MASTER_BYTES, layer_grads, True,
             1, back),
    ][0 if phased else 1 :]  # fmt: skip
    gathered_outer = 0.0
    tables = vocab_tables(step)
    if tables:
        comms += _vocab_parallel_comms(step, m)
    for param, ways in gathered(step):
        if param.per_layer or param.name in tables:
            continue
        full = param.numel / ways * step.read_share(param)  # after the gather
        gathered_outer += full * weight_bytes
        if param.name == "lm_head" and _head_over_stage(step):
            comms += _head_over_stage_comms(step, full, outer_grads)
            if (
                view.schedule in FUSED_SCHEDULES
            ):  # inside its loop: the gathered head and its gradient
                gathered_outer += full * MASTER_BYTES  # (fsdp=2 x stage=4: 0.88 with it)
            continue
        # a tied table is read twice (lookup, head), each read through its own gathered view:
        # one gather serves both (CSE), but on CPU each read's gradient is reduced on its own
        # (gpt3-125m, vocab 50257 on fsdp 8: two table-sized fp32 sets in the reduction, jax
        # 0.10.2), and the second set is live beside the first as an untied head's is
        uses = step.gradient_sets(param)
        gathered_outer += (uses - 1) * full * weight_bytes
        # outer gathers are loop-invariant: XLA hoists them out of the micro-batch loop
        comms.append(
            Comm(
                "fsdp",
                "weights",
                "all-gather",
                axes,
                n,
                full * weight_bytes,
                outside.get(param.name, _GATHERS_OTHER),
                True,
            )
        )
        comms.append(
            Comm("fsdp", "grads", grad_kind, axes, n, full * MASTER_BYTES, uses * outer_grads, True)
        )
    c = step.calib
    transient = c["fsdp_layers_live"] * gathered_layer + c["fsdp_outer_live"] * gathered_outer
    if m > 1:  # accumulating: the outer weights' unreduced fp32 gradients stay live
        transient += gathered_outer / weight_bytes * MASTER_BYTES
    return Contribution(memory={"gathered weights": transient}, comms=tuple(comms))


def _vocab_parallel_comms(step: Step, m: int) -> list[Comm]:
    """The vocab-parallel lookup, logits and loss per micro-batch (jax 0.10.2, CPU), on the
    rows of one FSDP group, [b·fsdp, s, h]: the lookup's partial rows reduce-scattered over
    ``fsdp`` (``shardlib.core.lookup``: a real reduce-scatter on every backend) and, with
    ``tensor``, summed over it at 1/fsdp; its cotangent and the head's input gathered over
    ``fsdp``; the head's input cotangent summed over every axis that splits vocab (where
    it replaces Megatron's all-reduce); the loss's max, sum and target pick over the split
    vocab (three of b·fsdp·s fp32 values)."""
    view, w = step.view, step.workload
    fsdp, n = (str(Axis.FSDP),), view["fsdp"]
    vocab = fsdp + ((str(Axis.TENSOR),) if view["tensor"] > 1 else ())
    ways = view["fsdp"] * view["tensor"]
    tokens = step.micro_batch * n * step.local_seq
    rows = tokens * w.embed * w.compute_bytes
    comms = [
        Comm("fsdp", "activations", "reduce-scatter", fsdp, n, rows, m, False),
        Comm("fsdp", "activations", "all-gather", fsdp, n, rows, 2 * m, False),
        Comm("fsdp", "activations", "all-reduce", vocab, ways, rows, m, False),
        Comm("fsdp", "softmax", "all-reduce", vocab, ways, tokens * 4, 3 * m, False),
    ]
    if view["tensor"] > 1:
        tensor = (str(Axis.TENSOR),)
        comms.append(
            Comm("fsdp", "activations", "all-reduce", tensor, view["tensor"], rows / n, m, False)
        )
    return comms


def _head_over_stage(step: Step) -> bool:
    """FSDP x stage (stage >= fsdp, no tensor): XLA splits the head's vocab over ``stage``.

    The head runs outside the pipeline, replicated over ``stage``; observed on jax 0.10.2,
    CPU (fsdp=2 x stage=4 and 2, data=2 x fsdp=2 x stage=2; fsdp=4 x stage=2 does not).
    """
    view = step.view
    return view["stage"] > 1 and view["stage"] >= view["fsdp"] and view["tensor"] == 1


def _head_over_stage_comms(step: Step, full: float, grads: float) -> list[Comm]:
    """The head [embed/fsdp, vocab] goes to [embed, vocab/stage] (a permute of full/p),
    is all-gathered over ``stage``; its gradient comes back by a permute of full/fsdp
    (every trip inside the 1F1B loop) and is reduced over ``fsdp`` at full/fsdp."""
    view, w = step.view, step.workload
    axes = (str(Axis.STAGE), str(Axis.FSDP))
    stage = (str(Axis.STAGE),)
    back = grads if view.schedule in FUSED_SCHEDULES else 1
    kind, wb, grad = step.scatter_kind, w.compute_bytes, full * MASTER_BYTES / view["fsdp"]
    return [
        Comm(
            "fsdp",
            "weights",
            "collective-permute",
            axes,
            view["stage"],
            full * wb / view["stage"],
            1,
            True,
        ),
        Comm("fsdp", "weights", "all-gather", stage, view["stage"], full * wb, 1, True),
        Comm("fsdp", "grads", "collective-permute", axes, view["stage"], grad, back, True),
        Comm("fsdp", "grads", kind, (str(Axis.FSDP),), view["fsdp"], grad, grads, True),
    ]


TERM = Term("fsdp", cost=fsdp, axis=SEARCH_AXIS)
