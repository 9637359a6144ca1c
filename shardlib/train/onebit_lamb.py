"""1-bit LAMB (Li et al. 2021): LAMB whose momentum crosses the data axis as sign bits.

DeepSpeed's ``OnebitLamb`` semantics, two stages:

* **Warm-up** (``freeze_step`` steps): plain LAMB on the fp32-averaged gradient, built from
  the same pieces as ``optimizer=lamb`` (``train/lamb.py``: Adam direction, decoupled decay,
  clipped trust ratio). Each step's trust ratio ``r`` (per layer of each parameter array, as
  ``optimizer=lamb`` takes it: DeepSpeed's tensors are a stacked array's layers) also feeds an
  exponential average, the *frozen coefficient* ``c = coeff_beta·c + (1 - coeff_beta)·r``
  (from 0, skipped where ``r == 1``, i.e. a norm was 0). At the last warm-up step the variance
  ``v`` is copied to ``v_fresh`` and each array's momentum scale is fixed:
  ``s_p = mean_q rms(m_q) / rms(m_p)``, which evens out the arrays' magnitudes before they
  share one sign code's scale.
* **Compression** (afterwards): ``v`` is frozen. Each worker folds its *local* gradient into
  the momentum, multiplies by ``s_p`` and the momenta are averaged by 1-bit Adam's
  ``compressed_allreduce`` (error feedback on worker and server), then divided by ``s_p``.
  From the averaged momentum the gradient is *reconstructed*,
  ``g~ = (m_t - b1·m_{t-1}) / (1 - b1)``, and kept in ``v_fresh = b2·v_fresh + (1-b2)·g~²``.
  With ``u' = m / (sqrt(v) + eps)`` and ``u = u' + wd·w`` the per-array scaling factor is
  ``f = max((sqrt(v) + eps) / (sqrt(v_fresh) + eps))``, pulled towards 1 by the decay's share
  ``q = min(1, ||u'|| / ||u||)``: ``f = q·f + (1 - q)``; clipped into
  ``[factor_min, factor_max]``, then into ``last_f·[1 - factor_threshold, 1 + factor_threshold]``
  (``last_f`` from 1). The update is ``c·f·u`` (the warm-up's ``[min, max]`` trust-ratio bounds
  are not applied again, as in DeepSpeed).

With ``bias_correction`` the moments are corrected as 1-bit Adam's are (``v`` at the freeze
step, ``m`` and ``v_fresh`` at the current one); DeepSpeed's OnebitLamb never corrects, which
its mapping keeps (``interop/deepspeed_sections.py``). DeepSpeed's first call only allocates
its buffers (no update); here step 1 is the first LAMB step. Bytes on the wire after warm-up
are 1-bit Adam's: 2(N-1)/N · (Ψ/8 + 4N) per device per step (``train/onebit.py``).

The step, the error buffers' layout and the plan's refusals are 1-bit Adam's:
``optimizer=onebit_lamb`` is LAMB with ``parallel.data.onebit_momentum`` (``optim.SPELLINGS``).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.flatten_util import ravel_pytree

from shardlib.train.lamb import Leads, adam_direction, layer_norm, per_array, per_layer, trust_ratio
from shardlib.train.onebit import AXIS, apply_exp_avg_mask, compressed_allreduce, padded_size


class OneBitLambState(NamedTuple):
    """LAMB's moments, the frozen coefficients and the two error-feedback buffers."""

    adam: optax.ScaleByAdamState  # count, mu (replicated), nu (replicated; frozen after)
    nu_fresh: Any  # like params: the variance of the reconstructed gradients
    coeff: Any  # like params, [layers] or [] each: EMA of the warm-up trust ratios
    last_factor: Any  # like params, [layers] or []: the previous step's scaling factor
    momentum_scale: Any  # like params, [layers] or []: s_p, fixed at the last warm-up step
    worker_error: jax.Array  # [N * P] fp32 global, [P] per device
    server_error: jax.Array  # [P] fp32 global, [P / N] per device


