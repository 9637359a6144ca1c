"""Mixture of experts: routing, expert-parallel parity, layout-independent dropping, traffic.

Every mesh here is one of the 8 fake CPU devices of tests/conftest.py. Compiles dominate
the run time, so each compiled train step serves several tests (module-scoped fixtures).
"""

import json
import math

import jax
import numpy as np
import pytest

from models.moe import routing as moe_routing
from shardlib import ShardingError, mesh_spec, rules_for_mesh
from shardlib.analysis import explain
from shardlib.core.inventory import inventory
from shardlib.core.mesh import MESHES_DIR
from shardlib.core.model import resolve_model
from shardlib.dataset.tokens import global_batch, load_tokens
from shardlib.parallel.expert import expert_axis
from shardlib.tools.cli import main
from shardlib.tools.parity import (
    FP32_TOLERANCE,
    Trace,
    compare,
    compare_traces,
    reference_mesh,
    trace,
)
from shardlib.train.config import TrainConfig, train_config
from shardlib.train.setup import make_setup


def moe_cfg(steps: int = 5, dispatch: str = "einsum", **model) -> TrainConfig:
    """moe-tiny with one MoE block; ``dispatch`` is a layout setting (``shardlib.core.ops``), not a
    model field: the trainer hands it to ``use_ops(dispatch=...)``."""
    overrides = {"layers": 1, "moe_every": 1, **model}
    return train_config(
        model="moe-tiny",
        steps=steps,
        batch=16,
        seq=32,
        dispatch=dispatch,
        **{f"model.{k}": v for k, v in sorted(overrides.items())},
    )


def build_mesh(axes: dict):
    """A mesh over the first prod(sizes) of the 8 fake devices."""
    return mesh_spec(**axes).build(jax.devices()[: math.prod(axes.values())])


# --- routing, on literal logits ---------------------------------------------------------------

route = jax.jit(
    moe_routing.route, static_argnames=("top_k", "capacity")
)  # one compile, not one per op


def test_capacity_priority_and_drops():
    """Four tokens all prefer expert 0; capacity 2 keeps the first two, in token order."""
    logits = np.array([[[3.0, 1, 0], [3, 0, 1], [3, 1, 0], [3, 0, 1]]], np.float32)
    r = route(logits, top_k=1, capacity=2)
    assert r.dispatch.shape == (1, 4, 3, 2)
    kept = r.dispatch[0].sum((1, 2))
    np.testing.assert_array_equal(kept, [1, 1, 0, 0])
    np.testing.assert_array_equal(r.dispatch[0, :2, 0], np.eye(2))  # slots 0 and 1 of expert 0
    assert float(r.stats["dropped"]) == 2.0
    np.testing.assert_allclose(r.stats["load"], [1.0, 0.0, 0.0])
    p = np.exp(3.0) / (np.exp(3.0) + np.exp(1.0) + 1.0)
    np.testing.assert_allclose(r.combine[0, 0, 0, 0], p, rtol=1e-6)  # k = 1: the raw probability


def test_top2_first_choices_before_second_choices():
    """With capacity 1, token 1's first choice (expert 1) beats token 0's second choice."""
    logits = np.array([[[2.0, 1.0, -5.0], [-5.0, 2.0, 1.0]]], np.float32)
    r = route(logits, top_k=2, capacity=1)
    assert float(r.dispatch[0, 1, 1, 0]) == 1.0  # token 1 -> expert 1 (first choice)
    assert float(r.dispatch[0, 0, 1].sum()) == 0.0  # token 0's second choice dropped
    assert float(r.dispatch[0, 0, 0, 0]) == 1.0 and float(r.dispatch[0, 1, 2, 0]) == 1.0
    assert float(r.stats["dropped"]) == 1.0
    gates = r.combine[0].sum((1, 2))  # renormalised top-2 gates, minus the dropped one
    np.testing.assert_allclose(gates[0], 1 / (1 + np.exp(-1.0)), rtol=1e-6)  # e^2 / (e^2 + e^1)


