"""PipeDream-2BW (``pipeline_schedule=2bw``): its update rule, state, checkpoint, refusals,
and the no-flush loop (``pipeline/two_bw_loop.py``) on 1F1B's toy decoder.

The trainer's 2bw run on stage 2 x data 2 is compared with a hand-written one-device loop
that applies the paper's rule W(t+1) = W(t) - lr·∇f(W(t-1)) with ``optax.sgd`` (and with a
loop that applies the fresh rule, which it must not match), one step behind: the trainer's
step 0 only fills the pipeline. The same run saves a checkpoint halfway; restored, it
continues to the same losses, weights (both versions) and in-flight work, bit for bit.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import test_pipeline_1f1b as toy

from shardlib import ShardingError, mesh_spec
from shardlib.checkpoint.store import restore
from shardlib.core.layout import use_layout
from shardlib.core.mesh import single_device_mesh
from shardlib.dataset.tokens import global_batch, load_tokens
from shardlib.parallel.pipeline.gpipe import PipelineParallel
from shardlib.parallel.pipeline.one_f_one_b import one_f_one_b_value_and_grad
from shardlib.parallel.pipeline.spec import PipelineSpec
from shardlib.parallel.pipeline.two_bw import CARRY, PREV_PARAMS
from shardlib.parallel.pipeline.two_bw_loop import two_bw_loop
from shardlib.planner import Workload, candidate
from shardlib.planner.cost.terms.pipeline_loop import bubble_fraction
from shardlib.planner.cost.total import estimate
from shardlib.tools.parity import FP32_TOLERANCE, random_state
from shardlib.tools.plan_cli import parse_settings
from shardlib.train.config import override, train_config
from shardlib.train.loop import run
from shardlib.train.setup import make_setup
from shardlib.train.step import grad_function, make_loss_fn

LR, STEPS, HALF = 0.5, 4, 2
CFG = train_config(
    steps=STEPS,
    batch=8,
    seq=16,
    pipeline_schedule="2bw",
    pipeline_microbatches=2,
    **{
        "model.layers": 2,
        "optimizer.name": "sgd",
        "optimizer.momentum": 0.0,
        "optimizer.weight_decay": 0.0,
        "optimizer.clip_norm": 0.0,
        "optimizer.schedule": "constant",
        "optimizer.warmup": 0,
        "optimizer.lr": LR,
    },
)


def _rel(a, b) -> float:
    errs = jax.tree.map(lambda x, y: np.linalg.norm(x - y) / np.linalg.norm(y), a, b)
    return float(max(jax.tree.leaves(errs)))


@functools.cache
def _one_device():
    """One device's jitted (loss, grads) of a batch and its batch layout (compiled once)."""
    one = make_setup(CFG, single_device_mesh())
    assert not one.stale_weights  # no stage axis: the plain gradient
    grad_fn = grad_function(one, make_loss_fn(one))

    def value_and_grad(params, tokens):
        with use_layout(one.mesh, one.rules):
            return grad_fn(params, tokens)

    return jax.jit(value_and_grad), one.batch_sharding