class Factors(NamedTuple):
    """1-bit LAMB's settings beyond LAMB's (DeepSpeed's names and defaults)."""

    coeff_beta: float = 0.9
    factor_max: float = 4.0
    factor_min: float = 0.5
    factor_threshold: float = 0.1


DEFAULTS = Factors()


def momentum_scales(mu, leads):
    """``s_p = mean_q rms(m_q) / rms(m_p)`` per layer of each array, ``q`` over every layer
    of every array (1 where ``m_p`` is all zero)."""

    def rms(m, lead):
        return layer_norm(m, lead) / math.sqrt(max(math.prod(m.shape[lead:]), 1))

    rms = jax.tree.map(rms, mu, leads)
    count = max(sum(r.size for r in jax.tree.leaves(rms)), 1)
    united = sum(jnp.sum(r) for r in jax.tree.leaves(rms)) / count
    return jax.tree.map(lambda r: jnp.where(r > 0, united / jnp.where(r > 0, r, 1), 1.0), rms)


def scaling_factor(denom, denom_fresh, prelim, u, last, f: Factors, lead: int = 0):
    """One array's ``f`` per layer (module docstring): the frozen-vs-fresh denominators'
    largest ratio, weighted by the decay's share of ``u``, then clipped twice."""
    factor = jnp.max(denom / denom_fresh, axis=tuple(range(lead, denom.ndim)))
    u_norm = layer_norm(u, lead)
    share = jnp.minimum(1.0, layer_norm(prelim, lead) / jnp.where(u_norm > 0, u_norm, 1))
    share = jnp.where(u_norm > 0, share, 1.0)
    factor = factor * share + (1.0 - share)
    factor = jnp.clip(factor, f.factor_min, f.factor_max)
    return jnp.clip(factor, last * (1 - f.factor_threshold), last * (1 + f.factor_threshold))


