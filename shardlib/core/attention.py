"""Attention on one device: dense, chunked (online softmax) and cuDNN, and packed documents.

``LocalAttention`` is what ``shardlib.core.ops.attention`` runs when no strategy installs
another form (``use_ops``); a strategy that splits the sequence over a mesh axis wraps it in
collectives across that axis and reuses the blockwise arithmetic below.

Softmax over a row of scores needs the row's maximum and sum; processed block by block, a
running maximum ``m`` and sum ``l`` are kept per query and the partial output is rescaled by
``exp(m_old - m_new)`` whenever the maximum grows (Milakov & Gimelshein 2018; Rabe & Staats
2021; FlashAttention). The backward pass recomputes each block's probabilities from the
saved log-sum-exp instead of storing them, so memory stays linear in the sequence length.

Every function takes token *positions* alongside q and k: the causal mask is ``q_pos >=
k_pos``, which stays right when the sequence is split or permuted across devices (ring
attention's zig-zag order), and a block whose keys all lie after its queries is skipped.

Internal layouts (G key/value heads, R query heads per K/V head, Q queries, T keys):
q, do, out ``[B, G, R, Q, K]``; k, v ``[B, T, G, K]``; statistics ``[B, G, R, Q]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import jax
import jax.numpy as jnp

from shardlib.core.errors import ShardingError

NEG_INF = -1e30  # finite: exp(NEG_INF - NEG_INF) must stay a number for all-masked rows
F32 = jnp.float32


def to_groups(x_BLHK, groups: int):
    """[B, L, H, K] -> [B, G, R, L, K]: query heads grouped under their K/V head."""
    b, l, h, k = x_BLHK.shape
    return x_BLHK.reshape(b, l, groups, h // groups, k).transpose(0, 2, 3, 1, 4)


def from_groups(x_BGRLK):
    """[B, G, R, L, K] -> [B, L, H, K]."""
    b, g, r, l, k = x_BGRLK.shape
    return x_BGRLK.transpose(0, 3, 1, 2, 4).reshape(b, l, g * r, k)


class SlidingWindow(int):
    """A causal mask limited to each query's last ``n`` keys (itself included): Mistral's
    sliding-window attention. Passed where the kernels take ``causal`` (it is truthy, so
    every causal path applies), it adds q_pos - k_pos < n to the mask and the block skips."""

    def __repr__(self) -> str:
        return f"SlidingWindow({int(self)})"


def _mask(q_pos_Q, k_pos_T, causal: bool):
    if not causal:
        return None
    mask_QT = q_pos_Q[:, None] >= k_pos_T[None, :]  # [Q, T]
    if isinstance(causal, SlidingWindow):
        mask_QT &= q_pos_Q[:, None] - k_pos_T[None, :] < int(causal)
    return mask_QT


def _scores(q_BGRQK, k_BTGK, q_pos, k_pos, causal, scale):
    """Scaled scores [B, G, R, Q, T] in fp32, NEG_INF where masked, and the mask."""
    s = jnp.einsum("bgrqk,btgk->bgrqt", q_BGRQK, k_BTGK, preferred_element_type=F32) * scale
    mask = _mask(q_pos, k_pos, causal)
    if mask is not None:
        s = jnp.where(mask, s, NEG_INF)
    return s, mask


def fwd_block(state, q, k, v, q_pos, k_pos, *, causal: bool, scale: float):
    """Fold one block of keys/values into the running (out, max, sum) of a block of queries."""
    o_BGRQK, m_BGRQ, l_BGRQ = state
    s, mask = _scores(q, k, q_pos, k_pos, causal, scale)
    m_new = jnp.maximum(m_BGRQ, s.max(-1))
    p = jnp.exp(s - m_new[..., None])
    if mask is not None:
        p = jnp.where(mask, p, 0.0)  # rows masked so far have m_new = NEG_INF and exp(0) = 1
    corr = jnp.exp(m_BGRQ - m_new)
    pv = jnp.einsum("bgrqt,btgk->bgrqk", p.astype(v.dtype), v, preferred_element_type=F32)
    return o_BGRQK * corr[..., None] + pv, m_new, l_BGRQ * corr + p.sum(-1)


def bwd_block(q, k, v, do, lse, delta, q_pos, k_pos, *, causal: bool, scale: float):
    """Gradients of one (query block, key block) pair from the saved log-sum-exp."""
    s, mask = _scores(q, k, q_pos, k_pos, causal, scale)
    p = jnp.exp(s - lse[..., None])
    if mask is not None:
        p = jnp.where(mask, p, 0.0)
    dv = jnp.einsum("bgrqt,bgrqk->btgk", p, do, preferred_element_type=F32)
    dp = jnp.einsum("bgrqk,btgk->bgrqt", do, v, preferred_element_type=F32)
    ds = p * (dp - delta[..., None])
    dq = jnp.einsum("bgrqt,btgk->bgrqk", ds, k, preferred_element_type=F32) * scale
    dk = jnp.einsum("bgrqt,bgrqk->btgk", ds, q, preferred_element_type=F32) * scale
    return dq, dk, dv


def init_state(q_BGRQK):
    b, g, r, q, k = q_BGRQK.shape
    return (
        jnp.zeros((b, g, r, q, k), F32),
        jnp.full((b, g, r, q), NEG_INF, F32),
        jnp.zeros((b, g, r, q), F32),
    )


def finish(state):
    """Normalised output (fp32) and the log-sum-exp the backward pass needs."""
    o, m, l = state
    return o / l[..., None], m + jnp.log(l)


def _visible(q_pos_c, k_pos_c, causal: bool):
    """Does any query of this block see any key of that block? (else the block is skipped)"""
    if not causal:
        return jnp.bool_(True)
    seen = jnp.max(q_pos_c) >= jnp.min(k_pos_c)
    if isinstance(causal, SlidingWindow):  # and not every key too far behind
        seen &= jnp.min(q_pos_c) - jnp.max(k_pos_c) < int(causal)
    return seen


def _chunks(x, n: int, axis: int):
    """Split ``axis`` into ``n`` chunks stacked in front: scan over them."""
    shape = x.shape[:axis] + (n, x.shape[axis] // n) + x.shape[axis + 1 :]
    return jnp.moveaxis(x.reshape(shape), axis, 0)


def _unchunk(x, axis: int):
    x = jnp.moveaxis(x, 0, axis)
    return x.reshape(x.shape[:axis] + (-1,) + x.shape[axis + 2 :])


def _slice(x, j, size: int, axis: int):
    return jax.lax.dynamic_slice_in_dim(x, j * size, size, axis)


def forward_pass(state, q, q_pos, k, v, k_pos, *, causal, scale, q_chunk, kv_chunk):
    """Fold all of ``k``/``v`` into ``state`` for all queries, chunk pair by chunk pair."""
    nq, nk = q.shape[3] // q_chunk, k.shape[1] // kv_chunk
    fold = partial(fwd_block, causal=causal, scale=scale)

    def per_query_chunk(_, xs):
        q_c, qp_c, *st = xs

        def per_key_chunk(j, st):
            k_c, v_c = _slice(k, j, kv_chunk, 1), _slice(v, j, kv_chunk, 1)
            kp_c = _slice(k_pos, j, kv_chunk, 0)
            return jax.lax.cond(
                _visible(qp_c, kp_c, causal),
                lambda st: fold(st, q_c, k_c, v_c, qp_c, kp_c),
                lambda st: st,
                st,
            )

        return None, jax.lax.fori_loop(0, nk, per_key_chunk, tuple(st))

    xs = (_chunks(q, nq, 3), _chunks(q_pos, nq, 0), *(_chunks(a, nq, 3) for a in state))
    _, out = jax.lax.scan(per_query_chunk, None, xs)
    return tuple(_unchunk(a, 3) for a in out)


def backward_pass(q, q_pos, k, v, k_pos, do, lse, delta, *, causal, scale, q_chunk, kv_chunk):
    """(dq, dk, dv) in fp32 of all queries against all of ``k``/``v``, chunk pair by pair."""
    nq, nk = q.shape[3] // q_chunk, k.shape[1] // kv_chunk
    grads = partial(bwd_block, causal=causal, scale=scale)

    def per_query_chunk(dkv, xs):
        q_c, qp_c, do_c, lse_c, delta_c = xs

        def per_key_chunk(j, carry):
            dq_c, dk, dv = carry
            k_c, v_c = _slice(k, j, kv_chunk, 1), _slice(v, j, kv_chunk, 1)
            kp_c = _slice(k_pos, j, kv_chunk, 0)

            def add(carry):
                dq_c, dk, dv = carry
                gq, gk, gv = grads(q_c, k_c, v_c, do_c, lse_c, delta_c, qp_c, kp_c)
                dk = jax.lax.dynamic_update_slice_in_dim(
                    dk, _slice(dk, j, kv_chunk, 1) + gk, j * kv_chunk, 1
                )
                dv = jax.lax.dynamic_update_slice_in_dim(
                    dv, _slice(dv, j, kv_chunk, 1) + gv, j * kv_chunk, 1
                )
                return dq_c + gq, dk, dv

            return jax.lax.cond(_visible(qp_c, kp_c, causal), add, lambda c: c, carry)

        dq_c, dk, dv = jax.lax.fori_loop(0, nk, per_key_chunk, (jnp.zeros(q_c.shape, F32), *dkv))
        return (dk, dv), dq_c

    zeros_kv = (jnp.zeros(k.shape, F32), jnp.zeros(v.shape, F32))
    xs = tuple(_chunks(a, nq, 3) for a in (q, do, lse, delta))
    xs = (xs[0], _chunks(q_pos, nq, 0), *xs[1:])
    (dk, dv), dq = jax.lax.scan(per_query_chunk, zeros_kv, xs)
    return _unchunk(dq, 3), dk, dv


def tied(*xs):
    """Tie a blockwise pass's inputs together so none of its work is hoisted out of a loop.

    Inside the model's differentiated layer scan, jax (0.10 and 0.12) moves computations
    that depend only on loop constants (here: keys and positions, hence every block's mask
    and skip test) out of the loop and keeps their results for every block: O(s²) memory
    again. An optimization barrier over all inputs makes everything depend on the queries.
    """
    return jax.lax.optimization_barrier(xs)


def pick_chunk(length: int, want: int) -> int:
    """The largest divisor of ``length`` that is at most ``want`` (chunks must tile exactly)."""
    for size in range(min(want, length), 0, -1):
        if length % size == 0:
            return size
    return 1


# --- one device: dense reference and chunked (memory-efficient) attention ----------------------


def dense_attention(q_BLHK, k_BTGK, v_BTGK, q_pos_L, k_pos_T, *, causal: bool = True):
    """Plain softmax attention with grouped K/V heads (fp32 softmax): the reference."""
    g, d = k_BTGK.shape[2], q_BLHK.shape[-1]
    q = to_groups(q_BLHK, g)
    s, mask = _scores(q, k_BTGK, q_pos_L, k_pos_T, causal, d**-0.5)
    probs = jax.nn.softmax(s, axis=-1).astype(v_BTGK.dtype)
    out = jnp.einsum("bgrqt,btgk->bgrqk", probs, v_BTGK)
    return from_groups(out).astype(q_BLHK.dtype)


@partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _chunked(q, k, v, q_pos, k_pos, causal, q_chunk, kv_chunk):
    return _chunked_fwd(q, k, v, q_pos, k_pos, causal, q_chunk, kv_chunk)[0]


def _chunked_fwd(q, k, v, q_pos, k_pos, causal, q_chunk, kv_chunk):
    opts = dict(causal=causal, scale=q.shape[-1] ** -0.5, q_chunk=q_chunk, kv_chunk=kv_chunk)
    state = forward_pass(init_state(q), *tied(q, q_pos, k, v, k_pos), **opts)
    out, lse = finish(state)
    out = out.astype(q.dtype)
    return out, (q, k, v, q_pos, k_pos, out, lse)


def _chunked_bwd(causal, q_chunk, kv_chunk, res, do):
    q, k, v, q_pos, k_pos, out, lse, do = tied(*res, do)
    delta = jnp.sum(do.astype(F32) * out.astype(F32), axis=-1)  # [B, G, R, Q]
    opts = dict(causal=causal, scale=q.shape[-1] ** -0.5, q_chunk=q_chunk, kv_chunk=kv_chunk)
    dq, dk, dv = backward_pass(q, q_pos, k, v, k_pos, do, lse, delta, **opts)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None


_chunked.defvjp(_chunked_fwd, _chunked_bwd)


def chunked_attention(q_BLHK, k_BTGK, v_BTGK, q_pos_L, k_pos_T, *, causal=True, chunk=512):
    """Attention in (query chunk, key chunk) blocks: temp memory O(chunk²), not O(L·T).

    Forward and backward both loop over chunk pairs and skip the ones the causal mask hides
    entirely; only the output and one log-sum-exp per query are kept for the backward pass.
    """
    g = k_BTGK.shape[2]
    q_chunk = pick_chunk(q_BLHK.shape[1], chunk)
    kv_chunk = pick_chunk(k_BTGK.shape[1], chunk)
    q = to_groups(q_BLHK, g)
    return from_groups(_chunked(q, k_BTGK, v_BTGK, q_pos_L, k_pos_T, causal, q_chunk, kv_chunk))


# --- packed documents and the per-device choice of kernel --------------------------------------

IMPLS = ("auto", "dense", "chunked", "cudnn")
"""``auto`` is replaced by one of the others when the plan meets the model and its devices
(``ParallelPlan.for_workload``, ``parallel.context.choice``); it never runs as such."""


@partial(jax.tree_util.register_dataclass, data_fields=["positions", "segments"], meta_fields=[])
@dataclass(frozen=True)
class Packed:
    """Positions and document ids of packed rows: several documents share one row.

    Passed where a model takes ``positions_L``: RoPE reads the per-row ``positions`` (they
    restart at 0 for each document) and attention keeps each query inside its own document
    (``segments`` equal) as well as causal. Segment 0 is padding.
    """

    positions: jax.Array = field()  # [batch, seq] int32, 0.. within each document
    segments: jax.Array = field()  # [batch, seq] int32, 1.. per document in the row, 0: pad


def packed_attention(q_BLHK, k_BTGK, v_BTGK, packed: Packed, causal=True):
    """Dense attention with grouped K/V heads, causal within each packed document only
    (and within a ``SlidingWindow``, when ``causal`` is one)."""
    g, d = k_BTGK.shape[2], q_BLHK.shape[-1]
    q_BGRQK = to_groups(q_BLHK, g)
    s_BGRQT = jnp.einsum(
        "bgrqk,btgk->bgrqt", q_BGRQK, k_BTGK, preferred_element_type=jnp.float32
    ) * (d**-0.5)
    pos_BL, seg_BL = packed.positions, packed.segments
    same_BQT = seg_BL[:, :, None] == seg_BL[:, None, :]
    mask_BQT = same_BQT & (pos_BL[:, :, None] >= pos_BL[:, None, :])
    if isinstance(causal, SlidingWindow):
        mask_BQT &= pos_BL[:, :, None] - pos_BL[:, None, :] < int(causal)
    s_BGRQT = jnp.where(mask_BQT[:, None, None], s_BGRQT, NEG_INF)
    probs = jax.nn.softmax(s_BGRQT, axis=-1).astype(v_BTGK.dtype)
    out_BGRQK = jnp.einsum("bgrqt,btgk->bgrqk", probs, v_BTGK)
    return from_groups(out_BGRQK).astype(q_BLHK.dtype)


def _cudnn(q, k, v, q_pos, k_pos, *, causal):
    # cuDNN's fused kernel knows only the natural order: plans never pair it with zig-zag.
    window = (int(causal) - 1, 0) if isinstance(causal, SlidingWindow) else None
    return jax.nn.dot_product_attention(
        q, k, v, is_causal=bool(causal), local_window_size=window, implementation="cudnn"
    )


def packed_cudnn_attention(q_BLHK, k_BTGK, v_BTGK, packed: Packed, causal=True):
    """Packed rows through cuDNN's fused kernel: the document mask as the kernel's mask.

    JAX's public call takes a boolean mask, which it turns into an additive bias of
    [batch, 1, L, T] in the compute dtype (bf16 at seq 2048: 8 MiB per row, against the
    fp32 [batch, heads, L, T] scores dense attention streams). Documents are contiguous in
    a row, so causal in the row's order is causal within each document. The packed (THD)
    layout that would skip the masked blocks is reachable only through ``jax._src``.
    """
    seg_BL = packed.segments
    same_B1QT = (seg_BL[:, :, None] == seg_BL[:, None, :])[:, None]  # [batch, 1, L, T]
    window = (int(causal) - 1, 0) if isinstance(causal, SlidingWindow) else None
    return jax.nn.dot_product_attention(
        q_BLHK,
        k_BTGK,
        v_BTGK,
        mask=same_B1QT,
        is_causal=True,
        local_window_size=window,
        implementation="cudnn",
    )


@dataclass(frozen=True)
class LocalAttention:
    """Attention on one device's whole sequence: the default form of ``ops.attention``."""

    impl: str = "dense"
    """dense (O(s²) scores), chunked (online softmax, O(chunk²)) or cudnn (GPU only); auto
    only as a request not yet decided."""
    chunk: int = 512
    """Query/key block length of chunked attention."""

    def __post_init__(self) -> None:
        if self.impl not in IMPLS:
            raise ShardingError(
                f"attention_impl={self.impl!r} is unknown. Fix: use one of {', '.join(IMPLS)}."
            )
        if self.chunk < 1:
            raise ShardingError(f"attention_chunk={self.chunk} must be >= 1.")

    def decided(self) -> None:
        """Refuse to run ``auto``: it is a request, decided before the step is traced."""
        if self.impl == "auto":
            raise ShardingError(
                "attention_impl=auto is decided when the plan meets the model and its devices "
                "(ParallelPlan.for_workload); this plan was not. Fix: call "
                "plan.for_workload(workload) first, or set attention_impl=dense|chunked|cudnn."
            )

    def kernel(self, causal: bool, length: int):
        """``inner(q, k, v, q_pos, k_pos)`` for sequences of ``length`` tokens."""
        self.decided()
        if self.impl == "chunked":
            return partial(chunked_attention, causal=causal, chunk=pick_chunk(length, self.chunk))
        if self.impl == "cudnn":
            return partial(_cudnn, causal=causal)
        return partial(dense_attention, causal=causal)

    def check_packed(self) -> None:
        """Packed rows (document masks) run the dense or the cuDNN kernel: chunked attention
        has no document mask."""
        if self.impl == "chunked":
            raise ShardingError(
                f"packed documents (a prepared dataset) need dense or cuDNN attention; this "
                f"run uses attention_impl={self.impl}. Fix: attention_impl=dense (or cudnn on "
                "a GPU), or a flat token file."
            )

    def __call__(self, q_BLHK, k_BLGK, v_BLGK, positions_L=None, *, causal: bool = True):
        """[B, L, H, K] -> [B, L, H, K]; ``positions_L`` true positions or ``Packed`` rows."""
        if isinstance(positions_L, Packed):
            self.check_packed()
            self.decided()
            if self.impl == "cudnn":
                return packed_cudnn_attention(q_BLHK, k_BLGK, v_BLGK, positions_L, causal)
            return packed_attention(q_BLHK, k_BLGK, v_BLGK, positions_L, causal)
        seq = q_BLHK.shape[1]
        pos = jnp.arange(seq, dtype=jnp.int32) if positions_L is None else positions_L
        return self.kernel(causal, seq)(q_BLHK, k_BLGK, v_BLGK, pos, pos)
