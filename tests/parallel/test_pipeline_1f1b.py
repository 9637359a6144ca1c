"""(Interleaved) 1F1B: the schedule's dependencies, its bubble in FLOPs, flat memory, errors.

The schedule is checked by simulation (every dependency of every micro-batch and virtual
stage, for many p, v, m; no compile). The bubble is measured on a toy decoder (a gather
embedding, tanh MLP blocks, a small head) run through ``one_f_one_b_value_and_grad`` without a
mesh: the compiled program then holds all p stages, so its FLOPs (loop bodies times their
trip counts, ``analysis.hlo``) over those of one device's fully rematerialised step are the
executed-over-ideal ratio 1 + (p-1)/(v·m) directly (the ideal: one device, the same
recompute of the stack's forward in the backward). Parity of the real model on simulated
devices is in ``tests/parallel/test_pipeline.py``.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from pipeline_timetables import walk

from shardlib import ShardingError, mesh_spec
from shardlib.analysis import hlo, hlo_flops
from shardlib.core.mesh import reference_mesh
from shardlib.core.ops import scan_blocks
from shardlib.dataset.tokens import global_batch, load_tokens
from shardlib.parallel.pipeline.one_f_one_b import one_f_one_b_value_and_grad
from shardlib.parallel.pipeline.spec import PipelineSpec
from shardlib.parallel.pipeline.timetable import Schedule
from shardlib.tools import parity
from shardlib.train.config import train_config
from shardlib.train.setup import make_setup


def _simulate(p, v, m):
    """{(kind, micro, virtual stage): iteration} from ``Schedule``, per device and trip."""
    sched = Schedule(p, m, v)

    def item(kind, it, t, s):
        return (kind, int(it.micro[s]), int(it.round[s]) * p + s), (t, int(it.slot[s]))

    return sched, walk(sched, p, item)


@pytest.mark.parametrize(
    "p,v,m", [(2, 1, 2), (3, 1, 6), (4, 1, 5), (2, 2, 4), (4, 2, 8), (2, 4, 6)]
)
def test_schedule_meets_every_dependency(p, v, m):
    """Each (micro-batch, virtual stage) runs forward and backward once; a forward follows its
    previous stage's by one trip, a backward its next stage's; the last stage turns around in
    one trip; a saved input's slot is not reused before its backward; the head trips are
    the p of every vp steady trips the trainer runs it in."""
    sched, when = _simulate(p, v, m)
    stages = v * p
    assert len(when) == 2 * m * stages
    assert sched.trips == v * m + v * p + p - 2 and sched.executed == v * m + p - 1
    for i, j in itertools.product(range(m), range(stages)):
        t_f, slot_f = when["f", i, j]
        t_b, slot_b = when["b", i, j]
        assert slot_f == slot_b and 0 <= t_b - t_f < sched.ring_slots
        assert (t_b == t_f) == (j == stages - 1)  # the last virtual stage turns around
        if j:
            assert when["f", i, j - 1][0] == t_f - 1
        if j < stages - 1:
            assert when["b", i, j + 1][0] == t_b - 1
        else:
            assert t_b == t_f
            assert (t_f - sched.warmup) % stages < p  # a head trip of ``steady``
    heads = sorted(when["f", i, stages - 1][0] for i in range(m))
    assert all(sched.warmup <= t < sched.cooldown_start for t in heads)
    # the head, the embedding and its gradient run in exactly the trips that need them
    embeds = {when["f", i, 0][0] for i in range(m)}
    embed_grads = {when["b", i, 0][0] for i in range(m)}
    for t in range(sched.trips):
        assert sched.heads(t) == (t in heads) or not sched.warmup <= t < sched.cooldown_start
        assert sched.embeds(t) == (t in embeds) or t >= v * m, t  # then device 0 is done
        assert sched.embeds_grad(t) == (t in embed_grads), t


def test_interleaving_needs_whole_groups_of_micro_batches():
    PipelineSpec(4, 8, 2, "1f1b").check(layers=8, batch=8)
    PipelineSpec(4, 6, 1, "1f1b").check(layers=8, batch=12)  # v = 1: any m
    with pytest.raises(ShardingError, match="pipeline_microbatches=4 or 8"):
        PipelineSpec(4, 6, 2, "1f1b").check(layers=8, batch=12)
    with pytest.raises(ShardingError, match="circular or 1f1b"):
        PipelineSpec(4, 8, 2, "gpipe").check(layers=8, batch=8)


# --- the toy decoder: FLOPs and memory from compiled programs ---------------------------------
# 16 layers: at least 2 per chunk for v = 4 (a 1-layer chunk's recompute loses its loop and
# XLA drops the unused output matmul, which the ideal's recompute cannot: not the bubble).
D, VOCAB, B, SEQ, LAYERS, P = 128, 64, 2, 32, 16, 2


def _block(w, x):
    return x + jnp.tanh(x @ w["up"]) @ w["down"]


def _embed(rest, tokens_bl):
    return rest["table"][tokens_bl]


def _head_loss(rest, x_bld, targets_bl):
    logits = x_bld @ rest["head"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets_bl).mean()


def _abstract(m):
    f32 = jnp.float32
    rest = {
        "table": jax.ShapeDtypeStruct((VOCAB, D), f32),
        "head": jax.ShapeDtypeStruct((D, VOCAB), f32),
    }
    blocks = {
        "up": jax.ShapeDtypeStruct((LAYERS, D, D), f32),
        "down": jax.ShapeDtypeStruct((LAYERS, D, D), f32),
    }
    return rest, blocks, jax.ShapeDtypeStruct((m * B, SEQ + 1), jnp.int32)


def _flops(exe):
    module = hlo.parse_module(exe.as_text())
    return hlo_flops.count_flops(module, hlo.call_multipliers(module)[0])


def _one_device(m):
    """The ideal: m micro-batches through the whole stack, gradients summed, with the same
    recompute as the pipeline (its backward re-runs each layer's forward from the layer's
    saved input: here ``jax.checkpoint`` of each block), so that only the bubble differs."""
    stack = lambda blocks, x: scan_blocks(jax.checkpoint(_block), blocks, x)  # noqa: E731

    def loss(params, tokens_bl1):
        rest, blocks = params
        x = stack(blocks, _embed(rest, tokens_bl1[:, :-1]))
        return _head_loss(rest, x, tokens_bl1[:, 1:]) / m

    def step(rest, blocks, tokens):
        micro = tokens.reshape(m, B, SEQ + 1)
        grad = jax.value_and_grad(loss)

        def body(acc, t):
            return jax.tree.map(jnp.add, acc, grad((rest, blocks), t)), None

        zero = jax.tree.map(jnp.zeros_like, (jnp.zeros(()), (rest, blocks)))
        return jax.lax.scan(body, zero, micro)[0]

    return jax.jit(step).lower(*_abstract(m)).compile()


def _one_f_one_b(v, m):
    spec = PipelineSpec(P, m, v, "1f1b")
    vg = one_f_one_b_value_and_grad(spec, block_fn=_block, embed=_embed, head_loss=_head_loss)
    return jax.jit(vg).lower(*_abstract(m)).compile()


@pytest.mark.slow
def test_bubble_from_flops_and_memory_flat_in_micro_batches():
    """FLOPs of all p stages over one device's = 1 + (p-1)/(v·m) within 2% for v in 1, 2, 4
    and m in 2p, 4p; temp memory does not grow with m (ring of 2vp - 1 inputs). Larger m, and
    the published layouts, are ``benchmarks/interleaved_1f1b.py``'s (CI time)."""
    temps = {}
    for m in (2 * P, 4 * P):  # (m = p: XLA unrolls the 2-trip loop, and its temp is less)
        ideal = _flops(_one_device(m))
        for v in (1, 2, 4):
            exe = _one_f_one_b(v, m)
            ratio, formula = _flops(exe) / ideal, 1 + (P - 1) / (v * m)
            assert abs(ratio / formula - 1) <= 0.02, (v, m, ratio, formula)
            temp = exe.memory_analysis().temp_size_in_bytes
            first = temps.setdefault(v, temp)  # at m = 2p
            assert temp <= 1.02 * first, (v, m, temp, first)
            ring = (2 * v * P - 1) * LAYERS // v * B * SEQ * D * 4  # [p, R, k, b, seq, embed]
            assert ring <= temp, (v, m, ring, temp)