def scale_by_onebit_lamb(
    *, b1: float, b2: float, eps: float, weight_decay: float, mask, freeze_step: int, n: int,
    steps: int, bias_correction: bool = True, trust_ratio_min: float = 0.0,
    trust_ratio_max: float = 0.0, factors: Factors = DEFAULTS, axis: str = AXIS,
    leads: Leads = per_array, exp_avg_mask=None,
) -> optax.GradientTransformation:  # fmt: skip
    """LAMB's update before the learning rate (direction, decay, trust ratio), with 1-bit
    momentum averaging after ``freeze_step`` (>= 1) steps. ``update`` takes each device's
    *local* gradient inside shard_map over ``axis`` (size ``n``). A run of at most
    ``freeze_step`` steps holds only the fp32 path, equal to ``optimizer=lamb``. ``leads``:
    the stacked layer dims of each array, each layer with its own coefficients.
    ``exp_avg_mask`` multiplies the averaged momentum of each compressed step, before the
    gradient is reconstructed from it (``onebit.apply_exp_avg_mask``; DeepSpeed's order)."""
    direction = adam_direction(b1, b2, eps, bias_correction)
    decay = optax.add_decayed_weights(weight_decay, mask)
    lo, hi = trust_ratio_min, trust_ratio_max or math.inf
    cb = factors.coeff_beta

    def init(params):
        p = padded_size(params, n)
        lead = leads(params)

        def scalar(v):  # [layers] or [] per array
            return jax.tree.map(lambda w, k: jnp.full(w.shape[:k], v, jnp.float32), params, lead)

        return OneBitLambState(
            adam=direction.init(params),
            nu_fresh=jax.tree.map(jnp.zeros_like, params),
            coeff=scalar(0.0),
            last_factor=scalar(1.0),
            momentum_scale=scalar(1.0),
            worker_error=jnp.zeros((n * p,), jnp.float32),
            server_error=jnp.zeros((p,), jnp.float32),
        )

    def warmup(grads, state, params, lead):
        g = jax.lax.pmean(grads, axis)  # the fp32 all-reduce
        u, adam = direction.update(g, state.adam)
        u, _ = decay.update(u, decay.init(params), params)
        ratio = jax.tree.map(lambda x, w, k: trust_ratio(x, w, lo, hi, k), u, params, lead)
        out = jax.tree.map(lambda x, r: x * per_layer(r, x), u, ratio)
        coeff = jax.tree.map(
            lambda c, r: jnp.where(r != 1, cb * c + (1 - cb) * r, c), state.coeff, ratio
        )
        last = adam.count == freeze_step  # fix v_fresh and s_p for the compression stage
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(last, a, b), new, old)  # noqa: E731
        return out, state._replace(
            adam=adam, coeff=coeff, nu_fresh=keep(adam.nu, state.nu_fresh),
            momentum_scale=keep(momentum_scales(adam.mu, lead), state.momentum_scale),
        )  # fmt: skip

    def compressed(grads, state, params, lead):
        m_last, scale = state.adam.mu, state.momentum_scale
        local = jax.tree.map(
            lambda m, x, s: (b1 * m + (1 - b1) * x) * per_layer(s, m), m_last, grads, scale
        )
        flat, unravel = ravel_pytree(local)
        pad = state.worker_error.shape[0] - flat.shape[0]
        mean_P, werr, serr = compressed_allreduce(
            jnp.pad(flat.astype(jnp.float32), (0, pad)), state.worker_error,
            state.server_error, axis=axis, n=n,
        )  # fmt: skip
        mu = jax.tree.map(lambda m, s: m / per_layer(s, m), unravel(mean_P[: flat.shape[0]]), scale)
        mu = apply_exp_avg_mask(mu, exp_avg_mask)
        recon = jax.tree.map(lambda m, m0: (m - b1 * m0) / (1 - b1), mu, m_last)
        nu_fresh = jax.tree.map(lambda v, x: b2 * v + (1 - b2) * x * x, state.nu_fresh, recon)
        count = optax.safe_increment(state.adam.count)
        nu = state.adam.nu
        mu_hat, nu_hat, fresh_hat = mu, nu, nu_fresh
        if bias_correction:
            mu_hat = optax.tree.bias_correction(mu, b1, count)
            nu_hat = optax.tree.bias_correction(nu, b2, min(freeze_step, steps))
            fresh_hat = optax.tree.bias_correction(nu_fresh, b2, count)
        denom = jax.tree.map(lambda v: jnp.sqrt(v) + eps, nu_hat)
        prelim = jax.tree.map(lambda m, d: m / d, mu_hat, denom)
        u, _ = decay.update(prelim, decay.init(params), params)
        factor = jax.tree.map(
            lambda d, v, p0, x, last, k: scaling_factor(
                d, jnp.sqrt(v) + eps, p0, x, last, factors, k
            ),
            denom, fresh_hat, prelim, u, state.last_factor, lead,
        )  # fmt: skip
        out = jax.tree.map(lambda x, c, f: x * per_layer(c * f, x), u, state.coeff, factor)
        adam = optax.ScaleByAdamState(count=count, mu=mu, nu=nu)
        return out, state._replace(
            adam=adam, nu_fresh=nu_fresh, last_factor=factor, worker_error=werr,
            server_error=serr,
        )  # fmt: skip

    def update(grads, state, params=None):
        if params is None:
            raise ValueError("1-bit LAMB's trust ratio needs the parameters.")
        lead = leads(params)
        if freeze_step >= steps:
            return warmup(grads, state, params, lead)
        return jax.lax.cond(
            state.adam.count < freeze_step,
            lambda *a: warmup(*a, lead),
            lambda *a: compressed(*a, lead),
            grads, state, params,
        )  # fmt: skip

    return optax.GradientTransformation(init, update)
