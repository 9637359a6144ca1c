"""A Llama-style decoder in Flax NNX, annotated with logical axis names only.

RMSNorm, rotary position embeddings, grouped-query attention and a SwiGLU MLP. The blocks
are created with ``nnx.vmap`` so every weight has a leading ``layers`` dim, and applied with
``jax.lax.scan``: compile time stays flat as depth grows. The model follows shardlib's
``Decoder`` protocol (``embed``, ``blocks``, ``head``), so a trainer can drive the layer loop
itself. Nothing here names a mesh axis or a strategy; shardlib's rules decide where each
logical dim lives, and ``shardlib.core.ops`` which attention kernel runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from models.llama.cache import attend_cached, init_cache
from models.llama.cache import decode as decode_cached
from models.llama.lora import adapted, add_attention_lora, add_lora, update
from models.llama.norm import rms_norm
from models.llama.rotary import check_scaling, rotary
from models.llama.swiglu import swiglu
from shardlib.core.layout import constrain, splits_alike
from shardlib.core.model import RESIDUAL  # the residual stream's own dims (and the norms on it)
from shardlib.core.ops import attention, lookup, matmul, run_blocks

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
    rope_scaling: tuple[float, ...] | None = None
    """RoPE frequency scaling, the fields ``rope_type`` names (``rotary.ROPE_TYPES``); Llama
    3's: (factor, low_freq_factor, high_freq_factor, original_max_positions). None: plain."""
    rope_type: str = "llama3"
    """Which scaling ``rope_scaling`` holds: llama3, linear, dynamic or yarn (Hugging Face's
    ``rope_type``); unused without ``rope_scaling``."""
    qkv_bias: bool = False
    """The q, k and v projections add biases (Qwen2)."""
    sliding_window: int = 0
    """Each token attends to itself and the ``sliding_window - 1`` tokens before it
    (Mistral); 0: to every earlier token."""
    max_positions: int = 8192
    """Longest sequence (prompt + generated tokens) ``shardlib generate`` accepts; Hugging
    Face's ``max_position_embeddings``."""
    tie_embeddings: bool = False
    """The LM head is the embedding table transposed (no ``lm_head`` parameter)."""
    lora_rank: int = 0
    """LoRA adapters' rank on ``lora_targets`` (0: none). The base weights stay, frozen by
    the trainer; adapters are ``nnx.LoRAParam``s."""
    lora_alpha: float = 16.0
    """LoRA scale numerator: the update is (alpha / rank) * A @ B (Hu et al. 2021)."""
    lora_targets: tuple[str, ...] = ("q", "v")
    """Projections that get adapters, from q, k, v, o, gate, up, down."""

    def __post_init__(self) -> None:
        bad = sorted(set(self.lora_targets) - set(LORA_TARGETS))
        if bad or self.lora_rank < 0:
            raise ValueError(
                f"model: lora_targets={self.lora_targets}, lora_rank={self.lora_rank}: "
                f"targets must come from {', '.join(LORA_TARGETS)} and rank be >= 0."
            )
        if self.heads % self.kv_heads:
            raise ValueError(
                f"model: heads={self.heads} is not a multiple of kv_heads={self.kv_heads}. "
                "Fix: choose kv_heads dividing heads."
            )
        check_scaling(self.rope_type, self.rope_scaling)
        if self.sliding_window < 0:
            raise ValueError(f"model: sliding_window={self.sliding_window} must be >= 0.")
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
        block += (h + 2 * k) * d if self.qkv_bias else 0
        r = self.lora_rank
        sizes = {"q": (e, h * d), "k": (e, k * d), "v": (e, k * d), "o": (h * d, e)}
        sizes |= {"gate": (e, f), "up": (e, f), "down": (f, e)}
        block += sum(r * sum(sizes[t]) for t in self.lora_targets) if r else 0
        return n * block + (1 if self.tie_embeddings else 2) * v * e + e


LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")


def _bias(shape: tuple[int, ...], names: tuple[str, ...]):
    return nnx.Param(nnx.with_partitioning(nnx.initializers.zeros, names)(None, shape, jnp.float32))


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], names: tuple[str, ...], fan_in: int):
    init = nnx.with_partitioning(init_normal(fan_in**-0.5), names)
    return nnx.Param(init(rngs.params(), shape, jnp.float32))


