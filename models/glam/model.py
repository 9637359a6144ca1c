"""GLaM (Du et al. 2021, "GLaM: Efficient Scaling of Language Models with Mixture-of-Experts"):
a decoder whose feed-forward sublayer is a mixture of experts in every other layer.

What makes it GLaM rather than ``models.moe``'s Llama-with-experts (which it reuses: the
router, capacity, dispatch/combine and the layer loop's statistics):

- Every other layer is an MoE layer; the unit the stack repeats is an MoE layer followed by
  a dense layer (the paper's figure: the MoE layer below, the Transformer layer above; the
  reference implementation, Praxis' ``GlamStackedTransformerHParams``, puts the experts in
  the first of each pair). The stack is ``[layers / 2, ...]``, scanned: one compiled body.
- Top-2 gating over E experts with GShard's load-balancing loss, weight 0.01: E x sum_e
  f_e x P_e with f_e the fraction of tokens whose *first* choice is e (``first_choice_load``);
  gates renormalised over the two chosen experts; capacity per expert and group.
- The dense layers' MLP is a gated GELU (GEGLU: gelu(x W_gate) * (x W_up), then W_down: three
  matrices of model x hidden); each expert is a plain two-matrix GELU MLP (W_in, W_out) of
  the same hidden width. This is what the published counts need: 64B/64E's 96.6B
  activated parameters come out exactly with three-matrix dense MLPs and two-matrix
  experts, and no other combination does (``tests/models/test_glam.py``).
- Multi-head attention without biases, RMSNorm without bias, and the output layer tied to
  the 256K-entry input embedding.

One deliberate difference: positions are rotary (Llama's) rather than the paper's per-layer
relative position bias (Transformer-XL / T5 buckets). shardlib's attention kernels (dense,
chunked, ring, all-gather, Ulysses, cuDNN) take no additive bias, and the bias is 32 buckets
x heads per layer: 262,144 parameters in 64B/64E, 0.00002% of its 1.16T, so the counts are
those of the published model to well within their printed digits.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from models.llama.cache import attend_cached
from models.llama.model import Attention, RMSNorm, _param, stack_blocks
from models.moe.model import EXPERT_NAMES, Moe, MoeConfig, MoeLayer
from shardlib.core.layout import constrain
from shardlib.core.model import RESIDUAL
from shardlib.core.ops import matmul


@dataclass(frozen=True)
class GlamConfig(MoeConfig):
    """GLaM's shape (the paper's model table: L, M, H, n_heads, d_head, E) and routing."""

    moe_every: int = 2
    """Every other layer is an MoE layer (GLaM); the stack repeats (MoE, dense) pairs."""
    top_k: int = 2
    """Top-2 gating."""
    aux_loss_weight: float = 0.01
    """GShard's load-balancing loss weight, as GLaM trains."""
    z_loss_weight: float = 0.0
    """No router z-loss (GLaM predates it)."""
    first_choice_load: bool = True
    """f_e counts first choices only (GShard's top-2 gating)."""
    tie_embeddings: bool = True
    """The softmax layer reads the input embedding (GShard's shared embedding softmax);
    ``Glam.head`` reads it tied whatever this says, and ``__post_init__`` refuses False."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.tie_embeddings:
            raise ValueError(
                "model: GLaM's softmax layer is the input embedding; tie_embeddings=True."
            )
        if self.moe_every != 2:
            raise ValueError(
                f"model: GLaM puts experts in every other layer; moe_every={self.moe_every}. "
                "Fix: moe_every=2 (or use the moe family for other spacings)."
            )

    def param_count(self) -> int:
        """All parameters: attention and norms in every layer, a GEGLU MLP in the dense
        layers, E two-matrix experts and a router in the MoE layers, one tied embedding."""
        e, v, n = self.embed, self.vocab, self.moe_layers
        attn = 2 * e + 2 * e * self.heads * self.head_dim + 2 * e * self.kv_heads * self.head_dim
        experts = self.experts * 2 * e * self.expert_mlp + e * self.experts
        embeddings = (1 if self.tie_embeddings else 2) * v * e
        return self.layers * attn + n * 3 * e * self.mlp + n * experts + embeddings + e

    def active_param_count(self) -> int:
        """Parameters one token runs through: all but the E - k experts it is not sent to
        (the router and the embedding count, as in the paper's n_act-params)."""
        idle = (self.experts - self.top_k) * 2 * self.embed * self.expert_mlp
        return self.param_count() - self.moe_layers * idle


class GegluMLP(nnx.Module):
    """The dense layers' MLP: (gelu(x W_gate) * x W_up) W_down."""

    def __init__(self, cfg: GlamConfig, rngs: nnx.Rngs):
        e, f = cfg.embed, cfg.mlp
        self.w_gate = _param(rngs, (e, f), ("embed", "mlp"), e)  # [embed, mlp]
        self.w_up = _param(rngs, (e, f), ("embed", "mlp"), e)  # [embed, mlp]
        self.w_down = _param(rngs, (f, e), ("mlp", "embed"), f)  # [mlp, embed]

    def __call__(self, x_BLD):
        dt = x_BLD.dtype
        x_BLD = constrain(x_BLD, ("batch", "seq", "embed"))  # gathered from the residual layout
        w_DJF = jnp.stack([self.w_gate[...], self.w_up[...]], axis=1).astype(dt)  # [e, 2, mlp]
        gate_up_BLJF = matmul("bld,djf->bljf", x_BLD, w_DJF, name="gate_up")
        gate_BLF, up_BLF = gate_up_BLJF[:, :, 0], gate_up_BLJF[:, :, 1]
        h_BLF = constrain(jax.nn.gelu(gate_BLF) * up_BLF, ("batch", "seq", "mlp"))
        h_BLF = checkpoint_name(h_BLF, "mlp_hidden")
        out_BLD = matmul("blf,fd->bld", h_BLF, self.w_down[...].astype(dt), name="down")
        return constrain(out_BLD, RESIDUAL)


class GeluExperts(nnx.Module):
    """E two-matrix GELU MLPs as stacked weights with a leading ``expert`` dim."""

    def __init__(self, cfg: GlamConfig, rngs: nnx.Rngs):
        n, e, f = cfg.experts, cfg.embed, cfg.expert_mlp
        self.w_in = _param(rngs, (n, e, f), ("expert", "embed", "mlp"), e)  # [E, embed, mlp]
        self.w_out = _param(rngs, (n, f, e), ("expert", "mlp", "embed"), f)  # [E, mlp, embed]

    def __call__(self, x_GECD):
        """Each expert on its own slots: [groups, experts, capacity, embed] in and out."""
        dt = x_GECD.dtype
        h_GECF = jnp.einsum("gecd,edf->gecf", x_GECD, self.w_in[...].astype(dt))
        h_GECF = constrain(jax.nn.gelu(h_GECF), ("batch_no_expert", "expert", None, "mlp"))
        out = jnp.einsum("gecf,efd->gecd", h_GECF, self.w_out[...].astype(dt))
        return constrain(out, EXPERT_NAMES)


class GlamMoeLayer(MoeLayer):
    """``models.moe``'s routing, dispatch and combine around GLaM's GELU experts."""

    def make_experts(self, cfg: GlamConfig, rngs: nnx.Rngs) -> nnx.Module:
        return GeluExperts(cfg, rngs)


class GlamPair(nnx.Module):
    """An MoE layer, then a dense layer (pre-norm residual sublayers): the stacked unit."""

    def __init__(self, cfg: GlamConfig, rngs: nnx.Rngs):
        self.moe_attn_norm = RMSNorm(cfg)
        self.moe_attn = Attention(cfg, rngs)
        self.moe_norm = RMSNorm(cfg)
        self.moe = GlamMoeLayer(cfg, rngs)
        self.attn_norm = RMSNorm(cfg)
        self.attn = Attention(cfg, rngs)
        self.mlp_norm = RMSNorm(cfg)
        self.mlp = GegluMLP(cfg, rngs)

    def __call__(self, x_BLD, positions_L=None) -> tuple[jax.Array, dict]:
        x_BLD = x_BLD + self.moe_attn(self.moe_attn_norm(x_BLD), positions_L)
        y_BLD, stats = self.moe(self.moe_norm(x_BLD))
        x_BLD = constrain(x_BLD + y_BLD, RESIDUAL)
        x_BLD = x_BLD + self.attn(self.attn_norm(x_BLD), positions_L)
        x_BLD = checkpoint_name(x_BLD, "attn_residual")
        x_BLD = x_BLD + self.mlp(self.mlp_norm(x_BLD))
        return constrain(x_BLD, RESIDUAL), stats

    def decode(self, x_BTD, kv, positions_T, start):
        """Both layers on their slices of the KV cache (``models.llama.cache``), kv: (k, v)
        [2, ...]; the new tokens are one routing group, as in ``MoeBlock.decode``."""
        (k, v), t = kv, x_BTD.shape[1]
        out_BTD, (k0, v0) = attend_cached(
            self.moe_attn, self.moe_attn_norm(x_BTD), (k[0], v[0]), positions_T, start
        )
        x_BTD = x_BTD + out_BTD
        x_BTD = x_BTD + self.moe(self.moe_norm(x_BTD), group=t)[0]
        out_BTD, (k1, v1) = attend_cached(
            self.attn, self.attn_norm(x_BTD), (k[1], v[1]), positions_T, start
        )
        x_BTD = x_BTD + out_BTD
        x_BTD = x_BTD + self.mlp(self.mlp_norm(x_BTD))
        return x_BTD, (jnp.stack([k0, k1]), jnp.stack([v0, v1]))


class Glam(Moe):
    """Tied embedding, ``layers / 2`` stacked ``GlamPair``s, final norm and the tied head
    (``Decoder`` with router statistics, ``Routed``); ``Moe.aux`` turns the statistics into
    the weighted balancing loss and the load metrics."""

    def make_blocks(self, cfg: GlamConfig, rngs: nnx.Rngs) -> nnx.Module:
        return stack_blocks(lambda r: GlamPair(cfg, r), cfg.moe_layers, rngs)

    def head(self, x_BLD, *, dtype=jnp.float32):
        """Logits [batch, seq, vocab] in fp32 from the tied table, the normed input scaled by
        1/sqrt(embed) as GShard's shared embedding softmax does: the table's entries are of
        order 1 (a lookup's scale), so unscaled logits would be of order sqrt(embed)."""
        x_BLD = self.final_norm(x_BLD) * jnp.asarray(self.cfg.embed**-0.5, x_BLD.dtype)
        # gathered in the logits' batch layout (vocab-parallel under FSDP: over fsdp only)
        x_BLD = constrain(x_BLD, ("batch", "seq", "embed"), beside={"vocab": self.cfg.vocab})
        logits_BLV = jnp.einsum("bld,vd->blv", x_BLD, self.embedding[...].astype(dtype))
        return constrain(logits_BLV.astype(jnp.float32), ("batch", "seq", "vocab"))
