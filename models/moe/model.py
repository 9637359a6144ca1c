"""A mixture-of-experts decoder: the Llama block with its MLP replaced every few layers.

Every ``moe_every``-th block routes each token to ``top_k`` of ``experts`` SwiGLU experts
(GShard, Switch). Tokens are routed in fixed *groups* (a sequence, or ``group_size``
tokens of one), each expert takes at most ``capacity`` tokens per group, and a token past
that is dropped: its expert output is zero and it passes on through the residual. Groups and
priorities (all first choices before any second choice, then token order) depend only on
the data, never on the mesh, so the same tokens drop on one device and on a thousand.

The blocks are one stack of identical *groups* (``moe_every - 1`` dense Llama blocks, then one
MoE block), ``[moe_layers, ...]``, scanned like Llama's blocks: one compiled body whatever
the depth. A group returns ``(x, router statistics)``; the layer loop sums the statistics and
``aux`` turns them into ``aux["loss"]`` (added to the training objective) and metrics.
``__call__`` returns ``(logits, aux)``. Model code names logical axes only; the expert
layout comes from shardlib's rules and the form of its all-to-all from ``shardlib.core.ops``.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from models.llama.cache import attend_cached
from models.llama.model import Attention, Block, Llama, LlamaConfig, RMSNorm, _param, stack_blocks
from models.moe.routing import Routing, route
from shardlib.core.capabilities import ExpertRouting
from shardlib.core.layout import constrain
from shardlib.core.ops import exchange

DISPATCH_NAMES = ("batch", None, None, "embed")  # [groups, experts, capacity, embed]
EXPERT_NAMES = ("batch_no_expert", "expert", None, "embed")  # the same, at the experts


@dataclass(frozen=True)
class MoeConfig(LlamaConfig):
    """A Llama decoder whose MLP is a mixture of experts every ``moe_every`` layers."""

    experts: int = 8
    """Experts per MoE layer (E)."""
    expert_mlp: int = 64
    """SwiGLU hidden width of one expert."""
    top_k: int = 2
    """Experts each token is sent to (k): 1 = Switch, 2 = GShard / Mixtral."""
    capacity_factor: float = 2.0
    """Capacity per expert and group = ceil(top_k * group tokens / experts * factor)."""
    moe_every: int = 1
    """Every n-th block is an MoE block (1: all; 2: every other one, as in GShard)."""
    no_drop: bool = False
    """Capacity = the whole group, so no token is ever dropped (dropless routing)."""
    group_size: int = 0
    """Tokens per routing group, a divisor of the sequence length; 0 = one sequence."""
    aux_loss_weight: float = 0.01
    """Weight of the load-balancing loss E * sum_e f_e * P_e (mean over MoE layers)."""
    z_loss_weight: float = 0.001
    """Weight of the router z-loss mean(logsumexp(logits)^2) (mean over MoE layers)."""
    first_choice_load: bool = False
    """The balancing loss's f_e counts first choices only (GShard, GLaM); else all k."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 1 <= self.top_k <= self.experts:
            raise ValueError(f"model: top_k={self.top_k} must be in 1..experts={self.experts}.")
        if self.moe_every < 1 or self.layers % self.moe_every:
            raise ValueError(
                f"model: layers={self.layers} is not a multiple of moe_every={self.moe_every}. "
                "Fix: choose layers = a multiple of moe_every."
            )
        if self.capacity_factor <= 0:
            raise ValueError(f"model: capacity_factor={self.capacity_factor} must be > 0.")

    @property
    def moe_layers(self) -> int:
        return self.layers // self.moe_every

    def routing(self) -> ExpertRouting:
        """The routing facts the planner reads (``shardlib.core.model.Routed``)."""
        return ExpertRouting(
            experts=self.experts,
            top_k=self.top_k,
            capacity_factor=self.capacity_factor,
            dim="expert",  # [expert, ...]: the leading dim of the stacked expert weights
            every=self.moe_every,
            group_size=self.group_size,
            no_drop=self.no_drop,
        )

    def capacity(self, group: int) -> int:
        """Slots per expert in a group of ``group`` tokens: the routing's one formula."""
        return self.routing().capacity(group)

    def param_count(self) -> int:
        e, h, k, d, f, v = (
            self.embed,
            self.heads,
            self.kv_heads,
            self.head_dim,
            self.mlp,
            self.vocab,
        )
        attn = 2 * e + e * h * d * 2 + e * k * d * 2
        experts = self.experts * 3 * e * self.expert_mlp + e * self.experts
        dense = self.layers - self.moe_layers
        return self.layers * attn + dense * 3 * e * f + self.moe_layers * experts + 2 * v * e + e


