"""What is being trained: the model's tensors with their logical names, batch and sequence.

The planner never builds the model. It reads the config's widths and lists every parameter
with the logical names ``models/llama.py`` (or ``models/moe.py``) gives it, so the same
rules that lay out the real model (``shardlib.plan.rules_for_mesh``) say how each candidate
splits each tensor. FLOPs follow the usual transformer count (6 per parameter per token,
plus attention); an MoE block counts the expert slots the program computes.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import models
from shardlib.errors import ShardingError


@dataclass(frozen=True)
class ParamInfo:
    """One parameter tensor (per layer when ``per_layer``; stacked over blocks in the model)."""

    name: str
    """Path in the model, e.g. ``blocks.attn.wq``."""
    dims: tuple[tuple[str | None, int], ...]
    """(logical name, size) per dim, without the leading ``layers`` dim (None: unnamed)."""
    per_layer: bool
    """Inside the scanned blocks (one copy per block that has it)."""
    share: float = 1.0
    """Fraction of the ``layers`` blocks that hold it: 1 for a Llama; in a mixture of
    experts 1/moe_every for the expert weights and router, the rest for the dense MLP."""

    @property
    def size(self) -> int:
        """Elements of one copy."""
        n = 1
        for _, size in self.dims:
            n *= size
        return n

    @property
    def numel(self) -> float:
        """Elements per layer on average (``size`` x ``share``): x layers = all copies."""
        return self.size * self.share


@dataclass(frozen=True)
class Workload:
    """A model config with the batch and sequence it is trained on."""

    model: str
    """Model preset name (``models.presets()``)."""
    cfg: Any
    """The model config (``LlamaConfig``), with overrides applied."""
    global_batch: int
    """Sequences per optimizer step."""
    seq: int
    """Tokens per sequence."""
    precision: str = "bf16"
    """Compute dtype: bf16 (fp32 master weights, as shardlib trains) or fp32."""

    @classmethod
    def from_preset(
        cls, model: str, global_batch: int, seq: int, precision: str = "bf16", **overrides
    ) -> Workload:
        try:
            cfg = models.config(model, **overrides)
        except ValueError as err:
            raise ShardingError(str(err)) from None
        return cls(model=model, cfg=cfg, global_batch=global_batch, seq=seq, precision=precision)

    @classmethod
    def from_train_config(cls, cfg) -> Workload:
        """The workload a ``TrainConfig`` trains (its model overrides applied)."""
        from shardlib.train.config import apply_overrides

        model_cfg = apply_overrides(
            models.config(cfg.model), dict(cfg.model_overrides), f"model {cfg.model}"
        )
        return cls(cfg.model, model_cfg, cfg.batch, cfg.seq, cfg.precision)

    # --- widths -------------------------------------------------------------------------------
    @property
    def layers(self) -> int:
        return self.cfg.layers

    @property
    def embed(self) -> int:
        return self.cfg.embed

    @property
    def compute_bytes(self) -> int:
        """Bytes per activation element (the compute dtype)."""
        return 2 if self.precision == "bf16" else 4

    @property
    def experts(self) -> int:
        """Experts per MoE layer (0: a dense model). Read if the config has the field."""
        return int(getattr(self.cfg, "experts", 0) or 0)

    @property
    def top_k(self) -> int:
        return int(getattr(self.cfg, "top_k", 1) or 1)

    @property
    def moe_every(self) -> int:
        """Every n-th block is an MoE block (``MoeConfig.moe_every``; 0: a dense model)."""
        return int(getattr(self.cfg, "moe_every", 1)) if self.experts else 0

    @property
    def moe_layers(self) -> int:
        return self.layers // self.moe_every if self.experts else 0

    @property
    def group_tokens(self) -> int:
        """Tokens per routing group (``MoeConfig.group_size``, 0: one sequence)."""
        return int(getattr(self.cfg, "group_size", 0) or 0) or self.seq

    @property
    def capacity(self) -> int:
        """Slots per expert and routing group (``MoeConfig.capacity``)."""
        return self.cfg.capacity(self.group_tokens) if self.experts else 0

    @property
    def slots_per_token(self) -> float:
        """Expert slots per token, E x capacity / group: k x the effective capacity factor."""
        return self.experts * self.capacity / self.group_tokens if self.experts else 0.0

    @cached_property
    def params(self) -> tuple[ParamInfo, ...]:
        """Every parameter, named as in ``models/llama.py`` (or ``models/moe.py``)."""
        c = self.cfg
        e, f, v = c.embed, c.mlp, c.vocab
        outer_in = (ParamInfo("embedding", (("vocab", v), ("embed", e)), False),)
        outer_out = (
            ParamInfo("final_norm.scale", (("embed", e),), False),
            ParamInfo("lm_head", (("embed", e), ("vocab", v)), False),
        )
        if not self.experts:
            return outer_in + _block("blocks", c, 1.0) + _mlp("blocks.mlp", e, f, 1.0) + outer_out
        # models/moe.py: dense Llama blocks ``dense_blocks`` [layers - moe_layers, ...] and
        # MoE blocks ``moe_blocks`` [moe_layers, ...]; shares spread them over ``layers``
        moe = 1.0 / self.moe_every
        dense = 1.0 - moe
        n, fe = self.experts, c.expert_mlp
        experts = (("expert", n), ("embed", e), ("mlp", fe))
        moe_params = (
            # [embed, E]: replicated over the expert axis (every token scores every expert)
            ParamInfo("moe_blocks.moe.router", (("embed", e), (None, n)), True, moe),
            ParamInfo("moe_blocks.moe.experts.w_gate", experts, True, moe),
            ParamInfo("moe_blocks.moe.experts.w_up", experts, True, moe),
            ParamInfo(
                "moe_blocks.moe.experts.w_down",
                (("expert", n), ("mlp", fe), ("embed", e)),
                True,
                moe,
            ),
        )
        dense_params = ()
        if dense:
            dense_params = _block("dense_blocks", c, dense) + _mlp("dense_blocks.mlp", e, f, dense)
        return outer_in + dense_params + _block("moe_blocks", c, moe) + moe_params + outer_out

    @cached_property
    def param_count(self) -> int:
        return round(sum(p.numel * (self.layers if p.per_layer else 1) for p in self.params))

    @cached_property
    def layer_param_count(self) -> float:
        """Parameters of one block, averaged over the blocks (dense and MoE)."""
        return sum(p.numel for p in self.params if p.per_layer)

    @property
    def tokens(self) -> int:
        return self.global_batch * self.seq

    # --- FLOPs --------------------------------------------------------------------------------
    @cached_property
    def layer_matmul_flops_per_token(self) -> float:
        """Forward FLOPs of one block's matmuls per token as the program runs them (2 per
        weight), averaged over the blocks.

        An MoE block runs each expert on all its ``capacity`` slots, filled or not (E x C /
        group slots per token: k x the capacity factor), plus the router and GShard's
        dispatch and combine einsums ([g,s,e,c] x [g,s,d]: 2 x E x C x d per token each).
        """
        c = self.cfg
        attn = 2 * c.embed * (2 * c.heads * c.head_dim + 2 * c.kv_heads * c.head_dim)
        if not self.experts:
            return float(attn + 6 * c.embed * c.mlp)
        moe = 1.0 / self.moe_every
        slots = self.slots_per_token
        expert = 2 * c.embed * self.experts + 6 * c.embed * c.expert_mlp * slots
        expert += 2 * 2 * slots * self.group_tokens * c.embed
        return attn + (1 - moe) * 6 * c.embed * c.mlp + moe * expert

    @cached_property
    def layer_unsplit_flops_per_token(self) -> float:
        """The part of ``layer_matmul_flops_per_token`` that tensor parallelism does not
        split: an MoE block's router and dispatch/combine einsums (their dims are embed,
        experts and slots, none split by tensor)."""
        if not self.experts:
            return 0.0
        c = self.cfg
        moe = 2 * c.embed * self.experts + 4 * self.slots_per_token * self.group_tokens * c.embed
        return moe / self.moe_every

    @cached_property
    def layer_useful_flops_per_token(self) -> float:
        """Like ``layer_matmul_flops_per_token``, counting only the k experts a token uses
        (no padding slots, no dispatch): the MFU numerator's count."""
        c = self.cfg
        if not self.experts:
            return self.layer_matmul_flops_per_token
        attn = 2 * c.embed * (2 * c.heads * c.head_dim + 2 * c.kv_heads * c.head_dim)
        moe = 1.0 / self.moe_every
        expert = 2 * c.embed * self.experts + 6 * c.embed * c.expert_mlp * self.top_k
        return attn + (1 - moe) * 6 * c.embed * c.mlp + moe * expert

    def attention_flops_per_token(self, seq: int) -> float:
        """Forward FLOPs of scores and weighted sum per token, dense (the mask is not skipped)."""
        c = self.cfg
        return 4.0 * seq * c.heads * c.head_dim

    @cached_property
    def head_flops_per_token(self) -> float:
        """Forward FLOPs of the output projection per token (the lookup is free)."""
        return 2.0 * self.embed * self.cfg.vocab

    @cached_property
    def model_flops(self) -> float:
        """Forward + backward FLOPs per step, no recompute: the MFU numerator."""
        per_token = self.layers * (
            self.layer_useful_flops_per_token + self.attention_flops_per_token(self.seq)
        )
        return 3.0 * self.tokens * (per_token + self.head_flops_per_token)


