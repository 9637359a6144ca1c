"""Optimizers and learning-rate schedules by name, all from optax, plus gradient clipping.

Every optimizer here keeps its state as trees shaped like the parameters (adafactor's
factored statistics drop one dim of their parameter), so ``shardlib.parallel.state`` can lay
each state tensor out like its parameter. Weight decay skips norms and biases everywhere.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import optax

from shardlib.core.errors import ShardingError
from shardlib.core.mesh import Axis
from shardlib.train import cycles
from shardlib.train.lamb import (
    Leads,
    lamb,
    lars,
    per_array,
    scale_by_uncorrected_adam,
    stacked_dims,
)

if TYPE_CHECKING:
    from shardlib.parallel.plan import ParallelPlan

SCHEDULES = ("constant", "warmup_cosine", "warmup_linear", "inverse_sqrt", "one_cycle",
             "range_test")  # fmt: skip
OPTIMIZERS = ("adamw", "adam", "sgd", "lamb", "lars", "adafactor", "onebit_adam", "onebit_lamb")
WARMUPS = ("linear", "log")
SPELLINGS = {
    "onebit_adam": ("adamw", {"onebit_momentum": True}),
    "onebit_lamb": ("lamb", {"onebit_momentum": True}),
}
"""Optimizer names that are another optimizer plus ``[parallel.data]`` settings: DeepSpeed's
OneBitAdam is AdamW (OneBitLamb LAMB) whose momentum crosses the data axis in 1 bit. The one
place a name sets how gradients travel (``resolve_optimizer``); everything else reads the plan."""
ONEBIT_BASES = ("adam", "adamw", "lamb")  # the optimizers whose momentum 1-bit exchanges


def check_optimizer(opt) -> None:
    """Unknown optimizer or schedule names fail when the config is made, and so does a
    learning rate no run wants: a negative one climbs the loss (6.6 -> 699 in 6 steps, exit 0
    before this check), zero trains nothing, nan or inf poisons the weights on step 1."""
    if not math.isfinite(opt.lr) or opt.lr <= 0:
        raise ShardingError(
            f"config: optimizer.lr={opt.lr} must be a finite number > 0 (a negative rate "
            "steps uphill, 0 does not move). Fix: a positive rate, e.g. lr=3e-3."
        )
    if opt.name not in OPTIMIZERS:
        raise ShardingError(
            f"config: optimizer={opt.name!r}. Fix: use one of {', '.join(OPTIMIZERS)}."
        )
    if opt.schedule not in SCHEDULES:
        raise ShardingError(
            f"config: schedule={opt.schedule!r}. Fix: use one of {', '.join(SCHEDULES)}."
        )
    if opt.schedule_steps < 0:
        raise ShardingError(
            f"config: schedule_steps={opt.schedule_steps} must be >= 0 (0: the run's steps)."
        )
    if opt.warmup_type not in WARMUPS:
        raise ShardingError(
            f"config: warmup_type={opt.warmup_type!r}. Fix: use one of {', '.join(WARMUPS)}."
        )
    if not opt.bias_correction and opt.name not in ("adamw", "adam", "lamb", *SPELLINGS):
        raise ShardingError(
            f"config: bias_correction=false is Adam's moments uncorrected, but optimizer="
            f"{opt.name} keeps none. Fix: optimizer=adamw, adam, lamb, onebit_adam or "
            "onebit_lamb, or bias_correction=true."
        )
    lo, hi = opt.trust_ratio_min, opt.trust_ratio_max
    if (lo or hi) and opt.name not in ("lamb", "onebit_lamb"):
        raise ShardingError(
            f"config: trust_ratio_min={lo}, trust_ratio_max={hi} bound LAMB's trust ratio, "
            f"but optimizer={opt.name}. Fix: optimizer=lamb or onebit_lamb, or leave both at 0."
        )
    if lo < 0 or hi < 0 or (hi and lo > hi):
        raise ShardingError(
            f"config: trust_ratio_min={lo}, trust_ratio_max={hi}: need 0 <= min <= max "
            "(0: unbounded). Fix: e.g. DeepSpeed's defaults 0.01 and 10."
        )
    if opt.freeze_step < 0 or opt.eps < 0:
        raise ShardingError(
            f"config: freeze_step={opt.freeze_step}, eps={opt.eps} must be >= 0. "
            "Fix: e.g. freeze_step=20 (about 15-25% of the steps) and eps=1e-8."
        )
    if opt.name == "onebit_lamb":
        _check_onebit_lamb(opt)
    _check_cycles(opt)


def _check_cycles(opt) -> None:
    """The cyclical schedules' settings (``train/cycles.py``), named with the fix."""
    problems = []
    if opt.schedule == "range_test" and opt.interval_steps < 1:
        problems.append(f"schedule=range_test needs interval_steps >= 1 ({opt.interval_steps})")
    if opt.schedule == "one_cycle" and (opt.warmup < 1 or opt.cycle_down_steps < 0):
        shape = f"warmup={opt.warmup}, cycle_down_steps={opt.cycle_down_steps}"
        problems.append(f"schedule=one_cycle needs warmup >= 1 and cycle_down_steps >= 0 ({shape})")
    if opt.interval_steps < 0:
        problems.append(f"interval_steps={opt.interval_steps} must be >= 0")
    if opt.b1_min and opt.schedule != "one_cycle":
        problems.append(f"b1_min={opt.b1_min} cycles beta1 with schedule=one_cycle only")
    if opt.b1_min and opt.name not in ("adamw", "adam"):
        problems.append(f"b1_min={opt.b1_min} cycles Adam's beta1, but optimizer={opt.name}")
    if opt.b1_min and not opt.bias_correction:
        problems.append("b1_min with bias_correction=false (the uncorrected chain has a fixed b1)")
    if opt.b1_min and not 0 < opt.b1_min <= opt.b1 < 1:
        problems.append(f"b1_min={opt.b1_min}, b1={opt.b1}: need 0 < b1_min <= b1 < 1")
    if problems:
        raise ShardingError(
            f"config: {'; '.join(problems)}. Fix: e.g. schedule=one_cycle warmup=1000 "
            "min_lr_ratio=0.1 b1_min=0.85 b1=0.95 optimizer=adamw, or schedule=range_test "
            "interval_steps=100 interval_rate=1."
        )


