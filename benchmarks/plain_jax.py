"""The peers table's baseline: the same Llama step written by hand in plain JAX.

No shardlib here: every weight gets a hand-written ``PartitionSpec`` per mesh, the step is
``jax.jit`` with donated state, the optimizer optax AdamW, and remat is ``jax.checkpoint``
on the scanned layer. It is what a careful user writes without a framework, so that
``benchmarks/peers.py`` can show what shardlib costs (or saves) on the same model: a
small decoder (vocab 8192, width 512, 8 heads of 64, SwiGLU 2048, 4 layers, untied head).
Heads and key/value heads are equal in this model, so attention needs no grouping.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


@dataclass(frozen=True)
class Shape:
    """The decoder's sizes (the peers.py model by default)."""

    vocab: int = 8192
    embed: int = 512
    heads: int = 8
    head_dim: int = 64
    mlp: int = 2048
    layers: int = 4
    eps: float = 1e-5
    theta: float = 10_000.0


# Hand-written layouts, one per mesh: the parameters' specs and the activations' batch.
# fsdp: every weight split on its embed dim; 3d: embed on fsdp, heads/mlp/vocab on tensor
# (Megatron), batch on data x fsdp; tp: Megatron alone, batch whole. Norms stay replicated.
LAYOUTS = {
    "fsdp": {
        "embedding": P(None, "fsdp"),  # [vocab, embed]
        "lm_head": P("fsdp", None),  # [embed, vocab]
        "wq": P(None, "fsdp"),  # [layers, embed, heads, head_dim] (wk, wv alike)
        "wo": P(None, None, None, "fsdp"),  # [layers, heads, head_dim, embed]
        "w_in": P(None, "fsdp"),  # [layers, embed, mlp] (gate and up)
        "w_down": P(None, None, "fsdp"),  # [layers, mlp, embed]
        "batch": "fsdp",
        "vocab": None,
    },
    "3d": {
        "embedding": P("tensor", "fsdp"),
        "lm_head": P("fsdp", "tensor"),
        "wq": P(None, "fsdp", "tensor"),
        "wo": P(None, "tensor", None, "fsdp"),
        "w_in": P(None, "fsdp", "tensor"),
        "w_down": P(None, "tensor", "fsdp"),
        "batch": ("data", "fsdp"),
        "vocab": "tensor",
    },
    "tp": {
        "embedding": P("tensor", None),
        "lm_head": P(None, "tensor"),
        "wq": P(None, None, "tensor"),
        "wo": P(None, "tensor"),
        "w_in": P(None, None, "tensor"),
        "w_down": P(None, "tensor"),
        "batch": None,
        "vocab": "tensor",
    },
}
MESHES = {"fsdp": {"fsdp": 8}, "3d": {"data": 2, "fsdp": 2, "tensor": 2}, "tp": {"tensor": 8}}


def make_mesh(name: str) -> jax.sharding.Mesh:
    axes = MESHES[name]
    auto = (jax.sharding.AxisType.Auto,) * len(axes)
    return jax.make_mesh(tuple(axes.values()), tuple(axes), axis_types=auto)


def param_specs(layout: dict) -> dict:
    w = layout
    blocks = {
        "attn_norm": P(),  # [layers, embed]
        "wq": w["wq"],
        "wk": w["wq"],
        "wv": w["wq"],
        "wo": w["wo"],
        "mlp_norm": P(),
        "w_gate": w["w_in"],
        "w_up": w["w_in"],
        "w_down": w["w_down"],
    }
    top = {"embedding": w["embedding"], "lm_head": w["lm_head"], "final_norm": P()}
    return {**top, "blocks": blocks}


def init_params(key, s: Shape) -> dict:
    """Normal(1/sqrt(fan_in)) weights, unit norms, as shardlib's Llama initialises them."""
    ks = iter(jax.random.split(key, 9))
    n, e, h, d, f = s.layers, s.embed, s.heads, s.head_dim, s.mlp

    def normal(shape, fan_in):
        return jax.random.normal(next(ks), shape, jnp.float32) * fan_in**-0.5

    blocks = {
        "attn_norm": jnp.ones((n, e)),
        "wq": normal((n, e, h, d), e),
        "wk": normal((n, e, h, d), e),
        "wv": normal((n, e, h, d), e),
        "wo": normal((n, h, d, e), h * d),
        "mlp_norm": jnp.ones((n, e)),
        "w_gate": normal((n, e, f), e),
        "w_up": normal((n, e, f), e),
        "w_down": normal((n, f, e), f),
    }
    return {
        "embedding": normal((s.vocab, e), 1),
        "lm_head": normal((e, s.vocab), e),
        "final_norm": jnp.ones((e,)),
        "blocks": blocks,
    }


def rms_norm(x, scale, eps):
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return x32.astype(x.dtype) * scale.astype(x.dtype)