def _reference(state, *, stale: bool, steps: int = STEPS - 1):
    """One device, by hand: (losses, final W) of ``steps`` steps of optax.sgd with the
    gradient at W(t-1) (``stale``) or at W(t)."""
    value_and_grad, sharding = _one_device()
    tx = optax.sgd(LR)
    prev = cur = state["params"]
    opt, losses = tx.init(cur), []
    for t in range(steps):
        tokens = global_batch(load_tokens(None), t, 8, 16, CFG.run.seed, sharding)
        loss, grads = value_and_grad(prev if stale else cur, tokens)
        updates, opt = tx.update(grads, opt, cur)
        prev, cur = cur, optax.apply_updates(cur, updates)
        losses.append(float(loss))
    return losses, jax.device_get(cur)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The 2bw run on stage 2 x data 2 (a checkpoint at step ``HALF``) and its setup."""
    ckpt = tmp_path_factory.mktemp("two_bw") / "run"
    cfg = override(CFG, {"checkpoint_dir": str(ckpt), "checkpoint_every": HALF})
    setup = make_setup(cfg, mesh_spec(stage=2, data=2).build(jax.devices()[:4]))
    state = random_state(setup)
    start = jax.device_put(setup.stored(state), setup.state_shardings)
    whole = run(setup, state=start, show=False)
    return setup, state, whole, ckpt


def test_2bw_spellings_and_refusals():
    """PipeDream-Flush is 1F1B; 2bw keeps one chunk per device and its state in the step."""
    assert PipelineParallel(schedule="pipedream-flush").schedule == "1f1b"
    assert PipelineParallel(schedule="pipedream-2bw").schedule == "2bw"
    spec = PipelineSpec(4, 6, 1, "2bw")
    spec.check(layers=4, batch=12)
    assert spec.bubble_ratio() == 1.0 and spec.iterations() == 6  # no flush
    with pytest.raises(ShardingError, match="virtual_stages=1"):
        PipelineSpec(2, 4, 2, "2bw").check(layers=4, batch=8)
    with pytest.raises(ShardingError, match="pipeline_microbatches=6 or more"):
        PipelineSpec(4, 4, 1, "2bw").check(layers=4, batch=8)
    mesh = mesh_spec(stage=2).build(jax.devices()[:2])
    with pytest.raises(ShardingError, match="offload.optimizer=false"):
        make_setup(override(CFG, {"parallel.offload.optimizer": True}), mesh)


@pytest.mark.slow
def test_2bw_trains_like_the_stale_rule_on_one_device(runs):
    """Step 0 only fills the pipeline (loss NaN, no update); step t >= 1 reports batch t-1's
    loss f(W(t-2)) and applies its gradient: the losses and the final W within 1e-5 (fp32)
    of the one-device stale loop one step behind; the fresh rule's W is far from it."""
    setup, state, whole, _ = runs
    assert setup.stale_weights and {PREV_PARAMS, CARRY} <= set(whole.state)
    assert np.isnan(whole.losses[0])
    losses, final = _reference(state, stale=True)
    got = jax.device_get(setup.natural(whole.state["params"]))
    np.testing.assert_allclose(whole.losses[1:], losses, rtol=FP32_TOLERANCE)
    assert _rel(got, final) <= FP32_TOLERANCE
    fresh_losses, fresh = _reference(state, stale=False)
    assert _rel(got, fresh) > 100 * FP32_TOLERANCE
    assert whole.losses[1] == pytest.approx(fresh_losses[0], rel=FP32_TOLERANCE)  # W(-1) = W(0)


@pytest.mark.slow
def test_2bw_with_tensor_beside_stage_and_data():
    """The same on stage 2 x data 2 x tensor 2: losses and final W within 1e-5 of the
    one-device stale loop, one step behind."""
    setup = make_setup(CFG, mesh_spec(stage=2, data=2, tensor=2).build(jax.devices()[:8]))
    state = random_state(setup)
    start = jax.device_put(setup.stored(state), setup.state_shardings)
    result = run(setup, state=start, show=False)
    losses, final = _reference(state, stale=True)
    np.testing.assert_allclose(result.losses[1:], losses, rtol=FP32_TOLERANCE)
    assert _rel(jax.device_get(setup.natural(result.state["params"])), final) <= FP32_TOLERANCE


@pytest.mark.slow
def test_2bw_resumes_exactly_from_a_checkpoint(runs):
    """Restored at step ``HALF`` (both weight versions and the in-flight pipeline work from
    the checkpoint), the run goes on to the uninterrupted run's losses and state, bit for
    bit."""
    setup, _, whole, ckpt = runs
    restored = restore(ckpt, setup, step=HALF)
    assert set(restored.state) >= {"params", PREV_PARAMS, CARRY}
    continued = run(setup, state=restored.state, show=False)
    assert continued.losses == whole.losses[HALF:]
    for key in ("params", PREV_PARAMS, CARRY):
        for a, b in zip(
            jax.tree.leaves(continued.state[key]), jax.tree.leaves(whole.state[key]), strict=True
        ):
            assert np.array_equal(np.asarray(a), np.asarray(b)), key


