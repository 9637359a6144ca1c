"""Compressed communication: packed sign bits (1-bit Adam) and block-quantized integers
(ZeRO++), as pure array functions that a ``shard_map`` body calls around its collectives.

The collective must carry the compressed dtype, so compression happens *before* it:
``pack_signs`` turns 8 signs into one uint8 and ``quantize_blocks`` turns a block of floats
into int8 (or two int4 per uint8) plus one fp32 scale per block. Dequantizing happens after
the collective on the receiving device.

Why these scales: for a sign code ``s * sign(x)`` the L2-optimal scale is ``mean(|x|)``
(minimise ``|x - s sign(x)|^2`` over ``s``); DeepSpeed uses the RMS instead, which
over-shoots by ``rms / mean|x|`` >= 1 and leaves more for error feedback to repair. For the
integer codes the scale is the block's absolute maximum over the largest code (symmetric,
no zero point), as ZeRO++ does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

BITS = np.arange(8, dtype=np.uint8)  # bit i of a packed byte holds element i of 8


def pack_signs(x_CK: jax.Array) -> jax.Array:
    """[C, K] floats -> [C, K / 8] uint8: bit set where ``x >= 0`` (K a multiple of 8)."""
    c, k = x_CK.shape
    bits = (x_CK >= 0).astype(jnp.uint8).reshape(c, k // 8, 8)
    return jnp.sum(bits << BITS, axis=-1, dtype=jnp.uint8)


def unpack_signs(packed_CB: jax.Array) -> jax.Array:
    """[C, K / 8] uint8 -> [C, K] fp32 signs (+1 / -1)."""
    c, b = packed_CB.shape
    bits = (packed_CB[..., None] >> BITS) & 1  # [C, K/8, 8]
    return (bits.astype(jnp.float32) * 2 - 1).reshape(c, b * 8)


def onebit_compress(x_CK: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One scale per chunk: (packed [C, K/8] uint8, scale [C] fp32, error [C, K] fp32).

    ``error = x - scale * sign(x)`` is what the code lost; error feedback adds it to the next
    step's input so that nothing is lost for good (Tang et al. 2021, Alg. 1).
    """
    scale_C = jnp.mean(jnp.abs(x_CK), axis=-1)
    packed = pack_signs(x_CK)
    error = x_CK - scale_C[:, None] * jnp.where(x_CK >= 0, 1.0, -1.0)
    return packed, scale_C, error


def onebit_decompress(packed_CB: jax.Array, scale_C: jax.Array) -> jax.Array:
    """[C, K/8] uint8 and [C] scales -> [C, K] fp32."""
    return unpack_signs(packed_CB) * scale_C[:, None]


def quantize_blocks(x_NK: jax.Array, bits: int) -> tuple[jax.Array, jax.Array]:
    """[..., K] floats in blocks of K -> (codes, scale [...] fp32), symmetric.

    ``bits=8``: int8 codes [..., K]. ``bits=4``: codes in [-7, 7] packed two per uint8,
    [..., K / 2] (K even), the lower nibble first.
    """
    top = 2 ** (bits - 1) - 1  # 127 or 7
    amax = jnp.max(jnp.abs(x_NK), axis=-1)
    scale = jnp.where(amax > 0, amax / top, 1.0).astype(jnp.float32)
    q = jnp.clip(jnp.round(x_NK / scale[..., None]), -top, top).astype(jnp.int8)
    if bits == 8:
        return q, scale
    nib = (q + 8).astype(jnp.uint8).reshape(*q.shape[:-1], q.shape[-1] // 2, 2)  # 1..15
    return nib[..., 0] | (nib[..., 1] << 4), scale


def dequantize_blocks(codes: jax.Array, scale: jax.Array, bits: int) -> jax.Array:
    """Inverse of ``quantize_blocks`` (up to rounding): [..., K] fp32."""
    if bits == 4:
        lo = (codes & 0xF).astype(jnp.int8) - 8
        hi = (codes >> 4).astype(jnp.int8) - 8
        codes = jnp.stack([lo, hi], axis=-1).reshape(*codes.shape[:-1], codes.shape[-1] * 2)
    return codes.astype(jnp.float32) * scale[..., None]


def check_bits(bits: int, what: str) -> None:
    """Only the two codes ZeRO++ uses."""
    from shardlib.core.errors import ShardingError

    if bits not in (4, 8):
        raise ShardingError(f"{what}={bits}: quantized communication uses 4 or 8 bits.")