def _check_onebit_lamb(opt) -> None:
    """1-bit LAMB's frozen coefficients come from the warm-up, and its factor must stay a
    positive band around 1 that each step may move by less than all of it."""
    problems = []
    if opt.freeze_step < 1:
        problems.append(f"freeze_step={opt.freeze_step} (the frozen trust ratios are averaged "
                        "over the warm-up: with none every update is 0)")  # fmt: skip
    if not 0 <= opt.coeff_beta < 1:
        problems.append(f"coeff_beta={opt.coeff_beta} (an average's weight, in [0, 1))")
    if not 0 < opt.factor_min <= 1 <= opt.factor_max:
        problems.append(f"factor_min={opt.factor_min}, factor_max={opt.factor_max} "
                        "(need 0 < factor_min <= 1 <= factor_max)")  # fmt: skip
    if not 0 <= opt.factor_threshold < 1:
        problems.append(f"factor_threshold={opt.factor_threshold} (a fraction, in [0, 1))")
    if problems:
        raise ShardingError(
            f"config: optimizer=onebit_lamb with {'; '.join(problems)}. Fix: DeepSpeed's "
            "defaults freeze_step >= 1/(1 - coeff_beta), coeff_beta=0.9, factor_min=0.5, "
            "factor_max=4, factor_threshold=0.1."
        )


