"""Chimera (bidirectional pipelines): its timetable, refusals, bubble in FLOPs, parity.

The timetable is checked by simulation (every dependency of every micro-batch and stage
of both directions; no compile). The bubble is measured as 1F1B's is
(``test_pipeline_1f1b``): the toy decoder through ``chimera_value_and_grad`` without a
mesh holds all p stages, so its FLOPs (loop bodies times their trip counts) over one
device's fully rematerialised step are the executed-over-ideal ratio. Parity runs the
trainer's gradient path on stage x data (x tensor) against one device's, fp32.
"""

import functools
import itertools
import math

import jax
import numpy as np
import pytest
import test_pipeline_1f1b as toy
from pipeline_timetables import walk

from shardlib import ShardingError, mesh_spec
from shardlib.core.layout import use_layout
from shardlib.core.mesh import single_device_mesh
from shardlib.dataset.tokens import global_batch, load_tokens
from shardlib.parallel.pipeline.chimera import chimera_value_and_grad
from shardlib.parallel.pipeline.chimera_timetable import DOWN, UP, ChimeraSchedule
from shardlib.parallel.pipeline.spec import PipelineSpec
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


def _simulate(p, m):
    """{(kind, micro, device): (trip, slot, direction)} from ``ChimeraSchedule``."""
    sched = ChimeraSchedule(p, m)

    def item(kind, it, t, s):
        return (kind, int(it.micro[s]), s), (t, int(it.slot[s]), int(it.direction[s]))

    return sched, walk(sched, p, item)