@pytest.mark.slow
def test_loss_scale_scales_loss_and_gradients():
    """Seeded with scale/m: the returned loss and gradients are exactly scale times those of
    the unscaled run (a power of two), as ``jax.value_and_grad`` of the scaled loss."""
    rest, blocks, tokens = _abstract(P)
    rng = np.random.default_rng(0)
    rest, blocks = jax.tree.map(
        lambda a: jnp.asarray(rng.normal(0, 0.1, a.shape), a.dtype), (rest, blocks)
    )
    tokens = jnp.asarray(rng.integers(0, VOCAB, tokens.shape), jnp.int32)
    spec = PipelineSpec(P, P, 2, "1f1b")
    vg = jax.jit(
        one_f_one_b_value_and_grad(spec, block_fn=_block, embed=_embed, head_loss=_head_loss)
    )
    plain = vg(rest, blocks, tokens, None, 1.0)
    scaled = vg(rest, blocks, tokens, None, 1024.0)  # same program: the scale is an input
    jax.tree.map(lambda a, b: np.testing.assert_allclose(b, 1024.0 * a, rtol=1e-6), plain, scaled)


# --- fp16 loss scaling under the 1F1B schedule, in the trainer ----------------------------
FP16 = dict(
    steps=2,
    batch=8,
    seq=16,
    warmup=1,
    precision="fp16",
    pipeline_schedule="1f1b",
    pipeline_microbatches=2,
    **{"model.layers": 4},
)
FP16_TOLERANCE = 2e-3  # fp16 compute: the pipeline sums in another order than one device


