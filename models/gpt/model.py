"""The GPT decoder as published (Radford et al. 2019, GPT-2; Brown et al. 2020, GPT-3), in
Flax NNX, annotated with logical axis names only.

What makes it GPT rather than Llama: LayerNorm with a bias before each sublayer (pre-LN, as
GPT-2 moved it) and once after the last block; learned absolute position embeddings added
to the token embeddings; biases on every projection; an MLP of two matrices, 4 x d_model
wide, with GELU (the tanh form GPT-2 ships, Hugging Face's ``gelu_new``); multi-head
attention (every head its own keys and values); the output projection is the token
embedding transposed (tied). GPT-3's alternating dense and locally banded sparse attention
is not modelled: every layer is dense, as in GPT-2 and Megatron-LM's GPT (the parameter
counts do not depend on it).

Like ``models.llama`` the blocks are stacked with ``nnx.vmap`` (every block weight has a
leading ``layers`` dim) and the model follows shardlib's ``Decoder`` protocol (``embed``,
``blocks``, ``head``), so remat, pipelines and offload drive the layer loop. The keys' and
values' head dim is named ``kv_heads`` (equal to ``heads`` here) so that every rule and
count that knows grouped-query attention reads a GPT block the same way. The presets are
Brown et al.'s Table 2.1 (``presets.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from models.llama.cache import decode as decode_cached
from models.llama.cache import init_cache
from models.llama.lora import adapted, add_attention_lora, add_lora, update
from models.llama.model import Block as LlamaBlock
from models.llama.model import stack_blocks
from shardlib.core.layout import constrain
from shardlib.core.model import RESIDUAL  # the residual stream's own dims
from shardlib.core.ops import Packed, attention, lookup, matmul, run_blocks, stacked_matmul

INIT_STD = 0.02
"""GPT-2's initialiser: normal(0.02) for every weight, 0.01 for the positions, and the two
projections back into the residual stream scaled by 1/sqrt(2 x layers) (Radford et al.)."""

CHECKPOINT_NAMES = (
    "attn_q",  # [batch, seq, heads, head_dim]
    "attn_k",  # [batch, seq, kv_heads, head_dim]
    "attn_v",  # [batch, seq, kv_heads, head_dim]
    "attn_context",  # [batch, seq, heads, head_dim] softmax(qk) v, before the output projection
    "attn_residual",  # [batch, seq, embed] the residual stream between attention and MLP
    "mlp_hidden",  # [batch, seq, mlp] gelu(x W_fc + b_fc)
)


@dataclass(frozen=True)
class GPTConfig:
    """Shape of the decoder (Brown et al. Table 2.1's columns, plus vocab and context)."""

    vocab: int = 256
    """Vocabulary size: 50257 for GPT-2/3's BPE (256 = bytes, the embedded default dataset)."""
    embed: int = 64
    """Model width d_model."""
    layers: int = 2
    """Number of decoder blocks n_layers (scanned)."""
    heads: int = 8
    """Attention heads n_heads (keys and values have as many: multi-head attention)."""
    head_dim: int = 0
    """Width of one head d_head; 0: embed // heads. The table's 13B has heads x d_head =
    5120 with d_model = 5140, so the two are kept apart (the projections map between them)."""
    mlp: int = 0
    """MLP hidden width; 0: 4 x embed, as published."""
    max_positions: int = 2048
    """Learned positions n_ctx (2048 for GPT-3, 1024 for GPT-2): the longest sequence."""
    norm_eps: float = 1e-5
    """LayerNorm epsilon (GPT-2's ``layer_norm_epsilon``)."""
    lora_rank: int = 0
    """LoRA adapters' rank on ``lora_targets`` (0: none); the base weights stay, frozen by
    the trainer (``models.llama.lora``, as for Llama)."""
    lora_alpha: float = 16.0
    """LoRA scale numerator: the update is (alpha / rank) * A @ B (Hu et al. 2021)."""
    lora_targets: tuple[str, ...] = ("q", "v")
    """Projections that get adapters, from q, k, v (the blocks of GPT-2's ``c_attn``), o
    (``attn.c_proj``), fc (``mlp.c_fc``) and proj (``mlp.c_proj``)."""

    def __post_init__(self) -> None:
        bad = sorted(set(self.lora_targets) - set(LORA_TARGETS))
        if bad or self.lora_rank < 0:
            raise ValueError(
                f"model: lora_targets={self.lora_targets}, lora_rank={self.lora_rank}: "
                f"targets must come from {', '.join(LORA_TARGETS)} and rank be >= 0."
            )
        if self.head_dim == 0 and self.embed % self.heads:
            raise ValueError(
                f"model: embed={self.embed} is not a multiple of heads={self.heads}, so "
                "head_dim cannot default to embed // heads. Fix: set model.head_dim."
            )

    @property
    def head_width(self) -> int:
        """d_head: ``head_dim``, or embed // heads when it is 0."""
        return self.head_dim or self.embed // self.heads

    @property
    def mlp_width(self) -> int:
        """The MLP's hidden width: ``mlp``, or 4 x embed when it is 0."""
        return self.mlp or 4 * self.embed

    def param_count(self) -> int:
        """Parameters by the architecture's formula (the tests compare it with the model's
        own inventory and with Table 2.1): per block two LayerNorms (2 x 2e), q/k/v/o
        (4 e·a·d) with their biases (3 a·d + e), the MLP's two matrices (2 e·f) with biases
        (f + e); then token and position tables ((V + n_ctx) e) and the final LayerNorm."""
        e, a, d, f = self.embed, self.heads, self.head_width, self.mlp_width
        block = 4 * e + 4 * e * a * d + 3 * a * d + e + 2 * e * f + f + e
        sizes = {"q": (e, a * d), "k": (e, a * d), "v": (e, a * d), "o": (a * d, e)}
        sizes |= {"fc": (e, f), "proj": (f, e)}  # LoRA: A [in, rank] and B [rank, out] each
        block += sum(self.lora_rank * sum(sizes[t]) for t in self.lora_targets)
        return self.layers * block + (self.vocab + self.max_positions) * e + 2 * e


LORA_TARGETS = ("q", "k", "v", "o", "fc", "proj")
"""Projections LoRA can adapt; ``hf.LORA_WEIGHTS`` names the weight of each."""


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], names: tuple[str, ...], std: float):
    init = nnx.with_partitioning(nnx.initializers.normal(std), names)
    return nnx.Param(init(rngs.params(), shape, jnp.float32))


