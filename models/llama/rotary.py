"""Rotary position embeddings (RoFormer), with the frequency scalings Llama-family
checkpoints carry: Llama 3's, linear (position interpolation), dynamic NTK and YaRN.

Kept apart from the decoder because the Hugging Face importer, the KV-cache decoder and the
context-parallel kernels all need the same angles: one definition, so a checkpoint's rotary
layout and the model's cannot drift apart. Each scaling follows Hugging Face's
``modeling_rope_utils`` (the same ``rope_type`` names and parameters).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from shardlib.core.ops import Packed

ROPE_TYPES = {  # rope_type -> the fields of ``rope_scaling``, in order
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_positions"),
    "linear": ("factor",),
    "dynamic": ("factor", "original_max_positions"),
    "yarn": ("factor", "original_max_positions", "beta_fast", "beta_slow", "attention_factor",
             "truncate"),
}  # fmt: skip
"""Llama 3 divides long wavelengths by ``factor`` and blends the middle band; linear divides
every frequency by ``factor``; dynamic NTK raises the base once a sequence is longer than
``original_max_positions``; YaRN blends interpolated and original frequencies by a ramp
between ``beta_fast`` and ``beta_slow`` rotations and scales cos and sin by
``attention_factor``."""


def check_scaling(rope_type: str, scaling) -> None:
    """ValueError unless ``scaling`` has the fields ``rope_type`` needs."""
    if rope_type not in ROPE_TYPES:
        raise ValueError(
            f"rope_type={rope_type!r}; supported: {', '.join(ROPE_TYPES)} (plain RoPE: "
            "rope_scaling None)."
        )
    if scaling is not None and len(scaling) != len(ROPE_TYPES[rope_type]):
        fields = ", ".join(ROPE_TYPES[rope_type])
        raise ValueError(f"rope_scaling={tuple(scaling)} for rope_type={rope_type!r}: ({fields}).")


def _plain(head_dim: int, theta) -> np.ndarray:
    return (1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))).astype(
        np.float32
    )


def _llama3(inv_K, factor, low, high, original):
    wavelen_K = 2 * np.pi / inv_K
    scaled_K = np.where(wavelen_K > original / low, inv_K / factor, inv_K)
    smooth_K = (original / wavelen_K - low) / (high - low)
    blended_K = (1 - smooth_K) * scaled_K / factor + smooth_K * scaled_K
    medium_K = (wavelen_K >= original / high) & (wavelen_K <= original / low)
    return np.where(medium_K, blended_K, scaled_K)


def _yarn(head_dim, theta, factor, original, beta_fast, beta_slow, truncate):
    def correction_dim(rotations):  # the dim whose wavelength fits ``rotations`` in context
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    high = high + 0.001 if low == high else high
    ramp_K = np.clip((np.arange(head_dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolate_K = 1 - ramp_K  # 1: the original frequency (short wavelengths)
    inv_K = _plain(head_dim, theta)
    return (inv_K / factor) * (1 - extrapolate_K) + inv_K * extrapolate_K


def rope_frequencies(
    head_dim: int, theta: float, scaling=None, rope_type: str = "llama3"
) -> tuple[np.ndarray, float]:
    """(inverse frequencies [head_dim / 2] fp32, cos/sin multiplier), as Hugging Face
    computes them for ``rope_type`` (``scaling`` None: plain RoPE). Dynamic NTK's depend on
    the sequence (``dynamic_frequencies``); this gives its short-sequence ones."""
    inv_K = _plain(head_dim, theta)
    if scaling is None or rope_type == "dynamic":
        return inv_K, 1.0
    check_scaling(rope_type, scaling)
    if rope_type == "llama3":
        return _llama3(inv_K, *scaling).astype(np.float32), 1.0
    if rope_type == "linear":
        return (inv_K / scaling[0]).astype(np.float32), 1.0
    factor, original, beta_fast, beta_slow, attention_factor, truncate = scaling
    inv_K = _yarn(head_dim, theta, factor, original, beta_fast, beta_slow, truncate)
    return inv_K.astype(np.float32), float(attention_factor)


def yarn_attention_factor(factor: float, mscale: float = 0.0, mscale_all_dim: float = 0.0):
    """YaRN's default cos/sin multiplier, 0.1 ln(factor) + 1 (DeepSeek's ratio of two
    such terms when ``mscale`` and ``mscale_all_dim`` are given), as Hugging Face's."""

    def get(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if mscale and mscale_all_dim:
        return get(factor, mscale) / get(factor, mscale_all_dim)
    return get(factor)


def dynamic_frequencies(head_dim: int, theta: float, scaling, length):
    """Dynamic NTK's inverse frequencies for sequences of ``length`` positions (traced): the
    plain ones up to ``original_max_positions``, then base theta x (factor x length /
    original - (factor - 1)) ^ (d / (d - 2))."""
    factor, original = scaling
    length = jnp.maximum(length.astype(jnp.float32), original)
    base = theta * ((factor * length / original) - (factor - 1)) ** (head_dim / (head_dim - 2))
    exponent_K = jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim
    return (1.0 / (base**exponent_K)).astype(jnp.float32)


def rotary(x_BLHK, theta: float, positions_L=None, scaling=None, rope_type: str = "llama3"):
    """Rotate pairs of features by position-dependent angles (RoFormer).

    Pairs are (i, i + head_dim/2) ("rotate_half", Hugging Face's layout; Meta's original
    checkpoints pair neighbours, see ``shardlib.interop.hf``). ``positions_L`` are the tokens' true
    positions (default 0..L-1): a strategy that reorders the sequence (zig-zag context
    parallelism) passes them so angles stay right; packed rows (``Packed``) carry per-row
    positions [batch, seq] restarting per document. ``scaling`` and ``rope_type``: the
    frequency scaling (``ROPE_TYPES``); dynamic NTK reads the longest position here, as
    Hugging Face does (max(position) + 1).
    """
    seq = x_BLHK.shape[1]
    packed = isinstance(positions_L, Packed)
    if packed:
        pos = positions_L.positions  # [batch, seq]
    else:
        pos = jnp.arange(seq) if positions_L is None else positions_L  # [seq]
    head_dim = x_BLHK.shape[-1]
    freq_K, multiplier = rope_frequencies(head_dim, theta, scaling, rope_type)
    freq_K = jnp.asarray(freq_K)
    if scaling is not None and rope_type == "dynamic":
        freq_K = dynamic_frequencies(head_dim, theta, scaling, jnp.max(pos) + 1)
    angle = pos.astype(jnp.float32)[..., None] * freq_K  # [(batch,) seq, head_dim / 2]
    sin, cos = jnp.sin(angle) * multiplier, jnp.cos(angle) * multiplier
    if packed:
        sin, cos = sin[:, :, None, :], cos[:, :, None, :]
    else:
        sin, cos = sin[None, :, None, :], cos[None, :, None, :]
    x1, x2 = jnp.split(x_BLHK.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BLHK.dtype)
