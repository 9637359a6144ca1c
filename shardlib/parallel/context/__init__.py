"""Context parallelism: the whole sequence dim split over a ``context`` axis.

Every activation's tokens (``seq`` inside blocks and ``res_seq`` between them) are split,
so each device holds s/N tokens of every layer's activations; the projections and the MLP
need no communication at all (weights are applied per token). Only attention mixes tokens,
and that is where the ``attention`` setting picks a kernel: ring (K/V passed around with
ppermute), all_to_all (Ulysses: heads <-> sequence) or all_gather.

Token order. Under a causal mask, with contiguous chunks device 0 attends to s/N keys and
device N-1 to all s, so ring attention would wait on the last device. With
``load_balance=true`` the loss function reorders each sequence once, before the embedding,
into the zig-zag order of ``zigzag_order`` (device i holds chunks i and 2N-1-i of 2N), and
reorders the targets the same way: the per-token losses are then a permutation of the
natural ones and their mean is unchanged, so nothing has to be undone afterwards. The true
positions travel with the tokens (``positions_L``) into RoPE and the causal mask.

This module is the whole strategy: the rule, the section, the token order, and the attention
form it installs into ``shardlib.core.ops`` (``ContextAttention``); the kernels that run on
each device's slice of the sequence are in ``kernels.py`` beside it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import ClassVar

import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from shardlib.core.attention import LocalAttention, Packed, pick_chunk
from shardlib.core.errors import ShardingError
from shardlib.core.layout import active_layout, mesh_axes
from shardlib.core.mesh import Axis
from shardlib.core.resolve import resolve_spec
from shardlib.core.rules import Rules
from shardlib.core.shard_map import shard_map
from shardlib.core.workload import Workload
from shardlib.parallel.context.choice import AttentionChoice, Device, Splits, choose
from shardlib.parallel.context.kernels import (
    all_gather_attention,
    ring_attention,
    ulysses_attention,
)

KINDS = ("none", "ring", "all_to_all", "all_gather")


@dataclass(frozen=True)
class ContextAttention:
    """Attention across the context axis, as ``ContextParallel.ops`` resolves it on a mesh:
    a callable with ``ops.attention``'s signature, installed by ``ParallelPlan.ops``."""

    kind: str = "none"
    """Across the context axis: none | ring | all_to_all (Ulysses) | all_gather."""
    local: LocalAttention = field(default_factory=LocalAttention)
    """The kernel on each device (dense / chunked / cudnn); ring uses its chunk only."""
    load_balance: bool = True
    """Zig-zag token order for ring and all-gather attention (equal causal work per device)."""
    axis: str = Axis.CONTEXT
    """The mesh axis the sequence is split over."""
    axis_size: int = 1
    """Its size (the token order depends on it)."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ShardingError(
                f"attention={self.kind!r} is unknown. Fix: use one of "
                f"{', '.join(KINDS[1:])} (or none without a context axis)."
            )
        object.__setattr__(self, "axis", str(self.axis))  # plain str, also for Axis members

    @property
    def zigzag(self) -> bool:
        return self.load_balance and self.axis_size > 1 and self.kind in ("ring", "all_gather")

    def token_order(self, seq: int) -> np.ndarray | None:
        """Positions in the order the model sees them, or None for the natural order."""
        return zigzag_order(seq, self.axis_size) if self.zigzag else None

    def check_packed(self) -> None:
        """Packed rows (document masks) run the dense or cuDNN kernel on whole sequences."""
        if self.kind != "none":
            raise ShardingError(
                f"packed documents (a prepared dataset) need attention on whole sequences; "
                f"this plan runs attention={self.kind}, attention_impl={self.local.impl}. "
                "Fix: a mesh without a context axis, or a flat token file."
            )
        self.local.check_packed()

    def __call__(self, q_BLHK, k_BLGK, v_BLGK, positions_L=None, *, causal: bool = True):
        return attend(q_BLHK, k_BLGK, v_BLGK, positions_L, form=self, causal=causal)


def zigzag_order(seq: int, n: int) -> np.ndarray:
    """Zig-zag assignment of 2n sequence chunks to n devices: device i gets i and 2n-1-i.

    Under a causal mask the first chunks attend to little and the last to everything;
    pairing chunk i with chunk 2n-1-i gives every device the same work. Returned is the
    permutation ``order`` such that ``tokens[:, order]``, split contiguously over the axis,
    gives each device its two chunks; ``order[j]`` is the true position of slot j.
    """
    if seq % (2 * n):
        raise ShardingError(
            f"zig-zag load balancing splits seq={seq} into 2 x context = {2 * n} chunks, "
            f"which does not divide it. Fix: make seq a multiple of {2 * n}, or set "
            "load_balance=false."
        )
    c = seq // (2 * n)
    chunks = [(i, 2 * n - 1 - i) for i in range(n)]
    return np.concatenate([np.arange(j * c, (j + 1) * c) for pair in chunks for j in pair])


def context_parallel(*, axis: str = Axis.CONTEXT) -> Rules:
    """Activation tokens (inside and between blocks) over ``axis``; parameters untouched."""
    return Rules(activations={"seq": (axis,), "res_seq": (axis,)})


def reorder_tokens(tokens_BL1, form: ContextAttention):
    """(inputs, targets, positions) of a [b, seq + 1] token batch in the form's token order.

    Inputs and targets are reordered alike, so the mean loss is that of the natural order;
    positions are None for the natural order (the model then uses 0..L-1).
    """
    inputs_BL, targets_BL = tokens_BL1[:, :-1], tokens_BL1[:, 1:]
    order = form.token_order(inputs_BL.shape[1])
    if order is None:
        return inputs_BL, targets_BL, None
    return inputs_BL[:, order], targets_BL[:, order], jnp.asarray(order, jnp.int32)


@dataclass(frozen=True)
class ContextParallel:
    """``[parallel.context]``: the sequence over a ``context`` axis, and the attention kernel."""

    axes: ClassVar[dict[str, str]] = {Axis.CONTEXT: "sequence split; attention across it"}
    logical_names: ClassVar[dict[str, str]] = {}

    attention: str = "ring"
    """Attention across the ``context`` axis: ring | all_to_all (Ulysses) | all_gather."""
    attention_impl: str = "auto"
    """Attention on each device: auto (chosen by rule, ``choice.py``: cuDNN on a GPU where it
    can run, else chunked where dense scores would not fit, else dense) | dense | chunked
    (online softmax) | cudnn (GPU only)."""
    attention_chunk: int = 512
    """Query/key block length of chunked attention (and of ring attention's inner blocks)."""
    load_balance: bool = True
    """Ring/all-gather attention: zig-zag token order so causal work is equal per device."""

    def __post_init__(self) -> None:
        # unknown kinds and bad chunks fail when the plan is made, not when it meets a mesh
        ContextAttention(self.attention, LocalAttention(self.attention_impl, self.attention_chunk))

    def choose(
        self, mesh_axes: Mapping[str, int], rules: Rules, workload: Workload, device: Device
    ) -> AttentionChoice:
        """The kernel ``attention_impl`` names on this mesh, model and device, with the reason
        (``choice.choose``; an explicit kernel is kept as set, without looking further)."""
        if self.attention_impl != "auto":
            return choose(self.attention_impl, workload, "none", Splits(), device)

        def ways(name: str) -> int:
            return math.prod(mesh_axes.get(a, 1) for a in rules.activations.get(name, ()))

        size = mesh_axes.get(Axis.CONTEXT)
        kind = self.attention if size is not None else "none"
        splits = Splits(batch=ways("batch"), heads=ways("heads"), seq=size or 1)
        return choose(self.attention_impl, workload, kind, splits, device)

    def rules(self, mesh_axes: Mapping[str, int]) -> list[Rules]:
        return [context_parallel(axis=Axis.CONTEXT)] if Axis.CONTEXT in mesh_axes else []

    def attention_form(self, mesh_axes: Mapping[str, int]) -> ContextAttention:
        """How ``shardlib.core.ops.attention`` runs on this mesh."""
        size = mesh_axes.get(Axis.CONTEXT)
        return ContextAttention(
            kind=self.attention if size is not None else "none",
            local=LocalAttention(self.attention_impl, self.attention_chunk),
            load_balance=self.load_balance,
            axis=Axis.CONTEXT,
            axis_size=size or 1,
        )

    def ops(self, mesh_axes: Mapping[str, int]) -> dict:
        """The forms this strategy gives the model's ops (``ParallelPlan.ops``)."""
        return {"attention": self.attention_form(mesh_axes)}

    def split_tokens(self, tokens_BL1, mesh_axes: Mapping[str, int]):
        """(inputs, targets, positions) in the order the model sees (``reorder_tokens``)."""
        return reorder_tokens(tokens_BL1, self.attention_form(mesh_axes))

    def check_packed(self, mesh_axes: Mapping[str, int]) -> None:
        """Packed rows run only where attention is dense on whole sequences."""
        self.attention_form(mesh_axes).check_packed()

    def check(self, mesh_axes: Mapping[str, int], rules: Rules, workload: Workload) -> None:
        """Kernel, token order and Ulysses head counts, before anything compiles."""
        form = self.attention_form(mesh_axes)
        if form.local.impl == "cudnn" and form.kind not in ("none", "all_to_all"):
            raise ShardingError(
                f"attention_impl=cudnn with attention={form.kind}: cuDNN's fused kernel takes "
                "whole, naturally ordered sequences only. Fix: attention=all_to_all, or "
                "attention_impl=dense|chunked."
            )
        if Axis.CONTEXT not in mesh_axes:
            return
        if form.kind == "none":
            raise ShardingError(
                "the mesh has a context axis but attention=none. Fix: attention=ring, "
                "all_to_all or all_gather, or drop the context axis."
            )
        if workload.experts and mesh_axes.get(Axis.CONTEXT, 1) > 1:
            raise ShardingError(  # routing priorities follow token order within a sequence
                "a context axis splits and reorders each sequence, while the MoE router ranks "
                "a sequence's tokens in their natural order (capacity drops would change). "
                "Fix: drop the context axis (use expert/data/fsdp/tensor axes) for MoE models."
            )
        form.token_order(workload.seq)  # raises when seq does not split into 2N zig-zag chunks
        if form.kind == "all_to_all":

            def spec(name):
                axes = rules.activations.get(name, ())
                return P(None, None, axes or None)

            heads, kv_heads = workload.dims.get("heads", 1), workload.dims.get("kv_heads", 1)
            axes = dict(mesh_axes)
            check_ulysses(heads, kv_heads, spec("heads"), spec("kv_heads"), axes, Axis.CONTEXT)


def attend(q_BLHK, k_BLGK, v_BLGK, positions_L=None, *, form: ContextAttention, causal=True):
    """Causal (or full) attention with grouped K/V heads: [B, L, H, K] -> [B, L, H, K].

    ``positions_L`` are the true positions of the L tokens (default ``arange(L)``): they
    drive the causal mask, so a permuted token order (zig-zag) attends correctly. ``Packed``
    positions (several documents per row) mask attention across documents.
    """
    active = active_layout()
    if form.kind == "none" or active is None:  # one device's program: attention is local
        return form.local(q_BLHK, k_BLGK, v_BLGK, positions_L, causal=causal)
    if isinstance(positions_L, Packed):
        form.check_packed()  # raises: packed rows are not split over a context axis
    seq = q_BLHK.shape[1]
    pos = jnp.arange(seq, dtype=jnp.int32) if positions_L is None else positions_L
    mesh, rules = active
    axes = mesh_axes(mesh)
    if form.axis not in axes:
        raise ShardingError(
            f"attention={form.kind} runs over mesh axis {form.axis!r}, which the mesh "
            f"({', '.join(f'{a}={s}' for a, s in axes.items())}) lacks. Fix: add it."
        )
    if rules.activations.get("seq") != (form.axis,):
        raise ShardingError(
            f"attention={form.kind} needs the activation rule seq -> ({form.axis!r},), got "
            f"{rules.activations.get('seq')}. Fix: compose parallel.context_parallel()."
        )
    n = axes[form.axis]
    q_names, kv_names = (
        ("batch", "seq", "heads", "head_dim"),
        ("batch", "seq", "kv_heads", "head_dim"),
    )
    q_spec = resolve_spec("attention q", q_BLHK.shape, q_names, rules, axes, "activations")
    kv_spec = resolve_spec("attention k/v", k_BLGK.shape, kv_names, rules, axes, "activations")
    local = seq // n
    if form.kind == "ring":
        block = local // 2 if form.zigzag else local
        chunk = pick_chunk(block, form.local.chunk) if form.local.impl == "chunked" else block
        fn = partial(ring_attention, axis_name=form.axis, axis_size=n, causal=causal, chunk=chunk)
    elif form.kind == "all_to_all":
        check_ulysses(q_BLHK.shape[2], k_BLGK.shape[2], q_spec, kv_spec, axes, form.axis)
        inner = form.local.kernel(causal, seq)
        fn = partial(ulysses_attention, axis_name=form.axis, inner=inner)
    else:
        inner = form.local.kernel(causal, local)
        fn = partial(all_gather_attention, axis_name=form.axis, inner=inner)
    pos_spec = P(form.axis)
    kernel = shard_map(
        fn, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, pos_spec, pos_spec), out_specs=q_spec
    )
    return kernel(q_BLHK, k_BLGK, v_BLGK, pos, pos)


def _ways(spec: P, dim: int, axes: dict[str, int]) -> int:
    part = spec[dim] if dim < len(spec) else None
    names = () if part is None else (part,) if isinstance(part, str) else tuple(part)
    return int(np.prod([axes[a] for a in names], dtype=int))


def check_ulysses(heads: int, kv_heads: int, q_spec: P, kv_spec: P, axes: dict, axis: str):
    """Ulysses splits each device's heads (and K/V heads) over the context axis: check it."""
    n = axes[axis]
    for name, count, spec in (("heads", heads, q_spec), ("kv_heads", kv_heads, kv_spec)):
        local = count // _ways(spec, 2, axes)
        if local % n:
            raise ShardingError(
                f"attention=all_to_all (Ulysses) splits {name}: {count} {name} leave {local} per "
                f"device after the other axes, which does not divide by {axis}={n}. Fix: use a "
                f"context axis dividing {local}, a model whose {name} divide, or attention=ring."
            )
