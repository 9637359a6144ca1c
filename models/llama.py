"""A Llama-style decoder in Flax NNX, annotated with logical axis names only.

RMSNorm, rotary position embeddings, grouped-query attention and a SwiGLU MLP. The blocks
are created with ``nnx.vmap`` so every weight has a leading ``layers`` dim, and applied with
``jax.lax.scan``: compile time stays flat as depth grows. Nothing here names a mesh axis or
a strategy; shardlib's rules decide where each logical dim lives.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from shardlib.layout import constrain

init_normal = nnx.initializers.normal

# Intermediates a rematerialisation policy can save or offload by name (``remat=names:...``).
CHECKPOINT_NAMES = (
    "attn_q",  # [batch, seq, heads, head_dim] after rotary
    "attn_k",  # [batch, seq, kv_heads, head_dim] after rotary
    "attn_v",  # [batch, seq, kv_heads, head_dim]
    "attn_context",  # [batch, seq, heads, head_dim] softmax(qk) v, before the output projection
    "attn_residual",  # [batch, seq, embed] the residual stream between attention and MLP
    "mlp_hidden",  # [batch, seq, mlp] silu(gate) * up
)


@dataclass(frozen=True)
class LlamaConfig:
    """Shape of the decoder."""

    vocab: int = 256
    """Vocabulary size (256 = bytes, for the embedded default dataset)."""
    embed: int = 64
    """Model width d_model."""
    layers: int = 2
    """Number of decoder blocks (scanned)."""
    heads: int = 16
    """Query heads."""
    kv_heads: int = 8
    """Key/value heads; heads must be a multiple (grouped-query attention)."""
    head_dim: int = 8
    """Width of one head (even, for rotary embeddings)."""
    mlp: int = 256
    """SwiGLU hidden width."""
    rope_theta: float = 10_000.0
    """Rotary embedding base."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""

    def __post_init__(self) -> None:
        if self.heads % self.kv_heads:
            raise ValueError(
                f"model: heads={self.heads} is not a multiple of kv_heads={self.kv_heads}. "
                "Fix: choose kv_heads dividing heads."
            )
        if self.head_dim % 2:
            raise ValueError(f"model: head_dim={self.head_dim} must be even for rotary embeddings.")

    def param_count(self) -> int:
        e, h, k, d, f, v, n = (
            self.embed,
            self.heads,
            self.kv_heads,
            self.head_dim,
            self.mlp,
            self.vocab,
            self.layers,
        )
        block = 2 * e + e * h * d * 2 + e * k * d * 2 + 3 * e * f
        return n * block + 2 * v * e + e


PRESETS: dict[str, LlamaConfig] = {
    # tests and the default training run: a few hundred thousand parameters
    "llama-tiny": LlamaConfig(),
    # ~12M parameters: memory and communication measurements
    "llama-small": LlamaConfig(
        vocab=8192, embed=256, layers=8, heads=8, kv_heads=4, head_dim=32, mlp=1024
    ),
    # the published shapes, for `explain` with abstract inputs (nothing is allocated)
    "llama-1b": LlamaConfig(
        vocab=128_256,
        embed=2048,
        layers=16,
        heads=32,
        kv_heads=8,
        head_dim=64,
        mlp=8192,
        rope_theta=500_000.0,
    ),
    "llama-7b": LlamaConfig(
        vocab=32_000, embed=4096, layers=32, heads=32, kv_heads=32, head_dim=128, mlp=11_008
    ),
    "llama-70b": LlamaConfig(
        vocab=32_000, embed=8192, layers=80, heads=64, kv_heads=8, head_dim=128, mlp=28_672
    ),
}


def preset(name: str, **overrides) -> LlamaConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}. Presets: {', '.join(PRESETS)}.")
    return replace(PRESETS[name], **overrides)


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], names: tuple[str, ...], fan_in: int):
    init = nnx.with_partitioning(init_normal(fan_in**-0.5), names)
    return nnx.Param(init(rngs.params(), shape, jnp.float32))


