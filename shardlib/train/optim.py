"""The optimizer, from optax: AdamW with warm-up + cosine decay and global-norm clipping."""

from __future__ import annotations

import jax
import optax

from shardlib.train.config import TrainConfig


def schedule(cfg: TrainConfig) -> optax.Schedule:
    """Linear warm-up to ``lr``, cosine decay to ``lr * min_lr_ratio`` at the last step."""
    warmup = min(cfg.warmup, max(cfg.steps - 1, 0))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0 if warmup else cfg.lr,
        peak_value=cfg.lr,
        warmup_steps=warmup,
        decay_steps=max(cfg.steps, warmup + 1),
        end_value=cfg.lr * cfg.min_lr_ratio,
    )


def decay_mask(params):
    """Weight decay on matrices only: norms' scales and biases (rank < 2 per layer) are exempt.

    Stacked layers carry a leading ``layers`` dim, so a norm scale is [layers, embed]; the
    test is on the name as well as the rank for that reason.
    """

    def keep(path, leaf) -> bool:
        names = [str(getattr(k, "key", k)) for k in path]
        return leaf.ndim >= 2 and not any("norm" in n or "bias" in n for n in names)

    return jax.tree_util.tree_map_with_path(keep, params)


def build_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    parts = []
    if cfg.clip_norm > 0:
        parts.append(optax.clip_by_global_norm(cfg.clip_norm))
    parts.append(
        optax.adamw(
            schedule(cfg), b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay, mask=decay_mask
        )
    )
    return optax.chain(*parts)
