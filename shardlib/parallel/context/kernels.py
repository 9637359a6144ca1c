"""The kernels context parallelism runs on each device's slice of the sequence.

All three run inside ``shard_map`` (``parallel.context.attend`` sets it up) and take token
positions alongside q and k, so the causal mask stays right in any token order.

Ring attention (Liu et al. 2023, "Ring Attention with Blockwise Transformers"): K/V blocks
travel around the context axis while queries stay put. Device i starts with its own K/V block; after
folding it into the online softmax of its queries it passes the block to device i+1 with
``ppermute`` and receives the one of device i-1, N-1 times. Only one foreign K/V block is
resident at a time, so attention memory per device falls by N.

The backward pass is written by hand (``custom_vjp``) rather than differentiated through
the loop: autodiff would keep every visiting K/V block and its probabilities, which is the
memory ring attention exists to avoid. It runs the ring again, recomputing each block's
probabilities from the saved log-sum-exp; the gradients of a K/V block travel *with* the
block, collecting each device's contribution, and after N hops they are home.

Causal masking uses token positions, so blocks that lie wholly in a query block's future
are skipped (``lax.cond``), and the zig-zag token order (``zigzag_order``) gives every
device the same amount of unmasked work.

Ulysses and all-gather call a local attention function ``inner(q, k, v, q_pos, k_pos)``
(dense or chunked) on what they gather.

- Ulysses (Jacobs et al. 2023, DeepSpeed-Ulysses): an all-to-all turns [s/N tokens, all
  heads] into [all tokens, h/N heads] for q, k and v; attention is then local per head and
  a fourth all-to-all turns the output back. Per device and layer 4·s·h/N elements move
  (forward), independent of N when s grows with N. Heads and K/V heads must divide by N.
- all-gather: every device gathers the whole K and V and attends with its own queries.
  Simple and head-count agnostic, but K/V memory is the full sequence's.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from shardlib.core.attention import (
    F32,
    backward_pass,
    finish,
    forward_pass,
    from_groups,
    init_state,
    tied,
    to_groups,
)


def _shift(xs, axis_name: str, n: int):
    """Send to the next device on the ring, receive from the previous one."""
    return jax.lax.ppermute(xs, axis_name, perm=[(i, (i + 1) % n) for i in range(n)])


@partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9))
def _ring(q, k, v, q_pos, k_pos, axis_name, n, causal, q_chunk, kv_chunk):
    return _ring_fwd(q, k, v, q_pos, k_pos, axis_name, n, causal, q_chunk, kv_chunk)[0]


def _ring_fwd(q, k, v, q_pos, k_pos, axis_name, n, causal, q_chunk, kv_chunk):
    opts = dict(causal=causal, scale=q.shape[-1] ** -0.5, q_chunk=q_chunk, kv_chunk=kv_chunk)
    q, q_pos, k, v, k_pos = tied(q, q_pos, k, v, k_pos)  # see blockwise.tied

    def step(_, carry):
        state, kv = carry
        state = forward_pass(state, q, q_pos, *kv, **opts)
        return state, _shift(kv, axis_name, n)

    # N-1 (fold, pass) steps, then fold the last visitor: it need not travel on.
    state, kv = jax.lax.fori_loop(0, n - 1, step, (init_state(q), (k, v, k_pos)))
    out, lse = finish(forward_pass(state, q, q_pos, *kv, **opts))
    out = out.astype(q.dtype)
    return out, (q, k, v, q_pos, k_pos, out, lse)


def _ring_bwd(axis_name, n, causal, q_chunk, kv_chunk, res, do):
    q, k, v, q_pos, k_pos, out, lse, do = tied(*res, do)
    opts = dict(causal=causal, scale=q.shape[-1] ** -0.5, q_chunk=q_chunk, kv_chunk=kv_chunk)
    delta = jnp.sum(do.astype(F32) * out.astype(F32), axis=-1)

    def fold(dq, kv, dkv):
        gq, gk, gv = backward_pass(q, q_pos, *kv, do, lse, delta, **opts)
        return dq + gq, (dkv[0] + gk, dkv[1] + gv)

    def step(_, carry):
        dq, kv, dkv = carry
        dq, dkv = fold(dq, kv, dkv)
        return dq, _shift(kv, axis_name, n), _shift(dkv, axis_name, n)

    zeros = (jnp.zeros(k.shape, F32), jnp.zeros(v.shape, F32))
    dq, kv, dkv = jax.lax.fori_loop(0, n - 1, step, (jnp.zeros(q.shape, F32), (k, v, k_pos), zeros))
    dq, dkv = fold(dq, kv, dkv)
    dk, dv = _shift(dkv, axis_name, n)  # the N-th hop brings each block's gradient home
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None


_ring.defvjp(_ring_fwd, _ring_bwd)


def ring_attention(
    q_BLHK, k_BLGK, v_BLGK, q_pos_L, k_pos_L, *, axis_name, axis_size, causal, chunk
):
    """One device's queries against the whole sequence's keys, passed around ``axis_name``.

    Arguments are this device's shards: ``q_pos_L``/``k_pos_L`` are the global positions of
    its tokens. ``chunk`` is the query/key block length inside one ring step (it must tile
    the local length; zig-zag passes half of it so each half is masked on its own).
    """
    g = k_BLGK.shape[2]
    q = to_groups(q_BLHK, g)
    out = _ring(q, k_BLGK, v_BLGK, q_pos_L, k_pos_L, axis_name, axis_size, causal, chunk, chunk)
    return from_groups(out)


# --- Ulysses and all-gather: collectives around a local kernel ------------------------------


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
