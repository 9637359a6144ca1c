"""LoRA adapters (Hu et al. 2021) on a decoder's projections (Llama's and GPT's), as
``nnx.LoRAParam`` factors.

The adapted projection is ``x @ W + (alpha / rank) * (x @ A) @ B``: ``nnx.LoRALinear``'s
math, applied on the activations (``update``) beside the model's fused q/k/v and gate/up
products, so the backward pass never forms a full-size weight gradient (the frozen base
weights get none at all). Inference and export use the merged weight
``W + (alpha / rank) * A @ B`` (``adapted``). ``nnx.LoRAParam`` is a
``nnx.Param`` subclass, so checkpoints carry the adapters; the trainer's optimizer filters
on it to freeze the base weights.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

init_normal = nnx.initializers.normal


def add_lora(
    module: nnx.Module,
    cfg,
    rngs: nnx.Rngs,
    target: str,
    w: nnx.Param,
    names: tuple[str, ...],
    inputs: int,
) -> None:
    """Give ``module`` LoRA factors for weight ``w`` (its first ``inputs`` dims are inputs).

    A [*in, rank] starts random and B [rank, *out] at zero, so the adapted model starts equal
    to the base one; each factor keeps its base weight's logical names on the dims it shares
    with it (the rank dim is replicated), so it is sharded like the base weight.
    """
    if not cfg.lora_rank or target not in cfg.lora_targets:
        return
    shape, r = tuple(w.shape), cfg.lora_rank
    fan_in = int(np.prod(shape[:inputs]))
    init_a = nnx.with_partitioning(init_normal(fan_in**-0.5), (*names[:inputs], None))
    init_b = nnx.with_partitioning(nnx.initializers.zeros, (None, *names[inputs:]))
    a = nnx.LoRAParam(init_a(rngs.params(), (*shape[:inputs], r), jnp.float32))
    b = nnx.LoRAParam(init_b(rngs.params(), (r, *shape[inputs:]), jnp.float32))
    setattr(module, f"lora_{target}_a", a)  # [*in, rank]
    setattr(module, f"lora_{target}_b", b)  # [rank, *out]


def add_attention_lora(module: nnx.Module, cfg, rngs: nnx.Rngs) -> None:
    """LoRA factors for an attention module's q, k, v and o projections (``wq``, ``wk``,
    ``wv`` [embed, heads or kv_heads, head_dim], ``wo`` [heads, head_dim, embed]), where
    ``cfg.lora_targets`` names them: Llama's and GPT's attention alike."""
    for t, w, names in (
        ("q", module.wq, ("embed", "heads", "head_dim")),
        ("k", module.wk, ("embed", "kv_heads", "head_dim")),
        ("v", module.wv, ("embed", "kv_heads", "head_dim")),
    ):
        add_lora(module, cfg, rngs, t, w, names, inputs=1)
    add_lora(module, cfg, rngs, "o", module.wo, ("heads", "head_dim", "embed"), inputs=2)


def adapted(module: nnx.Module, target: str, w: nnx.Param, lora_scale: float) -> jax.Array:
    """``w`` plus its LoRA update (alpha / rank) * A @ B, or ``w`` itself without adapters."""
    a = getattr(module, f"lora_{target}_a", None)
    if a is None:
        return w[...]
    b = getattr(module, f"lora_{target}_b")
    return w[...] + lora_scale * jnp.tensordot(a[...], b[...], axes=1)


def update(module: nnx.Module, target: str, x, inputs: int, lora_scale: float):
    """(alpha / rank) * (x @ A) @ B for input ``x`` (its last ``inputs`` dims contract with
    A), or 0 without adapters: [..., *in] -> [..., *out], in ``x``'s dtype."""
    a = getattr(module, f"lora_{target}_a", None)
    if a is None:
        return 0
    b = getattr(module, f"lora_{target}_b")
    dt = x.dtype
    xa = jnp.tensordot(x, a[...].astype(dt), axes=inputs)  # [..., rank]
    return lora_scale * jnp.tensordot(xa, b[...].astype(dt), axes=1)


def merge(flat: dict, model: dict, weights: dict[str, str]) -> dict:
    """Base weights with (alpha / rank) * A @ B added, adapters dropped: the parameters to
    export. ``flat``: paths -> arrays (numpy or jax); ``model``: the config fields;
    ``weights``: LoRA target -> the block weight its factors adapt (``attn/wq``)."""
    rank = model.get("lora_rank", 0)
    out = {k: v for k, v in flat.items() if "/lora_" not in k}
    if not rank:
        return out
    scale = model["lora_alpha"] / rank
    for target, weight in weights.items():
        module = weight.rpartition("/")[0]
        a = flat.get(f"blocks/{module}/lora_{target}_a")
        if a is None:
            continue
        b = flat[f"blocks/{module}/lora_{target}_b"]
        w = out[f"blocks/{weight}"]
        xp = np if isinstance(w, np.ndarray) else jnp
        layers = w.shape[0]
        a_LIR, b_LRO = a.reshape(layers, -1, rank), b.reshape(layers, rank, -1)
        delta = xp.matmul(a_LIR, b_LRO).reshape(w.shape)  # [layers, *in, *out]
        out[f"blocks/{weight}"] = (w + scale * delta).astype(w.dtype)
    return out
