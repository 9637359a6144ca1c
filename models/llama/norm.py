"""RMSNorm as a function whose gradient keeps only its input.

Autodiff of ``(x * r) * scale`` (``r = rsqrt(mean(x²) + eps)``) keeps the normalised
``x * r`` for the scale's gradient next to the output that the following product keeps for
its weight gradient. Under ``remat=full`` the backward pass recomputes both, and both stay
live until the block's backward reaches the norm: one more [batch, seq, embed] buffer per
norm, two per block, in the layer loop where memory peaks. The gradient written here reads
only ``x`` (which the block holds anyway) and recomputes ``r``, one reduction over the
width, as fused RMSNorm kernels do (Apex, Transformer Engine keep the input and 1/rms).
The forward is unchanged: fp32 statistics, the result in ``x``'s dtype.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp


def _rms(x32_BLD, eps: float):
    return jax.lax.rsqrt(jnp.mean(x32_BLD * x32_BLD, axis=-1, keepdims=True) + eps)


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def rms_norm(x_BLD, scale_D, eps: float):
    """``x / rms(x) * scale`` over the last dim; statistics in fp32."""
    x32 = x_BLD.astype(jnp.float32)
    return (x32 * _rms(x32, eps)).astype(x_BLD.dtype) * scale_D.astype(x_BLD.dtype)


def _forward(x_BLD, scale_D, eps):
    return rms_norm(x_BLD, scale_D, eps), (x_BLD, scale_D)


def _backward(eps, saved, g_BLD):
    x_BLD, scale_D = saved
    x32, g32 = x_BLD.astype(jnp.float32), g_BLD.astype(jnp.float32)
    r = _rms(x32, eps)  # [batch, seq, 1]
    gs = g32 * scale_D.astype(x_BLD.dtype).astype(jnp.float32)  # d loss / d (x * r)
    # d(x_j r)/d x_i = r δij - r³ x_i x_j / D
    dx = r * gs - x32 * (r * r * r) * jnp.mean(gs * x32, axis=-1, keepdims=True)
    lead = "abc"[: x_BLD.ndim - 1]
    dscale = jnp.einsum(f"{lead},{lead}d->d", r[..., 0], g32 * x32)
    return dx.astype(x_BLD.dtype), dscale.astype(scale_D.dtype)


rms_norm.defvjp(_forward, _backward)
