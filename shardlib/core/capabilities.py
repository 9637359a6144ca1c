"""What a model may offer beyond the ``Decoder`` protocol (``core.model``), each optional.

Training needs none of these; each unlocks one more thing the library does with a model:
``Generator`` text generation through a KV cache (``tools.generate``), ``Routed`` the
routing facts of mixture-of-experts layers (``ExpertRouting``: read by ``core.workload`` for
the planner and the plan's checks), and an ``HFAdapter`` registered with a family's presets
the Hugging Face import, export and ``init_from`` (``interop.hf``). A model that lacks one
is refused where it is needed, with the fix.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, get_args, runtime_checkable

import jax
import jax.numpy as jnp


@runtime_checkable
class Generator(Protocol):
    """A decoder ``shardlib.tools.generate`` continues text with, through a KV cache. Optional:
    training never asks for it. Every leaf of the cache is [layers, batch, length, kv_heads,
    head_dim], which ``generate.CACHE_NAMES`` lays out on the mesh."""

    max_positions: int
    """Positions the model attends over: the prompt and the new tokens must fit."""

    def init_cache(self, batch: int, length: int, dtype: Any = jnp.float32) -> Any:
        """A zeroed cache for ``batch`` sequences of up to ``length`` positions."""
        ...

    def decode(
        self, tokens_BT: jax.Array, cache: Any, start: jax.Array, *, dtype: Any = jnp.float32
    ) -> tuple[jax.Array, Any]:
        """``(logits [batch, T, vocab] fp32, cache)`` of T new tokens at positions ``start``..
        ``start + T - 1``, their keys and values written in: T = the prompt (prefill) or 1."""
        ...


@dataclass(frozen=True)
class ExpertRouting:
    """The routing of a model's mixture-of-experts layers: what no parameter shape shows and
    the planner costs (expert slots, dispatch bytes) and the plan checks. The model routes
    with ``capacity`` too, so the planner counts the slots the program computes."""

    experts: int
    """Experts per MoE layer (E)."""
    top_k: int
    """Experts each token is sent to (k)."""
    capacity_factor: float
    """Slots per expert and group: ceil(k x group tokens / E x factor), at most the group."""
    dim: str
    """The logical name the model gives its experts' dim (the dim expert parallelism splits)."""
    every: int = 1
    """Every n-th decoder layer is an MoE layer; one stacked block holds n decoder layers."""
    group_size: int = 0
    """Tokens per routing group (0: one sequence)."""
    no_drop: bool = False
    """Capacity = the whole group: no token is ever dropped."""

    def capacity(self, group: int) -> int:
        """Slots per expert in a group of ``group`` tokens (at most ``group``: k <= E)."""
        if self.no_drop:
            return group
        return min(group, math.ceil(self.top_k * group / self.experts * self.capacity_factor))


@runtime_checkable
class Routed(Protocol):
    """A model with mixture-of-experts layers; a dense model does not implement it.
    ``inventory`` reads ``routing()`` while it builds the model abstractly."""

    def routing(self) -> ExpertRouting:
        """The routing facts, from the model's config."""
        ...


HFLayout = Literal["same", "transpose", "in_heads", "out_heads", "heads_last", "heads_first"]
"""One layer of a shardlib tensor in Hugging Face's layout (``shardlib.interop.hf``): as is;
``nn.Linear``'s [out, in] of [in, out]; [heads*head_dim, embed] of [embed, heads, head_dim];
[embed, heads*head_dim] of [heads, head_dim, embed]; and for ``Conv1D`` weights, stored
[in, out] (GPT-2): [..., heads*head_dim] of [..., heads, head_dim] (``heads_last``: q/k/v
weights and biases) and [heads*head_dim, ...] of [heads, head_dim, ...] (``heads_first``:
the attention output's weight)."""


@dataclass(frozen=True, eq=False)
class HFAdapter:
    """A model family's map to and from a Hugging Face checkpoint (``config.json`` +
    ``*.safetensors``), registered with its presets (``ModelEntry.hf``) so that the library
    names no architecture's parameters. ``models/llama/hf.py`` is one."""

    hf_type: str
    """``config.json``'s ``model_type`` it reads (``"llama"``)."""
    preset: str
    """The preset a ``config.json``'s settings override (they give every shape)."""
    tensors: Mapping[str, tuple[str, HFLayout]]
    """Parameter path (``blocks/attn/wq``) -> Hugging Face name and layout; a ``blocks/``
    parameter has a tensor per layer, ``{i}`` in its name. Paths left out are not imported."""
    rotary: tuple[str, ...]
    """``in_heads`` paths whose rows rotary pairs up: ``interleaved_rope`` reorders them."""
    checked: tuple[str, ...]
    """Config fields no shape shows (``rope_theta``), checked against ``config.json``."""
    settings: Callable[[dict], dict]
    """``config.json`` -> config fields; ValueError names what the model cannot represent."""
    config_json: Callable[[dict], dict]
    """Config fields -> a ``config.json`` that ``transformers`` loads."""
    merged: Callable[[dict, dict], dict] = lambda flat, settings: flat
    """``(flat, settings)`` -> the host parameters to export, those with no Hugging Face name
    folded into those with one (LoRA: W + (alpha / rank) A @ B)."""
    base_prefix: str = ""
    """Hugging Face's ``base_model_prefix`` (``"transformer."`` for GPT-2): a checkpoint of
    the base model stores every name without it, and imports all the same."""
    fused: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    """Parameter path -> (k, n): the tensor is the k-th of n equal blocks along the last dim
    of its Hugging Face tensor, which n paths share (GPT-2's ``c_attn`` holds q, k and v)."""

    def __post_init__(self) -> None:
        bad = {p: lay for p, (_, lay) in self.tensors.items() if lay not in get_args(HFLayout)}
        bad |= {p: "rotary" for p in self.rotary if self.tensors[p][1] != "in_heads"}
        bad |= {p: f"fused {kn}" for p, kn in self.fused.items() if not 0 <= kn[0] < kn[1]}
        if bad:
            raise ValueError(f"HFAdapter {self.hf_type}: layouts {bad}; each must be one of "
                             f"{get_args(HFLayout)}, rotary ones in_heads, fused ones (k, n) "
                             "with 0 <= k < n.")  # fmt: skip
