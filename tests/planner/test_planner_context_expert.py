"""Planner terms for context (ring attention) and expert (MoE) parallelism.

Cheap formula checks, plus two compiled steps (8 simulated devices) compared with the
prediction: a data x context plan and an expert x tensor MoE plan.
"""

from __future__ import annotations

import math

import pytest

from shardlib import ShardingError
from shardlib.core.param_info import param_infos
from shardlib.planner import Workload, candidate, estimate
from shardlib.planner.inputs.cluster import Cluster
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
def test_moe_workload_reads_the_model_inventory(overrides):
    """Paths and logical dims are the model's own; every stacked copy is counted once."""
    import models

    w = Workload.from_preset("moe-tiny", 8, 16, "fp32", **overrides)
    cfg = models.config("moe-tiny", **overrides)
    assert w.param_count == cfg.param_count()  # the model's formula, not the inventory's sum
    copies = sum(p.numel * (w.layers if p.per_layer else 1) for p in w.params)
    assert copies == pytest.approx(w.param_count)
    experts = [p for p in w.params if p.name.endswith("experts.w_up")]
    assert len(experts) == 1 and experts[0].dims[0] == ("expert", cfg.experts)
    assert experts[0].share == pytest.approx(1 / cfg.moe_every)
    assert (w.embed, w.mlp, w.expert_mlp, w.experts) == (
        cfg.embed,
        cfg.mlp if cfg.moe_every > 1 else 0,  # no dense MLP when every block is MoE
        cfg.expert_mlp,
        cfg.experts,
    )


def test_stacked_groups_spread_over_the_decoder_layers():
    """Groups of (moe_every - 1) dense blocks and one MoE block stacked over moe_layers: each
    block's parameters have moe_layers copies, 1/moe_every of them per decoder layer."""
    blk = ("layers", "embed", "heads", "head_dim")
    entries = [
        ("embedding", (100, 8), ("vocab", "embed")),
        (("blocks", "dense", 0, "attn", "wq"), (2, 8, 4, 2), blk),
        (("blocks", "dense", 1, "attn", "wq"), (2, 8, 4, 2), blk),
        ("blocks.moe.moe.experts.w_up", (2, 4, 8, 16), ("layers", "expert", "embed", "mlp")),
        ("blocks.moe.moe.router", (2, 8, 4), ("layers", "embed", None)),
    ]
    infos = {p.name: p for p in param_infos(entries, layers=6)}  # moe_every 3, 2 groups
    dense = infos["blocks.dense.1.attn.wq"]
    assert dense.per_layer and dense.dims == (("embed", 8), ("heads", 4), ("head_dim", 2))
    assert dense.share == pytest.approx(1 / 3)
    assert infos["blocks.moe.moe.router"].dims == (("embed", 8), (None, 4))
    assert not infos["embedding"].per_layer and infos["embedding"].share == 1
    copies = sum(p.numel * (6 if p.per_layer else 1) for p in infos.values())
    assert copies == pytest.approx(800 + 2 * 2 * 64 + 2 * 512 + 2 * 32)


def test_ring_permutes_follow_the_ring_kernel():
    """Forward c-1 hops of K, V and positions; backward c-1 again plus c of the gradients."""
    w = _llama()
    for c in (2, 4):
        b = 16 // (8 // c)  # sequences per device
        est = estimate(w, candidate(data=8 // c, context=c), backend="cpu")
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
    est = estimate(w, candidate(data=4, context=2), backend="cpu")
    assert _wire(est, "all-reduce", "context") == pytest.approx(grads)
    assert _wire(est, "all-reduce", "data") == pytest.approx(1.5 * grads)
    assert _wire(est, "all-reduce", "data,context") == 0


def test_all_to_all_is_the_benchmark_formula():
    """benchmarks/moe.py: 4 k·cf·b·s·h (N-1)/N per MoE layer, cf = E·C/(k·s)."""
    w = _moe()
    for n in (2, 4, 8):
        est = estimate(w, candidate(expert=n, data=8 // n), backend="cpu")
        cf = w.cfg.capacity(128) * w.experts / (w.top_k * 128)
        formula = 4 * w.top_k * cf * (16 / 8) * 128 * w.embed * (n - 1) / n * 4
        assert _wire(est, "all-to-all", "expert") == pytest.approx(formula * w.moe_layers)


def test_expert_axis_reduces_only_the_replicated_gradients():
    w = _moe()
    est = estimate(w, candidate(expert=8), backend="cpu")
    replicated = sum(
        p.numel * (w.layers if p.per_layer else 1) for p in w.params if "experts." not in p.name
    )
    assert _wire(est, "all-reduce", "expert") == pytest.approx(2 * 7 / 8 * 4 * replicated)


def test_search_space_has_experts_only_for_moe_moe_stages_and_no_moe_context():
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
    assert any(m["stage"] > 1 and m["context"] > 1 for m in dense)  # ring inside the stages
    moe = list(meshes(_moe(), cluster, Space()))
    assert any(m["expert"] > 1 for m in moe)
    assert any(m["stage"] > 1 and m["expert"] > 1 for m in moe)  # GPipe/circular carry stats
    assert all(m["context"] == 1 for m in moe)
    # GPipe p = 2, m = 2: 3 loop trips of 2 blocks (1 MoE) each: 4 all-to-alls per MoE run,
    # and data replicas (the router's batch means completed over them): gradients reduced
    # over data alone once per step, after the loop
    est = estimate(_moe(), candidate(stage=2, data=2, expert=2, microbatches=2))
    a2a = [c for c in est.comms if c.kind == "all-to-all" and c.axes == ("expert",)]
    assert [c.count for c in a2a] == [4 * 3 * 1]
    data = [c for c in est.comms if c.axes == ("data",)]
    assert data and all(c.count in (1, 2) for c in data), data  # once (per layer: 2 layers)
    # the trainer's refusals, in its words
    refusals = {"per-stage vjp.*gpipe or circular": candidate(stage=2, expert=4, schedule="1f1b")}
    refusals["ring attention's token order"] = candidate(context=2, expert=4)
    for needle, plan in refusals.items():
        with pytest.raises(ShardingError, match=needle):
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


@pytest.mark.slow
@pytest.mark.parametrize(
    "workload, plan",
    [
        (_llama(layers=2), candidate(data=4, context=2)),
        (_moe(), candidate(expert=4, tensor=2)),
    ],
    ids=["data4-context2", "expert4-tensor2"],
)
def test_prediction_matches_the_compiled_step(workload, plan):
    from shardlib.planner.validate import validate

    check = validate(workload, plan)
    assert abs(check.memory_ratio - 1) <= 0.10, check  # the target
    assert abs(check.wire_ratio - 1) <= 0.02, check  # the collective terms are exact formulas