@pytest.mark.slow
def test_fp16_loss_scaling_under_1f1b():
    """Losses, gradient norms and first gradients of fp16 1F1B (stage 2 x data 2; v = 1, the
    same loop as interleaved, whose scale seeding ``test_loss_scale_scales_loss_and_gradients``
    checks at v = 2) match one device's fp16 run; a scale that overflows the backward pass skips the
    step (parameters untouched, the overflow counted) as without a pipeline."""
    cfg = train_config(**FP16)
    mesh = mesh_spec(stage=2, data=2).build(jax.devices()[:4])
    setup = make_setup(cfg, mesh)
    state = parity.random_state(setup)
    result = parity.compare(setup, make_setup(cfg, reference_mesh(mesh)), state)
    assert result.ok(FP16_TOLERANCE), result
    assert result.max_rel_loss_err > 0 or result.max_rel_grad_err > 0  # fp16 really ran
    start = jax.device_put(state, setup.state_shardings)
    ls = start["loss_scale"]
    big = jax.device_put(np.float32(2.0**40), ls["scale"].sharding)
    start = {**start, "loss_scale": {**ls, "scale": big}}
    before = jax.device_get(start["params"])
    batch = global_batch(load_tokens(None), 0, 8, 16, cfg.run.seed, setup.batch_sharding)
    after, metrics = setup.train_step(start, batch)
    assert int(metrics["overflow"]) == 1 and int(metrics["skipped_steps"]) == 1
    same = jax.tree.map(np.array_equal, jax.device_get(after["params"]), before)
    assert all(jax.tree.leaves(same))