def test_balanced_router_has_unit_aux_loss():
    logits = np.zeros((2, 8, 4), np.float32)
    logits[:, np.arange(8), np.arange(8) % 4] = 1.0
    r = route(logits, top_k=1, capacity=8)
    np.testing.assert_allclose(r.stats["aux_loss"], 1.0, rtol=1e-6)
    np.testing.assert_allclose(r.stats["load"], 0.25)
    assert float(r.stats["dropped"]) == 0.0


# --- layouts, validated before compiling ------------------------------------------------------


def test_expert_weights_resolve_to_the_expert_axis():
    setup = make_setup(moe_cfg(), mesh_spec(fsdp=2, expert=2, tensor=2).build())
    experts = setup.param_specs["blocks"]["moe"]["moe"]["experts"]  # [groups, E, ...]
    assert experts["w_gate"] == jax.sharding.PartitionSpec(None, "expert", "fsdp", "tensor")
    assert experts["w_down"] == jax.sharding.PartitionSpec(None, "expert", "tensor", "fsdp")
    assert setup.rules.activations["batch"] == ("fsdp", "expert")
    assert setup.rules.activations["batch_no_expert"] == ("fsdp",)


def test_experts_not_divisible_by_the_expert_axis_is_a_clear_error():
    with pytest.raises(ShardingError, match=r"'expert', size 6.*expert=4"):
        make_setup(moe_cfg(experts=6), mesh_spec(data=2, expert=4).build())


def test_shard_map_dispatch_needs_the_expert_axis_innermost_in_the_batch():
    """The all-to-all concatenates groups in expert order: any other fold would permute them."""
    rules = rules_for_mesh({"data": 2, "expert": 4})
    assert expert_axis(rules, {"data": 2, "expert": 4}) == "expert"
    swapped = rules.replace(activations={"batch": ("expert", "data")})
    with pytest.raises(ShardingError, match="must end with the expert axis"):
        expert_axis(swapped, {"data": 2, "expert": 4})


# --- parity: fp32, 5 steps, capacity high enough that nothing drops ---------------------------

NO_DROP = {"capacity_factor": 8.0}  # capacity = the whole sequence, for k = 1 and 2
PARITY = {  # name: (mesh, dispatch, top_k, full)
    # full: parity.compare as for every strategy (sharded init, first-step gradients leaf by
    # leaf); otherwise 5 steps of losses and gradient norms from the reference's initial state
    # (one compile instead of three).
    "e2-einsum-top2": ({"expert": 2}, "einsum", 2, False),
    "e4-einsum-top1": ({"expert": 4}, "einsum", 1, False),
    "e8-shard_map-top2": ({"expert": 8}, "shard_map", 2, True),
    "d2e4-shard_map-top1": ({"data": 2, "expert": 4}, "shard_map", 1, False),
    "e4t2-einsum-top2": ({"expert": 4, "tensor": 2}, "einsum", 2, False),
}


def light_trace(setup, state) -> Trace:
    """Losses and gradient norms only (no first-step gradients: one compile, not two)."""
    got = trace(setup, state, grads=False)
    assert all(r["moe_dropped"] == 0 for r in got.records)
    return got


@pytest.fixture(scope="module")
def moe_reference():
    """One-device einsum references (both dispatch paths compare with them): the full top-2
    trace, light traces per top_k, and the initial state on the host (it does not depend on
    top_k, dispatch or capacity)."""
    mesh = reference_mesh(mesh_spec(data=1).build(jax.devices()[:1]))
    setup = make_setup(moe_cfg(top_k=2, **NO_DROP), mesh)
    full = trace(setup)
    first = jax.device_get(setup.init_state())  # a cache hit
    light = {2: full}
    light[1] = light_trace(make_setup(moe_cfg(top_k=1, **NO_DROP), mesh), first)
    return full, light, first


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PARITY))
def test_moe_parity_fp32(name, moe_reference):
    axes, dispatch, top_k, full = PARITY[name]
    setup = make_setup(moe_cfg(top_k=top_k, dispatch=dispatch, **NO_DROP), build_mesh(axes))
    ref_full, ref_light, first = moe_reference
    if full:
        result = compare(setup, ref_full, first)  # the reference's initial state
        assert result.max_rel_loss_err <= FP32_TOLERANCE, result
        assert result.max_rel_grad_err <= FP32_TOLERANCE, result
        assert result.ok(), result
        return
    result = compare_traces(light_trace(setup, first), ref_light[top_k])
    assert result.max_rel_loss_err <= FP32_TOLERANCE, result
    assert result.ok(), result


