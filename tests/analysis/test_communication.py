"""Communication, memory and FLOPs of the compiled train step vs the published formulas.

Compile-only (abstract shapes, nothing allocated): ``explain`` reads the optimized HLO.
Figures are from the CPU backend; see REFERENCE.md for how CPU differs from GPU.
"""

import jax
import pytest

import models
from benchmarks.reference import dp_gradient_allreduce, megatron_tp_layer, zero_memory, zero_wire
from shardlib import mesh_spec
from shardlib.analysis import explain
from shardlib.train.config import parse_overrides, train_config
from shardlib.train.setup import make_setup

pytestmark = pytest.mark.slow  # compiles and trains: the full suite, not the inner loop

SMALL = train_config(model="llama-small", batch=16, seq=128)
PSI = models.config("llama-small").param_count()


def report_for(cfg, devices=8, **axes):
    setup = make_setup(cfg, mesh_spec(**axes).build(jax.devices()[:devices]))
    return explain(
        setup.train_step, setup.abstract_state(), setup.abstract_batch(), mesh=setup.mesh
    )


@pytest.fixture(scope="module")
def dp8():
    return report_for(SMALL, data=8)


@pytest.fixture(scope="module")
def fsdp8():
    return report_for(SMALL, fsdp=8)


def test_report_counts_the_model(dp8):
    assert dp8.params_count == PSI > 10_000_000


def test_dp_gradient_allreduce_matches_ring_formula(dp8):
    measured = dp8.collective_totals_by_axis["data"]["wire_bytes"]
    assert set(dp8.collective_totals) == {"all-reduce"}
    assert measured / dp_gradient_allreduce(PSI, 8) == pytest.approx(1.0, abs=0.05)


def test_fsdp_communication_vs_zero3(fsdp8):
    """ZeRO-3 moves 3(N-1)/N·4Ψ. CPU XLA reduces gradients with an all-reduce where GPU emits a
    reduce-scatter; counting those as reduce-scatters gives the GPU-equivalent figure. The
    embedding and output projection (2·V·h of Ψ) are vocab-parallel here (2,048 tokens per
    step <= vocab 8192 / 2): they are never gathered nor reduced; an all-reduce (the head's
    input cotangent), a reduce-scatter (the lookup, ``shardlib.core.lookup``) and two all-gathers
    of the [b, s, h] activations take their place."""
    totals = fsdp8.collective_totals
    gathered = totals["all-gather"]["wire_bytes"]
    reduced = totals["all-reduce"]["wire_bytes"]
    scattered = totals["reduce-scatter"]["wire_bytes"]
    blocks = PSI - 2 * 8192 * 256  # llama-small: vocab 8192, embed 256
    rows = 16 * 128 * 256  # [b, s, h] of the whole batch (fp32: 4 bytes, as parameters)
    expected = dp_gradient_allreduce(blocks, 8) + dp_gradient_allreduce(rows, 8)
    assert reduced / expected == pytest.approx(1.0, abs=0.05)
    assert scattered / (dp_gradient_allreduce(rows, 8) / 2) == pytest.approx(1.0, abs=0.01)
    gpu_equivalent = gathered + reduced / 2 + scattered
    formula = zero_wire(3, blocks, 8)
    assert 0.85 <= gpu_equivalent / formula <= 1.15, gpu_equivalent / formula


def test_fsdp_argument_bytes_are_an_eighth_of_model_state(fsdp8):
    """Parameters (4Ψ) + Adam moments (8Ψ), split 8 ways; gradients are not arguments."""
    expected = zero_memory(3, PSI, 8, grad_bytes=0)
    assert fsdp8.memory.argument_bytes / expected == pytest.approx(1.0, abs=0.10)


def test_tensor_parallel_has_four_bsh_allreduces_per_layer():
    cfg = SMALL
    report = report_for(cfg, devices=4, tensor=4)
    layers = models.config("llama-small").layers
    per_layer = megatron_tp_layer(cfg.dataset.batch, cfg.dataset.seq, 256, t=4)
    in_loop = [c for c in report.collectives if c.count == layers and c.axes == ("tensor",)]
    assert [c.kind for c in in_loop] == ["all-reduce"] * 4
    assert all(c.buffer_bytes == per_layer["buffer_bytes"] for c in in_loop)
    assert sum(c.wire_bytes for c in in_loop) == pytest.approx(per_layer["wire_bytes"])


def test_scanned_layers_are_counted_per_trip():
    """A 10-layer scan reports 10x the per-layer collectives and FLOPs of one layer.

    The scan body is compiled once; ``explain`` multiplies it by the loop's trip count.
    Two depths isolate the per-layer part: F(L) = F0 + L·f, so F(10) - F(6) = F(6) - F(2).
    """
    reports = {}
    for layers in (2, 6, 10):
        cfg = parse_overrides([f"model.layers={layers}"], train_config(batch=16, seq=32))
        reports[layers] = report_for(cfg, data=2, fsdp=2, tensor=2)
    flops = {k: r.flops_per_device for k, r in reports.items()}
    per_layer = (flops[10] - flops[2]) / 8
    assert flops[10] - flops[6] == pytest.approx(flops[6] - flops[2], rel=0.01)
    assert flops[10] - flops[2] == pytest.approx(8 * per_layer)
    cfg = models.config("llama-tiny")
    matmul = 6 * (cfg.param_count() - 2 * cfg.vocab * cfg.embed) / cfg.layers * 16 * 32 / 8
    assert 1.0 <= per_layer / matmul <= 1.5  # + attention scores and elementwise work
    # XLA's own count sees the loop body once: it does not grow 5x from 2 to 10 layers.
    xla = {k: r.xla_cost_analysis_flops for k, r in reports.items()}
    assert xla[10] < 1.5 * xla[2]
    for layers, report in reports.items():
        looped = [c for c in report.collectives if c.count == layers]
        per_trip = [c for c in reports[10].collectives if c.count == 10]
        assert len(looped) == len(per_trip) > 0
