"""Rotary position embeddings (RoFormer), with Llama 3's long-context frequency scaling.

Kept apart from the decoder because the Hugging Face importer, the KV-cache decoder and the
context-parallel kernels all need the same angles: one definition, so a checkpoint's rotary
layout and the model's cannot drift apart.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from shardlib.core.ops import Packed


def rope_frequencies(head_dim: int, theta: float, scaling=None) -> np.ndarray:
    """Inverse frequencies [head_dim / 2] in fp32, as Hugging Face's Llama computes them.

    ``scaling`` = (factor, low_freq_factor, high_freq_factor, original_max_positions):
    Llama 3's scheme divides long wavelengths by ``factor``, keeps short ones and blends
    those in between (``rope_type="llama3"``).
    """
    inv_K = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    inv_K = inv_K.astype(np.float32)
    if scaling is None:
        return inv_K
    factor, low, high, original = scaling
    wavelen_K = 2 * np.pi / inv_K
    scaled_K = np.where(wavelen_K > original / low, inv_K / factor, inv_K)
    smooth_K = (original / wavelen_K - low) / (high - low)
    blended_K = (1 - smooth_K) * scaled_K / factor + smooth_K * scaled_K
    medium_K = (wavelen_K >= original / high) & (wavelen_K <= original / low)
    return np.where(medium_K, blended_K, scaled_K).astype(np.float32)


def rotary(x_BLHK, theta: float, positions_L=None, scaling=None):
    """Rotate pairs of features by position-dependent angles (RoFormer).

    Pairs are (i, i + head_dim/2) ("rotate_half", Hugging Face's layout; Meta's original
    checkpoints pair neighbours, see ``shardlib.interop.hf``). ``positions_L`` are the tokens' true
    positions (default 0..L-1): a strategy that reorders the sequence (zig-zag context
    parallelism) passes them so angles stay right; packed rows (``Packed``) carry per-row
    positions [batch, seq] restarting per document.
    """
    seq = x_BLHK.shape[1]
    packed = isinstance(positions_L, Packed)
    if packed:
        pos = positions_L.positions  # [batch, seq]
    else:
        pos = jnp.arange(seq) if positions_L is None else positions_L  # [seq]
    freq_K = jnp.asarray(rope_frequencies(x_BLHK.shape[-1], theta, scaling))
    angle = pos.astype(jnp.float32)[..., None] * freq_K  # [(batch,) seq, head_dim / 2]
    if packed:
        sin, cos = jnp.sin(angle)[:, :, None, :], jnp.cos(angle)[:, :, None, :]
    else:
        sin, cos = jnp.sin(angle)[None, :, None, :], jnp.cos(angle)[None, :, None, :]
    x1, x2 = jnp.split(x_BLHK.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BLHK.dtype)