def schedule(cfg, steps: int) -> optax.Schedule:
    """The learning rate at each step; warm-up (where there is one) is linear from 0.

    warmup_cosine / warmup_linear decay to ``lr * min_lr_ratio`` at the last step;
    inverse_sqrt decays as ``lr * sqrt(warmup / step)`` after the warm-up (Vaswani et al.).
    ``cfg.schedule_steps``, where set, is the schedule's length instead of the run's ``steps``.
    """
    steps = cfg.schedule_steps or steps
    warmup = min(cfg.warmup, max(steps - 1, 0))
    end = cfg.lr * cfg.min_lr_ratio
    ramp = _warmup_ramp(cfg.warmup_type, cfg.lr, warmup)
    if cfg.schedule == "constant":
        return optax.constant_schedule(cfg.lr)
    if cfg.schedule == "one_cycle":
        return cycles.one_cycle(cfg)
    if cfg.schedule == "range_test":
        return cycles.range_test(cfg)
    if cfg.schedule == "warmup_cosine" and cfg.warmup_type == "log" and warmup:
        cosine = optax.cosine_decay_schedule(cfg.lr, max(steps - warmup, 1), cfg.min_lr_ratio)
        return optax.join_schedules([ramp, cosine], [warmup])
    if cfg.schedule == "warmup_cosine":
        return optax.warmup_cosine_decay_schedule(
            init_value=0.0 if warmup else cfg.lr,
            peak_value=cfg.lr,
            warmup_steps=warmup,
            decay_steps=max(steps, warmup + 1),
            end_value=end,
        )
    decay_steps = max(steps - warmup, 1)
    if cfg.schedule == "warmup_linear":
        after = optax.linear_schedule(cfg.lr, end, decay_steps)
    else:  # inverse_sqrt
        w = max(warmup, 1)

        def after(count):
            return cfg.lr * jnp.sqrt(w / jnp.maximum(count + w, w))  # join_schedules shifts count

    if not warmup:
        return after
    return optax.join_schedules([ramp, after], [warmup])


def _warmup_ramp(kind: str, lr: float, warmup: int) -> optax.Schedule:
    """0 -> lr over ``warmup`` steps: linear, or DeepSpeed's ``log`` warm-up
    (``lr * log(step + 1) / log(warmup)``, WarmupLR's default ``warmup_type``)."""
    if kind == "linear" or warmup < 2:
        return optax.linear_schedule(0.0, lr, warmup)
    return lambda count: lr * jnp.log(count + 1.0) / jnp.log(float(warmup))


def decay_mask(params):
    """Weight decay on matrices only: norms' scales and biases (rank < 2 per layer) are exempt.

    Stacked layers carry a leading ``layers`` dim, so a norm scale is [layers, embed]; the
    test is on the name as well as the rank for that reason.
    """

    def keep(path, leaf) -> bool:
        names = [str(getattr(k, "key", k)) for k in path]
        return leaf.ndim >= 2 and not any("norm" in n or "bias" in n for n in names)

    return jax.tree_util.tree_map_with_path(keep, params)


def resolve_optimizer(opt, plan: ParallelPlan):
    """``(optimizer, plan)`` with a ``SPELLINGS`` name replaced by its optimizer and the
    plan's ``[parallel.data]`` settings it stands for; other names pass unchanged."""
    if opt.name not in SPELLINGS:
        return opt, plan
    name, data = SPELLINGS[opt.name]
    plan = dataclasses.replace(plan, data=dataclasses.replace(plan.data, **data))
    return dataclasses.replace(opt, name=name), plan


