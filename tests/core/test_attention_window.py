"""Sliding-window attention (Mistral's): ``ops.attention(window=W)`` lets query i see keys
i - W < j <= i, in every kernel that takes the causal mask (``core.attention.SlidingWindow``).

A hand-written masked softmax is the reference: dense attention must equal it, and the
chunked kernel (which skips key blocks wholly outside the window), packed rows and zig-zag
ring attention on a context axis of 2 must equal dense, outputs and gradients, to 1e-5.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh

from shardlib import base_rules, compose
from shardlib.core.attention import (
    Packed,
    SlidingWindow,
    chunked_attention,
    dense_attention,
    packed_attention,
)
from shardlib.core.layout import use_layout
from shardlib.core.ops import attention, use_ops
from shardlib.parallel import context_parallel
from shardlib.parallel.context import ContextAttention

B, L, H, G, K, W = 2, 32, 4, 2, 8, 5
POS = jnp.arange(L)


@pytest.fixture(scope="module")
def qkv():
    keys = jax.random.split(jax.random.key(0), 4)
    shapes = ((B, L, H, K), (B, L, G, K), (B, L, G, K), (B, L, H, K))
    return tuple(jax.random.normal(key, shape) for key, shape in zip(keys, shapes, strict=True))


def _with_grads(fn, q, k, v, do):
    out, vjp = jax.vjp(fn, q, k, v)
    return (out, *vjp(do))


def _max_rel(got, want):
    return max(
        float(jnp.abs(a - b).max() / jnp.abs(b).max()) for a, b in zip(got, want, strict=True)
    )


def _windowed_dense(q, k, v, do):
    return _with_grads(
        lambda q, k, v: dense_attention(q, k, v, POS, POS, causal=SlidingWindow(W)), q, k, v, do
    )


def test_dense_window_is_the_masked_softmax(qkv):
    q, k, v, _ = qkv
    behind = POS[:, None] - POS[None, :]
    mask = (behind >= 0) & (behind < W)  # [L, L]
    k_rep, v_rep = jnp.repeat(k, H // G, axis=2), jnp.repeat(v, H // G, axis=2)
    s = jnp.einsum("bqhk,bthk->bhqt", q, k_rep) * K**-0.5
    p = jax.nn.softmax(jnp.where(mask, s, -jnp.inf), axis=-1)
    want = jnp.einsum("bhqt,bthk->bqhk", p, v_rep)
    got = dense_attention(q, k, v, POS, POS, causal=SlidingWindow(W))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    plain = dense_attention(q, k, v, POS, POS, causal=True)
    assert float(jnp.abs(plain - got).max()) > 1e-2  # the window changes the result


@pytest.mark.slow
def test_chunked_and_packed_windows_match_dense(qkv):
    q, k, v, do = qkv
    want = _windowed_dense(q, k, v, do)
    chunked = jax.jit(lambda q, k, v, do: _with_grads(
        lambda q, k, v: chunked_attention(q, k, v, POS, POS, causal=SlidingWindow(W), chunk=8),
        q, k, v, do))(q, k, v, do)  # fmt: skip
    assert _max_rel(chunked, want) < 1e-5
    packed = Packed(jnp.tile(POS, (B, 1)), jnp.ones((B, L), jnp.int32))  # one document a row
    got = _with_grads(
        lambda q, k, v: packed_attention(q, k, v, packed, SlidingWindow(W)), q, k, v, do
    )
    assert _max_rel(got, want) < 1e-5


@pytest.mark.slow
def test_zigzag_ring_window_matches_dense(qkv):
    q, k, v, do = qkv
    n = 2
    mesh = Mesh(np.array(jax.devices()[:n]), ("context",), axis_types=(AxisType.Auto,))
    rules = compose(base_rules(), context_parallel())
    plan = ContextAttention(kind="ring", load_balance=True, axis_size=n)
    order = plan.token_order(L)
    undo = np.argsort(order)

    def fn(q, k, v):
        with use_layout(mesh, rules), use_ops(attention=plan):
            out = attention(q[:, order], k[:, order], v[:, order], jnp.asarray(order), window=W)
        return out[:, undo]

    got = jax.jit(lambda q, k, v, do: _with_grads(fn, q, k, v, do))(q, k, v, do)
    assert _max_rel(got, _windowed_dense(q, k, v, do)) < 1e-5
