"""Mixed precision: compute dtypes and fp16 loss scaling (dynamic or static), DeepSpeed's way.

bf16 and fp16 compute with fp32 master weights (the loss function casts a copy of the
parameters each step). fp16's narrow exponent underflows small gradients, so the loss is
multiplied by a scale before the backward pass and the gradients divided by it after
(Micikevicius et al. 2018). DeepSpeed's dynamic scaler, reproduced here:

* start at ``2**initial_scale_power``;
* a step whose gradients are not finite is skipped: parameters, optimizer state and the
  optimizer's step counter stay exactly as they were;
* each overflow spends one unit of ``hysteresis``; an overflow with none left halves the
  scale (not below ``min_loss_scale``); an overflow at the minimum scale is an error
  (``LossScaleError``, raised by the training loop on the host);
* after ``loss_scale_window`` consecutive clean steps the scale doubles and the hysteresis
  is restored.

A positive ``loss_scale`` is DeepSpeed's static scale instead: every step scales by it, it
never changes, and a step whose gradients are not finite is still skipped (as DeepSpeed's
ZeRO optimizers do); the minimum-scale error cannot arise.

The scaler's state is part of the train state, so checkpoints keep it.

fp8: bf16 compute whose block projections run in FP8 with delayed scaling (``train/fp8.py``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from shardlib.core.errors import ShardingError

# precision -> compute dtype (fp8: bf16 everywhere but the FP8 projections, ``train/fp8.py``)
DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16, "fp16": jnp.float16, "fp8": jnp.bfloat16}


class LossScaleError(ShardingError):
    """fp16 training overflowed at the minimum loss scale: it cannot make progress."""


def check_precision(cfg) -> None:
    """Unknown dtypes and out-of-range loss-scaling settings fail when the config is made."""
    if cfg.compute not in DTYPES:
        raise ShardingError(f"config: precision={cfg.compute!r}; use fp32, bf16, fp16 or fp8.")
    if cfg.fp8_amax_history < 1:
        raise ShardingError(
            f"config: fp8_amax_history={cfg.fp8_amax_history} must be >= 1. Fix: 1024 "
            "(Transformer Engine's and MaxText's default)."
        )
    if cfg.initial_scale_power < 0 or cfg.loss_scale_window < 1 or cfg.hysteresis < 1:
        raise ShardingError(
            "config: loss-scaling settings out of range; need initial_scale_power >= 0, "
            "loss_scale_window >= 1, hysteresis >= 1."
        )
    if cfg.loss_scale < 0:
        raise ShardingError(
            f"config: loss_scale={cfg.loss_scale} must be >= 0. Fix: 0 (dynamic scaling) or "
            "a static scale such as 1024."
        )
    if cfg.min_loss_scale <= 0 or cfg.min_loss_scale > 2.0**cfg.initial_scale_power:
        raise ShardingError(
            f"config: min_loss_scale={cfg.min_loss_scale} must be > 0 and <= the initial scale "
            f"2**{cfg.initial_scale_power}."
        )


def compute_dtype(cfg):
    return DTYPES[cfg.compute]


def uses_loss_scale(cfg) -> bool:
    return cfg.compute == "fp16"


def init_loss_scale(cfg) -> dict:
    """The scaler's state: scalars, replicated on every device."""
    start = cfg.loss_scale or 2.0**cfg.initial_scale_power
    return {
        "scale": jnp.asarray(start, jnp.float32),
        "good_steps": jnp.zeros((), jnp.int32),  # clean steps since the last change/overflow
        "hysteresis": jnp.asarray(cfg.hysteresis, jnp.int32),  # overflows left before halving
        "skipped": jnp.zeros((), jnp.int32),  # skipped steps so far (a metric)
        "exhausted": jnp.zeros((), jnp.bool_),  # overflowed at the minimum scale
    }


def abstract_loss_scale(cfg) -> dict:
    return jax.eval_shape(lambda: init_loss_scale(cfg))


def all_finite(tree) -> jax.Array:
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


def update_loss_scale(cfg, ls: dict, finite: jax.Array) -> dict:
    """The scaler after one step whose gradients were (not) finite."""
    scale, good, hyst = ls["scale"], ls["good_steps"], ls["hysteresis"]
    if cfg.loss_scale:  # static: the scale stays; only the counts move
        return {
            **ls,
            "good_steps": jnp.where(finite, good + 1, 0),
            "skipped": ls["skipped"] + jnp.where(finite, 0, 1),
        }
    min_scale = jnp.float32(cfg.min_loss_scale)
    # overflow: spend hysteresis, or halve once none is left
    halve = jnp.logical_and(~finite, hyst <= 1)
    exhausted = jnp.logical_and(halve, scale <= min_scale)
    over_scale = jnp.where(halve, jnp.maximum(scale / 2, min_scale), scale)
    over_hyst = jnp.where(halve, hyst, hyst - 1)
    # clean: count, and double after a full window (restoring the hysteresis)
    good_next = good + 1
    double = good_next >= cfg.loss_scale_window
    clean_scale = jnp.where(double, scale * 2, scale)
    clean_hyst = jnp.where(double, jnp.int32(cfg.hysteresis), hyst)
    return {
        "scale": jnp.where(finite, clean_scale, over_scale),
        "good_steps": jnp.where(finite, jnp.where(double, 0, good_next), 0),
        "hysteresis": jnp.where(finite, clean_hyst, over_hyst),
        "skipped": ls["skipped"] + jnp.where(finite, 0, 1),
        "exhausted": jnp.logical_or(ls["exhausted"], exhausted),
    }


def keep_if(finite: jax.Array, new, old):
    """``new`` where the step was finite, else ``old``, leaf by leaf (a skipped step)."""
    return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)


def metrics(ls: dict, finite: jax.Array) -> dict:
    """What the loop records per step: the scale after the step, the skip counts."""
    return {
        "loss_scale": ls["scale"],
        "skipped_steps": ls["skipped"],
        "overflow": jnp.logical_not(finite).astype(jnp.int32),
        "loss_scale_exhausted": ls["exhausted"].astype(jnp.int32),
    }


def check_record(record: dict, cfg) -> None:
    """Raise on the host when the step overflowed at the minimum scale (called by the loop)."""
    if record.get("loss_scale_exhausted"):
        raise LossScaleError(
            f"fp16 loss scaling: step {record['step']} overflowed at the minimum loss scale "
            f"{cfg.min_loss_scale:g} with the hysteresis spent; training cannot progress. "
            "Fix: train in bf16 (no scaling needed), lower the learning rate, or lower "
            "min_loss_scale."
        )
