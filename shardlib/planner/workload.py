"""What is being trained: the model's tensors with their logical names, batch and sequence.

The planner never builds the model. It reads the config's widths and lists every parameter
with the logical names ``models/llama.py`` gives it, so the same rules that lay out the real
model (``shardlib.plan.rules_for_mesh``) say how each candidate splits each tensor. FLOPs
follow the usual transformer count (6 per parameter per token, plus attention).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import models
from shardlib.errors import ShardingError


@dataclass(frozen=True)
class ParamInfo:
    """One parameter tensor (per layer when ``per_layer``; stacked over ``layers`` in the model)."""

    name: str
    """Path in the model, e.g. ``blocks.attn.wq``."""
    dims: tuple[tuple[str, int], ...]
    """(logical name, size) per dim, without the leading ``layers`` dim."""
    per_layer: bool
    """Inside the scanned blocks (one copy per layer)."""

    @property
    def numel(self) -> int:
        n = 1
        for _, size in self.dims:
            n *= size
        return n


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

    @cached_property
    def params(self) -> tuple[ParamInfo, ...]:
        """Every parameter of the Llama family, named as in ``models/llama.py``."""
        c = self.cfg
        e, h, g, d, f, v = c.embed, c.heads, c.kv_heads, c.head_dim, c.mlp, c.vocab
        mlp_dims = (("embed", e), ("mlp", f))
        if self.experts:
            mlp_dims = (("expert", self.experts), *mlp_dims)
        return (
            ParamInfo("embedding", (("vocab", v), ("embed", e)), False),
            ParamInfo("blocks.attn_norm.scale", (("embed", e),), True),
            ParamInfo("blocks.attn.wq", (("embed", e), ("heads", h), ("head_dim", d)), True),
            ParamInfo("blocks.attn.wk", (("embed", e), ("kv_heads", g), ("head_dim", d)), True),
            ParamInfo("blocks.attn.wv", (("embed", e), ("kv_heads", g), ("head_dim", d)), True),
            ParamInfo("blocks.attn.wo", (("heads", h), ("head_dim", d), ("embed", e)), True),
            ParamInfo("blocks.mlp_norm.scale", (("embed", e),), True),
            ParamInfo("blocks.mlp.w_gate", mlp_dims, True),
            ParamInfo("blocks.mlp.w_up", mlp_dims, True),
            ParamInfo("blocks.mlp.w_down", (*mlp_dims[:-2], ("mlp", f), ("embed", e)), True),
            ParamInfo("final_norm.scale", (("embed", e),), False),
            ParamInfo("lm_head", (("embed", e), ("vocab", v)), False),
        )

    @cached_property
    def param_count(self) -> int:
        return sum(p.numel * (self.layers if p.per_layer else 1) for p in self.params)

    @cached_property
    def layer_param_count(self) -> int:
        return sum(p.numel for p in self.params if p.per_layer)

    @property
    def tokens(self) -> int:
        return self.global_batch * self.seq

    # --- FLOPs --------------------------------------------------------------------------------
    @cached_property
    def layer_matmul_flops_per_token(self) -> float:
        """Forward FLOPs of one block's matmuls per token (2 per weight; experts: top_k)."""
        c = self.cfg
        attn = 2 * c.embed * (2 * c.heads * c.head_dim + 2 * c.kv_heads * c.head_dim)
        mlp = 2 * 3 * c.embed * c.mlp * (self.top_k if self.experts else 1)
        return float(attn + mlp)

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
            self.layer_matmul_flops_per_token + self.attention_flops_per_token(self.seq)
        )
        return 3.0 * self.tokens * (per_token + self.head_flops_per_token)
