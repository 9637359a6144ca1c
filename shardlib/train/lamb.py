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
per *layer*, as the paper and DeepSpeed take it per parameter tensor of an unstacked model: a
stacked ``[layers, ...]`` weight (its leading dims named ``layers``, read from the model's
logical names by ``stacked_dims``) gets one ratio per layer, not one for all of them, which
optax's per-array ``scale_by_trust_ratio`` would give. Without the names every array is one
tensor (optax's convention).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from shardlib.core.layout import names_at
from shardlib.core.param_info import LAYERS

Leads = Callable[[Any], Any]
"""``params -> tree of int``: how many leading dims of each array are stacked layers."""


def stacked_dims(names) -> Leads:
    """The leading ``layers`` dims of each array, from the model's logical ``names`` (a tree
    like the parameters, as ``inventory`` gives it): 1 for a block weight ``[layers, ...]``,
    0 for the embedding, the head and a model without stacked blocks."""

    def leads(params):
        def count(key_path, _) -> int:
            dims = names_at(names, key_path) or ()
            n = 0
            while n < len(dims) and dims[n] == LAYERS:
                n += 1
            return n

        return jax.tree_util.tree_map_with_path(count, params)

    return leads


def per_array(params):
    """No stacked dims anywhere: one trust ratio per array (optax's convention)."""
    return jax.tree.map(lambda _: 0, params)


def layer_norm(x: jax.Array, lead: int) -> jax.Array:
    """``x.shape[:lead]``: the 2-norm of each layer's slice of ``x`` (of all of it at 0)."""
    return jnp.sqrt(jnp.sum(jnp.square(x), axis=tuple(range(lead, x.ndim))))


def per_layer(r: jax.Array, x: jax.Array) -> jax.Array:
    """``r`` of shape ``x.shape[:lead]`` with trailing unit dims, to scale ``x`` by."""
    return r.reshape(r.shape + (1,) * (x.ndim - r.ndim)).astype(x.dtype)


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


def trust_ratio(
    u: jax.Array, w: jax.Array, lo: float = 0.0, hi: float = math.inf, lead: int = 0,
    coefficient: float = 1.0, eps: float = 0.0,
):  # fmt: skip
    """``u.shape[:lead]`` fp32: ``clip(c ||w|| / (||u|| + eps), lo, hi)`` per layer of one
    parameter array, 1 where a norm is 0 (optax's and DeepSpeed's convention; 1-bit LAMB
    averages it, ``train/onebit_lamb.py``; LARS sets ``coefficient`` and ``eps``)."""
    w_norm, u_norm = layer_norm(w, lead), layer_norm(u, lead)
    ratio = jnp.clip(coefficient * w_norm / jnp.where(u_norm == 0, 1, u_norm + eps), lo, hi)
    return jnp.where((w_norm == 0) | (u_norm == 0), 1.0, ratio).astype(jnp.float32)


def scale_by_layer_trust_ratio(
    lo: float = 0.0, hi: float = math.inf, leads: Leads = per_array, **ratio
) -> optax.GradientTransformation:
    """``u * clip(||w|| / ||u||, lo, hi)`` per layer of each parameter array (``leads``);
    1 where a norm is 0. With ``per_array`` and no bounds: ``optax.scale_by_trust_ratio``."""

    def update(updates, state, params=None):
        if params is None:
            raise ValueError("the trust ratio needs the parameters.")

        def one(u, w, lead):
            return u * per_layer(trust_ratio(u, w, lo, hi, lead, **ratio), u)

        return jax.tree.map(one, updates, params, leads(params)), state

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
    leads: Leads = per_array,
) -> optax.GradientTransformation:
    """LAMB; ``trust_ratio_min``/``max`` of 0 leave that side unbounded; ``leads`` says which
    leading dims are stacked layers (``stacked_dims``), each with its own trust ratio."""
    direction = adam_direction(b1, b2, eps, bias_correction)
    trust = scale_by_layer_trust_ratio(trust_ratio_min, trust_ratio_max or math.inf, leads)
    return optax.chain(
        direction,
        optax.add_decayed_weights(weight_decay, mask),
        trust,
        optax.scale_by_learning_rate(lr),
    )


def lars(
    lr: optax.ScalarOrSchedule, *, weight_decay: float, mask, momentum: float,
    leads: Leads = per_array, trust_coefficient: float = 0.001, eps: float = 0.0,
) -> optax.GradientTransformation:  # fmt: skip
    """LARS (You et al. 2017) as ``optax.lars`` composes it (decay, masked trust ratio,
    learning rate, momentum), with the trust ratio per layer of stacked arrays (``leads``)."""
    trust = scale_by_layer_trust_ratio(leads=leads, coefficient=trust_coefficient, eps=eps)
    return optax.chain(
        optax.add_decayed_weights(weight_decay, mask),
        optax.masked(trust, mask),
        optax.scale_by_learning_rate(lr),
        optax.trace(decay=momentum, nesterov=False),
    )
