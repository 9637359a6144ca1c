"""The 1cycle policy and the range test give DeepSpeed's rate (and beta1) at every step.

The reference below re-derives DeepSpeed's OneCycle and LRRangeTest as a DeepSpeed engine
drives them: the optimizer starts at ``cycle_min_lr`` / ``cycle_min_mom``, and after each
step ``step()`` sets the next rate from ``last_batch_iteration`` (``deepspeed/runtime/
lr_schedules.py``: the scale factor reads ``last_batch_iteration + 1``; the decay starts at
``last_batch_iteration - total_size + 1``).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from shardlib.core.errors import ShardingError
from shardlib.interop.deepspeed import from_deepspeed
from shardlib.train import cycles
from shardlib.train.config import Optimizer, override, train_config
from shardlib.train.optim import build_optimizer, check_optimizer, schedule


def deepspeed_one_cycle(steps, lo, hi, up, down, decay_every, decay_rate, mom_lo, mom_hi, mom_rate):
    """(lr, beta1) used by each of ``steps`` optimizer steps under DeepSpeed's OneCycle."""
    total, ratio = float(up + down), up / float(up + down)
    lr, mom, out = lo, mom_lo, []
    for last in range(steps):
        out.append((lr, mom))  # this step's values; then the scheduler steps
        b = last + 1
        x = 1.0 + b / total - math.floor(1 + b / total)
        scale = x / ratio if x <= ratio else (x - 1) / (ratio - 1)
        if last < total:
            lr, mom = lo + (hi - lo) * scale, mom_hi - (mom_hi - mom_lo) * scale
        else:
            k = (last - total + 1) / decay_every if decay_every else 0.0
            lr = lo if not (decay_every and decay_rate) else lo / (1 + decay_rate * k)
            mom = mom_hi if not (decay_every and mom_rate) else mom_hi * (1 + mom_rate * k)
    return out


@pytest.mark.parametrize("down, every, rate, mom_rate", [(3, 2, 0.5, 0.01), (0, 0, 0.0, 0.0)])
def test_one_cycle_rate_and_beta1_are_deepspeeds_at_every_step(down, every, rate, mom_rate):
    cfg = Optimizer(
        lr=0.015, min_lr_ratio=0.004 / 0.015, schedule="one_cycle", warmup=5,
        cycle_down_steps=down, interval_steps=every, interval_rate=rate, b1=0.9, b1_min=0.8,
        b1_decay_rate=mom_rate,
    )  # fmt: skip
    want = deepspeed_one_cycle(20, 0.004, 0.015, 5, down or 5, every, rate, 0.8, 0.9, mom_rate)
    lr, b1 = cycles.one_cycle(cfg), cycles.one_cycle_b1(cfg)
    got = [(float(lr(c)), float(b1(c))) for c in range(20)]
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert max(g[0] for g in got) == pytest.approx(0.015)  # the peak is reached


def test_range_test_grows_as_deepspeeds():
    for staircase in (False, True):
        cfg = Optimizer(lr=1e-3, schedule="range_test", interval_steps=4, interval_rate=2.0,
                        staircase=staircase)  # fmt: skip
        fn = math.floor if staircase else float
        want = [1e-3 * (1 + 2.0 * fn(c / 4)) for c in range(12)]  # c = last_batch_iteration + 1
        got = [float(schedule(cfg, 100)(c)) for c in range(12)]
        np.testing.assert_allclose(got, want, rtol=1e-6)