def _const(value: float, shape: tuple[int, ...], names: tuple[str, ...]):
    init = nnx.with_partitioning(nnx.initializers.constant(value), names)
    return nnx.Param(init(None, shape, jnp.float32))


class LayerNorm(nnx.Module):
    """LayerNorm with a scale and a bias over the model width; statistics in fp32."""

    def __init__(self, cfg: GPTConfig):
        self.eps = cfg.norm_eps
        self.scale = _const(1.0, (cfg.embed,), ("embed",))  # [embed]
        self.bias = _const(0.0, (cfg.embed,), ("embed",))  # [embed]

    def __call__(self, x_BLD):
        # scale and bias in the residual stream's layout (gathered here under FSDP)
        scale_D = constrain(self.scale[...], ("res_embed",))
        bias_D = constrain(self.bias[...], ("res_embed",))
        x32 = x_BLD.astype(jnp.float32)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
        y = ((x32 - mean) * jax.lax.rsqrt(var + self.eps)).astype(x_BLD.dtype)
        return y * scale_D.astype(y.dtype) + bias_D.astype(y.dtype)


class Attention(nnx.Module):
    """Causal multi-head self-attention with biased q/k/v and output projections."""

    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs):
        e, h, d = cfg.embed, cfg.heads, cfg.head_width
        out_std = INIT_STD / (2 * cfg.layers) ** 0.5
        self.wq = _param(rngs, (e, h, d), ("embed", "heads", "head_dim"), INIT_STD)  # [e, h, d]
        self.wk = _param(rngs, (e, h, d), ("embed", "kv_heads", "head_dim"), INIT_STD)  # [e,h,d]
        self.wv = _param(rngs, (e, h, d), ("embed", "kv_heads", "head_dim"), INIT_STD)  # [e,h,d]
        self.bq = _const(0.0, (h, d), ("heads", "head_dim"))  # [heads, head_dim]
        self.bk = _const(0.0, (h, d), ("kv_heads", "head_dim"))  # [kv_heads, head_dim]
        self.bv = _const(0.0, (h, d), ("kv_heads", "head_dim"))  # [kv_heads, head_dim]
        self.wo = _param(rngs, (h, d, e), ("heads", "head_dim", "embed"), out_std)  # [h, d, e]
        self.bo = _const(0.0, (e,), ("embed",))  # [embed]
        self.lora_scale = cfg.lora_alpha / max(cfg.lora_rank, 1)
        add_attention_lora(self, cfg, rngs)

    window = 0
    """Every earlier position is visible (``models.llama.cache.attend_cached`` reads it)."""

    def weights(self) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """(wq, wk, wv, wo) with their LoRA updates added, as the KV-cache path reads them
        (``models.llama.cache``)."""
        return tuple(
            adapted(self, t, w, self.lora_scale)
            for t, w in (("q", self.wq), ("k", self.wk), ("v", self.wv), ("o", self.wo))
        )

    def biased(self, q_BLHK, k_BLHK, v_BLHK):
        """q, k and v with their biases added (the KV-cache path's separate products)."""
        dt = q_BLHK.dtype
        return (q_BLHK + self.bq[...].astype(dt), k_BLHK + self.bk[...].astype(dt),
                v_BLHK + self.bv[...].astype(dt))  # fmt: skip

    def rotary(self, x_BLHK, positions_L=None):
        """The identity: GPT's positions are learned and added to the embeddings."""
        return x_BLHK

    def __call__(self, x_BLD, positions_L=None):
        dt = x_BLD.dtype
        x_BLD = constrain(x_BLD, ("batch", "seq", "embed"))  # gathered from the residual layout

        # one product for q, k and v (GPT-2's c_attn): the backward pass sums the three input
        # gradients before one reduction, not after three
        def w_DHJK(wq, wk, wv):  # [embed, heads, 3, head_dim]
            return jnp.stack([wq, wk, wv], axis=2).astype(dt)

        weights = (self.wq[...], self.wk[...], self.wv[...])
        b_HJK = jnp.stack([self.bq[...], self.bk[...], self.bv[...]], axis=1).astype(dt)
        qkv_BLHJK = stacked_matmul("bld,dhjk->blhjk", x_BLD, w_DHJK, weights, name="qkv") + b_HJK
        q, k, v = (t[:, :, :, 0] for t in jnp.split(qkv_BLHJK, 3, axis=3))  # [b, l, h, d] each
        s = self.lora_scale  # LoRA adapters, if any, beside the fused product
        q, k, v = (q + update(self, "q", x_BLD, 1, s), k + update(self, "k", x_BLD, 1, s),
                   v + update(self, "v", x_BLD, 1, s))  # fmt: skip
        q = checkpoint_name(constrain(q, ("batch", "seq", "heads", "head_dim")), "attn_q")
        k = checkpoint_name(constrain(k, ("batch", "seq", "kv_heads", "head_dim")), "attn_k")
        v = checkpoint_name(constrain(v, ("batch", "seq", "kv_heads", "head_dim")), "attn_v")
        out_BLHK = attention(q, k, v, positions_L)  # the active plan picks dense/ring/...
        out_BLHK = checkpoint_name(out_BLHK, "attn_context")
        out_BLHK = constrain(out_BLHK, ("batch", "seq", "heads", "head_dim"))
        out_BLD = matmul("blhk,hkd->bld", out_BLHK, self.wo[...].astype(dt), name="o")
        out_BLD = out_BLD + update(self, "o", out_BLHK, 2, s)
        return constrain(out_BLD + self.bo[...].astype(dt), RESIDUAL)


