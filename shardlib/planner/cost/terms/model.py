"""The model's own share: FLOPs and the activations the backward pass needs.

FLOPs per device are 3x the forward matmuls (forward, two backward matmuls), split over
every axis that splits tokens (the batch and sequence splits the axes declare) or weights
(tensor), plus the forward that rematerialisation repeats. Saved activations follow
Korthikanti et al. 2022: per layer, per token, some elements of width h (norm inputs,
residual: not split by tensor parallelism), some of the q/k/v and MLP widths (split by
tensor), and the attention scores (a·s per token, split by tensor). remat=none is booked by
definition (``terms.remat.KEPT["none"]``: what the block's backward needs, each buffer once,
as fused kernels keep it; ~32 bytes per token per h per layer at Llama 7B in bf16,
Korthikanti et al.'s 34), the scores' count fitted for dense attention on a GPU. On the CPU
backend each block kind adds what XLA:CPU's fp32 program keeps beside it, read off the
buffer assignment (``terms.remat.saved_coefficients``: none for Llama's block, GPT's fp32
LayerNorm and tanh-GELU temporaries), two fp32 score sets, and one layer's attention
backward live once (``attention_backward_bytes``).

A strategy that changes what a layer saves says so in its own term's hooks: the parts it
replaces (``Term.saved``: an attention that keeps no score matrix, an MoE block's routed
buffers), how many sets of the layers a device keeps (``Term.scales_saved``: a pipeline's
trips), the head's batch (``Term.head_batch``) and what is live once (``Term.working``).
"""

from __future__ import annotations

import math
from typing import Any

from shardlib.parallel.pipeline.spec import FUSED_SCHEDULES
from shardlib.planner.cost.terms.base import Contribution, Step
from shardlib.planner.cost.terms.declare import Term
from shardlib.planner.cost.terms.remat import (
    KEPT,
    on_cpu,
    per_layer,
    recompute_flops,
    saved_coefficients,
    saved_input_split,
    segments_of,
    trip_layers,
)


def flops(step: Step) -> float:
    w, view = step.workload, step.view
    t = view["tensor"]
    unsplit = w.layer_unsplit_flops_per_token  # MoE routing: not split by tensor
    layer = (w.layer_matmul_flops_per_token - unsplit) / t + unsplit
    attn = w.attention_flops_per_token(w.seq) / t
    forward = step.tokens * (step.layers_per_device * (layer + attn) + w.head_flops_per_token / t)
    extra = recompute_flops(step, step.tokens, layer, attn)
    return 3 * forward + extra


def scanned(step: Step) -> bool:
    """Whether the layers' residuals are those of a differentiated layer loop (a scan): not
    under a fused pipeline schedule (1F1B, 2BW, Chimera), whose stage backward re-runs one
    layer's forward and takes its VJP at once (``parallel.pipeline.stage_work``), so XLA
    fuses the elementwise temporaries a scan would stack into the backward's own kernels
    (GPT's block on 1F1B stage 2 x tensor 4, gpt3-1.3b width, 4 layers, seq 1024: planner
    / compiled 1.091 with the scan's fp32 LayerNorm and GELU copies booked, 1.045 without;
    gpt-tiny widened to h 512: 1.310 and 1.144). The schedule is ``none`` without stages."""
    return step.view.schedule not in FUSED_SCHEDULES