PRESETS: dict[str, MoeConfig] = {
    # tests and the example run: 8 experts of width 64 in the second of two blocks
    "moe-tiny": MoeConfig(
        embed=64, layers=2, heads=4, kv_heads=2, head_dim=16, mlp=256, moe_every=2
    ),
    # Hugging Face Mixtral imports (models/moe/hf.py): an MoE block in every layer, dropless
    "mixtral-tiny": MoeConfig(
        embed=64,
        layers=2,
        heads=4,
        kv_heads=2,
        head_dim=16,
        experts=4,
        moe_every=1,
        no_drop=True,
        rope_theta=1_000_000.0,
    ),
    # Mixtral 8x7B shapes (46.7B parameters), for `explain` with abstract inputs
    "mixtral-8x7b": MoeConfig(
        vocab=32_000,
        embed=4096,
        layers=32,
        heads=32,
        kv_heads=8,
        head_dim=128,
        mlp=14_336,
        rope_theta=1_000_000.0,
        experts=8,
        expert_mlp=14_336,
        top_k=2,
        capacity_factor=1.25,
    ),
}


class Experts(nnx.Module):
    """E SwiGLU MLPs as stacked weights with a leading ``expert`` dim."""

    def __init__(self, cfg: MoeConfig, rngs: nnx.Rngs):
        n, e, f = cfg.experts, cfg.embed, cfg.expert_mlp
        self.w_gate = _param(rngs, (n, e, f), ("expert", "embed", "mlp"), e)  # [E, embed, mlp]
        self.w_up = _param(rngs, (n, e, f), ("expert", "embed", "mlp"), e)  # [E, embed, mlp]
        self.w_down = _param(rngs, (n, f, e), ("expert", "mlp", "embed"), f)  # [E, mlp, embed]

    def __call__(self, x_GECD):
        """Each expert on its own slots: [groups, experts, capacity, embed] in and out."""
        dt = x_GECD.dtype
        gate = jnp.einsum("gecd,edf->gecf", x_GECD, self.w_gate[...].astype(dt))
        up = jnp.einsum("gecd,edf->gecf", x_GECD, self.w_up[...].astype(dt))
        h_GECF = constrain(jax.nn.silu(gate) * up, ("batch_no_expert", "expert", None, "mlp"))
        out = jnp.einsum("gecf,efd->gecd", h_GECF, self.w_down[...].astype(dt))
        return constrain(out, EXPERT_NAMES)


