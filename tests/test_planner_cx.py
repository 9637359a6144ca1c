"""Planner terms for context (ring attention) and expert (MoE) parallelism.

Cheap formula checks, plus two compiled steps (8 simulated devices) compared with the
prediction: a data x context plan and an expert x tensor MoE plan.
"""

from __future__ import annotations

import math

import pytest

from shardlib import ShardingError
from shardlib.planner import Plan, Workload, estimate
from shardlib.planner.cluster import Cluster
from shardlib.planner.search import Space, meshes

MOE = dict(embed=256, mlp=1024, expert_mlp=512, layers=4, moe_every=2, heads=8, kv_heads=4)


def _moe(batch=16, seq=128, **overrides) -> Workload:
    return Workload.from_preset("moe-tiny", batch, seq, "fp32", **{**MOE, **overrides})


def _llama(batch=16, seq=128, layers=2) -> Workload:
    return Workload.from_preset("llama-small", batch, seq, "fp32", layers=layers)


def _wire(est, kind: str, axes: str) -> float:
    return sum(c.wire_bytes for c in est.comms if c.kind == kind and ",".join(c.axes) == axes)


# --- formulas ---------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides", [{}, MOE, {**MOE, "moe_every": 1, "top_k": 1}])
def test_moe_workload_lists_the_model_parameters(overrides):
    """Names, logical dims and counts as models/moe.py builds them."""
    import models
    from shardlib.mesh import mesh_spec
    from shardlib.train.config import TrainConfig
    from shardlib.train.setup import make_setup

    w = Workload.from_preset("moe-tiny", 8, 16, "fp32", **overrides)
    assert w.param_count == models.config("moe-tiny", **overrides).param_count()
    cfg = TrainConfig(model="moe-tiny", batch=8, seq=16, model_overrides=tuple(overrides.items()))
    import jax

    setup = make_setup(cfg, mesh_spec(data=1).build(jax.devices()[:1]))
    model_paths = {".".join(str(k) for k in path) for path in _paths(setup.param_specs)}
    if w.moe_every == 1:  # the model keeps an empty [0, ...] stack of dense blocks
        model_paths = {p for p in model_paths if not p.startswith("dense_blocks.")}
    assert {p.name for p in w.params} == model_paths


def _paths(tree, prefix=()):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _paths(v, (*prefix, k))
    else:
        yield prefix


def test_ring_permutes_follow_the_ring_kernel():
    """Forward c-1 hops of K, V and positions; backward c-1 again plus c of the gradients."""
    w = _llama()
    for c in (2, 4):
        b = 16 // (8 // c)  # sequences per device
        est = estimate(w, Plan(data=8 // c, context=c), backend="cpu")
        block = b * (128 // c) * w.cfg.kv_heads * w.cfg.head_dim * 4
        kv = 2 * block + (128 // c) * 4
        expected = w.layers * (2 * (c - 1) * kv + c * 2 * block)
        if c == 2:
            assert expected == pytest.approx(w.layers * 4 * 2 * block, rel=0.01)  # 3c-2 = 4
        assert _wire(est, "collective-permute", "context") == pytest.approx(expected)


def test_data_and_context_reduce_gradients_separately_without_fsdp():
    """Two all-reduces of all gradients (as compiled), not one over both axes."""
    w = _llama()
    grads = 4 * w.param_count
    est = estimate(w, Plan(data=4, context=2), backend="cpu")
    assert _wire(est, "all-reduce", "context") == pytest.approx(grads)
    assert _wire(est, "all-reduce", "data") == pytest.approx(1.5 * grads)
    assert _wire(est, "all-reduce", "data,context") == 0


def test_all_to_all_is_the_benchmark_formula():
    """benchmarks/moe.py: 4 k·cf·b·s·h (N-1)/N per MoE layer, cf = E·C/(k·s)."""
    w = _moe()
    for n in (2, 4, 8):
        est = estimate(w, Plan(expert=n, data=8 // n), backend="cpu")
        cf = w.cfg.capacity(128) * w.experts / (w.top_k * 128)
        formula = 4 * w.top_k * cf * (16 / 8) * 128 * w.embed * (n - 1) / n * 4
        assert _wire(est, "all-to-all", "expert") == pytest.approx(formula * w.moe_layers)


def test_expert_axis_reduces_only_the_replicated_gradients():
    w = _moe()
    est = estimate(w, Plan(expert=8), backend="cpu")
    replicated = sum(
        p.numel * (w.layers if p.per_layer else 1) for p in w.params if "experts." not in p.name
    )
    assert _wire(est, "all-reduce", "expert") == pytest.approx(2 * 7 / 8 * 4 * replicated)


def test_search_space_has_experts_only_for_moe_and_no_moe_stages_or_context():
    cluster = Cluster(
        name="t",
        devices_per_host=8,
        hosts=1,
        memory_bytes=80e9,
        peak_flops=1e15,
        intra_host_bw=1e11,
        inter_host_bw=1e10,
    )
    dense = list(meshes(_llama(), cluster, Space()))
    assert dense and all(m["expert"] == 1 for m in dense)
    moe = list(meshes(_moe(), cluster, Space()))
    assert any(m["expert"] > 1 for m in moe)
    assert all(m["stage"] == 1 and m["context"] == 1 for m in moe)
    for plan in (Plan(stage=2, expert=4), Plan(context=2, expert=4)):
        with pytest.raises(ShardingError, match="not pipelined"):
            estimate(_moe(), plan)


def test_moe_flops_count_the_capacity_slots():
    w = _moe(moe_every=1)
    c = w.cfg
    slots = c.experts * c.capacity(128) / 128
    assert slots == pytest.approx(c.top_k * c.capacity_factor)
    attn = 2 * c.embed * (2 * c.heads + 2 * c.kv_heads) * c.head_dim
    routed = 2 * c.embed * c.experts + 6 * c.embed * c.expert_mlp * slots
    dispatch = 4 * slots * 128 * c.embed
    assert w.layer_matmul_flops_per_token == pytest.approx(attn + routed + dispatch)
    assert w.layer_useful_flops_per_token < w.layer_matmul_flops_per_token
    assert math.isclose(w.layer_unsplit_flops_per_token, 2 * c.embed * c.experts + dispatch)


# --- compiled checks (8 simulated devices) ----------------------------------------------------


@pytest.mark.parametrize(
    "workload, plan",
    [
        (_llama(layers=2), Plan(data=4, context=2)),
        (_moe(), Plan(expert=4, tensor=2)),
    ],
    ids=["data4-context2", "expert4-tensor2"],
)
def test_prediction_matches_the_compiled_step(workload, plan):
    from shardlib.planner.validate import validate

    check = validate(workload, plan)
    assert abs(check.memory_ratio - 1) <= 0.10, check  # the target
    assert abs(check.wire_ratio - 1) <= 0.02, check  # the collective terms are exact formulas
