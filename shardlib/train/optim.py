"""Optimizers and learning-rate schedules by name, all from optax, plus gradient clipping.

Every optimizer here keeps its state as trees shaped like the parameters (adafactor's
factored statistics drop one dim of their parameter), so ``shardlib.train.layouts`` can lay
each state tensor out like its parameter. Weight decay skips norms and biases everywhere.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from shardlib.errors import ShardingError

SCHEDULES = ("constant", "warmup_cosine", "warmup_linear", "inverse_sqrt")
OPTIMIZERS = ("adamw", "adam", "sgd", "lamb", "lars", "adafactor")


def check_optimizer(opt) -> None:
    """Unknown optimizer or schedule names fail when the config is made."""
    if opt.name not in OPTIMIZERS:
        raise ShardingError(
            f"config: optimizer={opt.name!r}. Fix: use one of {', '.join(OPTIMIZERS)}."
        )
    if opt.schedule not in SCHEDULES:
        raise ShardingError(
            f"config: schedule={opt.schedule!r}. Fix: use one of {', '.join(SCHEDULES)}."
        )


def schedule(cfg, steps: int) -> optax.Schedule:
    """The learning rate at each step; warm-up (where there is one) is linear from 0.

    warmup_cosine / warmup_linear decay to ``lr * min_lr_ratio`` at the last step;
    inverse_sqrt decays as ``lr * sqrt(warmup / step)`` after the warm-up (Vaswani et al.).
    """
    warmup = min(cfg.warmup, max(steps - 1, 0))
    end = cfg.lr * cfg.min_lr_ratio
    if cfg.schedule == "constant":
        return optax.constant_schedule(cfg.lr)
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
    return optax.join_schedules([optax.linear_schedule(0.0, cfg.lr, warmup), after], [warmup])


def decay_mask(params):
    """Weight decay on matrices only: norms' scales and biases (rank < 2 per layer) are exempt.

    Stacked layers carry a leading ``layers`` dim, so a norm scale is [layers, embed]; the
    test is on the name as well as the rank for that reason.
    """

    def keep(path, leaf) -> bool:
        names = [str(getattr(k, "key", k)) for k in path]
        return leaf.ndim >= 2 and not any("norm" in n or "bias" in n for n in names)

    return jax.tree_util.tree_map_with_path(keep, params)


def _optimizer(cfg, lr: optax.Schedule) -> optax.GradientTransformation:
    wd, mask = cfg.weight_decay, decay_mask
    if cfg.name == "adamw":
        return optax.adamw(lr, b1=cfg.b1, b2=cfg.b2, weight_decay=wd, mask=mask)
    if cfg.name == "adam":  # no decay at all: that is what distinguishes it from adamw
        return optax.adam(lr, b1=cfg.b1, b2=cfg.b2)
    if cfg.name == "sgd":
        sgd = optax.sgd(lr, momentum=cfg.momentum)
        return optax.chain(optax.add_decayed_weights(wd, mask), sgd) if wd else sgd
    if cfg.name == "lamb":
        return optax.lamb(lr, b1=cfg.b1, b2=cfg.b2, weight_decay=wd, mask=mask)
    if cfg.name == "lars":
        # Norms and biases get neither decay nor a trust ratio (You et al. 2017).
        return optax.lars(
            lr, weight_decay=wd, weight_decay_mask=mask, trust_ratio_mask=mask,
            momentum=cfg.momentum,
        )  # fmt: skip
    return optax.adafactor(
        lr,
        min_dim_size_to_factor=cfg.factored_min_dim,
        weight_decay_rate=wd or None,
        weight_decay_mask=mask,
    )


def build_optimizer(cfg, steps: int) -> optax.GradientTransformation:
    """Global-norm clipping (if set), then the named optimizer with the named schedule."""
    parts = []
    if cfg.clip_norm > 0:
        parts.append(optax.clip_by_global_norm(cfg.clip_norm))
    parts.append(_optimizer(cfg, schedule(cfg, steps)))
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


def stop_base_gradients(loss_fn, lora_rank: int):
    """With LoRA, ``loss_fn`` sees the base weights as constants: XLA then drops their
    weight-gradient products (``freeze_base`` would discard them anyway), and the reported
    gradient norm is the adapters'."""
    if not lora_rank:
        return loss_fn

    def frozen(params, *args):
        params = jax.tree_util.tree_map_with_path(
            lambda path, x: x if _is_adapter(path) else jax.lax.stop_gradient(x), params
        )
        return loss_fn(params, *args)

    return frozen