# --- one compiled train step per mesh: dropping, traffic, memory ------------------------------

COMM = {  # name: (mesh, dispatch)
    "e1": ({"expert": 1}, "einsum"),  # the one-device reference
    "e8": ({"expert": 8}, "einsum"),
    "e4t2-shard_map": ({"expert": 4, "tensor": 2}, "shard_map"),
}


@pytest.fixture(scope="module")
def compiled_steps(moe_reference):
    """Per mesh: the setup, its layout report and the metrics of one step from one state.

    capacity_factor 1: E * capacity = k * group tokens, so REFERENCE.md's all-to-all formula
    is exact, and tokens drop. ``explain`` compiles the step; compiling it again the same way
    is a cache hit, and that executable runs one step from the reference's initial state.
    """
    first = moe_reference[2]
    out = {}
    for name, (axes, dispatch) in COMM.items():
        cfg = moe_cfg(steps=1, capacity_factor=1.0, dispatch=dispatch)
        setup = make_setup(cfg, build_mesh(axes))
        args = (setup.abstract_state(), setup.abstract_batch())
        report = explain(setup.train_step, *args, mesh=setup.mesh)
        with jax.set_mesh(setup.mesh):
            step = setup.train_step.lower(*args).compile()
        tokens = global_batch(
            load_tokens(None),
            0,
            cfg.dataset.batch,
            cfg.dataset.seq,
            cfg.run.seed,
            setup.batch_sharding,
        )
        _, metrics = step(jax.device_put(first, setup.state_shardings), tokens)
        out[name] = (setup, report, jax.device_get(metrics))
    return out


@pytest.mark.slow
def test_dropped_tokens_do_not_depend_on_the_mesh(compiled_steps):
    _, _, ref = compiled_steps["e1"]
    assert ref["moe_dropped"] > 0, "capacity_factor 1 should drop tokens"
    for name, (_, _, metrics) in compiled_steps.items():
        assert metrics["moe_dropped"] == ref["moe_dropped"], name
        for e in range(8):
            assert metrics[f"moe_load_{e}"] == pytest.approx(ref[f"moe_load_{e}"], abs=1e-7)
        assert metrics["loss"] == pytest.approx(ref["loss"], rel=FP32_TOLERANCE), name


def a2a_formula_bytes(setup) -> float:
    """REFERENCE.md: 4 all-to-alls per MoE layer, k*b*s*h*(N-1)/N elements each per device."""
    axes = dict(setup.mesh.shape)
    n = axes["expert"]
    b = setup.cfg.dataset.batch // math.prod(axes[a] for a in setup.rules.activations["batch"])
    k, h = setup.model_cfg.top_k, setup.model_cfg.embed
    return 4 * k * b * setup.cfg.dataset.seq * h * (n - 1) / n * 4  # fp32


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in COMM if n != "e1"])
def test_all_to_all_bytes_per_moe_layer_match_the_formula(name, compiled_steps):
    setup, report, _ = compiled_steps[name]
    a2a = [op for op in report.collectives if op.kind == "all-to-all"]
    assert a2a and all(op.axes == ("expert",) for op in a2a), a2a
    per_layer = sum(op.total_wire_bytes for op in a2a) / setup.model_cfg.moe_layers
    assert per_layer == pytest.approx(a2a_formula_bytes(setup), rel=0.05)
    gathers = [op for op in report.collectives if op.kind == "all-gather" and "expert" in op.axes]
    assert not gathers, gathers  # experts stay put; only tokens cross the expert axis


