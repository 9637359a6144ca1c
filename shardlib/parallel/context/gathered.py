"""Context-parallel attention by collectives around a local kernel: Ulysses and all-gather.

Both run inside ``shard_map`` on one device's slice of the sequence and call a local
attention function ``inner(q, k, v, q_pos, k_pos)`` (dense or chunked) on what they gather.

- Ulysses (Jacobs et al. 2023, DeepSpeed-Ulysses): an all-to-all turns [s/N tokens, all
  heads] into [all tokens, h/N heads] for q, k and v; attention is then local per head and
  a fourth all-to-all turns the output back. Per device and layer 4·s·h/N elements move
  (forward), independent of N when s grows with N. Heads and K/V heads must divide by N.
- all-gather: every device gathers the whole K and V and attends with its own queries.
  Simple and head-count agnostic, but K/V memory is the full sequence's.
"""

from __future__ import annotations

import jax


def ulysses_attention(q_BLHK, k_BLGK, v_BLGK, q_pos_L, k_pos_L, *, axis_name, inner):
    """Swap sequence for heads, attend over the full sequence on h/N heads, swap back."""

    def to_heads(x):  # [B, L/N, H, K] -> [B, L, H/N, K]
        return jax.lax.all_to_all(x, axis_name, split_axis=2, concat_axis=1, tiled=True)

    q, k, v = to_heads(q_BLHK), to_heads(k_BLGK), to_heads(v_BLGK)
    q_pos = jax.lax.all_gather(q_pos_L, axis_name, tiled=True)
    k_pos = jax.lax.all_gather(k_pos_L, axis_name, tiled=True)
    out = inner(q, k, v, q_pos, k_pos)
    return jax.lax.all_to_all(out, axis_name, split_axis=1, concat_axis=2, tiled=True)


def all_gather_attention(q_BLHK, k_BLGK, v_BLGK, q_pos_L, k_pos_L, *, axis_name, inner):
    """Local queries against the gathered keys and values of the whole sequence."""

    def gather(x, axis):
        return jax.lax.all_gather(x, axis_name, axis=axis, tiled=True)

    return inner(q_BLHK, gather(k_BLGK, 1), gather(v_BLGK, 1), q_pos_L, gather(k_pos_L, 0))