class MLP(nnx.Module):
    """x W_fc + b_fc, GELU (tanh form), then W_proj + b_proj: two matrices of e x 4e."""

    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs):
        e, f = cfg.embed, cfg.mlp_width
        out_std = INIT_STD / (2 * cfg.layers) ** 0.5
        self.w_fc = _param(rngs, (e, f), ("embed", "mlp"), INIT_STD)  # [embed, mlp]
        self.b_fc = _const(0.0, (f,), ("mlp",))  # [mlp]
        self.w_proj = _param(rngs, (f, e), ("mlp", "embed"), out_std)  # [mlp, embed]
        self.b_proj = _const(0.0, (e,), ("embed",))  # [embed]
        self.lora_scale = cfg.lora_alpha / max(cfg.lora_rank, 1)
        add_lora(self, cfg, rngs, "fc", self.w_fc, ("embed", "mlp"), inputs=1)
        add_lora(self, cfg, rngs, "proj", self.w_proj, ("mlp", "embed"), inputs=1)

    def __call__(self, x_BLD):
        dt = x_BLD.dtype
        x_BLD = constrain(x_BLD, ("batch", "seq", "embed"))  # gathered from the residual layout
        s = self.lora_scale
        h_BLF = matmul("bld,df->blf", x_BLD, self.w_fc[...].astype(dt), name="fc")
        h_BLF = h_BLF + update(self, "fc", x_BLD, 1, s)
        h_BLF = jax.nn.gelu(h_BLF + self.b_fc[...].astype(dt), approximate=True)
        h_BLF = checkpoint_name(constrain(h_BLF, ("batch", "seq", "mlp")), "mlp_hidden")
        out_BLD = matmul("blf,fd->bld", h_BLF, self.w_proj[...].astype(dt), name="proj")
        out_BLD = out_BLD + update(self, "proj", h_BLF, 1, s)
        return constrain(out_BLD + self.b_proj[...].astype(dt), RESIDUAL)