@pytest.mark.parametrize("p,m", [(2, 2), (2, 6), (4, 4), (4, 8), (6, 4), (8, 16)])
def test_chimera_timetable_meets_every_dependency(p, m):
    """Each micro-batch runs forward and backward once on every device, in its direction
    (first half down: stage s on device s; second half up: stage s on device p-1-s); a
    forward follows its previous stage's by one trip, a backward its next stage's; the
    last stage turns around in one trip, in a head trip; saved slots live < 2p - 1 trips;
    each device executes m + p - 2 forwards (and backwards) for m useful ones; in every
    trip a device's forward and backward run the same chunk (the one it reads weights of)."""
    sched, when = _simulate(p, m)
    assert len(when) == 2 * m * p
    assert sched.trips == m + 2 * p - 3 and sched.executed == m + p - 2
    for i, stage in itertools.product(range(m), range(p)):
        up = i >= m // 2
        device = p - 1 - stage if up else stage
        t_f, slot_f, d_f = when["f", i, device]
        t_b, slot_b, d_b = when["b", i, device]
        assert d_f == d_b == (UP if up else DOWN)
        assert slot_f == slot_b and 0 <= t_b - t_f < sched.ring_slots
        prev = device + (1 if up else -1)  # the previous stage's device
        if stage:
            assert when["f", i, prev][0] == t_f - 1
            assert when["b", i, prev][0] == t_b + 1
        if stage == p - 1:
            assert t_b == t_f and sched.heads(t_f)
    for t in range(sched.trips):
        d = sched.direction(t, np)
        assert (sched.forward(t, np).direction == d).all(), t
        assert (sched.backward(t, np).direction == d).all(), t
    heads = {when["f", i, p - 1 if i < m // 2 else 0][0] for i in range(m)}
    assert {t for t in range(sched.trips) if sched.heads(t)} == heads


def test_chimera_refuses_what_it_cannot_pair():
    PipelineSpec(4, 4, 1, "chimera").check(layers=8, batch=8)
    with pytest.raises(ShardingError, match="virtual_stages=1"):
        PipelineSpec(4, 4, 2, "chimera").check(layers=8, batch=8)
    with pytest.raises(ShardingError, match="stage count is even"):
        PipelineSpec(3, 4, 1, "chimera").check(layers=6, batch=8)
    with pytest.raises(ShardingError, match="pipeline_microbatches=4"):
        PipelineSpec(4, 3, 1, "chimera").check(layers=8, batch=6)


@pytest.mark.slow
def test_chimera_bubble_from_flops_and_no_chunk_copies():
    """FLOPs of all p = 4 stages over one device's = (m + p - 2)/m within 2% for m = p, 2p.

    The paper's (D-2)/(2N+D-2) counts single forward or backward units a device may run in
    any order; a lockstep trip runs its forward and backward bodies on every device, so the
    warm-up's idle backward slots and the cool-down's idle forward slots stay empty: the
    executed-over-useful ratio is 1 + (p-2)/m here, 1 + (p-2)/(2m) in the paper's count
    (1F1B: 1 + (p-1)/m). Printed side by side.

    Memory, in W = the blocks' fp32 bytes (all p stages: no mesh): beside the ring of
    (2p - 1) x L saved layer inputs the step keeps the up stages' weights (1 W) and the two
    accumulators (2 W), no copy of the chunk a trip runs (picking it whole from a [p, 2, k]
    stack kept 6.9 W)."""
    p = 4
    w_bytes = 2 * toy.LAYERS * toy.D * toy.D * 4  # the blocks' up and down, fp32
    ring = (2 * p - 1) * toy.LAYERS * toy.B * toy.SEQ * toy.D * 4
    for m in (p, 2 * p):
        ideal = toy._flops(toy._one_device(m))
        vg = chimera_value_and_grad(
            PipelineSpec(p, m, 1, "chimera"),
            block_fn=toy._block,
            embed=toy._embed,
            head_loss=toy._head_loss,
        )
        exe = jax.jit(vg).lower(*toy._abstract(m)).compile()
        ratio = toy._flops(exe) / ideal
        ours, paper = 1 + (p - 2) / m, 1 + (p - 2) / (2 * m)
        kept = (exe.memory_analysis().temp_size_in_bytes - ring) / w_bytes
        print(f"p={p} m={m}: measured {ratio:.4f}, pair-trip form {ours:.4f}, paper {paper:.4f};"
              f" kept beside the ring {kept:.2f} W")  # fmt: skip
        assert abs(ratio / ours - 1) <= 0.02, (m, ratio, ours)
        assert PipelineSpec(p, m, 1, "chimera").bubble_ratio() == ours
        assert kept <= 3.25, kept  # up weights 1 + accumulators 2; a chunk copy adds 1


PARITY = dict(steps=1, batch=8, seq=16, pipeline_schedule="chimera", **{"model.layers": 4})


def _loss_and_grads(cfg, mesh, params):
    """The trainer's gradient path (the pipeline's own) on ``mesh``: (loss, grads) on host."""
    setup = make_setup(cfg, mesh)
    grad_fn = grad_function(setup, make_loss_fn(setup))

    def value_and_grad(params, tokens):
        with use_layout(setup.mesh, setup.rules):
            return grad_fn(params, tokens)

    tokens = global_batch(load_tokens(None), 0, 8, 16, cfg.run.seed, setup.batch_sharding)
    params = jax.device_put(params, setup.param_shardings)
    jitted = jax.jit(value_and_grad, in_shardings=(setup.param_shardings, setup.batch_sharding))
    return jax.device_get(jitted(params, tokens))


@functools.cache
def _reference(m):
    """Random parameters and one device's (loss, grads) at them (shared by the cases)."""
    cfg, one = train_config(**PARITY, pipeline_microbatches=m), single_device_mesh()
    params = parity.random_state(make_setup(cfg, one))["params"]
    return params, _loss_and_grads(cfg, one, params)


@pytest.mark.slow
@pytest.mark.parametrize(
    "axes,m", [({"stage": 2, "data": 2, "tensor": 2}, 4), ({"stage": 4, "data": 2}, 4)]
)
def test_chimera_gradients_like_one_device(axes, m):
    """Loss and every parameter's gradient within 1e-5 (fp32) of one device's, on stage x
    data (x tensor) with m micro-batches (m/2 each way)."""
    cfg = train_config(**PARITY, pipeline_microbatches=m)
    mesh = mesh_spec(**axes).build(jax.devices()[: math.prod(axes.values())])
    params, ref = _reference(m)
    got = _loss_and_grads(cfg, mesh, params)
    assert abs(got[0] - ref[0]) <= FP32_TOLERANCE * abs(ref[0]), (got[0], ref[0])
    errs = jax.tree.map(lambda a, b: np.linalg.norm(a - b) / np.linalg.norm(b), got[1], ref[1])
    assert max(jax.tree.leaves(errs)) <= FP32_TOLERANCE, errs


# --- the planner's term (``planner/cost/terms/chimera.py``) ------------------------------------
def _estimates(**axes):
    workload = Workload.from_preset("llama-tiny", 16, 128, "fp32", layers=8)
    return {
        s: estimate(workload, candidate(**axes, schedule=s), backend="cpu")
        for s in ("1f1b", "chimera")
    }


def test_planner_books_doubled_weights_bubble_and_stage_bytes():
    """Against 1F1B on the same plan: 1 W more memory (the up stages' weights and the second
    accumulator, less 1F1B's per-trip chunk copy), both booking two fp32 logits-sized buffers
    of the loss head fewer (per-stage targets: the one-hot in place), the bubble (p-2)/m instead
    of (p-1)/m, and two flips of W plus a second hand-over per executed chunk over
    ``stage``; the CLI takes ``schedule=chimera``."""
    est = _estimates(stage=4, tensor=2, microbatches=4)
    f1, ch = est["1f1b"], est["chimera"]
    weights = ch.memory["up stage weights"]
    per_layer = 73856 * 4 / 2  # llama-tiny's block, fp32, split over tensor 2
    assert weights == pytest.approx(2 * per_layer, rel=0.01)  # 1 W, 2 layers a stage
    logits = 16 // 4 * 128 * 256 // 2 * 4  # one micro-batch's fp32 logits, vocab / tensor 2
    head = "head buffers spared (per-stage targets)"
    assert ch.memory[head] == f1.memory[head] == -2 * logits
    assert ch.memory_bytes - f1.memory_bytes == pytest.approx(weights)
    assert bubble_fraction("chimera", 4, 4, 1) == (4 - 2) / 4  # 1F1B: (4 - 1) / 4
    assert ch.flops < f1.flops  # one executed chunk (fwd, recompute, bwd) less per device
    extra = {c.what: c.wire_bytes for c in ch.comms if c.strategy == "chimera"}
    assert extra["doubled weights"] == extra["replica gradients"] == pytest.approx(weights)
    assert parse_settings(["stage=4,schedule=chimera"], "--set")["schedule"] == "chimera"


@pytest.mark.slow
def test_planner_memory_and_stage_bytes_like_the_compiled_step():
    """Held-out plan (stage 4 x data 2, m = 8): memory within 10% and the ``stage`` axis's
    bytes within 5% of the compiled train step's (``planner.validate``)."""
    workload = Workload.from_preset("llama-tiny", 32, 128, "fp32", layers=16)
    c = validate(workload, candidate(stage=4, data=2, microbatches=8, schedule="chimera"))
    assert abs(c.memory_ratio - 1) <= 0.10, (c.predicted_memory, c.compiled_memory)
    stage = (c.predicted_wire_by_axes["stage"], c.compiled_wire_by_axes["stage"])
    assert abs(stage[0] / stage[1] - 1) <= 0.05, stage