def _onebit(
    cfg, lr: optax.Schedule, steps: int, n: int, leads: Leads = per_array, exp_avg_mask=None
) -> optax.GradientTransformation:
    """Adam(W) or LAMB whose momentum is averaged over the ``n`` data devices in 1 bit
    (``train/onebit.py``, ``train/onebit_lamb.py``); decoupled decay after the direction,
    as DeepSpeed's."""
    if cfg.name not in ONEBIT_BASES:
        raise ShardingError(
            f"parallel.data.onebit_momentum exchanges Adam's or LAMB's momentum in 1 bit, but "
            f"optimizer={cfg.name} keeps none to exchange. Fix: optimizer=adamw, adam or lamb "
            "(or onebit_adam, onebit_lamb), or onebit_momentum=false."
        )
    if cfg.name == "lamb":
        from shardlib.train.onebit_lamb import Factors, scale_by_onebit_lamb

        factors = Factors(cfg.coeff_beta, cfg.factor_max, cfg.factor_min, cfg.factor_threshold)
        direction = scale_by_onebit_lamb(
            b1=cfg.b1, b2=cfg.b2, eps=cfg.eps or 1e-6, weight_decay=cfg.weight_decay,
            mask=decay_mask, freeze_step=cfg.freeze_step, n=n, steps=steps,
            bias_correction=cfg.bias_correction, trust_ratio_min=cfg.trust_ratio_min,
            trust_ratio_max=cfg.trust_ratio_max, factors=factors, leads=leads,
            exp_avg_mask=exp_avg_mask,
        )  # fmt: skip
        return optax.chain(direction, optax.scale_by_learning_rate(lr))
    from shardlib.train.onebit import scale_by_onebit_adam

    direction = scale_by_onebit_adam(
        b1=cfg.b1, b2=cfg.b2, eps=cfg.eps or 1e-8, freeze_step=cfg.freeze_step, n=n,
        steps=steps, bias_correction=cfg.bias_correction, exp_avg_mask=exp_avg_mask,
    )  # fmt: skip
    wd = cfg.weight_decay if cfg.name == "adamw" else 0.0  # adam: no decay, as below
    decay = [optax.add_decayed_weights(wd, decay_mask)] if wd else []
    return optax.chain(direction, *decay, optax.scale_by_learning_rate(lr))


def _optimizer(cfg, lr: optax.Schedule, leads: Leads = per_array) -> optax.GradientTransformation:
    wd, mask = cfg.weight_decay, decay_mask
    eps = {"eps": cfg.eps} if cfg.eps else {}  # 0: the optimizer's own default
    if cfg.name in ("adamw", "adam") and not cfg.bias_correction:  # optax's chain, uncorrected
        decay = [optax.add_decayed_weights(wd, mask)] if cfg.name == "adamw" else []
        direction = scale_by_uncorrected_adam(cfg.b1, cfg.b2, cfg.eps or 1e-8)
        return optax.chain(direction, *decay, optax.scale_by_learning_rate(lr))
    if cfg.b1_min:  # 1cycle's momentum: beta1 a schedule, through optax's injection
        b1 = cycles.one_cycle_b1(cfg)
        if cfg.name == "adam":
            return optax.inject_hyperparams(optax.adam)(lr, b1=b1, b2=cfg.b2, **eps)
        return optax.inject_hyperparams(optax.adamw, static_args=("mask",))(
            lr, b1=b1, b2=cfg.b2, weight_decay=wd, mask=mask, **eps
        )
    if cfg.name == "adamw":
        return optax.adamw(lr, b1=cfg.b1, b2=cfg.b2, weight_decay=wd, mask=mask, **eps)
    if cfg.name == "adam":  # no decay at all: that is what distinguishes it from adamw
        return optax.adam(lr, b1=cfg.b1, b2=cfg.b2, **eps)
    if cfg.name == "sgd":
        sgd = optax.sgd(lr, momentum=cfg.momentum)
        return optax.chain(optax.add_decayed_weights(wd, mask), sgd) if wd else sgd
    if cfg.name == "lamb":  # optax.lamb's chain, with DeepSpeed's switches (train/lamb.py)
        return lamb(
            lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps or 1e-6, weight_decay=wd, mask=mask,
            bias_correction=cfg.bias_correction, trust_ratio_min=cfg.trust_ratio_min,
            trust_ratio_max=cfg.trust_ratio_max, leads=leads,
        )  # fmt: skip
    if cfg.name == "lars":
        # Norms and biases get neither decay nor a trust ratio (You et al. 2017).
        return lars(lr, weight_decay=wd, mask=mask, momentum=cfg.momentum, leads=leads)
    return optax.adafactor(
        lr,
        min_dim_size_to_factor=cfg.factored_min_dim,
        weight_decay_rate=wd or None,
        weight_decay_mask=mask,
    )


