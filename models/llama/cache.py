"""The KV cache every decoder here generates with: one path for prefill (T = prompt length)
and decode (T = 1), shared by Llama (and Qwen2, Mistral), GPT, the MoE model (Mixtral) and
GLaM.

Keys and values of every decoder layer live in one buffer [layers, batch, length, kv_heads,
head_dim] that the layer scan carries slice by slice; T new tokens at positions
``start .. start+T-1`` write theirs in place and attend to every cached position at or
before their own (causal). What differs between the families stays in their modules:

- a scanned unit (a block, or a group of several decoder layers such as ``MoeGroup``) has
  ``decode(x_BTD, kv, positions_T, start) -> (x_BTD, kv)``; ``kv`` is its layers' slice of
  the cache, (k, v) each [batch, length, kv_heads, head_dim], with a leading [layers of the
  unit] dim when the unit holds more than one layer;
- an attention module offers what ``attend_cached`` reads: ``weights()`` (wq, wk, wv, wo,
  LoRA updates added), ``biased(q, k, v)``, ``rotary(x, positions)``, ``window`` (0: none)
  and, where it has one, an output bias ``bo``.

The norms, MLPs, routers, rotary embeddings and adapted weights are the models' own modules,
so the cached path cannot drift from their ``__call__`` (tests check greedy decoding with the
cache against argmax decoding without it, family by family).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

CACHE_NAMES = (None, "batch", None, "kv_heads", "head_dim")
"""Logical names of a cache buffer's dims: batch over the data axes, kv heads over tensor."""


def init_cache(layers: int, batch: int, length: int, kv_heads: int, head_dim: int,
               dtype=jnp.float32) -> dict:  # fmt: skip
    """Zeroed keys and values, each [layers, batch, length, kv_heads, head_dim]."""
    shape = (layers, batch, length, kv_heads, head_dim)
    return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}


def attend_cached(attn, x_BTD, kv, positions_T, start):
    """Self-attention of T new tokens against the cache, which they are first written into:
    (out [batch, T, embed], (k, v) [batch, length, kv_heads, head_dim] updated)."""
    k_BSGK, v_BSGK = kv
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
    out_BTD = jnp.einsum("bthk,hkd->btd", out_BTHK, wo.astype(dt))
    if hasattr(attn, "bo"):  # GPT's output bias
        out_BTD = out_BTD + attn.bo[...].astype(dt)
    return out_BTD, (k_BSGK, v_BSGK)


def decode(model, x_BTD, cache: dict, start, *, dtype=jnp.float32):
    """(logits [batch, T, vocab] fp32, cache) of the embedded new tokens ``x_BTD`` at
    positions start..start+T-1: ``model.blocks`` scanned unit by unit, then ``model.head``."""
    positions_T = start + jnp.arange(x_BTD.shape[1])
    block_graph, blocks_state = nnx.split(model.blocks)
    units = jax.tree.leaves(blocks_state)[0].shape[0]
    layers = cache["k"].shape[0]
    if layers % units:
        raise ValueError(f"generate: a cache of {layers} layers for {units} stacked units.")
    per_unit = layers // units
    k, v = cache["k"], cache["v"]
    if per_unit > 1:  # [units, layers of a unit, ...]: a free reshape of an unsplit dim
        k, v = (c.reshape(units, per_unit, *c.shape[1:]) for c in (k, v))

    def unit(x_BTD, xs):
        unit_state, k, v = xs
        x_BTD, kv = nnx.merge(block_graph, unit_state).decode(x_BTD, (k, v), positions_T, start)
        return x_BTD, kv

    x_BTD, (k, v) = jax.lax.scan(unit, x_BTD, (blocks_state, k, v))
    cache = {"k": k.reshape(cache["k"].shape), "v": v.reshape(cache["v"].shape)}
    return model.head(x_BTD, dtype=dtype), cache