def _layer_parts(
    step: Step, micro_batch: int, policy: str | None, scores: bool
) -> tuple[float, set[str]]:
    """(bytes one layer saves, the parts terms replaced)."""
    w, view = step.workload, step.view
    t = view["tensor"]
    tokens = micro_batch * step.local_seq
    policy = per_layer(view.remat) if policy is None else policy
    k = saved_coefficients(
        policy, step.calib, mlp_matrices=w.mlp_matrices, cpu=on_cpu(step), scanned=scanned(step)
    )
    if policy == "full":  # the kept input, split over tensor (terms.remat.saved_input_split)
        k["h"] -= KEPT["full"]["h"] * (1 - 1 / saved_input_split(step))
    for split in step.hooks("residual_split"):  # h-wide buffers a layout keeps split
        elements, ways = split(step, policy)
        k["h"] -= elements * (1 - 1 / ways)
    qkv = w.local_qkv_width(t)  # per device: K/V heads fewer than t are whole on each
    parts: dict[str, Any] = {
        "attention": k["scores"] * w.heads * w.seq / t if scores else 0.0,
        "mlp": (k["mlp"] * w.mlp / t,),
    }
    replaced: set[str] = set()
    for saved in step.hooks("saved"):
        own = saved(step, policy, k)
        parts.update(own)
        replaced.update(own)
    attn_out = w.heads * w.head_dim  # the attention output, split by tensor as q is
    elems = k["h"] * w.embed + k["q"] * attn_out / t + k["qkv"] * qkv + parts["attention"]
    for addend in parts["mlp"]:
        elems += addend
    return tokens * elems * w.compute_bytes, replaced


def layer_activation_bytes(
    step: Step, micro_batch: int, policy: str | None = None, *, scores: bool = True
) -> float:
    """Bytes one layer saves for backward on one device, for one micro-batch (``scores``:
    with the attention scores' part)."""
    return _layer_parts(step, micro_batch, policy, scores)[0]


def logits_share(step: Step) -> float:
    """The share of the head's tokens whose logits are live at once (``Term.logits_share``:
    a chunked loss keeps one slice's)."""
    return math.prod(share(step) for share in step.hooks("logits_share"))


def head_activation_bytes(step: Step, micro_batch: int) -> float:
    """Logits (fp32: the model casts them up), their softmax and gradient (of the tokens
    whose logits are live at once: ``logits_share``), and the embedding. The h-wide
    buffers are as wide as the layout leaves the residual stream (``Term.head_split``)."""
    w, view, c = step.workload, step.view, step.calib
    tokens = micro_batch * step.local_seq
    logits = c["head_vocab"] * w.vocab / view["tensor"] * 4 * logits_share(step)
    width = w.embed / math.prod(split(step) for split in step.hooks("head_split"))
    return tokens * (logits + c["head_h"] * width * 4)


def activations(step: Step) -> dict[str, float]:
    """Saved activations per device: the layers' sets the terms keep (one, or a pipeline's),
    what is live once, and the loss head's on the batch it runs on."""
    b = step.micro_batch
    layer_bytes, replaced = _layer_parts(step, b, None, True)
    sets = 1
    for scales in step.hooks("scales_saved"):
        sets *= scales(step)
    saved = layer_bytes * step.layers_per_device * sets
    working = 0.0
    w, view, c = step.workload, step.view, step.calib
    policy = per_layer(view.remat)
    segments = segments_of(step)
    if segments:  # Chen et al.: k segment inputs per layer-loop call, one segment's layers live
        calls = step.layers_per_device / trip_layers(step)  # circular: v rounds per set
        saved = layer_activation_bytes(step, b, "full") * segments * sets * calls
        working = layer_bytes * trip_layers(step) / segments
    if policy != "none" and "attention" not in replaced:
        # the recomputed probabilities of one layer are live again (unless a term keeps no
        # score matrix: ring attention, a fused kernel)
        scores = w.heads * step.local_seq / view["tensor"]
        live = c["remat_scores"] * b * step.local_seq * scores * w.compute_bytes
        # full inside segments: the segment's recompute and the layer's hold one each
        # (compiled: +1 score set over this count on 3 layouts, benchmarks/sublinear_remat.py)
        working += live * (2 if segments and policy == "full" else 1)
    if policy == "full":  # and the rest of the recomputed layer: part of the none set
        working += c["full_layer_live"] * layer_activation_bytes(step, b, "none", scores=False)
    if policy == "none":  # one layer's backward working set beyond its saved set and the
        # scores' (fitted per block kind: 0 for Llama's; GPT's fp32 LayerNorm and GELU)
        live_elems = c.get("layer_live_h", 0.0) * w.embed
        live_elems += c.get("layer_live_mlp", 0.0) * w.mlp / view["tensor"]
        working += live_elems * b * step.local_seq * w.compute_bytes
    working += sum(live(step, b) for live in step.hooks("working"))
    head = head_activation_bytes(step, head_rows(step))
    if policy == "none" and on_cpu(step) and "attention" not in replaced:
        if not scanned(
            step
        ):  # one score set, in the head's freed buffers (``fused_backward_bytes``)
            working += fused_backward_bytes(step, b, head)
        else:
            working += attention_backward_bytes(step, b)  # dense attention's, once
    return {"activations": saved + working, "logits": head}


