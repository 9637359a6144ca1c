"""Pipelines composed with the other strategies: MoE models and context parallelism under a
pipeline, and the 1F1B schedule running the plan's attention kernels (the one gradient path).

One step's loss, the model's metrics and every gradient leaf against one device (fp32,
1e-5 relative), one compile per layout (``lower().compile()``; like every test, without
LLVM's backend optimisations: ``xla_test_flags.py``). An MoE's statistics ride through the stages
with their micro-batch (``parallel/pipeline/stats.py``) and the total is their mean over
the m micro-batches, so the one-device reference accumulates gradients over the same m
micro-batches (``parallel.data.microbatches = m``): the load-balancing loss is a product of
two batch means, not linear in the batch.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shardlib import ShardingError, mesh_spec
from shardlib.analysis import hlo
from shardlib.analysis.collective import collective_op
from shardlib.core.layout import use_layout
from shardlib.core.mesh import reference_mesh
from shardlib.dataset.tokens import global_batch, load_tokens
from shardlib.tools.parity import FP32_TOLERANCE, random_state
from shardlib.train.config import override, train_config
from shardlib.train.setup import make_setup
from shardlib.train.step import grad_function, make_loss_fn

M = 2  # pipeline micro-batches


def _mesh(axes):
    return mesh_spec(**axes).build(jax.devices()[: math.prod(axes.values())])


def moe_cfg(**overrides):
    """moe-tiny with two MoE groups (one per stage), 8 sequences of 16 tokens."""
    return train_config(
        model="moe-tiny",
        batch=8,
        seq=16,
        pipeline_microbatches=M,
        **{"model.layers": 2, "model.moe_every": 1},
        **overrides,
    )


class Step:
    """``(loss, metrics, grads)`` of the first batch, as the train step computes them (the
    plan's value_and_grad, accumulated over ``parallel.data.microbatches``), compiled once."""

    def __init__(self, cfg, mesh, state):
        setup = self.setup = make_setup(cfg, mesh)
        grad_fn = grad_function(setup, make_loss_fn(setup, with_metrics=True), has_aux=True)

        def step(params, tokens_BL1):
            with use_layout(setup.mesh, setup.rules):
                (loss, metrics), grads = grad_fn(params, tokens_BL1)
            return loss, metrics, grads

        d = cfg.dataset
        tokens = global_batch(
            load_tokens(d.path), 0, d.batch, d.seq, cfg.run.seed, setup.batch_sharding
        )
        params = jax.device_put(state["params"], setup.param_shardings)
        self.exe = jax.jit(step).lower(params, tokens).compile()
        self.loss, self.metrics, self.grads = jax.device_get(self.exe(params, tokens))

    def collectives(self):
        """Every collective of the compiled step, on the mesh's axes, loop trips counted."""
        module = hlo.parse_module(self.exe.as_text())
        mesh = self.setup.mesh
        shape, names = tuple(mesh.shape.values()), tuple(mesh.axis_names)
        return [
            collective_op(c, shape, names)
            for c in hlo.collectives(module, hlo.call_multipliers(module)[0])
        ]


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def assert_same(got: Step, ref: Step):
    assert _rel(got.loss, ref.loss) <= FP32_TOLERANCE, (got.loss, ref.loss)
    assert set(got.metrics) == set(ref.metrics)
    for name in ref.metrics:
        assert _rel(got.metrics[name], ref.metrics[name]) <= FP32_TOLERANCE, name
    errs = jax.tree.map(_rel, got.grads, ref.grads)
    worst = max(jax.tree.leaves(errs))
    assert worst <= FP32_TOLERANCE, errs


@pytest.mark.slow
def test_moe_under_a_pipeline_matches_one_device():
    """stage 2 x data 2 x expert 2 (the expert axis inside the stage), GPipe, the explicit
    ``shard_map`` all-to-all inside the stage vmap: loss (cross-entropy + router aux/z
    losses), every router metric and every gradient equal one device accumulating over the
    same m micro-batches; the tokens cross the expert axis in every loop trip."""
    axes = {"stage": 2, "data": 2, "expert": 2}
    cfg = moe_cfg(dispatch="shard_map")
    mesh = _mesh(axes)
    ref_setup = make_setup(override(cfg, {"parallel.data.microbatches": M}), reference_mesh(mesh))
    state = random_state(ref_setup)
    ref = Step(ref_setup.cfg, reference_mesh(mesh), state)
    got = Step(cfg, mesh, state)
    assert got.setup.plan.pipeline_spec().stages == 2
    assert got.metrics["aux_loss"] > 0 and got.metrics["moe_dropped"] > 0
    assert_same(got, ref)
    trips = M + 2 - 1  # GPipe: m + p - 1, one MoE block per stage and trip
    ops = got.collectives()
    a2a = [op for op in ops if op.kind == "all-to-all" and op.axes == ("expert",)]
    assert a2a and sum(op.count for op in a2a) == 4 * trips, a2a  # dispatch, combine, 2 back
    # gradients reduced over data once per step, as a dense model's (the data replicas
    # complete the router's batch means instead: small all-reduces inside the loop)
    grads = [op for op in ops if "data" in op.axes and op.buffer_bytes > 4096]
    assert grads and all(op.count == 1 for op in grads), [(o.name, o.count) for o in grads]


@pytest.mark.slow
def test_stage_and_context_axes_match_one_device():
    """stage 2 x context 2 x data 2, GPipe, ring attention: the stage buffer's seq dim is
    split over context (each stage hand-over moves b·(s/c)·h), the ring's K/V hops run over
    context inside the stage loop, and loss and every gradient equal one device's."""
    axes = {"stage": 2, "context": 2, "data": 2}
    cfg = train_config(
        batch=8, seq=16, attention="ring", pipeline_microbatches=M, **{"model.layers": 2}
    )
    mesh = _mesh(axes)
    ref_setup = make_setup(cfg, reference_mesh(mesh))
    state = random_state(ref_setup)
    ref = Step(cfg, reference_mesh(mesh), state)
    got = Step(cfg, mesh, state)
    assert_same(got, ref)
    ops = got.collectives()
    ring = [op for op in ops if op.kind == "collective-permute" and op.axes == ("context",)]
    assert ring and min(op.count for op in ring) >= M, ring  # every trip's layers
    shift = [op for op in ops if op.kind == "collective-permute" and op.axes == ("stage",)]
    embed = got.setup.model_cfg.embed
    b = cfg.dataset.batch // (M * axes["data"])  # rows of a micro-batch on one device
    local = b * (cfg.dataset.seq // axes["context"]) * embed * 4  # fp32 [b, s/c, h]
    assert shift and max(op.buffer_bytes for op in shift) == local, shift


def _context_cfg(attention: str, **overrides):
    """llama-tiny, 2 layers, 8 sequences of 16 tokens, a context-split attention kernel."""
    return train_config(
        batch=8,
        seq=16,
        attention=attention,
        pipeline_microbatches=M,
        **{"model.layers": 2},
        **overrides,
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "attention,remat",
    [("ring", "none"), ("ring", "full"), ("all_to_all", "none"), ("all_gather", "none")],
)
def test_1f1b_runs_the_plans_attention_kernel(attention, remat):
    """stage 2 x context 2 x data 2 under the 1F1B schedule: its loop runs the loss's own
    parts under ``plan.ops()``, so the configured kernel runs (ring: the K/V hops over
    ``context`` in every executed chunk, forward and backward; Ulysses: its all-to-alls;
    all-gather: its K/V gathers) in the zig-zag token order, and loss and every gradient
    equal one device's (fp32, 1e-5)."""
    axes = {"stage": 2, "context": 2, "data": 2}
    cfg = _context_cfg(attention, pipeline_schedule="1f1b", remat=remat)
    mesh = _mesh(axes)
    ref_setup = make_setup(cfg, reference_mesh(mesh))
    state = random_state(ref_setup)
    ref = Step(cfg, reference_mesh(mesh), state)
    got = Step(cfg, mesh, state)
    assert got.setup.plan.pipeline_spec().schedule == "1f1b"
    assert_same(got, ref)
    kind = {"ring": "collective-permute", "all_to_all": "all-to-all"}.get(attention, "all-gather")
    on_context = [op for op in got.collectives() if op.kind == kind and op.axes == ("context",)]
    # every executed chunk (m + p - 1 forwards, as many backwards) runs each layer's kernel
    assert on_context and sum(op.count for op in on_context) >= 2 * (M + 1), on_context


def test_1f1b_refuses_packed_rows():
    """A packed batch's document positions cannot travel through the 1F1B stages: refused
    while tracing, with the fix, before anything compiles."""
    setup = make_setup(
        _context_cfg("ring", pipeline_schedule="1f1b"), _mesh({"stage": 2, "data": 2})
    )
    grad_fn = grad_function(setup, make_loss_fn(setup))
    b, s = setup.cfg.dataset.batch, setup.cfg.dataset.seq
    batch = {
        "tokens": jax.ShapeDtypeStruct((b, s + 1), jnp.int32),
        "weights": jax.ShapeDtypeStruct((b, s), jnp.float32),
        "positions": jax.ShapeDtypeStruct((b, s), jnp.int32),
        "segments": jax.ShapeDtypeStruct((b, s), jnp.int32),
    }
    with pytest.raises(ShardingError, match="1f1b with a packed batch.*Fix"):
        jax.eval_shape(grad_fn, setup.param_shapes, batch)