def build_optimizer(
    cfg, steps: int, plan: ParallelPlan | None = None, names=None, exp_avg_mask=None
) -> optax.GradientTransformation:
    """Global-norm clipping (if set), then the named optimizer with the named schedule.

    A ``SPELLINGS`` name is resolved against ``plan`` first (``resolve_optimizer``). With the
    plan's ``data.onebit_momentum`` the Adam or LAMB update averages the momentum over the ``data``
    axis in 1 bit; it sees each device's local gradient, so its clipping uses the local norm
    (the averaged gradient is never formed after warm-up). With the model's logical
    ``names`` the trust ratios of LAMB and LARS are per layer of a stacked ``[layers, ...]``
    array (``train/lamb.py``), as the papers take them per tensor; without, per array.
    ``exp_avg_mask`` (1-bit Adam / LAMB only; DeepSpeed's parameter-group key, a tree like
    the parameters) multiplies the averaged momentum of each compressed step
    (``onebit.apply_exp_avg_mask``); ``onebit.with_exp_avg_mask`` sets it on a setup.
    """
    if plan is not None:
        cfg, plan = resolve_optimizer(cfg, plan)
    elif cfg.name in SPELLINGS:
        raise ShardingError(
            f"optimizer={cfg.name} sets parallel.data settings {SPELLINGS[cfg.name][1]}, "
            "which need the plan. Fix: build_optimizer(cfg, steps, plan)."
        )
    parts = []
    if cfg.clip_norm > 0:
        parts.append(optax.clip_by_global_norm(cfg.clip_norm))
    lr = schedule(cfg, steps)
    leads = per_array if names is None else stacked_dims(names)
    onebit = plan is not None and plan.data.onebit_momentum
    if exp_avg_mask is not None and not onebit:
        raise ShardingError(
            f"exp_avg_mask is 1-bit Adam's and LAMB's (it masks the compressed momentum), but "
            f"optimizer={cfg.name} runs without parallel.data.onebit_momentum. Fix: "
            "optimizer=onebit_adam or onebit_lamb, or drop exp_avg_mask."
        )
    if onebit:
        n = plan.mesh_axes.get(Axis.DATA, 1)
        parts.append(_onebit(cfg, lr, steps, n, leads, exp_avg_mask))
    else:
        parts.append(_optimizer(cfg, lr, leads))
    return optax.chain(*parts)


def freeze_base(tx: optax.GradientTransformation, lora_rank: int):
    """With LoRA the optimizer sees only the adapters: every other update is zero (optax's
    ``multi_transform`` keeps no state for them), so the base weights never move."""
    if not lora_rank:
        return tx

    def labels(params):
        return jax.tree_util.tree_map_with_path(
            lambda path, _: "adapter" if _is_adapter(path) else "base", params
        )

    return optax.multi_transform({"adapter": tx, "base": optax.set_to_zero()}, labels)


def _is_adapter(path) -> bool:
    return any("lora_" in str(getattr(k, "key", k)) for k in path)


def frozen_base(params, lora_rank: int):
    """With LoRA, the loss sees the base weights as constants: XLA then drops their
    weight-gradient products (``freeze_base`` would discard them anyway), and the reported
    gradient norm is the adapters'."""
    if not lora_rank:
        return params
    return jax.tree_util.tree_map_with_path(
        lambda path, x: x if _is_adapter(path) else jax.lax.stop_gradient(x), params
    )