def test_a_cycled_beta1_is_the_one_adam_uses():
    """One Adam step per beta1 value, against optax.adam with that beta1 fixed (the update
    of step c depends on b1 at step c; bias correction uses it too, as PyTorch's does)."""
    cfg = Optimizer(name="adam", lr=0.01, schedule="one_cycle", warmup=2, b1=0.95, b1_min=0.85,
                    clip_norm=0.0, b2=0.99)  # fmt: skip
    tx = build_optimizer(cfg, 10)
    params = {"w": jnp.ones(3)}
    grads = [{"w": jnp.array([0.1, -0.2, 0.3]) * (i + 1)} for i in range(4)]
    state, p = tx.init(params), params
    b1s = [float(cycles.one_cycle_b1(cfg)(c)) for c in range(4)]
    lrs = [float(cycles.one_cycle(cfg)(c)) for c in range(4)]
    mu = nu = jnp.zeros(3)
    for c, g in enumerate(grads):
        u, state = tx.update(g, state, p)
        p = optax.apply_updates(p, u)
        mu = b1s[c] * mu + (1 - b1s[c]) * g["w"]
        nu = 0.99 * nu + 0.01 * g["w"] ** 2
        step = (
            -lrs[c] * (mu / (1 - b1s[c] ** (c + 1))) / (jnp.sqrt(nu / (1 - 0.99 ** (c + 1))) + 1e-8)
        )
        np.testing.assert_allclose(u["w"], step, rtol=1e-5)
    assert b1s[0] == pytest.approx(0.85) and b1s[1] != b1s[2]


def test_cycle_settings_are_checked_with_the_fix():
    for bad in (
        {"schedule": "range_test"},  # no interval
        {"schedule": "one_cycle", "warmup": 0},
        {"b1_min": 0.8},  # without one_cycle
        {"schedule": "one_cycle", "b1_min": 0.8, "name": "lamb"},
        {"schedule": "one_cycle", "b1_min": 0.95, "b1": 0.9},
    ):
        with pytest.raises(ShardingError, match="Fix: e.g. schedule=one_cycle"):
            check_optimizer(Optimizer(**bad))


QANET_LIKE = {
    "train_batch_size": 8,
    "train_micro_batch_size_per_gpu": 1,
    "optimizer": {"type": "Adam", "params": {"lr": 0.001, "weight_decay": 3e-7}},
    "scheduler": {
        "type": "OneCycle",
        "params": {
            "cycle_min_lr": 0.004, "cycle_max_lr": 0.015, "cycle_first_step_size": 1000,
            "cycle_second_step_size": 100, "cycle_first_stair_count": 100,
            "decay_step_size": 1000, "decay_lr_rate": 0.01,
        },
    },
}  # fmt: skip


def test_deepspeed_one_cycle_and_range_test_map_to_the_schedules():
    plan = from_deepspeed(QANET_LIKE, 8)
    s = plan.settings
    assert s["optimizer.schedule"] == "one_cycle" and s["optimizer.lr"] == 0.015
    assert s["optimizer.warmup"] == 1000 and s["optimizer.cycle_down_steps"] == 100
    assert (s["optimizer.b1"], s["optimizer.b1_min"], s["optimizer.b2"]) == (0.9, 0.8, 0.99)
    assert any("stair_count" in n for n in plan.notes)
    cfg = override(train_config(), s)  # a valid config: the checks pass
    assert cfg.optimizer.schedule == "one_cycle"
    lamb = {**QANET_LIKE, "optimizer": {"type": "Lamb", "params": {"lr": 0.001}}}
    with pytest.raises(Exception, match="cycle_momentum"):
        from_deepspeed(lamb, 8)
    rt = {**QANET_LIKE, "scheduler": {"type": "LRRangeTest", "params": {
        "lr_range_test_min_lr": 1e-4, "lr_range_test_step_size": 50,
        "lr_range_test_step_rate": 5, "lr_range_test_staircase": True}}}  # fmt: skip
    s = from_deepspeed(rt, 8).settings
    assert (s["optimizer.schedule"], s["optimizer.lr"], s["optimizer.interval_steps"]) == (
        "range_test",
        1e-4,
        50,
    )
    assert s["optimizer.staircase"] is True and s["optimizer.interval_rate"] == 5


def test_schedules_jit():
    cfg = Optimizer(lr=0.01, schedule="one_cycle", warmup=3, b1_min=0.8)
    assert jax.jit(cycles.one_cycle(cfg))(jnp.int32(4)).dtype == jnp.float32
