"""Llama with a KV cache: one function for prefill (T = prompt length) and decode (T = 1).

Keys and values of every layer live in one buffer [layers, batch, length, kv_heads,
head_dim] that the layer scan carries slice by slice; T new tokens at positions
``start .. start+T-1`` write theirs in place and attend to every cached position at or
before their own (causal). The blocks' norms, MLP, rotary embedding and LoRA-adapted weights
are the model's own modules, so the cached path cannot drift from ``Llama.__call__``
(tests check greedy decoding with the cache against argmax decoding without it).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

CACHE_NAMES = (None, "batch", None, "kv_heads", "head_dim")
"""Logical names of a cache buffer's dims: batch over the data axes, kv heads over tensor."""


def init_cache(cfg, batch: int, length: int, dtype=jnp.float32) -> dict:
    shape = (cfg.layers, batch, length, cfg.kv_heads, cfg.head_dim)
    return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}


def _attend_cached(attn, x_BTD, k_BSGK, v_BSGK, positions_T, start):
    """Self-attention of T new tokens against the cache, which they are first written into."""
    dt, (b, t, _) = x_BTD.dtype, x_BTD.shape
    wq, wk, wv, wo = attn.weights()
    _, h, d = wq.shape
    g = wk.shape[1]
    q_BTHK, k_BTGK, v_BTGK = attn.biased(
        jnp.einsum("btd,dhk->bthk", x_BTD, wq.astype(dt)),
        jnp.einsum("btd,dgk->btgk", x_BTD, wk.astype(dt)),
        jnp.einsum("btd,dgk->btgk", x_BTD, wv.astype(dt)),
    )
    q_BTHK, k_BTGK = attn.rotary(q_BTHK, positions_T), attn.rotary(k_BTGK, positions_T)
    at = (0, start, 0, 0)
    k_BSGK = jax.lax.dynamic_update_slice(k_BSGK, k_BTGK.astype(k_BSGK.dtype), at)
    v_BSGK = jax.lax.dynamic_update_slice(v_BSGK, v_BTGK.astype(v_BSGK.dtype), at)
    q_BTGJK = q_BTHK.reshape(b, t, g, h // g, d).astype(jnp.float32)
    scores_BGJTS = jnp.einsum("btgjk,bsgk->bgjts", q_BTGJK, k_BSGK.astype(jnp.float32))
    scores_BGJTS = scores_BGJTS * d**-0.5
    behind_TS = positions_T[:, None] - jnp.arange(k_BSGK.shape[1])[None, :]
    visible_TS = behind_TS >= 0
    if attn.window:  # sliding-window attention: only the last ``window`` keys
        visible_TS &= behind_TS < attn.window
    scores_BGJTS = jnp.where(visible_TS, scores_BGJTS, jnp.finfo(jnp.float32).min)
    probs_BGJTS = jax.nn.softmax(scores_BGJTS, axis=-1)
    out_BTGJK = jnp.einsum("bgjts,bsgk->btgjk", probs_BGJTS, v_BSGK.astype(jnp.float32))
    out_BTHK = out_BTGJK.reshape(b, t, h, d).astype(dt)
    return jnp.einsum("bthk,hkd->btd", out_BTHK, wo.astype(dt)), k_BSGK, v_BSGK


def decode(model, tokens_BT, cache: dict, start, *, dtype=jnp.float32):
    """(logits [batch, T, vocab] fp32, cache): see the module docstring."""
    positions_T = start + jnp.arange(tokens_BT.shape[1])
    x_BTD = model.embed(tokens_BT, dtype=dtype)
    block_graph, blocks_state = nnx.split(model.blocks)

    def layer(x_BTD, xs):
        layer_state, k_BSGK, v_BSGK = xs
        block = nnx.merge(block_graph, layer_state)
        out_BTD, k_BSGK, v_BSGK = _attend_cached(
            block.attn, block.attn_norm(x_BTD), k_BSGK, v_BSGK, positions_T, start
        )
        x_BTD = x_BTD + out_BTD
        x_BTD = x_BTD + block.mlp(block.mlp_norm(x_BTD))
        return x_BTD, (k_BSGK, v_BSGK)

    x_BTD, (k, v) = jax.lax.scan(layer, x_BTD, (blocks_state, cache["k"], cache["v"]))
    return model.head(x_BTD, dtype=dtype), {"k": k, "v": v}