class RMSNorm(nnx.Module):
    def __init__(self, cfg: LlamaConfig):
        self.eps = cfg.norm_eps
        init = nnx.with_partitioning(nnx.initializers.ones, ("embed",))
        self.scale = nnx.Param(init(None, (cfg.embed,), jnp.float32))  # [embed]

    def __call__(self, x_BLD):
        x32 = x_BLD.astype(jnp.float32)
        norm = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (x32 * norm).astype(x_BLD.dtype) * self.scale[...].astype(x_BLD.dtype)


def rotary(x_BLHK, theta: float):
    """Rotate pairs of features by position-dependent angles (RoFormer)."""
    seq, half = x_BLHK.shape[1], x_BLHK.shape[-1] // 2
    freq_K = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle_LK = jnp.arange(seq, dtype=jnp.float32)[:, None] * freq_K[None, :]
    sin, cos = jnp.sin(angle_LK)[None, :, None, :], jnp.cos(angle_LK)[None, :, None, :]
    x1, x2 = jnp.split(x_BLHK.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BLHK.dtype)


def causal_attention(q_BLHK, k_BLGK, v_BLGK):
    """Dense causal attention with grouped K/V heads; softmax in fp32."""
    b, l, h, d = q_BLHK.shape
    g = k_BLGK.shape[2]
    q_BLGRK = q_BLHK.reshape(b, l, g, h // g, d)
    scores = jnp.einsum("blgrk,bmgk->bgrlm", q_BLGRK, k_BLGK).astype(jnp.float32) * d**-0.5
    mask_LM = jnp.tril(jnp.ones((l, l), bool))
    scores = jnp.where(mask_LM, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_BLGK.dtype)
    out = jnp.einsum("bgrlm,bmgk->blgrk", probs, v_BLGK)
    return out.reshape(b, l, h, d)


class Attention(nnx.Module):
    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        e, h, g, d = cfg.embed, cfg.heads, cfg.kv_heads, cfg.head_dim
        self.theta = cfg.rope_theta
        self.wq = _param(rngs, (e, h, d), ("embed", "heads", "head_dim"), e)  # [embed, heads, hd]
        self.wk = _param(rngs, (e, g, d), ("embed", "kv_heads", "head_dim"), e)  # [embed, kv, hd]
        self.wv = _param(rngs, (e, g, d), ("embed", "kv_heads", "head_dim"), e)  # [embed, kv, hd]
        self.wo = _param(rngs, (h, d, e), ("heads", "head_dim", "embed"), h * d)  # [heads, hd, e]

    def __call__(self, x_BLD):
        dt = x_BLD.dtype
        e, h, d = self.wq.shape
        g = self.wk.shape[1]
        # One projection for Q, K and V, grouped per kv head ([embed, kv_heads, r + 2, hd]):
        # the stacking is along an unsplit dim, so it is local under tensor parallelism, and
        # the backward pass then sums the three input gradients before its one all-reduce.
        w_qkv = jnp.concatenate(
            [
                self.wq[...].reshape(e, g, h // g, d),
                self.wk[...][:, :, None],
                self.wv[...][:, :, None],
            ],
            axis=2,
        ).astype(dt)
        qkv_BLGCK = jnp.einsum("bld,dgck->blgck", x_BLD, w_qkv)
        q = qkv_BLGCK[:, :, :, :-2].reshape(*x_BLD.shape[:2], h, d)
        k, v = qkv_BLGCK[:, :, :, -2], qkv_BLGCK[:, :, :, -1]
        q = constrain(rotary(q, self.theta), ("batch", "seq", "heads", "head_dim"))
        k = constrain(rotary(k, self.theta), ("batch", "seq", "kv_heads", "head_dim"))
        v = constrain(v, ("batch", "seq", "kv_heads", "head_dim"))
        q, k, v = (
            checkpoint_name(q, "attn_q"),
            checkpoint_name(k, "attn_k"),
            checkpoint_name(v, "attn_v"),
        )
        out_BLHK = checkpoint_name(causal_attention(q, k, v), "attn_context")
        return jnp.einsum("blhk,hkd->bld", out_BLHK, self.wo[...].astype(dt))


class MLP(nnx.Module):
    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        e, f = cfg.embed, cfg.mlp
        self.w_gate = _param(rngs, (e, f), ("embed", "mlp"), e)  # [embed, mlp]
        self.w_up = _param(rngs, (e, f), ("embed", "mlp"), e)  # [embed, mlp]
        self.w_down = _param(rngs, (f, e), ("mlp", "embed"), f)  # [mlp, embed]

    def __call__(self, x_BLD):
        dt = x_BLD.dtype
        # Gate and up in one product (stacked along an unsplit dim): one all-reduce in backward.
        w_gu = jnp.stack([self.w_gate[...], self.w_up[...]], axis=1).astype(dt)  # [embed, 2, mlp]
        gu_BLCF = jnp.einsum("bld,dcf->blcf", x_BLD, w_gu)
        gate_BLF, up_BLF = gu_BLCF[:, :, 0], gu_BLCF[:, :, 1]
        h_BLF = constrain(jax.nn.silu(gate_BLF) * up_BLF, ("batch", "seq", "mlp"))
        h_BLF = checkpoint_name(h_BLF, "mlp_hidden")
        return jnp.einsum("blf,fd->bld", h_BLF, self.w_down[...].astype(dt))


class Block(nnx.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg)
        self.attn = Attention(cfg, rngs)
        self.mlp_norm = RMSNorm(cfg)
        self.mlp = MLP(cfg, rngs)

    def __call__(self, x_BLD):
        x_BLD = checkpoint_name(x_BLD + self.attn(self.attn_norm(x_BLD)), "attn_residual")
        x_BLD = x_BLD + self.mlp(self.mlp_norm(x_BLD))
        return constrain(x_BLD, ("batch", "seq", "embed"))


LayerFn = Callable[[Callable, object, jax.Array], jax.Array]


def scan_layers(block_fn, blocks_state, x_BLD):
    """Apply stacked blocks with a scan: one compiled body, any depth."""

    def body(x, layer_state):
        return block_fn(layer_state, x), None

    x_BLD, _ = jax.lax.scan(body, x_BLD, blocks_state)
    return x_BLD


class Llama(nnx.Module):
    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embedding = _param(rngs, (cfg.vocab, cfg.embed), ("vocab", "embed"), 1)  # [V, E]

        @nnx.split_rngs(splits=cfg.layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make_blocks(rngs: nnx.Rngs) -> Block:
            return Block(cfg, rngs)

        self.blocks = make_blocks(rngs)  # every weight: [layers, ...]
        self.final_norm = RMSNorm(cfg)
        self.lm_head = _param(rngs, (cfg.embed, cfg.vocab), ("embed", "vocab"), cfg.embed)

    def __call__(self, tokens_BL, *, dtype=jnp.float32, layers: LayerFn = scan_layers):
        """Logits [batch, seq, vocab] in fp32; ``dtype`` is the compute dtype.

        ``layers`` applies the stacked blocks; strategies that restructure the layer loop
        (rematerialisation, pipelining) pass their own with the same signature.
        """
        graphdef, blocks_state = nnx.split(self.blocks)

        def block_fn(layer_state, x):
            return nnx.merge(graphdef, layer_state)(x)

        x_BLD = layers(block_fn, blocks_state, self.embed(tokens_BL, dtype=dtype))
        return self.head(x_BLD, dtype=dtype)

    def embed(self, tokens_BL, *, dtype=jnp.float32):
        """Token ids [batch, seq] -> residual stream [batch, seq, embed] (before the blocks)."""
        # The lookup reads the table in the activation layout (vocab-parallel, embed whole):
        # XLA then emits Megatron's masked lookup + all-reduce instead of regathering it.
        table_VD = constrain(self.embedding[...], ("vocab", "embed"))
        x_BLD = jnp.take(table_VD, tokens_BL, axis=0).astype(dtype)
        return constrain(x_BLD, ("batch", "seq", "embed"))

    def head(self, x_BLD, *, dtype=jnp.float32):
        """Residual stream after the blocks -> logits [batch, seq, vocab] in fp32."""
        x_BLD = self.final_norm(x_BLD)
        logits_BLV = jnp.einsum("bld,dv->blv", x_BLD, self.lm_head[...].astype(dtype))
        return constrain(logits_BLV.astype(jnp.float32), ("batch", "seq", "vocab"))
