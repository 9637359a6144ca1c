"""Per-block memory coefficients: a GPT block (LayerNorm with biases, a two-matrix GELU MLP)
reads its own counts (``gpt_*`` in ``planner.cost.coefficients``: its fp32 CPU extras read
off the buffer assignment, what is live once fitted on ``calibrate.gpt_probes``), a Llama
block the shared ones, and a two-matrix MLP keeps one mlp-wide buffer fewer than SwiGLU
under the policies that book it by definition."""

import json

import pytest

from shardlib.planner import Workload, candidate, estimate
from shardlib.planner.calibrate.fit import predicted_memory
from shardlib.planner.calibrate.gpt_probes import GPT_PROBES
from shardlib.planner.cost.coefficients import COEFFICIENTS, for_block
from shardlib.planner.cost.terms.remat import KEPT, saved_coefficients

GPT_RECORDS = "shardlib/planner/calibrate/gpt_probes.jsonl"


@pytest.fixture(scope="module")
def workloads():
    return Workload.from_preset("gpt-tiny", 16, 128), Workload.from_preset("llama-tiny", 16, 128)


def test_a_gpt_block_reads_its_own_counts_and_llama_the_shared_ones(workloads):
    gpt, llama = workloads
    assert (gpt.block_kind, llama.block_kind) == ("gpt", "")
    assert (gpt.mlp_matrices, llama.mlp_matrices) == (2, 3)
    assert for_block(COEFFICIENTS, "gpt")["cpu_mlp"] == COEFFICIENTS["gpt_cpu_mlp"]
    bumped = {**COEFFICIENTS, "gpt_cpu_mlp": COEFFICIENTS["gpt_cpu_mlp"] + 1.0}
    for plan in (candidate(data=8), candidate(stage=2, tensor=4, schedule="1f1b", microbatches=4)):
        for w in (gpt, llama):
            base = estimate(w, plan, backend="cpu").memory_bytes
            more = estimate(w, plan, backend="cpu", calib=bumped).memory_bytes
            # one more mlp-wide element per token per layer (2 sequences x 128 tokens per
            # device) in the layer loop; none where 1F1B takes one layer's VJP at a time
            scanned = w is gpt and plan.describe() == "data=8"
            want = 2 * 128 * w.mlp * w.compute_bytes * w.layers if scanned else 0.0
            assert more - base == pytest.approx(want)


@pytest.mark.parametrize("policy", ["none", "selective"])
def test_a_two_matrix_mlp_keeps_one_mlp_buffer_fewer(policy):
    swiglu = saved_coefficients(policy, COEFFICIENTS)
    gelu = saved_coefficients(policy, COEFFICIENTS, mlp_matrices=2)
    assert swiglu["mlp"] - gelu["mlp"] == 1.0
    assert gelu["mlp"] == KEPT[policy]["mlp"] - 1 + COEFFICIENTS.get(f"{policy}_mlp", 0.0)


def test_the_gpt_counts_hold_on_their_published_width_probes():
    """The stored GPT probes at GPT-3's widths (compiled by ``python -m
    shardlib.planner.calibrate.fit --group gpt``; ``--records ... --free gpt`` refits the
    table's values from all of them) are predicted within 10% with the table's values."""
    with open(GPT_RECORDS) as f:
        records = [json.loads(line) for line in f]
    assert len(records) == len(GPT_PROBES)
    published = [r for r in records if "model=gpt3-" in r["overrides"]]
    assert len(published) == 9
    ratios = [predicted_memory(r, COEFFICIENTS) / r["memory"] for r in published]
    assert max(abs(r - 1) for r in ratios) <= 0.10, ratios