class Block(LlamaBlock):
    """Pre-LN residual block: x + attn(ln_1(x)), then x + mlp(ln_2(x)): Llama's residual
    wiring (``__call__``, and ``decode`` on the KV cache) around GPT's sublayers."""

    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs):
        self.attn_norm = LayerNorm(cfg)
        self.attn = Attention(cfg, rngs)
        self.mlp_norm = LayerNorm(cfg)
        self.mlp = MLP(cfg, rngs)


class GPT(nnx.Module):
    """Token and position embeddings, ``layers`` stacked ``Block``s, final LayerNorm and
    the tied LM head (``Decoder``)."""

    checkpoint_names = CHECKPOINT_NAMES
    block_kind = "gpt"
    """The planner's activation coefficients fitted on GPT blocks (LayerNorm, biases, GELU)
    rather than Llama's (``shardlib.planner.cost.coefficients``)."""

    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        e = cfg.embed
        self.embedding = _param(rngs, (cfg.vocab, e), ("vocab", "embed"), INIT_STD)  # [V, E]
        # [max_positions, embed]: the positions dim is never split (no rule names it)
        self.position_embedding = _param(rngs, (cfg.max_positions, e), (None, "embed"), 0.01)
        self.blocks = stack_blocks(lambda r: Block(cfg, r), cfg.layers, rngs)  # [layers, ...]
        self.final_norm = LayerNorm(cfg)

    def __call__(self, tokens_BL, *, positions_L=None, dtype=jnp.float32):
        """Logits [batch, seq, vocab] in fp32: the one-device path (``Llama.__call__``)."""
        block_graph, blocks_state = nnx.split(self.blocks)
        x_BLD = self.embed(tokens_BL, positions_L=positions_L, dtype=dtype)
        x_BLD, _ = run_blocks(block_graph, blocks_state, x_BLD, positions_L)
        return self.head(x_BLD, dtype=dtype)

    def embed(self, tokens_BL, *, positions_L=None, dtype=jnp.float32):
        """Token ids [batch, seq] -> token + position embeddings [batch, seq, embed].

        ``positions_L``: the tokens' true positions, as the blocks get them (``Decoder``):
        None for 0..seq-1 in order, [seq] when a layout reorders the sequence (zig-zag
        context parallelism), or a packed row's ``Packed``, whose positions restart at 0
        for each document (each then embeds as it would alone)."""
        seq = tokens_BL.shape[1]
        if seq > self.cfg.max_positions:
            raise ValueError(
                f"GPT: sequence of {seq} tokens, but the position table "
                f"'position_embedding' has {self.cfg.max_positions} rows. Fix: seq <= "
                f"{self.cfg.max_positions}, or a larger model.max_positions."
            )
        x_BLD = lookup(self.embedding[...], tokens_BL).astype(dtype)  # vocab-parallel if split
        table_PD = self.position_embedding[...].astype(dtype)  # [max_positions, embed]
        if positions_L is None:
            pos_BLD = table_PD[None, :seq]  # [1, seq, embed]
        elif isinstance(positions_L, Packed):
            pos_BLD = table_PD[positions_L.positions]  # [batch, seq, embed]
        else:
            pos_BLD = table_PD[positions_L][None]  # [1, seq, embed] in the tokens' order
        return constrain(x_BLD + pos_BLD, RESIDUAL)

    def head(self, x_BLD, *, dtype=jnp.float32):
        """Residual stream after the blocks -> logits [batch, seq, vocab] in fp32, through
        the token embedding transposed (tied: GPT has no separate output matrix)."""
        x_BLD = self.final_norm(x_BLD)
        # gathered in the logits' batch layout (vocab-parallel under FSDP: over fsdp only)
        x_BLD = constrain(x_BLD, ("batch", "seq", "embed"), beside={"vocab": self.cfg.vocab})
        logits_BLV = jnp.einsum("bld,vd->blv", x_BLD, self.embedding[...].astype(dtype))
        return constrain(logits_BLV.astype(jnp.float32), ("batch", "seq", "vocab"))

    @property
    def max_positions(self) -> int:
        return self.cfg.max_positions

    def decode(self, tokens_BT, cache: dict, start, *, dtype=jnp.float32):
        """Logits [batch, T, vocab] of T new tokens at positions start.. (their learned
        position rows added), and the KV cache with their keys and values written in."""
        positions_T = start + jnp.arange(tokens_BT.shape[1])
        x_BTD = self.embed(tokens_BT, positions_L=positions_T, dtype=dtype)
        return decode_cached(self, x_BTD, cache, start, dtype=dtype)

    def init_cache(self, batch: int, length: int, dtype=jnp.float32) -> dict:
        """Zeroed keys and values [layers, batch, length, heads, head_dim]."""
        cfg = self.cfg
        return init_cache(cfg.layers, batch, length, cfg.heads, cfg.head_width, dtype)
