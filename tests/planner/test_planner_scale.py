"""The planner's memory and tensor terms at published widths.

The full-depth held-out table (7B on 64 devices, 70B on 512, 175B on 1024, the plans the
search picks included) is ``benchmarks/planner_scale_validation.py``; the two issue-14
layouts are ``benchmarks/pipeline_scale.py``. Here: the structure those rest on, from the
formulas (no compile), and one small compile of the 1F1B + full-recompute case.
"""

from __future__ import annotations

import pytest

from shardlib.planner import PlanView, Workload, candidate, estimate
from shardlib.planner.cost.coefficients import COEFFICIENTS
from shardlib.planner.cost.terms import TERMS
from shardlib.planner.cost.terms.base import Step
from shardlib.planner.cost.terms.model import layer_activation_bytes
from shardlib.planner.cost.terms.pipeline import layer_runs, stage_inputs_saved
from shardlib.planner.cost.terms.remat import KEPT

GPT_175B = dict(embed=12288, layers=8, heads=96, kv_heads=96, head_dim=128, mlp=32768)


def _step(w: Workload, **plan) -> Step:
    plan = candidate(**plan)
    return Step(w, plan, "cpu", PlanView(plan), TERMS, COEFFICIENTS)


def test_selective_keeps_h_wide_buffers_that_tensor_parallelism_does_not_split():
    """Per layer, selective saves a + b/t: the q/k/v and MLP outputs split by tensor, and at
    least the layer input and the attention output projection's (2h) whole at any t."""
    w = Workload.from_preset("llama-70b", 8, 2048, "bf16", **GPT_175B, vocab=51200)
    tokens = 1 * 2048  # one sequence per micro-batch
    saved = {t: layer_activation_bytes(_step(w, tensor=t, remat="selective"), 1) for t in (2, 4, 8)}
    b = (saved[2] - saved[4]) / (1 / 2 - 1 / 4)
    a = saved[8] - b / 8
    assert saved[4] - b / 4 == pytest.approx(a)  # exactly a + b/t
    assert a >= KEPT["selective"]["h"] * w.embed * tokens * w.compute_bytes
    qkv = (w.heads + 2 * w.kv_heads) * w.head_dim
    floor = (KEPT["selective"]["qkv"] * qkv + KEPT["selective"]["mlp"] * w.mlp) * tokens * 2
    assert b >= floor


def test_one_f_one_b_runs_five_all_reduces_per_layer_and_chunk_whatever_the_policy():
    """2 forward + 2 backward (Megatron) and the layer's recompute right before its backward
    (up to the MLP: the attention output's all-reduce): 5, under every remat policy, since
    the schedule re-runs each layer from its saved input (``stage_work``)."""
    w = Workload.from_preset("llama-small", 16, 128, "fp32", layers=4)
    plan = dict(data=2, stage=2, tensor=2, schedule="1f1b", microbatches=2)
    for remat in ("none", "full"):
        est = estimate(w, candidate(**plan, remat=remat), backend="cpu")
        step = _step(w, **plan, remat=remat)
        (layers,) = [c for c in est.comms if c.strategy == "tensor" and c.what == "activations"]
        assert layers.count == 5 * layer_runs(step)  # L/p blocks x (m + p - 1) chunks
        # the ring: 2·v·p - 1 slots of a chunk's L/(p·v) layer inputs, v = 1
        assert stage_inputs_saved(step) == (2 * 2 - 1) * 2


@pytest.mark.slow
def test_compiled_one_f_one_b_full_recompute_matches_prediction():
    from shardlib.planner.validate import validate

    w = Workload.from_preset("llama-small", 16, 128, "fp32", layers=4)
    plan = candidate(data=2, stage=2, tensor=2, schedule="1f1b", microbatches=2, remat="full")
    check = validate(w, plan)
    tensor = check.compiled_wire_by_axes["tensor"]
    # within the planner's 5% bytes target: the interleaved-1F1B loop's head trips and
    # embedding all-reduce are counted per executed chunk (2% over on this small model)
    assert check.predicted_wire_by_axes["tensor"] == pytest.approx(tensor, rel=0.05)
    assert check.memory_ratio == pytest.approx(1.0, abs=0.10)
