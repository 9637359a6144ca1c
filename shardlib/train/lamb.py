"""LAMB (You et al. 2020) with DeepSpeed's two switches, from optax's building blocks.

``optax.lamb`` is ``scale_by_adam -> add_decayed_weights -> scale_by_trust_ratio ->
learning rate``: the Adam direction plus decoupled decay, ``u``, scaled per parameter by the
trust ratio ``||w|| / ||u||`` (1 where either norm is 0). DeepSpeed's FusedLamb
(``optimizer.type: Lamb``) adds:

* ``bias_correction: false``: the moments are used as they stand, ``m / (sqrt(v) + eps)``;
  optax's ``scale_by_adam`` always corrects, so this direction keeps the same state
  (``ScaleByAdamState``) and updates it with optax's own moment functions (Adam(W) with
  ``bias_correction=false`` uses it too, ``train/optim.py``);
* ``max_coeff`` / ``min_coeff``: the trust ratio is clipped into ``[min_coeff, max_coeff]``
  where both norms are nonzero (DeepSpeed's ``lamb_coeff``; 1 elsewhere, as in optax).

With bias correction and no bounds this is ``optax.lamb`` itself. The trust ratio is taken
per parameter array, as optax's: a stacked ``[layers, ...]`` weight has one ratio for all of
its layers.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax


def scale_by_uncorrected_adam(b1: float, b2: float, eps: float) -> optax.GradientTransformation:
    """Adam's direction without bias correction: ``m_t / (sqrt(v_t) + eps)``."""

    def init(params):
        return optax.scale_by_adam(b1, b2, eps).init(params)

    def update(updates, state, params=None):
        del params
        mu = optax.tree.update_moment(updates, state.mu, b1, 1)
        nu = optax.tree.update_moment_per_elem_norm(updates, state.nu, b2, 2)
        out = jax.tree.map(lambda m, v: m / (jnp.sqrt(v) + eps), mu, nu)
        count = optax.safe_increment(state.count)
        return out, optax.ScaleByAdamState(count=count, mu=mu, nu=nu)

    return optax.GradientTransformation(init, update)


def trust_ratio(u: jax.Array, w: jax.Array, lo: float = 0.0, hi: float = math.inf):
    """[] fp32: ``clip(||w|| / ||u||, lo, hi)`` for one parameter array, 1 where a norm is 0
    (optax's and DeepSpeed's convention; 1-bit LAMB averages it, ``train/onebit_lamb.py``)."""
    w_norm, u_norm = optax.safe_norm(w, 0.0), optax.safe_norm(u, 0.0)
    ratio = jnp.clip(w_norm / jnp.where(u_norm == 0, 1, u_norm), lo, hi)
    return jnp.where((w_norm == 0) | (u_norm == 0), 1.0, ratio).astype(jnp.float32)


def scale_by_clipped_trust_ratio(lo: float, hi: float) -> optax.GradientTransformation:
    """``u * clip(||w|| / ||u||, lo, hi)`` per parameter array; 1 where a norm is 0."""

    def update(updates, state, params=None):
        def one(u, w):
            return u * trust_ratio(u, w, lo, hi).astype(u.dtype)

        return jax.tree.map(one, updates, params), state

    return optax.GradientTransformation(optax.init_empty_state, update)


def adam_direction(b1: float, b2: float, eps: float, bias_correction: bool):
    """LAMB's first stage: optax's Adam direction, corrected or not (state
    ``optax.ScaleByAdamState`` either way)."""
    if bias_correction:
        return optax.scale_by_adam(b1, b2, eps)
    return scale_by_uncorrected_adam(b1, b2, eps)


def lamb(
    lr: optax.ScalarOrSchedule,
    *,
    b1: float,
    b2: float,
    eps: float,
    weight_decay: float,
    mask,
    bias_correction: bool = True,
    trust_ratio_min: float = 0.0,
    trust_ratio_max: float = 0.0,
) -> optax.GradientTransformation:
    """LAMB; ``trust_ratio_min``/``max`` of 0 leave that side unbounded."""
    direction = adam_direction(b1, b2, eps, bias_correction)
    if trust_ratio_min or trust_ratio_max:
        trust = scale_by_clipped_trust_ratio(trust_ratio_min, trust_ratio_max or math.inf)
    else:
        trust = optax.scale_by_trust_ratio()
    return optax.chain(
        direction,
        optax.add_decayed_weights(weight_decay, mask),
        trust,
        optax.scale_by_learning_rate(lr),
    )
