"""What is being trained: the model's tensors with their logical names, batch and sequence.

One description of the model and the step, read by the plan's checks (``ParallelPlan.check``:
each strategy refuses what it cannot run before anything compiles), the trainer and the
planner. Nothing is built: the facts come from the parameter inventory the model itself
declares (``shardlib.core.inventory.inventory``: ``nnx.eval_shape``, nothing allocated), so the
rules that lay out the real model (``shardlib.parallel.plan``) say how each candidate splits
each tensor, and a new model needs no copy of its parameter list here. The widths the FLOP
and activation formulas use (embed, heads, mlp, ...) are the sizes of those logical dims.
FLOPs follow the usual transformer count (6 per parameter per token, plus attention); an
MoE block counts the expert slots the program computes. Routing facts that no parameter
shape shows (experts, top-k, capacity, which blocks are MoE) come from the model itself
(``shardlib.core.model.Routed``); a dense model has none.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from shardlib.core.capabilities import ExpertRouting
from shardlib.core.errors import ShardingError
from shardlib.core.inventory import inventory
from shardlib.core.model import resolve_model
from shardlib.core.param_info import LAYERS, ParamInfo, param_infos, plain_shape


@dataclass(frozen=True)
class Workload:
    """A model's parameters with the batch and sequence it is trained on: what a
    ``ParallelPlan`` is checked against, what the trainer runs and what the planner costs."""

    model: str
    """The model name ``shardlib.core.model.resolve_model`` resolves (a preset or module:fn)."""
    params: tuple[ParamInfo, ...]
    """Every parameter, as the model declares it."""
    param_count: int
    """Parameters of the model (the inventory's count)."""
    layers: int
    """Decoder layers: the stacked blocks, times the decoder layers in one block."""
    global_batch: int
    """Sequences per optimizer step (all micro-batches together)."""
    seq: int
    """Tokens per sequence."""
    precision: str = "bf16"
    """Compute dtype: bf16 (fp32 master weights, as shardlib trains), fp16 or fp32."""
    cfg: Any = None
    """The model's config (None for a plain function): the settings a plan file records."""
    overrides: tuple[tuple[str, Any], ...] = ()
    """The ``model.NAME`` settings applied to the model (as given)."""
    routing: ExpertRouting | None = None
    """The model's mixture-of-experts routing (``shardlib.core.model.Routed``); None: dense."""
    blocks: int = 0
    """Stacked blocks: the leading ``layers`` dim of the model's ``blocks``, which the layer
    loop and a pipeline split (an MoE model stacks groups of ``routing.every`` layers)."""
    microbatches: int = 1
    """Gradient-accumulation micro-batches the batch is split into (the plan's; the planner
    leaves 1 and costs each candidate's own)."""
    checkpoint_names: tuple[str, ...] = ()
    """Intermediates the model tags with ``checkpoint_name`` (for ``remat=names:...``)."""
    block_stats: bool = False
    """The blocks return per-layer statistics besides the residual (an MoE router's)."""
    block_kind: str = ""
    """Which fitted per-block memory coefficients the planner reads (the model class's
    ``block_kind``, ``Inventory.block_kind``); "": the Llama-fitted defaults."""
    max_positions: int | None = None
    """Positions the model declares (``Inventory.max_positions``): the rows of a learned
    position table (GPT's), of which a step reads its first ``seq``."""

    def __hash__(self) -> int:
        return self._hash

    @cached_property
    def _hash(self) -> int:
        """The fields' hash, computed once: the planner's caches key on the workload
        thousands of times per search, and its parameter list is long."""
        return hash(tuple(vars(self)[f.name] for f in dataclasses.fields(self)))

    @classmethod
    def from_params(
        cls, entries, *, routing: ExpertRouting | None = None, model: str = "", **fields
    ) -> Workload:
        """The workload of ``(path, shape, names)`` entries (``core.inventory.Inventory.params``)
        with the step's ``fields`` (``global_batch`` and ``seq`` default to 1): for a plan's
        checks on a model of one's own, or tests. Blocks are the stacked ``layers`` dim."""
        entries = tuple((path, plain_shape(shape), names) for path, shape, names in entries)
        stacked = [shape[0] for _, shape, names in entries if names and names[0] == LAYERS]
        blocks = stacked[0] if stacked else 0
        layers = blocks * (routing.every if routing else 1)
        return cls(
            model=model,
            params=param_infos(entries, layers),
            param_count=sum(math.prod(shape) for _, shape, _ in entries),
            layers=layers,
            global_batch=fields.pop("global_batch", 1),
            seq=fields.pop("seq", 1),
            routing=routing,
            blocks=blocks,
            **fields,
        )

    @classmethod
    def from_factory(
        cls,
        factory,
        global_batch: int,
        seq: int,
        precision: str = "bf16",
        overrides=(),
        inv=None,
        microbatches: int = 1,
    ) -> Workload:
        """The workload of a ``shardlib.core.model.ModelFactory``; ``inv``: its inventory when
        the caller has it already (the model is then not built again)."""
        inv = inventory(factory) if inv is None else inv
        return cls.from_params(
            inv.params,
            routing=inv.routing,
            model=factory.name,
            global_batch=global_batch,
            seq=seq,
            precision=precision,
            cfg=factory.config,
            overrides=tuple(dict(overrides).items()),
            microbatches=microbatches,
            checkpoint_names=inv.checkpoint_names,
            block_stats=inv.block_stats,
            block_kind=inv.block_kind,
            max_positions=inv.max_positions,
        )

    @classmethod
    def from_preset(
        cls, model: str, global_batch: int, seq: int, precision: str = "bf16", **overrides
    ) -> Workload:
        """``model`` (a registered name or ``package.module:function``) with overrides."""
        try:
            factory = resolve_model(model, overrides)
        except ValueError as err:
            raise ShardingError(str(err)) from None
        return cls.from_factory(factory, global_batch, seq, precision, overrides)

    @classmethod
    def from_train_config(cls, cfg) -> Workload:
        """The workload a ``TrainConfig`` trains (its model overrides applied)."""
        return cls.from_preset(
            cfg.model,
            cfg.dataset.batch,
            cfg.dataset.seq,
            cfg.precision.compute,
            **dict(cfg.model_overrides),
        )

    # --- widths: the sizes of the logical dims the parameters name ---------------------------
    @cached_property
    def dims(self) -> Mapping[str, int]:
        """Size of each logical dim of the dense parameters (those without the experts' dim,
        ``routing.dim``), that dim's size, and ``expert_mlp``: the experts' hidden width."""
        out: dict[str, int] = {}
        experts_dim = self.routing.dim if self.routing else None
        for param in self.params:
            names = dict(param.dims)
            if experts_dim in names:
                out.setdefault("expert_mlp", names.get("mlp", 0))
                out.setdefault(experts_dim, names[experts_dim])
                continue
            for name, size in param.dims:
                if name is not None:
                    out.setdefault(name, size)
        return out

    def _dim(self, name: str) -> int:
        return self.dims.get(name, 0)

    embed = property(lambda self: self._dim("embed"))
    heads = property(lambda self: self._dim("heads"))
    kv_heads = property(lambda self: self._dim("kv_heads"))
    head_dim = property(lambda self: self._dim("head_dim"))
    mlp = property(lambda self: self._dim("mlp"))
    """The dense MLP's hidden width (0 when every block is an MoE block)."""
    vocab = property(lambda self: self._dim("vocab"))
    expert_mlp = property(lambda self: self._dim("expert_mlp"))

    def local_kv_heads(self, tensor: int) -> float:
        """K/V heads on one device of a ``tensor``-way group: split where they divide,
        otherwise all of them (``parallel.tensor``: replicated, as Megatron-LM does)."""
        kv = self.kv_heads
        return kv / tensor if kv % tensor == 0 else kv

    def local_qkv_width(self, tensor: int) -> float:
        """Width of one device's q, k and v together: (heads/t + 2 local K/V heads) x d."""
        return (self.heads / tensor + 2 * self.local_kv_heads(tensor)) * self.head_dim

    @cached_property
    def tensor_sizes(self) -> tuple[int, ...]:
        """Every size of a dim tensor parallelism must split (heads, MLP and vocab; not the
        K/V heads, which it replicates where they do not divide)."""
        names = ("heads", "mlp", "vocab")
        return tuple(sorted({s for p in self.params for n, s in p.dims if n in names}))

    @property
    def tied_head(self) -> bool:
        """The output head reads the embedding table (GPT-2/3, Qwen2's small models): the
        decoder holds an ``embedding`` and no ``lm_head`` of its own."""
        names = {p.name for p in self.params}
        return "embedding" in names and "lm_head" not in names

    def rows_read(self, param: ParamInfo) -> float:
        """Share of ``param`` one sequence reads: ``seq / max_positions`` for a learned
        position table outside the layers (an unnamed first dim of ``max_positions`` rows,
        read in order by a slice: XLA gathers and reduces those rows alone), else 1."""
        first = param.dims[0] if param.dims else (None, 0)
        table = not param.per_layer and first == (None, self.max_positions)
        return min(self.seq / self.max_positions, 1.0) if table else 1.0

    @property
    def compute_bytes(self) -> int:
        """Bytes per activation element (the compute dtype)."""
        return 2 if self.precision in ("bf16", "fp8") else 4  # fp8: bf16 between products

    # --- the step ----------------------------------------------------------------------------
    @property
    def micro_batch(self) -> int:
        """Sequences in one gradient-accumulation micro-batch."""
        return self.global_batch // self.microbatches

    # --- mixture of experts: the model's routing (``Routed``) --------------------------------
    @property
    def experts(self) -> int:
        """Experts per MoE layer (0: a dense model)."""
        return self.routing.experts if self.routing else 0

    @property
    def top_k(self) -> int:
        """Experts each token is sent to (1 for a dense model)."""
        return self.routing.top_k if self.routing else 1

    @property
    def moe_every(self) -> int:
        """Every n-th decoder layer is an MoE layer (0: a dense model)."""
        return self.routing.every if self.routing else 0

    @property
    def moe_layers(self) -> int:
        return self.layers // self.moe_every if self.routing else 0

    @property
    def group_tokens(self) -> int:
        """Tokens per routing group (the routing's group size; 0 there: one sequence)."""
        return (self.routing.group_size if self.routing else 0) or self.seq

    @property
    def capacity(self) -> int:
        """Slots per expert and routing group (the routing's own formula)."""
        return self.routing.capacity(self.group_tokens) if self.routing else 0

    @property
    def slots_per_token(self) -> float:
        """Expert slots per token, E x capacity / group: k x the effective capacity factor."""
        return self.experts * self.capacity / self.group_tokens if self.experts else 0.0

    @cached_property
    def layer_param_count(self) -> float:
        """Parameters of one block, averaged over the blocks (dense and MoE)."""
        return sum(p.numel for p in self.params if p.per_layer)

    @property
    def tokens(self) -> int:
        return self.global_batch * self.seq

    def _matrices(self, experts: bool) -> int:
        """Weight matrices of one (expert) MLP: elements of the per-layer weights naming both
        embed and mlp, over embed x hidden width (x experts), per layer of that kind.
        3 for SwiGLU (gate, up, down), 2 for GPT's GELU MLP (fc, proj); 3 when none."""
        experts_dim = self.routing.dim if self.routing else None
        hidden = self.expert_mlp if experts else self.mlp
        share = (1 / self.moe_every if experts else 1 - 1 / self.moe_every) if experts_dim else 1
        elements = sum(
            p.numel
            for p in self.params
            if p.per_layer
            and {"embed", "mlp"} <= {n for n, _ in p.dims}
            and (experts_dim in dict(p.dims)) == experts
        )
        one = self.embed * hidden * (self.experts if experts else 1) * share
        return round(elements / one) if one and elements else 3

    @cached_property
    def mlp_matrices(self) -> int:
        """Weight matrices of the dense MLP, read from the parameters: 3 for SwiGLU (gate,
        up, down), 2 for a GELU MLP (GPT's fc and proj). FLOPs count 2 x embed x mlp each."""
        return self._matrices(experts=False)

    @cached_property
    def expert_mlp_matrices(self) -> int:
        """Weight matrices of one expert (3 for a SwiGLU expert), read from the parameters."""
        return self._matrices(experts=True) if self.experts else 3

    # --- FLOPs --------------------------------------------------------------------------------
    @cached_property
    def _attention_matmul_flops(self) -> float:
        """Forward FLOPs of one block's q/k/v/o projections per token (2 per weight)."""
        e, d = self.embed, self.head_dim
        return 2 * e * (2 * self.heads * d + 2 * self.kv_heads * d)

    @cached_property
    def layer_matmul_flops_per_token(self) -> float:
        """Forward FLOPs of one block's matmuls per token as the program runs them (2 per
        weight), averaged over the blocks.

        An MoE block runs each expert on all its ``capacity`` slots, filled or not (E x C /
        group slots per token: k x the capacity factor), plus the router and GShard's
        dispatch and combine einsums ([g,s,e,c] x [g,s,d]: 2 x E x C x d per token each).
        """
        attn, dense = self._attention_matmul_flops, 2 * self.mlp_matrices * self.embed * self.mlp
        if not self.experts:
            return float(attn + dense)
        moe = 1.0 / self.moe_every
        slots, per_slot = self.slots_per_token, 2 * self.expert_mlp_matrices
        expert = 2 * self.embed * self.experts + per_slot * self.embed * self.expert_mlp * slots
        expert += 2 * 2 * slots * self.group_tokens * self.embed
        return attn + (1 - moe) * dense + moe * expert

    @cached_property
    def layer_unsplit_flops_per_token(self) -> float:
        """The part of ``layer_matmul_flops_per_token`` that tensor parallelism does not
        split: an MoE block's router and dispatch/combine einsums (their dims are embed,
        experts and slots, none split by tensor)."""
        if not self.experts:
            return 0.0
        e = self.embed
        moe = 2 * e * self.experts + 4 * self.slots_per_token * self.group_tokens * e
        return moe / self.moe_every

    @cached_property
    def layer_useful_flops_per_token(self) -> float:
        """Like ``layer_matmul_flops_per_token``, counting only the k experts a token uses
        (no padding slots, no dispatch): the MFU numerator's count."""
        if not self.experts:
            return self.layer_matmul_flops_per_token
        e, moe = self.embed, 1.0 / self.moe_every
        per_token = 2 * self.expert_mlp_matrices * e * self.expert_mlp * self.top_k
        expert = 2 * e * self.experts + per_token
        dense = 2 * self.mlp_matrices * e * self.mlp
        return self._attention_matmul_flops + (1 - moe) * dense + moe * expert

    def attention_flops_per_token(self, seq: int) -> float:
        """Forward FLOPs of scores and weighted sum per token, dense (the mask is not skipped)."""
        return 4.0 * seq * self.heads * self.head_dim

    @cached_property
    def head_flops_per_token(self) -> float:
        """Forward FLOPs of the output projection per token (the lookup is free)."""
        return 2.0 * self.embed * self.vocab

    @cached_property
    def model_flops(self) -> float:
        """Forward + backward FLOPs per step, no recompute: the MFU numerator."""
        per_token = self.layers * (
            self.layer_useful_flops_per_token + self.attention_flops_per_token(self.seq)
        )
        return 3.0 * self.tokens * (per_token + self.head_flops_per_token)