def _block(prefix: str, c, share: float) -> tuple[ParamInfo, ...]:
    """The attention half of a block (``models.llama.Block`` and ``models.moe.MoeBlock``)."""
    e, h, g, d = c.embed, c.heads, c.kv_heads, c.head_dim
    return (
        ParamInfo(f"{prefix}.attn_norm.scale", (("embed", e),), True, share),
        ParamInfo(f"{prefix}.attn.wq", (("embed", e), ("heads", h), ("head_dim", d)), True, share),
        ParamInfo(
            f"{prefix}.attn.wk", (("embed", e), ("kv_heads", g), ("head_dim", d)), True, share
        ),
        ParamInfo(
            f"{prefix}.attn.wv", (("embed", e), ("kv_heads", g), ("head_dim", d)), True, share
        ),
        ParamInfo(f"{prefix}.attn.wo", (("heads", h), ("head_dim", d), ("embed", e)), True, share),
        ParamInfo(f"{prefix}.mlp_norm.scale", (("embed", e),), True, share),
    )


def _mlp(prefix: str, e: int, f: int, share: float) -> tuple[ParamInfo, ...]:
    """A SwiGLU MLP: [embed, mlp] gate and up, [mlp, embed] down."""
    return (
        ParamInfo(f"{prefix}.w_gate", (("embed", e), ("mlp", f)), True, share),
        ParamInfo(f"{prefix}.w_up", (("embed", e), ("mlp", f)), True, share),
        ParamInfo(f"{prefix}.w_down", (("mlp", f), ("embed", e)), True, share),
    )
