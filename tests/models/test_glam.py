"""GLaM (Du et al. 2021): the paper's shapes and parameter counts, read abstractly (nothing
allocated, the 1.2T model included), its routing, and parity with one device under FSDP,
tensor + sequence, expert and pipeline layouts (fp32, relative error <= 1e-5).

Counted against the paper: 64B/64E, "1.2T" total parameters (printed to two digits: the
model has 1.162T, which rounds to it; within 1% is not a claim the printed digits can
support) and 96.6B activated per token (within 0.01%); 1.7B/256E, 105B total (within
0.4%). The activated count is the model's own: every parameter but the experts a token is
not sent to, (E - k) / E of the expert weights.
"""

import math

import jax
import numpy as np
import pytest
from layout_cases import first_devices_mesh, one_device_reference

from models.moe import routing as moe_routing
from shardlib.core.model import inventory, resolve_model
from shardlib.core.workload import Workload
from shardlib.tools.parity import FP32_TOLERANCE, compare_traces, trace
from shardlib.train.config import override, train_config
from shardlib.train.setup import make_setup

PUBLISHED = {  # name: (total, printed digit of the total, activated per token or None)
    "glam-64b-64e": (1.2e12, 0.1e12, 96.6e9),
    "glam-1.7b-256e": (105e9, 1e9, None),
}


def counts(name: str) -> tuple[int, int, object]:
    """(total, activated per token, config) of the model the preset builds."""
    factory = resolve_model(name)
    inv = inventory(factory)  # nnx.eval_shape over the real modules
    cfg = factory.config
    experts = sum(math.prod(p.shape) for p in inv.params if ".experts." in p.path)
    active = inv.param_count - experts * (cfg.experts - cfg.top_k) // cfg.experts
    assert inv.param_count == cfg.param_count() and active == cfg.active_param_count()
    return inv.param_count, active, cfg


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_glam_presets_have_the_papers_counts(name):
    total, active, cfg = counts(name)
    published, digit, published_active = PUBLISHED[name]
    print(f"{name}: {total / 1e9:.2f}B total, {active / 1e9:.3f}B activated")
    assert abs(total - published) <= max(0.01 * published, digit / 2)
    if published_active:
        assert abs(active - published_active) / published_active <= 0.01
    assert cfg.moe_layers * 2 == cfg.layers and cfg.top_k == 2


def test_the_ffn_forms_the_published_counts_need():
    """GEGLU (three matrices) in the dense layers, two-matrix experts: with three-matrix
    experts 64B/64E would hold 1.7T, with two-matrix dense MLPs 88B would be activated."""
    _, active, cfg = counts("glam-64b-64e")
    mh, layers = cfg.embed * cfg.mlp, cfg.moe_layers
    gated_experts = cfg.param_count() + layers * cfg.experts * mh
    plain_dense = active - layers * mh
    assert gated_experts > 1.6e12 and plain_dense < 0.92 * 96.6e9
    w = Workload.from_preset("glam-64b-64e", 1, 1024)  # the planner reads the same forms
    assert (w.mlp_matrices, w.expert_mlp_matrices, w.moe_every, w.top_k) == (3, 2, 2, 2)


def test_balancing_loss_counts_first_choices_only():
    """GShard's top-2 loss: f_e is the fraction of tokens whose first choice is e. Four
    tokens each choose experts (0, 1): f = (1, 0, 0) with first choices, (1/2, 1/2, 0) with
    both, and the two losses differ accordingly."""
    logits = np.tile(np.array([[2.0, 1.0, -5.0]], np.float32), (1, 4, 1))
    route = jax.jit(moe_routing.route, static_argnames=("top_k", "capacity", "first_choice_load"))
    first = route(logits, top_k=2, capacity=4, first_choice_load=True)
    both = route(logits, top_k=2, capacity=4)
    np.testing.assert_allclose(first.stats["load"], [1.0, 0.0, 0.0])
    np.testing.assert_allclose(both.stats["load"], [0.5, 0.5, 0.0])
    p = np.exp([2.0, 1.0, -5.0]) / np.exp([2.0, 1.0, -5.0]).sum()
    np.testing.assert_allclose(first.stats["aux_loss"], 3 * p[0], rtol=1e-6)


# --- parity with one device ------------------------------------------------------------------

M = 2  # micro-batches: accumulated on one device, pipelined on the stage axis
CFG = override(
    train_config(model="glam-tiny", steps=2, batch=8, seq=16, **{"model.capacity_factor": "8.0"}),
    {"parallel.data.microbatches": M},
)
"""The one reference: capacity the whole sequence (nothing drops, every layout routes
alike), and gradients accumulated over M micro-batches, as a pipeline's are: the balancing
loss is a product of batch means, so it is per micro-batch in both."""

CASES = {  # name: (mesh axes, config overrides); the first compares every gradient leaf
    "fsdp2-tp2-sp-e2": ({"fsdp": 2, "tensor": 2, "expert": 2}, {"sequence_parallel": "true"}),
    "gpipe-p2-fsdp2-e2": (
        {"stage": 2, "fsdp": 2, "expert": 2},
        {"pipeline_schedule": "gpipe", "pipeline_microbatches": M, "parallel.data.microbatches": 1},
    ),
}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) for n in CASES])
def test_glam_parity_fp32(name):
    axes, overrides = CASES[name]
    ref, state = one_device_reference(CFG)
    # the pipeline: losses of both steps and gradient norms (one compile, not two)
    setup = make_setup(override(CFG, overrides), first_devices_mesh(**axes))
    got = trace(setup, state, grads=name == next(iter(CASES)))
    assert all(r["moe_dropped"] == 0 for r in got.records)
    result = compare_traces(got, ref)
    print(f"{name}: loss {result.max_rel_loss_err:.1e} grads {result.max_rel_grad_err:.1e}")
    assert result.max_rel_loss_err <= FP32_TOLERANCE, result
    assert result.ok(), result