class MoeLayer(nnx.Module):
    """Route, dispatch to the experts' devices, run the experts, combine back."""

    def __init__(self, cfg: MoeConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        # [embed, E]: the router is replicated over the expert axis (every token scores all E)
        self.router = _param(rngs, (cfg.embed, cfg.experts), ("embed", None), cfg.embed)
        self.experts = self.make_experts(cfg, rngs)

    def make_experts(self, cfg: MoeConfig, rngs: nnx.Rngs) -> nnx.Module:
        """The experts a subclass replaces ([groups, E, C, embed] in and out; GLaM's GELU)."""
        return Experts(cfg, rngs)

    def __call__(self, x_BLD, group: int = 0) -> tuple[jax.Array, dict]:
        """(output, router statistics); ``group``: tokens per routing group, 0 for the
        config's (the KV-cache path routes each step's new tokens as one group)."""
        cfg = self.cfg
        b, l, d = x_BLD.shape
        s = group or cfg.group_size or l
        if l % s:
            raise ValueError(
                f"model: group_size={cfg.group_size} does not divide the sequence length {l}. "
                "Fix: choose a divisor of seq, or group_size=0 (one group per sequence)."
            )
        # Groups never span sequences, so a batch split keeps every group on one device.
        x_GSD = constrain(x_BLD.reshape(b * (l // s), s, d), ("batch", None, "embed"))
        router_DE = self.router[...].astype(jnp.float32)
        logits_GSE = jnp.einsum("gsd,de->gse", x_GSD.astype(jnp.float32), router_DE)
        logits_GSE = constrain(logits_GSE, ("batch", None, None))  # routing is per group
        r: Routing = route(
            logits_GSE,
            top_k=cfg.top_k,
            capacity=cfg.capacity(s),
            first_choice_load=cfg.first_choice_load,
        )
        dispatch_GSEC = constrain(r.dispatch.astype(x_BLD.dtype), ("batch", None, None, None))
        combine_GSEC = constrain(r.combine.astype(x_BLD.dtype), ("batch", None, None, None))
        x_GECD = constrain(jnp.einsum("gsec,gsd->gecd", dispatch_GSEC, x_GSD), DISPATCH_NAMES)
        x_GECD = exchange(x_GECD, DISPATCH_NAMES, EXPERT_NAMES, "dispatch")  # all-to-all
        y_GECD = self.experts(x_GECD)
        y_GECD = exchange(y_GECD, EXPERT_NAMES, DISPATCH_NAMES, "combine")  # and back
        y_GSD = jnp.einsum("gsec,gecd->gsd", combine_GSEC, y_GECD)
        return y_GSD.reshape(b, l, d), r.stats


class MoeBlock(nnx.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + moe(norm(x))."""

    def __init__(self, cfg: MoeConfig, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg)
        self.attn = Attention(cfg, rngs)
        self.mlp_norm = RMSNorm(cfg)
        self.moe = MoeLayer(cfg, rngs)

    def __call__(self, x_BLD, positions_L=None):
        x_BLD = x_BLD + self.attn(self.attn_norm(x_BLD), positions_L)
        y_BLD, stats = self.moe(self.mlp_norm(x_BLD))
        return constrain(x_BLD + y_BLD, ("batch", "seq", "embed")), stats

    def decode(self, x_BTD, kv, positions_T, start):
        """The block on the KV cache (``models.llama.cache``). The T new tokens are one
        routing group: the prompt at prefill, as a sequence in training; one token at each
        decode step, which a capacity never drops (k distinct experts, one slot each)."""
        out_BTD, kv = attend_cached(self.attn, self.attn_norm(x_BTD), kv, positions_T, start)
        x_BTD = x_BTD + out_BTD
        y_BTD, _ = self.moe(self.mlp_norm(x_BTD), group=x_BTD.shape[1])
        return x_BTD + y_BTD, kv


class MoeGroup(nnx.Module):
    """``moe_every - 1`` dense Llama blocks, then one MoE block: the unit the stack repeats.

    Grouping keeps one uniform stack (every weight ``[moe_layers, ...]``), so the library's
    layer loop, remat and offload treat it like Llama's; the dense blocks are unrolled.
    """

    def __init__(self, cfg: MoeConfig, rngs: nnx.Rngs):
        self.dense = nnx.List([Block(cfg, rngs) for _ in range(cfg.moe_every - 1)])
        self.moe = MoeBlock(cfg, rngs)

    def __call__(self, x_BLD, positions_L=None) -> tuple[jax.Array, dict]:
        for block in self.dense:
            x_BLD = block(x_BLD, positions_L)
        return self.moe(x_BLD, positions_L)

    def decode(self, x_BTD, kv, positions_T, start):
        """The group's layers on their slices of the cache, kv: (k, v) [moe_every, ...] (or
        the one layer's, without that dim, when moe_every is 1: ``models.llama.cache``)."""
        if not self.dense:
            return self.moe.decode(x_BTD, kv, positions_T, start)
        k, v = kv
        out_k, out_v = [], []
        for i, block in enumerate([*self.dense, self.moe]):
            x_BTD, (k_i, v_i) = block.decode(x_BTD, (k[i], v[i]), positions_T, start)
            out_k.append(k_i)
            out_v.append(v_i)
        return x_BTD, (jnp.stack(out_k), jnp.stack(out_v))


class Moe(Llama):
    """Llama's embedding and head around a stack of ``MoeGroup``s (``Decoder`` with stats,
    ``Routed``, and Llama's ``Generator``: the cache holds every decoder layer)."""

    def routing(self) -> ExpertRouting:
        """The routing of its MoE layers (``shardlib.core.model.Routed``)."""
        return self.cfg.routing()

    def make_blocks(self, cfg: MoeConfig, rngs: nnx.Rngs) -> nnx.Module:
        return stack_blocks(lambda r: MoeGroup(cfg, r), cfg.moe_layers, rngs)

    def aux(self, totals: dict, tokens: int) -> dict:
        """Objective term and metrics from the router statistics summed over MoE layers."""
        cfg, n = self.cfg, self.cfg.moe_layers
        aux_loss, z_loss = totals["aux_loss"] / n, totals["z_loss"] / n
        aux = {
            "loss": cfg.aux_loss_weight * aux_loss + cfg.z_loss_weight * z_loss,
            "moe_aux_loss": aux_loss,
            "moe_z_loss": z_loss,
            "moe_dropped": totals["dropped"],
            "moe_dropped_fraction": totals["dropped"] / (n * tokens * cfg.top_k),
        }
        for e in range(cfg.experts):
            aux[f"moe_load_{e}"] = totals["load"][e] / n
        return aux
