"""The chunked loss in the planner (``terms.loss``): one slice's logits booked, one more head
forward counted, and the booked fall in memory set against the compiled one.

Compiled on one CPU device (jax 0.10.2, fp32, llama-tiny with vocab 32768, 2 layers, batch
4 x seq 512, loss_chunk=64): predicted/compiled 770.7/866.7 MiB (0.89) whole, 587.5/559.0
MiB (1.05) chunked; the booked fall (183.2 MiB) is 0.60 of the compiled one (307.7 MiB).
The unchunked head is under-booked on such logits-heavy models (``coefficients``: the fit
books 0.8 fp32 logits-sized buffers where these probes keep two), so the booked fall, a
share of that booking, is short by the same factor.
"""

from __future__ import annotations

import dataclasses

import pytest

from shardlib.parallel.loss import LossChunks
from shardlib.planner import Workload, candidate, estimate
from shardlib.planner.candidate import PlanView
from shardlib.planner.cost.coefficients import COEFFICIENTS
from shardlib.planner.validate import validate

MIB = 2**20
VOCAB, SEQ, BATCH, CHUNK = 32768, 512, 4, 64


def _w(layers: int = 2) -> Workload:
    overrides = {"vocab": VOCAB, "layers": layers}
    return Workload.from_preset("llama-tiny", BATCH, SEQ, "fp32", **overrides)


def _chunked(plan, chunk: int = CHUNK):
    return dataclasses.replace(plan, loss=LossChunks(chunk=chunk))


@pytest.mark.parametrize(
    "sizes",
    [dict(data=1), dict(fsdp=2, tensor=2), dict(stage=2, data=2, microbatches=2)],
)
def test_one_slices_logits_are_booked(sizes):
    """The logits-sized buffers fall to chunk/seq of themselves (GPipe's after-the-loop
    buffers too); the h-wide ones and everything else stay."""
    w, plan = _w(), candidate(**sizes)
    whole, chunked = (estimate(w, p, backend="cpu") for p in (plan, _chunked(plan)))
    c, t = COEFFICIENTS, plan.mesh_axes.get("tensor", 1)
    tokens = BATCH // (plan.mesh_axes.get("data", 1) * plan.mesh_axes.get("fsdp", 1)) * SEQ
    if "stage" not in sizes:
        tokens //= sizes.get("microbatches", 1)
    logits = c["head_vocab"] * tokens * VOCAB / t * 4  # booked without slices
    fall = logits * (1 - CHUNK / SEQ)
    if "stage" in sizes:  # GPipe: the head after the loop, on the whole data shard
        fall += c["pipe_logits"] * tokens * VOCAB / t * 4 * (1 - CHUNK / SEQ)
    assert whole.memory_bytes - chunked.memory_bytes == pytest.approx(fall, rel=1e-9)
    assert {k for k, v in whole.memory.items() if v != chunked.memory[k]} <= {
        "logits",
        "pipeline buffers",
    }
    # the backward recomputes the head: one more forward of it per step
    head = w.tokens / (plan.mesh_axes.get("data", 1) * plan.mesh_axes.get("fsdp", 1))
    extra = head * w.head_flops_per_token / t
    assert chunked.flops - whole.flops == pytest.approx(extra, rel=1e-9)
    assert "loss_chunk=64" in PlanView(chunked.plan).knobs_text()  # the plan's summary


def test_the_booked_fall_against_the_compiled_one():
    """Both fall, the booked by less than the compiled (never more freed than is), and by
    at least half of it (see the module docstring for the figures)."""
    w = _w()
    plan = candidate(data=1)
    whole, chunked = validate(w, plan), validate(w, _chunked(plan))
    booked = whole.predicted_memory - chunked.predicted_memory
    compiled = whole.compiled_memory - chunked.compiled_memory
    logits = BATCH * SEQ * VOCAB * 4
    print(
        f"predicted/compiled MiB: whole {whole.predicted_memory / MIB:.1f}/"
        f"{whole.compiled_memory / MIB:.1f}, chunked {chunked.predicted_memory / MIB:.1f}/"
        f"{chunked.compiled_memory / MIB:.1f}; fall booked {booked / MIB:.1f}, compiled "
        f"{compiled / MIB:.1f} ({booked / compiled:.2f})"
    )
    assert compiled >= logits  # the compiled step frees more than one logits tensor
    assert 0.5 * compiled <= booked <= compiled
    assert chunked.memory_ratio > whole.memory_ratio  # closer to the compiled figure


def test_the_plan_names_the_setting():
    plan = _chunked(candidate(data=1))
    assert plan.tables() == {"loss": {"chunk": CHUNK}}  # a mesh file's [parallel.loss]
    assert "loss.chunk=64" in plan.describe()


@pytest.mark.parametrize(
    "sizes",
    [  # compiled wire MiB whole -> chunked (jax 0.10.2, CPU, batch 8, 8 slices): data 8
        # 29.0 -> 29.0 (replica groups), fsdp 8 6.5 -> 7.4 (the head's input gathered again),
        # data 2 x fsdp 2 x tensor 2 8.5 -> 22.8 (the head's gradient over data per slice),
        # stage 2 x fsdp 4 40.3 -> 172.3 (the gathered head per slice)
        dict(data=8),
        dict(fsdp=8),
        dict(data=2, fsdp=2, tensor=2),
        dict(stage=2, fsdp=4, microbatches=2),
    ],
)
def test_the_slices_collectives_are_booked(sizes):
    w = Workload.from_preset("llama-tiny", 8, SEQ, "fp32", vocab=VOCAB, layers=2)
    check = validate(w, _chunked(candidate(**sizes)))
    assert check.wire_ratio == pytest.approx(1.0, abs=0.05), check
