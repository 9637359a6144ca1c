"""TeraPipe (token slices through the stages): refusals, bubble in FLOPs, parity, planner.

Parity runs the trainer's gradient path on stage x data / stage x tensor against one
device's, fp32, with a batch of 2 sequences cut into token slices. The bubble is measured
as GPipe's is (``test_pipeline``): compiled FLOPs of the pipelined step, loop trips
counted, over one device's, against TeraPipe's executed/ideal = (s+p-1)/s.
"""

import functools
import math

import jax
import numpy as np
import pytest
from test_pipeline import _mesh

from benchmarks._programs import layer_stack_program
from shardlib import ShardingError, mesh_spec
from shardlib.analysis import hlo, hlo_flops
from shardlib.core.layout import use_layout
from shardlib.core.mesh import single_device_mesh
from shardlib.dataset.tokens import global_batch, load_tokens
from shardlib.parallel.pipeline.spec import PipelineSpec
from shardlib.parallel.pipeline.terapipe import check_terapipe
from shardlib.planner import Workload, candidate
from shardlib.planner.cost.terms.pipeline_loop import bubble_fraction
from shardlib.planner.cost.total import estimate
from shardlib.planner.validate import validate
from shardlib.tools import parity
from shardlib.tools.parity import FP32_TOLERANCE
from shardlib.tools.plan_cli import parse_settings
from shardlib.train.config import train_config
from shardlib.train.setup import make_setup
from shardlib.train.step import grad_function, make_loss_fn

BATCH, SEQ = 2, 16
PARITY = dict(steps=1, batch=BATCH, seq=SEQ, pipeline_schedule="terapipe", **{"model.layers": 4})


def _step(cfg, mesh):
    """The trainer's gradient path on ``mesh``, jitted, and its inputs' shardings."""
    setup = make_setup(cfg, mesh)
    grad_fn = grad_function(setup, make_loss_fn(setup))

    def value_and_grad(params, tokens):
        with use_layout(setup.mesh, setup.rules):
            return grad_fn(params, tokens)

    jitted = jax.jit(value_and_grad, in_shardings=(setup.param_shardings, setup.batch_sharding))
    return setup, jitted


def _loss_and_grads(cfg, mesh, params):
    setup, jitted = _step(cfg, mesh)
    tokens = global_batch(load_tokens(None), 0, BATCH, SEQ, cfg.run.seed, setup.batch_sharding)
    return jax.device_get(jitted(jax.device_put(params, setup.param_shardings), tokens))


@functools.cache
def _reference():
    """Random parameters and one device's (loss, grads) at them (shared by the cases)."""
    cfg, one = train_config(**PARITY, pipeline_microbatches=4), single_device_mesh()
    params = parity.random_state(make_setup(cfg, one))["params"]
    return params, _loss_and_grads(cfg, one, params)


def test_terapipe_refuses_what_it_cannot_slice():
    spec = PipelineSpec(2, 4, 1, "terapipe")
    spec.check(layers=4, batch=1)  # a batch of 1: slices, not micro-batches
    check_terapipe(spec, seq=16, block_stats=False)
    with pytest.raises(ShardingError, match="slice count dividing"):
        check_terapipe(spec, seq=18, block_stats=False)
    with pytest.raises(ShardingError, match="block statistics"):
        check_terapipe(spec, seq=16, block_stats=True)
    with pytest.raises(ShardingError, match="virtual_stages"):
        check_terapipe(PipelineSpec(2, 4, 2, "terapipe"), seq=16, block_stats=False)
    assert spec.iterations() == 4 + 2 - 1
    assert spec.bubble_ratio() == (4 + 2 - 1) / 4


@pytest.mark.slow
@pytest.mark.parametrize("axes,s", [({"stage": 2, "data": 2}, 4), ({"stage": 2, "tensor": 2}, 2)])
def test_terapipe_gradients_like_one_device(axes, s):
    """Loss and every parameter's gradient within 1e-5 (fp32) of one device's."""
    cfg = train_config(**PARITY, pipeline_microbatches=s)
    mesh = mesh_spec(**axes).build(jax.devices()[: math.prod(axes.values())])
    params, ref = _reference()
    got = _loss_and_grads(cfg, mesh, params)
    assert abs(got[0] - ref[0]) <= FP32_TOLERANCE * abs(ref[0]), (got[0], ref[0])
    errs = jax.tree.map(lambda a, b: np.linalg.norm(a - b) / np.linalg.norm(b), got[1], ref[1])
    assert max(jax.tree.leaves(errs)) <= FP32_TOLERANCE, errs