@pytest.mark.slow
def test_expert_weight_bytes_fall_as_one_over_the_expert_axis(compiled_steps):
    def expert_bytes(report) -> int:
        return sum(
            t.bytes_per_device for t in report.tensors if t.is_param and ".experts." in t.path
        )

    full = expert_bytes(compiled_steps["e1"][1])
    assert full > 0
    assert expert_bytes(compiled_steps["e8"][1]) * 8 == full  # benchmarks/moe.py: e2, e4 too
    # tensor parallelism inside each expert (its mlp dim) splits them further
    assert expert_bytes(compiled_steps["e4t2-shard_map"][1]) * 8 == full


# --- the command line --------------------------------------------------------------------------


@pytest.mark.slow
def test_cli_trains_moe_tiny_and_reports_router_metrics(tmp_path):
    metrics = tmp_path / "moe.jsonl"
    argv = ["train", "--mesh", "cpu-8-expert", "model=moe-tiny", "steps=15", "batch=16"]
    assert main([*argv, "seq=32", f"metrics={metrics}"]) == 0
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    for key in ("ce_loss", "moe_aux_loss", "moe_z_loss", "moe_dropped_fraction", "moe_load_7"):
        assert key in records[0], key
    assert sum(records[0][f"moe_load_{e}"] for e in range(8)) == pytest.approx(1.0)
    first, last = records[0]["loss"], np.mean([r["loss"] for r in records[-5:]])
    assert last < first - 1.0, (first, last)
    assert (MESHES_DIR / "cpu-8-expert.toml").read_text().startswith("# Use this when:")


def test_mixtral_preset_has_the_published_size():
    factory = resolve_model("mixtral-8x7b")
    assert factory.config.param_count() == pytest.approx(46.7e9, rel=0.01)
    assert inventory(factory).param_count == factory.config.param_count()


def test_capacity_follows_the_reference_formula():
    """ceil(k * tokens / E * factor): REFERENCE.md's ceil(tokens / E * cf), doubled for k=2."""

    def config(**overrides):
        return resolve_model("moe-tiny", overrides).config

    assert config(top_k=1, capacity_factor=1.25).capacity(100) == math.ceil(100 / 8 * 1.25)
    assert config(top_k=2, capacity_factor=1.25).capacity(100) == 32
    assert config(no_drop=True).capacity(100) == 100
    assert config(capacity_factor=100.0).capacity(100) == 100  # at most all


@pytest.mark.slow
def test_bad_moe_settings_are_reported_by_the_cli(capsys):
    assert main(["train", "--mesh", "cpu-8-expert", "model=moe-tiny", "dispatch=a2a"]) == 2
    assert main(["train", "--mesh", "cpu-8-expert", "model=moe-tiny", "model.moe_every=3"]) == 2
    err = capsys.readouterr().err
    assert "dispatch='a2a'" in err and "moe_every=3" in err


def test_moe_with_a_stage_axis_is_refused_only_by_the_1f1b_schedule():
    """GPipe/circular carry the router statistics (tests/parallel/test_pipeline_composition.py),
    per data replica too; the 1F1B schedule's own vjp does not yet, and says so before
    compiling."""
    from shardlib import ShardingError, mesh_spec
    from shardlib.train.config import parse_overrides
    from shardlib.train.setup import make_setup

    mesh = mesh_spec(stage=2, data=4).build()
    cfg = parse_overrides(["model=moe-tiny", "model.layers=4", "batch=8", "seq=16"])
    assert make_setup(cfg, mesh).plan.pipeline_spec().schedule == "gpipe"
    one_f_one_b = parse_overrides(["pipeline_schedule=1f1b"], cfg)
    with pytest.raises(ShardingError, match="per-stage vjp.*Fix: pipeline_schedule=gpipe or circ"):
        make_setup(one_f_one_b, mesh)
    step = parse_overrides(["pipeline_gather_weights=step"], cfg)  # carried per replica too
    assert make_setup(step, mesh).plan.pipeline_spec().gather_weights == "step"


def test_moe_with_a_context_axis_is_refused_before_compiling():
    from shardlib import ShardingError, mesh_spec
    from shardlib.train.config import parse_overrides
    from shardlib.train.setup import make_setup

    cfg = parse_overrides(["model=moe-tiny", "batch=8", "seq=16"])
    with pytest.raises(ShardingError, match="context axis"):
        make_setup(cfg, mesh_spec(context=2, data=4).build())