def head_rows(step: Step) -> int:
    """The batch rows the loss head runs on at once: a term's (``Term.head_batch``: a
    pipeline's), else the micro-batch."""
    batches = [head_batch(step) for head_batch in step.hooks("head_batch")]
    return batches[0] if batches else step.micro_batch


def attention_backward_bytes(step: Step, micro_batch: int) -> float:
    """Dense attention's backward under remat=none on the CPU backend: score-sized
    temporaries of one layer live once (``layer_live_scores``: the gradients of the
    probabilities and of the scores and their product, fp32, and the causal mask, a byte
    per score: 3.25 fp32 sets in llama-7b's buffer assignment at 8x2048 tokens per
    device). Booked beside the loss head's buffers, as every working set is: XLA reuses
    the head's freed logits buffers for them there (same offsets), but booking the larger
    of the two hides a chunked loss's fall where the head is under-booked (vocab-heavy
    models: ``coefficients``), as the refits that took the larger did. The seq-128 probes
    the ``layer_*`` counts were fitted on cannot show these buffers (scores are 1/16 of
    seq 2048's per token); the same attention code runs in GPT's block.
    Under a fused pipeline schedule (1F1B, 2BW, Chimera) ``fused_backward_bytes`` instead.
    A score set is the layer's queries against all its keys: under TeraPipe a slice's L/s
    queries against the whole sequence's keys (its K/V buffer), not (L/s)², as the saved
    scores' count is (``_layer_parts``): TeraPipe's data 2 x stage 4 plan (llama-tiny,
    seq 256, s = 4) holds three f32[16 heads, 64, 256] buffers of 1 MiB each at once in
    its backward, where (L/s)² booked 0.81 MiB in all."""
    return step.calib.get("layer_live_scores", 0.0) * score_set_bytes(step, micro_batch)


def score_set_bytes(step: Step, micro_batch: int) -> float:
    """One layer's score matrix on a device, in the compute dtype: its queries against the
    whole sequence's keys (a TeraPipe slice's too), heads split over ``tensor``."""
    w, view = step.workload, step.view
    keys = w.seq // view.ways("seq")
    scores = micro_batch * step.local_seq * w.heads * keys / view["tensor"]
    return scores * w.compute_bytes


def fused_backward_bytes(step: Step, micro_batch: int, head: float) -> float:
    """Dense attention's backward temporaries under a fused pipeline loop (remat=none, CPU
    backend): one score set beyond the saved layer's two, in place of the head's buffers.

    The stage backward re-runs each layer's forward from its saved input
    (``parallel.pipeline.stage_work``) and takes its VJP there, one layer at a time, in the
    trip's backward half, after the head's logits are freed: one more fp32 score-sized
    buffer is live beside the two the layer saved (measured, not the non-fused 3.25), and it
    lands in the head's freed buffers, so only what exceeds them adds. llama-tiny (16 heads,
    vocab 256), stage 2 x fsdp 4, m = 2, 8 layers, one sequence per device, seq
    64/128/256/512: planner / compiled 1.04/0.86/0.83/0.74 without it, 1.11/1.00/1.09/1.04
    with a whole set always, 1.04/0.94/1.03/1.01 with the excess over the head (XLA's
    default codegen). The non-fused count (3.25 sets) read 1.103 on llama-1b (8 layers,
    stage 4, m = 8), whose 128K-vocabulary head outgrows a set: this books nothing there
    (0.930), nor on ``benchmarks/planner_validation.py``'s other fused rows."""
    return max(0.0, score_set_bytes(step, micro_batch) - head)


def model(step: Step) -> Contribution:
    return Contribution(memory=activations(step), flops=flops(step))


TERM = Term("model", cost=model)