def rope(x_BLHD, theta):
    d = x_BLHD.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, d, 2, dtype=np.float32) / d)
    angle = jnp.arange(x_BLHD.shape[1], dtype=jnp.float32)[:, None] * inv  # [seq, d/2]
    sin, cos = jnp.sin(angle)[None, :, None], jnp.cos(angle)[None, :, None]
    x1, x2 = jnp.split(x_BLHD.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x_BLHD.dtype)


def make_loss(mesh, layout: dict, s: Shape, dtype, remat: str):
    """``loss(params, tokens [b, seq + 1])``: mean next-token cross-entropy."""
    batch, vocab = layout["batch"], layout["vocab"]

    def pin(x, *spec):
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(*spec)))

    def block(x, p):
        h = rms_norm(x, p["attn_norm"], s.eps)
        q = jnp.einsum("bld,dhk->blhk", h, p["wq"].astype(dtype))
        k = jnp.einsum("bld,dhk->blhk", h, p["wk"].astype(dtype))
        v = jnp.einsum("bld,dhk->blhk", h, p["wv"].astype(dtype))
        q, k = rope(q, s.theta), rope(k, s.theta)
        scores = jnp.einsum("blhk,bmhk->bhlm", q, k).astype(jnp.float32) / np.sqrt(s.head_dim)
        causal = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
        probs = jax.nn.softmax(jnp.where(causal, scores, -1e30), axis=-1).astype(dtype)
        ctx = jnp.einsum("bhlm,bmhk->blhk", probs, v)
        x = pin(x + jnp.einsum("blhk,hkd->bld", ctx, p["wo"].astype(dtype)), batch)
        h = rms_norm(x, p["mlp_norm"], s.eps)
        gate = jnp.einsum("bld,df->blf", h, p["w_gate"].astype(dtype))
        up = jnp.einsum("bld,df->blf", h, p["w_up"].astype(dtype))
        out = jnp.einsum("blf,fd->bld", jax.nn.silu(gate) * up, p["w_down"].astype(dtype))
        return pin(x + out, batch)

    if remat != "none":
        policy = {"full": None, "dots": jax.checkpoint_policies.dots_saveable}[remat]
        block = jax.checkpoint(block, policy=policy)

    def loss(params, tokens_BL1):
        inputs, targets = tokens_BL1[:, :-1], tokens_BL1[:, 1:]
        x = pin(params["embedding"].astype(dtype)[inputs], batch)
        x, _ = jax.lax.scan(lambda c, p: (block(c, p), None), x, params["blocks"])
        x = rms_norm(x, params["final_norm"], s.eps)
        logits = jnp.einsum("bld,dv->blv", x, params["lm_head"].astype(dtype))
        logits = pin(logits.astype(jnp.float32), batch, None, vocab)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    return loss


def make_step(mesh_name: str, *, s: Shape = Shape(), precision="fp32", remat="full", lr=3e-4):
    """``(step, state_shardings, batch_sharding, tx)``: the jitted, donated train step."""
    mesh, layout = make_mesh(mesh_name), LAYOUTS[mesh_name]
    dtype = {"fp32": jnp.float32, "bf16": jnp.bfloat16}[precision]
    tx = optax.adamw(lr, weight_decay=0.1)
    shard = jax.tree.map(
        lambda spec: NamedSharding(mesh, spec),
        param_specs(layout),
        is_leaf=lambda x: isinstance(x, P),
    )
    abstract = jax.eval_shape(lambda: init_params(jax.random.key(0), s))
    opt_shardings = optax.tree_map_params(
        tx, lambda _, sh: sh, jax.eval_shape(tx.init, abstract), shard,
        transform_non_params=lambda _: NamedSharding(mesh, P()),
    )  # fmt: skip
    state_shardings = {"params": shard, "opt": opt_shardings}
    batch_sharding = NamedSharding(mesh, P(layout["batch"]))
    loss_fn = make_loss(mesh, layout, s, dtype, remat)

    def step(state, tokens_BL1):
        loss, grads = jax.value_and_grad(loss_fn)(state["params"], tokens_BL1)
        updates, opt = tx.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, loss

    jitted = jax.jit(
        step,
        in_shardings=(state_shardings, batch_sharding),
        out_shardings=(state_shardings, None),
        donate_argnums=0,
    )
    return jitted, state_shardings, batch_sharding, tx


def init_state(s: Shape, tx, state_shardings, seed: int = 0) -> dict:
    def init():
        params = init_params(jax.random.key(seed), s)
        return {"params": params, "opt": tx.init(params)}

    return jax.jit(init, out_shardings=state_shardings)()


def abstract_state(s: Shape, tx, state_shardings) -> dict:
    params = jax.eval_shape(lambda: init_params(jax.random.key(0), s))
    tree = {"params": params, "opt": jax.eval_shape(tx.init, params)}
    return jax.tree.map(
        lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), tree, state_shardings
    )