def test_planner_books_two_weight_sets_and_no_bubble():
    """Against 1F1B on the same plan: 2 x the held fp32 parameters more in the state (W(t-1)
    and the carried gradient sums) and 3 x in the first 2p-2 trips' picks
    (``terms/two_bw.py``), the carried ring not booked twice; fewer FLOPs (no bubble); the
    CLI takes ``schedule=2bw``."""
    workload = Workload.from_preset("llama-tiny", 16, 128, "fp32", layers=8)
    f1, bw = (
        estimate(workload, candidate(stage=2, data=2, microbatches=4, schedule=s), backend="cpu")
        for s in ("1f1b", "2bw")
    )
    stale = bw.memory["2bw stale weights and carried gradients"]
    assert stale == pytest.approx(2 * bw.memory["params"])
    picks = bw.memory["2bw first trips' weight and accumulator picks"]
    assert picks == pytest.approx(3 * bw.memory["params"])
    assert bw.memory["pipeline buffers"] == f1.memory["pipeline buffers"]  # the ring, once
    assert bw.memory_bytes - f1.memory_bytes == pytest.approx(stale + picks)
    assert bw.flops < f1.flops and bubble_fraction("2bw", 2, 4, 1) == 0.0  # no flush
    assert parse_settings(["stage=2,schedule=2bw"], "--set")["schedule"] == "2bw"


# --- the no-flush loop (``pipeline/two_bw_loop.py``) on the toy decoder of test_pipeline_1f1b --
@pytest.mark.slow
def test_no_flush_loop_gradients_and_bubble():
    """p = 2, m = 4, three chained calls on three different weight sets: call k returns
    batch k-1's loss and gradients at W(k-1), equal to 1F1B's on that batch at those
    weights (fp32, 1e-5), and differing where the previous weights are not passed. The
    compiled call executes m chunks per device where 1F1B executes m+p-1: its FLOPs over
    1F1B's are m/(m+p-1) within 2% (the paper's 2BW has no flush bubble)."""
    p, m = toy.P, 4
    parts = dict(block_fn=toy._block, embed=toy._embed, head_loss=toy._head_loss)
    rest, blocks, tokens = toy._abstract(m)
    init, step = two_bw_loop(PipelineSpec(p, m, 1, "2bw"), **parts)
    carry = jax.eval_shape(init, rest, blocks, tokens)
    exe = jax.jit(step).lower(rest, blocks, rest, blocks, carry, tokens).compile()
    vg = one_f_one_b_value_and_grad(PipelineSpec(p, m, 1, "1f1b"), **parts)
    reference = jax.jit(vg).lower(rest, blocks, tokens).compile()
    ratio, formula = toy._flops(exe) / toy._flops(reference), m / (m + p - 1)
    print(f"p={p} m={m}: 2bw loop / 1F1B FLOPs {ratio:.4f}, m/(m+p-1) = {formula:.4f}")
    assert abs(ratio / formula - 1) <= 0.02, (ratio, formula)

    rng = np.random.default_rng(0)
    draw = lambda a: jnp.asarray(rng.normal(0, 0.1, a.shape), a.dtype)  # noqa: E731
    weights = [jax.tree.map(draw, (rest, blocks)) for _ in range(3)]
    batches = [jnp.asarray(rng.integers(0, toy.VOCAB, tokens.shape), jnp.int32) for _ in range(3)]
    carry = init(*weights[0], batches[0])
    _, _, _, carry = exe(*weights[0], *weights[0], carry, batches[0])  # an empty pipeline's
    for k in (1, 2):
        got = exe(*weights[k], *weights[k - 1], carry, batches[k])
        want = reference(*weights[k - 1], batches[k - 1])
        assert _rel(got[:3], want) <= FP32_TOLERANCE
        fresh = exe(*weights[k], *weights[k], carry, batches[k])  # no stale weights
        assert _rel(fresh[1:3], want[1:]) > 100 * FP32_TOLERANCE
        carry = got[3]