def _matmul_and_total_flops(exe) -> tuple[int, int]:
    """Per-device (dot FLOPs, all FLOPs) of one run, every loop body counted per trip."""
    module = hlo.parse_module(exe.as_text())
    mult = hlo.call_multipliers(module)[0]
    dots = total = 0
    for comp in module.computations.values():
        if k := mult.get(comp.name, 0):
            types = comp.types()
            for inst in comp.instructions:
                f = k * hlo_flops.instruction_flops(inst, types)
                total += f
                dots += f if inst.opcode == "dot" else 0
    return dots, total


def _stack_flops(p, **overrides):
    cfg = train_config(batch=1, seq=256, **{"model.layers": 4}, **overrides)
    setup = make_setup(cfg, _mesh({"stage": p}) if p > 1 else single_device_mesh())
    jitted, args = layer_stack_program(setup)
    return _matmul_and_total_flops(jitted.lower(*args).compile())


@pytest.mark.slow
def test_terapipe_bubble_from_flops():
    """One sequence (batch 1) in s = 4 slices over p = 2 stages: p x the layer stack's FLOPs
    per device over one device's is (s+p-1)/s, TeraPipe's executed/ideal (idle share
    (p-1)/(s+p-1)): the matmuls within 0.5%, all FLOPs within 2.5%. The elementwise rest is
    ~2% over at batch 1 (1.020 here, 1.018-1.024 for p = 2, 4 and s = 2..8 in
    ``benchmarks/terapipe.py``; 1.0035 at batch 4 with the same slices): the compiled
    slice attention does more elementwise work per score than one device's [heads, seq,
    seq] (11 multiplies and 2 adds per score against 9 and 1, counted per op); the loop's
    own per-trip K/V bookkeeping is O(L/s)."""
    p, s = 2, 4
    one = _stack_flops(1)
    got = _stack_flops(p, pipeline_schedule="terapipe", pipeline_microbatches=s)
    formula = (s + p - 1) / s
    dots, total = (p * g / o / formula for g, o in zip(got, one, strict=True))
    print(f"terapipe p={p} s={s}: matmul {dots:.4f}, all {total:.4f} x (s+p-1)/s")
    assert abs(dots - 1) <= 0.005 and abs(total - 1) <= 0.025, (dots, total)


# --- the planner (``planner/cost/terms/terapipe.py`` and GPipe's loop terms) ---------------
def test_planner_books_kv_buffers_and_the_slice_bubble():
    """batch 2, seq 256, s = 4 on stage 2 x data 2 x tensor 2: the loop carries the whole
    per-replica batch (1 sequence) in slices of 64 tokens, the K/V buffers are (trips + 1)
    copies of [L/p, b, seq, kv/t, head_dim] x 2, one causal mask per trip (a byte per score
    of a slice's queries against the whole sequence, for the stage's 2 layers at once), the
    bubble (p-1)/s; the CLI takes it."""
    workload = Workload.from_preset("llama-tiny", 2, 256, "fp32", layers=4)
    plan = candidate(stage=2, data=2, tensor=2, microbatches=4, schedule="terapipe")
    est = estimate(workload, plan, backend="cpu")
    kv_per_layer = 1 * 256 * (8 / 2) * 8 * 4  # b, seq, kv_heads / t, head_dim, fp32
    assert est.memory["terapipe K/V buffers"] == pytest.approx((5 + 1) * 2 * 2 * kv_per_layer)
    assert est.memory["terapipe masks"] == 5 * 1 * 64 * (16 / 2) * 256  # trips, b, L/s, a/t, seq
    kw = dict(stage=2, data=2, tensor=2, microbatches=4, schedule="terapipe", remat="full")
    full = estimate(workload, candidate(**kw), backend="cpu")
    assert "terapipe masks" not in full.memory  # remat recomputes the mask with the layer
    assert bubble_fraction("terapipe", 2, 4, 1) == (2 - 1) / 4
    assert parse_settings(["stage=2,schedule=terapipe"], "--set")["schedule"] == "terapipe"


@pytest.mark.slow
def test_planner_memory_and_wire_like_the_compiled_step():
    """stage 4 x data 2, s = 4, batch 2: memory within 10% and every axis's bytes within
    5% of the compiled train step's (``planner.validate``)."""
    workload = Workload.from_preset("llama-tiny", 2, 256, "fp32", layers=4)
    c = validate(workload, candidate(stage=4, data=2, microbatches=4, schedule="terapipe"))
    assert abs(c.memory_ratio - 1) <= 0.10, (c.predicted_memory, c.compiled_memory)
    for axis, got in c.compiled_wire_by_axes.items():
        assert abs(c.predicted_wire_by_axes[axis] / got - 1) <= 0.05, (axis, c)
