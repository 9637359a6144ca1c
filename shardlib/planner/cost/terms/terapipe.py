"""TeraPipe's own share (``parallel/pipeline/terapipe.py``), on top of the GPipe loop's.

TeraPipe runs GPipe's loop with token slices for micro-batches: ``Step.micro_batch`` is
the device's whole batch and ``Step.local_seq`` one slice's tokens (L/s), so the
``pipeline`` term's hand-overs (b·(L/s)·h per trip) and bubble ((s+p-1)/s executed over
ideal, ``PipelineSpec.bubble_ratio``) are GPipe's formulas as they stand. What it adds:

* memory: each stage's K/V buffer, [L/p layers, b, seq, kv_heads/t, head_dim] for K and
  for V in the compute dtype, carried through the loop. ``jax.grad`` of the loop keeps the
  buffer every trip read (each slice's attention reads all of it), so s + p - 1 copies
  are live at the backward's start, and the buffer's cotangent once more: (trips + 1) x.
* memory, under remat=none with dense attention: each trip's causal mask, a byte per score
  ([b, heads/t, L/s, seq] booleans). A slice's mask compares its true positions, offset
  + arange(L/s), with the keys' and so changes with the trip; ``jax.grad`` of the loop
  keeps it per trip as a residual of the attention's ``where`` (a layer loop without
  slices computes one mask, loop-invariant, kept once). Data 2 x stage 4, llama-tiny,
  seq 256, s = 4: pred[7 trips, 16 heads, 64, 256], 1.75 MiB of the step's 24.3 (the
  same one per trip with 2 layers per stage: the trip's layer loop does not change it).
  With it and the slice's score sets (``terms.model.attention_backward_bytes``) that plan
  reads 1.034. Not booked yet: with 2 layers per stage (8 layers) the backward copies
  each trip's [2, ...] slice of every saved stack out of its [trips, 2, ...] stack (layer
  dim moved); that plan reads 0.889 (GPipe's loops make the same copies, but booking them
  over-books its circular, context and MoE rows: which are live at the peak is open).
"""

from __future__ import annotations

from shardlib.planner.cost.terms.base import Contribution, Step
from shardlib.planner.cost.terms.declare import Term
from shardlib.planner.cost.terms.pipeline_loop import trips
from shardlib.planner.cost.terms.remat import per_layer


def kv_buffer_bytes(step: Step) -> float:
    """One stage's K and V buffers on one device (whole sequence, its L/p layers)."""
    view, w = step.view, step.workload
    seq = w.seq // view.ways("seq")
    kv = w.local_kv_heads(view["tensor"]) * w.head_dim
    return 2 * step.layers_per_device * step.micro_batch * seq * kv * w.compute_bytes


def mask_bytes(step: Step) -> float:
    """The causal masks one device keeps for the backward: one per trip (a byte per score
    of one slice's queries against the whole sequence), under remat=none with the score
    matrix materialised (a remat policy recomputes the mask with the layer; a fused kernel
    builds none)."""
    view, w = step.view, step.workload
    if per_layer(view.remat) != "none" or view.fused_attention:
        return 0.0
    keys = w.seq // view.ways("seq")
    scores = step.micro_batch * step.local_seq * w.heads * keys / view["tensor"]
    return trips(step) * scores  # one per trip: loop-invariant in the trip's layer loop


def terapipe(step: Step) -> Contribution:
    if step.view["stage"] <= 1 or step.view.schedule != "terapipe":
        return Contribution()
    memory = {"terapipe K/V buffers": (trips(step) + 1) * kv_buffer_bytes(step)}
    if masks := mask_bytes(step):
        memory["terapipe masks"] = masks
    return Contribution(memory=memory)


TERM = Term("terapipe", cost=terapipe)
