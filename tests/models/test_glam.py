"""GLaM (Du et al. 2021): the paper's shapes and parameter counts, read abstractly (nothing
allocated, the 1.2T model included), its routing, and parity with one device under FSDP,
tensor + sequence, expert and pipeline layouts (fp32, relative error <= 1e-5).

The counts are checked against the paper's model table (``TABLE_4``). The activated count is
the model's own: every parameter but the experts a token is not sent to, (E - k) / E of the
expert weights; the router and the tied embedding count, as in the paper.
"""

import dataclasses
import math

import jax
import numpy as np
import pytest
from layout_cases import first_devices_mesh, one_device_reference

from models.glam import PRESETS
from models.moe import routing as moe_routing
from shardlib.core.inventory import inventory
from shardlib.core.model import resolve_model
from shardlib.core.workload import Workload
from shardlib.tools.parity import FP32_TOLERANCE, compare_traces, trace
from shardlib.train.config import override, train_config
from shardlib.train.setup import make_setup

TABLE_4 = {  # preset: (n_params, n_act-params) as printed, embedding rows those counts hold
    "glam-0.1b-64e": ("1.9B", "145M", 32_000),
    "glam-1.7b-64e": ("27B", "1.879B", 32_000),
    "glam-1.7b-256e": ("105B", "1.886B", 32_000),
    "glam-8b-64e": ("143B", "9.8B", 32_000),
    "glam-64b-64e": ("1.2T", "96.6B", 256_000),
}
"""Du et al. 2021 (arXiv:2112.06905), Table 4, "Sizes and architectures of both MoE and dense
models": the rows shardlib ships, with the shapes in ``models/glam/presets.py``.

The table is not one count of its own shapes. The paper states a 256K vocabulary, and only
64B/64E's 96.6B holds the whole 256,000 x M embedding (without it: 94.5B, -2.2%). The 1.7B
and 8B rows hold a 32,000-row table instead: with it the model gives 1.878B, 1.879B, 1.881B
activated for 1.7B/32E, 64E, 128E (every printed digit, ``test_the_1_7b_rows``), 1.884B for
256E (printed 1.886B), 9.80B for 8B/64E; with the stated 256K they read 24% (1.7B) and 9.4%
(8B) over. The model keeps the paper's 256K vocabulary (it is what GLaM trains with), and the
comparison takes (256,000 - rows) x M off the model's count, which says by how much and why
each row differs. 64B/64E's "1.2T" is its 1.162T printed to two digits (3.2% under 1.2T:
within half the printed digit, not within 1%). 0.1B/64E's 145M activated fits no table size:
127.7M without an embedding, 152.3M with 32,000 rows (+5.0%), 324.3M with 256K; the
paper's 0.1B dense row (130M: 113.3M without, 137.8M with 32,000 rows) is short alike.
"""
UNEXPLAINED = {("glam-0.1b-64e", "n_act-params")}
"""Printed counts between the model's without an embedding and with the row's table."""


def printed(text: str) -> tuple[float, float]:
    """(value, half the last printed digit) of a count as the table prints it: '1.879B'."""
    number, unit = text[:-1], {"M": 1e6, "B": 1e9, "T": 1e12}[text[-1]]
    decimals = len(number.partition(".")[2])
    return float(number) * unit, 0.5 * 10**-decimals * unit


def counts(name: str) -> tuple[int, int, object]:
    """(total, activated per token, config) of the model the preset builds."""
    factory = resolve_model(name)
    inv = inventory(factory)  # nnx.eval_shape over the real modules
    cfg = factory.config
    experts = sum(math.prod(p.shape) for p in inv.params if ".experts." in p.path)
    active = inv.param_count - experts * (cfg.experts - cfg.top_k) // cfg.experts
    assert inv.param_count == cfg.param_count() and active == cfg.active_param_count()
    return inv.param_count, active, cfg


def close(got: float, text: str) -> bool:
    """Within 1% of a printed count, or within half its last printed digit."""
    want, half = printed(text)
    return abs(got - want) <= max(0.01 * want, half)


@pytest.mark.parametrize("name", list(TABLE_4))
def test_glam_presets_have_the_papers_counts(name):
    total, active, cfg = counts(name)
    n_params, n_act, rows = TABLE_4[name]
    recount = (cfg.vocab - rows) * cfg.embed  # the embedding rows the table's count leaves out
    for label, got, text in (("n_params", total, n_params), ("n_act-params", active, n_act)):
        off = (got - recount) / printed(text)[0] - 1
        print(f"{name} {label}: {got / 1e9:.4f}B, as the table counts {off:+.2%} from {text}")
        if (name, label) in UNEXPLAINED:
            assert got - cfg.vocab * cfg.embed < printed(text)[0] < got - recount
        else:
            assert close(got - recount, text), (name, label, got - recount, text)
    assert cfg.moe_layers * 2 == cfg.layers and cfg.top_k == 2


def test_the_1_7b_rows():
    """Table 4's 1.7B rows at E = 32, 64, 128, 256. Activated: as a 32,000-row embedding
    gives them, the router (M x E per MoE layer: +0.8M, +1.6M, +3.1M) the only part that
    grows with E; 32E, 64E and 128E to every printed digit, 256E 0.11% under. Totals: from
    64E on they double with E as the experts do (27B, 53B, 105B; experts 25.8B, 51.5B,
    103.1B); 32E's printed 20B is not its shape's: 14.0B with that table (experts 12.9B),
    14.4B with the 256K one, 30% and 28% under the print."""
    cfg = PRESETS["glam-1.7b-64e"]
    recount = (cfg.vocab - 32_000) * cfg.embed
    table = {  # E: (n_params, n_act-params)
        32: ("20B", "1.878B"),
        64: ("27B", "1.879B"),
        128: ("53B", "1.881B"),
        256: ("105B", "1.886B"),
    }
    for experts, (n_params, n_act) in table.items():
        moe = dataclasses.replace(cfg, experts=experts)
        active, total = moe.active_param_count() - recount, moe.param_count() - recount
        want, half = printed(n_act)
        assert abs(active - want) <= (half if experts < 256 else 0.01 * want), (experts, active)
        assert close(total, n_params) == (experts != 32), (experts, total)


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
