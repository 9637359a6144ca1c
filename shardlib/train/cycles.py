"""Cyclical schedules: the 1cycle policy and the learning-rate range test (Smith 2018, "A
disciplined approach to neural network hyper-parameters"), as DeepSpeed runs them.

optax has the pieces of a schedule but not these two shapes as DeepSpeed defines them (a
triangle of ``warmup`` + ``cycle_down_steps`` steps, then ``lr_min / (1 + rate·interval)``;
a range test growing by ``1 + rate·interval``), and a DeepSpeed user expects their run to
follow the same rates. Each function returns an optax schedule (count -> value); the
optimizer steps with it as with any other (``train.optim.schedule``), and with a cycled
``b1`` through ``optax.inject_hyperparams``.

Step numbering: optax's count c is the update being made (0 first). DeepSpeed sets the
rate after each step from ``last_batch_iteration`` = c - 1, and its triangle reads
``last_batch_iteration + 1`` = c, so the values below are DeepSpeed's at every step; before
its first ``step()`` DeepSpeed leaves the optimizer at ``cycle_min_lr`` and
``cycle_min_mom``, which is what c = 0 gives here.
"""

from __future__ import annotations

import jax.numpy as jnp
import optax


def _triangle(c, up: int, down: int):
    """0 -> 1 over ``up`` steps, back to 0 over ``down``: DeepSpeed's scale factor."""
    total = float(up + down)
    ratio = up / total
    b = c.astype(jnp.float32) / total
    x = 1.0 + b - jnp.floor(1.0 + b)
    return jnp.where(x <= ratio, x / ratio, (x - 1.0) / (ratio - 1.0))


def _after(c, up: int, down: int, every: int):
    """Intervals of ``every`` steps since the triangle ended (0 while it runs)."""
    if not every:
        return jnp.zeros((), jnp.float32)
    return jnp.maximum(c.astype(jnp.float32) - (up + down), 0.0) / every


def one_cycle(cfg) -> optax.Schedule:
    """``lr·min_lr_ratio`` up to ``lr`` over ``warmup`` steps, back down over
    ``cycle_down_steps`` (0: as many), then ``lr_min / (1 + interval_rate·k)`` after k
    intervals of ``interval_steps`` (no decay when either is 0)."""
    up, down = cfg.warmup, cfg.cycle_down_steps or cfg.warmup
    hi, lo = cfg.lr, cfg.lr * cfg.min_lr_ratio
    rate = cfg.interval_rate if cfg.interval_steps else 0.0

    def lr(count):
        c = jnp.asarray(count)
        in_cycle = c - 1 < up + down
        cycle = lo + (hi - lo) * _triangle(c, up, down)
        decayed = lo / (1.0 + rate * _after(c, up, down, cfg.interval_steps))
        return jnp.where(in_cycle, cycle, decayed)

    return lr


def one_cycle_b1(cfg) -> optax.Schedule:
    """Adam's beta1 cycled against the rate: ``b1`` down to ``b1_min`` and back, then
    ``b1·(1 + b1_decay_rate·k)`` (DeepSpeed's ``cycle_momentum``); ``b1_min`` before the
    first step, as DeepSpeed leaves it."""
    up, down = cfg.warmup, cfg.cycle_down_steps or cfg.warmup
    hi, lo = cfg.b1, cfg.b1_min
    rate = cfg.b1_decay_rate if cfg.interval_steps else 0.0

    def b1(count):
        c = jnp.asarray(count)
        cycle = hi - (hi - lo) * _triangle(c, up, down)
        after = hi * (1.0 + rate * _after(c, up, down, cfg.interval_steps))
        return jnp.where(c == 0, lo, jnp.where(c - 1 < up + down, cycle, after))

    return b1


def range_test(cfg) -> optax.Schedule:
    """``lr·(1 + interval_rate·c/interval_steps)``, in steps of whole intervals with
    ``staircase``: the rate grows until the loss says where it is too high."""

    def lr(count):
        k = jnp.asarray(count).astype(jnp.float32) / cfg.interval_steps
        return cfg.lr * (1.0 + cfg.interval_rate * (jnp.floor(k) if cfg.staircase else k))

    return lr