class RMSNorm(nnx.Module):
    def __init__(self, cfg: LlamaConfig):
        self.eps = cfg.norm_eps
        init = nnx.with_partitioning(nnx.initializers.ones, ("embed",))
        self.scale = nnx.Param(init(None, (cfg.embed,), jnp.float32))  # [embed]

    def __call__(self, x_BLD):
        # the scale in the residual stream's layout (FSDP splits it on embed: gathered here,
        # or XLA may broadcast it to the batch's shape first and gather that)
        scale_D = constrain(self.scale[...], ("res_embed",))
        return rms_norm(
            x_BLD, scale_D, self.eps
        )  # its gradient keeps only x (models/llama/norm.py)


class Attention(nnx.Module):
    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        e, h, g, d = cfg.embed, cfg.heads, cfg.kv_heads, cfg.head_dim
        self.theta, self.rope_scaling, self.rope_type = (
            cfg.rope_theta,
            cfg.rope_scaling,
            cfg.rope_type,
        )
        self.window = cfg.sliding_window
        self.lora_scale = cfg.lora_alpha / max(cfg.lora_rank, 1)
        self.wq = _param(rngs, (e, h, d), ("embed", "heads", "head_dim"), e)  # [embed, heads, hd]
        self.wk = _param(rngs, (e, g, d), ("embed", "kv_heads", "head_dim"), e)  # [embed, kv, hd]
        self.wv = _param(rngs, (e, g, d), ("embed", "kv_heads", "head_dim"), e)  # [embed, kv, hd]
        self.wo = _param(rngs, (h, d, e), ("heads", "head_dim", "embed"), h * d)  # [heads, hd, e]
        if cfg.qkv_bias:  # Qwen2's
            self.bq = _bias((h, d), ("heads", "head_dim"))  # [heads, head_dim]
            self.bk = _bias((g, d), ("kv_heads", "head_dim"))  # [kv_heads, head_dim]
            self.bv = _bias((g, d), ("kv_heads", "head_dim"))  # [kv_heads, head_dim]
        add_attention_lora(self, cfg, rngs)

    def weights(self) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """(wq, wk, wv, wo) with their LoRA updates added (the base weights without any)."""
        return tuple(
            adapted(self, t, w, self.lora_scale)
            for t, w in (("q", self.wq), ("k", self.wk), ("v", self.wv), ("o", self.wo))
        )

    def rotary(self, x_BLHK, positions_L=None):
        return rotary(x_BLHK, self.theta, positions_L, self.rope_scaling, self.rope_type)

    def biased(self, q_BLHK, k_BLGK, v_BLGK):
        """q, k and v with their biases added (Qwen2's), where the model has them."""
        if not hasattr(self, "bq"):
            return q_BLHK, k_BLGK, v_BLGK
        dt = q_BLHK.dtype
        return (q_BLHK + self.bq[...].astype(dt), k_BLGK + self.bk[...].astype(dt),
                v_BLGK + self.bv[...].astype(dt))  # fmt: skip

    def __call__(self, x_BLD, positions_L=None):
        dt, (b, l, _), (e, h, d), g = x_BLD.dtype, x_BLD.shape, self.wq.shape, self.wk.shape[1]
        x_BLD = constrain(x_BLD, ("batch", "seq", "embed"))  # gathered from the residual layout
        wq, wk, wv, wo = self.wq[...], self.wk[...], self.wv[...], self.wo[...]
        if splits_alike({"heads": h, "kv_heads": g}):
            # One product for q, k and v (each K/V head next to its query heads): the
            # backward pass then sums the three input gradients before one reduction.
            w_DGJK = jnp.concatenate(  # [embed, kv_heads, h/g + 2, head_dim]
                [wq.reshape(e, g, h // g, d), wk[:, :, None], wv[:, :, None]],
                axis=2,
            ).astype(dt)
            qkv_BLGJK = matmul("bld,dgjk->blgjk", x_BLD, w_DGJK, name="qkv")
            # split, not sliced: the gradient is one concatenation, not a padded copy each
            q, k, v = jnp.split(qkv_BLGJK, [h // g, h // g + 1], axis=3)
            q, k, v = q.reshape(b, l, h, d), k[:, :, :, 0], v[:, :, :, 0]
        else:  # K/V heads whole where the query heads split (fewer than the tensor degree)
            q = matmul("bld,dhk->blhk", x_BLD, wq.astype(dt), name="q")
            w_DJGK = jnp.stack([wk, wv], axis=1).astype(dt)  # [embed, 2, kv_heads, head_dim]
            k, v = jnp.unstack(matmul("bld,djgk->jblgk", x_BLD, w_DJGK, name="kv"))
        s = self.lora_scale  # LoRA adapters, if any, beside the fused product
        q, k, v = (q + update(self, "q", x_BLD, 1, s), k + update(self, "k", x_BLD, 1, s),
                   v + update(self, "v", x_BLD, 1, s))  # fmt: skip
        q, k, v = self.biased(q, k, v)
        q = constrain(self.rotary(q, positions_L), ("batch", "seq", "heads", "head_dim"))
        k = constrain(self.rotary(k, positions_L), ("batch", "seq", "kv_heads", "head_dim"))
        v = constrain(v, ("batch", "seq", "kv_heads", "head_dim"))
        q, k, v = (
            checkpoint_name(q, "attn_q"),
            checkpoint_name(k, "attn_k"),
            checkpoint_name(v, "attn_v"),
        )
        out_BLHK = attention(q, k, v, positions_L, window=self.window)  # dense/ring/... by plan
        out_BLHK = checkpoint_name(out_BLHK, "attn_context")
        out_BLHK = constrain(out_BLHK, ("batch", "seq", "heads", "head_dim"))
        out_BLD = matmul("blhk,hkd->bld", out_BLHK, wo.astype(dt), name="o")
        out_BLD = out_BLD + update(self, "o", out_BLHK, 2, s)
        return constrain(out_BLD, RESIDUAL)


class MLP(nnx.Module):
    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        e, f = cfg.embed, cfg.mlp
        self.w_gate = _param(rngs, (e, f), ("embed", "mlp"), e)  # [embed, mlp]
        self.w_up = _param(rngs, (e, f), ("embed", "mlp"), e)  # [embed, mlp]
        self.w_down = _param(rngs, (f, e), ("mlp", "embed"), f)  # [mlp, embed]
        self.lora_scale = cfg.lora_alpha / max(cfg.lora_rank, 1)
        add_lora(self, cfg, rngs, "gate", self.w_gate, ("embed", "mlp"), inputs=1)
        add_lora(self, cfg, rngs, "up", self.w_up, ("embed", "mlp"), inputs=1)
        add_lora(self, cfg, rngs, "down", self.w_down, ("mlp", "embed"), inputs=1)

    def __call__(self, x_BLD):
        dt = x_BLD.dtype
        x_BLD = constrain(x_BLD, ("batch", "seq", "embed"))  # gathered from the residual layout
        w_DJF = jnp.stack([self.w_gate[...], self.w_up[...]], axis=1).astype(dt)  # [embed, 2, mlp]
        gate_up_BLJF = matmul("bld,djf->bljf", x_BLD, w_DJF, name="gate_up")  # as q/k/v
        s = self.lora_scale  # LoRA adapters, if any, beside the fused product
        gate_BLF, up_BLF = (t[:, :, 0] for t in jnp.split(gate_up_BLJF, 2, axis=2))  # as q, k, v
        gate_BLF = gate_BLF + update(self, "gate", x_BLD, 1, s)
        up_BLF = up_BLF + update(self, "up", x_BLD, 1, s)
        h_BLF = constrain(swiglu(gate_BLF, up_BLF), ("batch", "seq", "mlp"))
        h_BLF = checkpoint_name(h_BLF, "mlp_hidden")
        out_BLD = matmul("blf,fd->bld", h_BLF, self.w_down[...].astype(dt), name="down")
        return constrain(out_BLD + update(self, "down", h_BLF, 1, s), RESIDUAL)


class Block(nnx.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg)
        self.attn = Attention(cfg, rngs)
        self.mlp_norm = RMSNorm(cfg)
        self.mlp = MLP(cfg, rngs)

    def __call__(self, x_BLD, positions_L=None):
        x_BLD = x_BLD + self.attn(self.attn_norm(x_BLD), positions_L)
        x_BLD = checkpoint_name(x_BLD, "attn_residual")
        x_BLD = x_BLD + self.mlp(self.mlp_norm(x_BLD))
        return constrain(x_BLD, RESIDUAL)

    def decode(self, x_BTD, kv, positions_T, start):
        """The block on the KV cache (``models.llama.cache``): prefill, or one decode step."""
        out_BTD, kv = attend_cached(self.attn, self.attn_norm(x_BTD), kv, positions_T, start)
        x_BTD = x_BTD + out_BTD
        return x_BTD + self.mlp(self.mlp_norm(x_BTD)), kv


def stack_blocks(make_block: Callable[[nnx.Rngs], nnx.Module], count: int, rngs: nnx.Rngs):
    """``count`` blocks as one module whose every weight has a leading ``layers`` dim."""

    @nnx.split_rngs(splits=count)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def make(rngs: nnx.Rngs) -> nnx.Module:
        return make_block(rngs)

    return make(rngs)


class Llama(nnx.Module):
    """Embedding, ``layers`` stacked ``Block``s, final norm and LM head (``Decoder``)."""

    checkpoint_names = CHECKPOINT_NAMES

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embedding = _param(rngs, (cfg.vocab, cfg.embed), ("vocab", "embed"), 1)  # [V, E]
        self.blocks = self.make_blocks(cfg, rngs)  # every weight: [layers, ...]
        self.final_norm = RMSNorm(cfg)
        if not cfg.tie_embeddings:  # tied: the head reads the embedding table
            self.lm_head = _param(rngs, (cfg.embed, cfg.vocab), ("embed", "vocab"), cfg.embed)

    def make_blocks(self, cfg: LlamaConfig, rngs: nnx.Rngs) -> nnx.Module:
        """The stack a subclass replaces (the MoE model stacks groups of blocks)."""
        return stack_blocks(lambda r: Block(cfg, r), cfg.layers, rngs)

    def __call__(self, tokens_BL, *, positions_L=None, dtype=jnp.float32):
        """Logits [batch, seq, vocab] in fp32 (and ``aux`` when the blocks report stats).

        ``dtype`` is the compute dtype; ``positions_L`` the tokens' true positions when the
        sequence arrives reordered (default 0..L-1). This is the one-device path: a trainer
        that remats, pipelines or offloads drives ``embed``, ``blocks`` and ``head`` itself.
        """
        block_graph, blocks_state = nnx.split(self.blocks)
        x_BLD = self.embed(tokens_BL, dtype=dtype)
        x_BLD, totals = run_blocks(block_graph, blocks_state, x_BLD, positions_L)
        logits_BLV = self.head(x_BLD, dtype=dtype)
        if totals is None:
            return logits_BLV
        return logits_BLV, self.aux(totals, tokens_BL.size)

    def embed(self, tokens_BL, *, dtype=jnp.float32):
        """Token ids [batch, seq] -> residual stream [batch, seq, embed] (before the blocks)."""
        # vocab-parallel (Megatron's masked lookup) wherever the table is split on vocab
        x_BLD = lookup(self.embedding[...], tokens_BL).astype(dtype)
        return constrain(x_BLD, RESIDUAL)

    def head(self, x_BLD, *, dtype=jnp.float32):
        """Residual stream after the blocks -> logits [batch, seq, vocab] in fp32."""
        x_BLD = self.final_norm(x_BLD)
        # gathered in the logits' batch layout (vocab-parallel under FSDP: over fsdp only)
        x_BLD = constrain(x_BLD, ("batch", "seq", "embed"), beside={"vocab": self.cfg.vocab})
        if self.cfg.tie_embeddings:
            logits_BLV = jnp.einsum("bld,vd->blv", x_BLD, self.embedding[...].astype(dtype))
        else:
            logits_BLV = jnp.einsum("bld,dv->blv", x_BLD, self.lm_head[...].astype(dtype))
        return constrain(logits_BLV.astype(jnp.float32), ("batch", "seq", "vocab"))

    @property
    def max_positions(self) -> int:
        """Positions the rotary tables cover (``Generator``: prompt + new tokens fit)."""
        return self.cfg.max_positions

    def decode(self, tokens_BT, cache: dict, start, *, dtype=jnp.float32):
        """Logits [batch, T, vocab] of T new tokens at positions start.., and the KV cache
        with their keys and values written in (``models.llama.cache``: prefill and decode)."""
        return decode_cached(self, self.embed(tokens_BT, dtype=dtype), cache, start, dtype=dtype)

    def init_cache(self, batch: int, length: int, dtype=jnp.float32) -> dict:
        """Zeroed keys and values [layers, batch, length, kv_heads, head_dim]."""
        cfg = self.cfg
        return init_cache(cfg.layers, batch, length, cfg.kv_heads, cfg.head_dim, dtype)
