"""TeraPipe's own share (``parallel/pipeline/terapipe.py``), on top of the GPipe loop's.

TeraPipe runs GPipe's loop with token slices for micro-batches: ``Step.micro_batch`` is
the device's whole batch and ``Step.local_seq`` one slice's tokens (L/s), so the
``pipeline`` term's hand-overs (b·(L/s)·h per trip) and bubble ((s+p-1)/s executed over
ideal, ``PipelineSpec.bubble_ratio``) are GPipe's formulas as they stand. What it adds:

* memory: each stage's K/V buffer, [L/p layers, b, seq, kv_heads/t, head_dim] for K and
  for V in the compute dtype, carried through the loop. ``jax.grad`` of the loop keeps the
  buffer every trip read (each slice's attention reads all of it), so s + p - 1 copies
  are live at the backward's start, and the buffer's cotangent once more: (trips + 1) x.
"""

from __future__ import annotations

from shardlib.planner.cost.terms.base import Contribution, Step, Term
from shardlib.planner.cost.terms.pipeline_loop import trips


def kv_buffer_bytes(step: Step) -> float:
    """One stage's K and V buffers on one device (whole sequence, its L/p layers)."""
    view, w = step.view, step.workload
    seq = w.seq // view.ways("seq")
    kv = w.local_kv_heads(view["tensor"]) * w.head_dim
    return 2 * step.layers_per_device * step.micro_batch * seq * kv * w.compute_bytes


def terapipe(step: Step) -> Contribution:
    if step.view["stage"] <= 1 or step.view.schedule != "terapipe":
        return Contribution()
    return Contribution(memory={"terapipe K/V buffers": (trips(step) + 1) * kv_buffer_bytes(step)})


TERM = Term("terapipe", cost=terapipe)
