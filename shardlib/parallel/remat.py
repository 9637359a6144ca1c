"""Rematerialisation: which intermediates of a block the backward pass keeps, per layer.

``remat`` is one short string, parsed once into a frozen ``RematSpec``:

* ``none``: keep every residual the backward pass needs (fastest, most memory);
* ``full``: keep nothing inside a block; the backward recomputes the block from its input
  (the scan over layers still saves each block's input: about one extra forward, ~1.33x);
* ``dots``: keep the results of matrix multiplies, recompute the cheap elementwise rest;
* ``selective``: Korthikanti et al.'s selective recompute: keep the projections' outputs
  (matmuls without batch dims) but not the attention scores and softmax (batched matmuls,
  s² per head), which the backward recomputes from the saved q and k;
* ``names:a,b``: keep only the intermediates the model tagged ``a`` and ``b``
  (``jax.ad_checkpoint.checkpoint_name``; see the model's ``CHECKPOINT_NAMES``);
* ``offload:a,b``: keep ``a`` and ``b`` too, but move them to ``pinned_host`` memory in the
  forward pass and back to the device in the backward pass; recompute everything else;
* ``segments:k`` / ``sqrt``, optionally ``+policy``: Chen et al.'s sublinear-memory
  checkpointing over k segments of layers, the policy inside each (``parallel.segments``).

The policy wraps the per-layer ``block_fn`` that the model hands to its ``layers``
function, so it applies the same way inside the plain scan and inside pipeline stages.

Under ``full`` the only activations kept between the forward and the backward pass are the
blocks' inputs, the residual stream [batch, seq, embed]. Plain tensor parallelism keeps
that stream whole on every device of the ``tensor`` axis, so each device would keep the
same copy. ``partition_saved_inputs`` keeps 1/t of it instead and all-gathers it before
the block is recomputed: Megatron-LM's ``--distribute-saved-activations`` and DeepSpeed's
``partition_activations`` (ZeRO-R's partitioned activation checkpointing, Rajbhandari et
al. 2020). The forward pass and its collectives are unchanged; the backward pass gains one
all-gather of a block's input per layer.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardlib.core.errors import ShardingError
from shardlib.core.layout import activation_spec, active_layout, mesh_axes
from shardlib.core.mesh import Axis
from shardlib.core.model import RESIDUAL
from shardlib.core.ops import recomputed
from shardlib.core.rules import entry_axes
from shardlib.parallel.segments import parse_segments, segment_count

MODES = ("none", "full", "dots", "selective", "names", "offload")


@dataclass(frozen=True)
class RematSpec:
    """A parsed ``remat=`` setting."""

    mode: str = "none"
    """One of ``MODES``."""
    names: tuple[str, ...] = ()
    """Checkpoint names kept (``names``) or offloaded to host (``offload``)."""
    segments: int = 0
    """Chen et al.'s segments around the per-layer policy: 0 none, k, or ``segments.SQRT``."""

    @property
    def active(self) -> bool:
        return self.mode != "none"

    def policy(self):
        """The ``jax.checkpoint`` policy (None for ``full``: save nothing but the inputs)."""
        cp = jax.checkpoint_policies
        if self.mode == "full":
            return cp.nothing_saveable
        if self.mode == "dots":
            return cp.dots_saveable
        if self.mode == "selective":
            return cp.dots_with_no_batch_dims_saveable
        if self.mode == "names":
            return cp.save_only_these_names(*self.names)
        if self.mode == "offload":
            return cp.save_and_offload_only_these_names(
                names_which_can_be_saved=[],
                names_which_can_be_offloaded=list(self.names),
                offload_src="device",
                offload_dst="pinned_host",
            )
        raise ValueError(f"remat mode {self.mode!r} has no policy")


def parse_remat(text: str, known_names: tuple[str, ...] = ()) -> RematSpec:
    """``"offload:mlp_hidden,attn_context"`` -> RematSpec, checking names against the model;
    ``"sqrt+full"`` -> the per-layer policy ``full`` inside sqrt(L) segments."""
    outer, plus, inner = text.partition("+")
    segments = parse_segments(outer, text)
    if segments:
        spec = parse_remat(inner if plus else "none", known_names)
        if spec.segments:
            raise ShardingError(f"remat={text!r} nests segments twice. Fix: remat={outer}.")
        return RematSpec(mode=spec.mode, names=spec.names, segments=segments)
    mode, _, rest = text.partition(":")
    names = tuple(n.strip() for n in rest.split(",") if n.strip())
    if mode not in MODES:
        raise ShardingError(
            f"remat={text!r}: unknown mode {mode!r}. Fix: one of none, full, dots, selective, "
            "names:<a,b>, offload:<a,b>, segments:<k>[+policy], sqrt[+policy]."
        )
    if mode in ("names", "offload"):
        if not names:
            raise ShardingError(
                f"remat={text!r} names no intermediates. Fix: e.g. {mode}:"
                f"{known_names[0] if known_names else 'mlp_hidden'}."
            )
        unknown = [n for n in names if known_names and n not in known_names]
        if unknown:
            raise ShardingError(
                f"remat={text!r}: the model names no intermediate {unknown[0]!r}. "
                f"Fix: use some of {', '.join(known_names)}."
            )
    elif names:
        raise ShardingError(f"remat={text!r}: mode {mode!r} takes no names. Fix: remat={mode}.")
    return RematSpec(mode=mode, names=names)


@dataclass(frozen=True)
class Remat:
    """``[parallel.remat]``: what each block keeps for the backward pass."""

    axes: ClassVar[dict[str, str]] = {}  # no mesh axis of its own
    logical_names: ClassVar[dict[str, str]] = {}

    policy: str = "none"
    """none | full | dots | selective | names:<a,b> | offload:<a,b>, or segments:<k> | sqrt
    with an optional ``+policy`` inside the segments (module docstring)."""

    def __post_init__(self) -> None:
        parse_remat(self.policy)  # unknown modes fail when the plan is made

    def spec(self, workload=None) -> RematSpec:
        """The parsed policy; names are checked against the model's tagged intermediates."""
        return parse_remat(self.policy, workload.checkpoint_names if workload else ())

    def check(self, mesh_axes, rules, workload) -> None:
        spec = self.spec(workload)
        if spec.segments > 0 and workload.blocks and mesh_axes.get(Axis.STAGE, 1) == 1:
            segment_count(spec.segments, workload.blocks)  # a pipeline's stage: when traced


def remat_block(block_fn: Callable, spec: RematSpec, never_save: tuple[str, ...] = ()) -> Callable:
    """``block_fn`` under ``jax.checkpoint`` with the spec's policy (unchanged for none).

    ``never_save`` names values that must be recomputed even under ``none`` (weights fetched
    from host memory: saving them would keep every layer on the device). Under ``none``
    such a block is recomputed whole (``nothing_saveable``): saving everything but the
    named weights still saved what the block derives from them alone (a reshaped
    projection, the gate/up concatenation), measured as 2.8 of llama-tiny's 3.2 weight
    tensors per layer kept for every layer (``analysis.memory_kinds.loop_staged``). The
    other policies save only dots or listed names, so they never save those anyway.
    ``prevent_cse=False``: the block runs inside a scan, whose loop boundary already keeps
    XLA from merging the recomputation back into the forward pass (JAX's advice for scans).
    """
    if not spec.active and not never_save:
        return block_fn
    policy = spec.policy() if spec.active else jax.checkpoint_policies.nothing_saveable
    return jax.checkpoint(recomputed(block_fn), policy=policy, prevent_cse=False)


def _saved_layouts(x_BLD) -> tuple[NamedSharding, NamedSharding] | None:
    """(the residual's layout, its flattened copy split over ``tensor`` as well), or None
    where there is nothing to split: no active layout or no ``tensor`` axis, a residual
    that ``tensor`` already splits (sequence parallel, 2D/3D), one split on tokens or
    width (only a batch-major split flattens without moving data), or sizes that do not
    divide."""
    active = active_layout()
    if active is None or x_BLD.ndim != 3:
        return None
    mesh, rules = active
    axes = mesh_axes(mesh)
    spec = activation_spec("layer input", tuple(x_BLD.shape), RESIDUAL, rules, axes)
    entries = (*spec, *(None,) * (3 - len(spec)))
    batch = entry_axes(entries[0])
    if axes.get(Axis.TENSOR, 1) == 1 or Axis.TENSOR in batch or any(entries[1:]):
        return None
    if x_BLD.size % (math.prod(axes[a] for a in batch) * axes[Axis.TENSOR]):
        return None
    return NamedSharding(mesh, spec), NamedSharding(mesh, P((*batch, Axis.TENSOR)))


def partition_saved_inputs(block_fn: Callable) -> Callable:
    """``block_fn`` under full remat whose saved input is split over ``tensor``.

    The forward pass runs ``block_fn`` as it is and keeps its layer's weights (slices of
    the stacked ones, not copies) and the carry's residual stream flattened and split over
    ``tensor`` on top of its own layout; the backward pass gathers the input back and
    recomputes the block (``jax.vjp``) from it. Flattened, the split is on the
    outermost dim, so the gather concatenates whole rows and needs no relayout. Where
    ``_saved_layouts`` finds nothing to split this is ``remat=full``'s ``jax.checkpoint``.
    """
    full = remat_block(block_fn, RematSpec(mode="full"))

    def run(layer_state, carry):
        leaves, treedef = jax.tree.flatten(carry)
        layouts = [_saved_layouts(x) for x in leaves]
        if not any(layouts):
            return full(layer_state, carry)
        shapes = [x.shape for x in leaves]

        def leafwise(fn, c):
            """``fn(x, layout)`` on the leaves of ``c`` that are split; the others as they are."""
            return [x if lay is None else fn(x, lay)
                    for x, lay in zip(jax.tree.leaves(c), layouts, strict=True)]  # fmt: skip

        # The carry pinned to its own layout around the forward block: a no-op, except that
        # without it XLA lets the split layout of the saved copy spread back into the
        # forward pass (llama, tensor 8: 201 MB of collectives per step instead of 109 MB).
        def pin(c):
            xs = leafwise(lambda x, lay: jax.lax.with_sharding_constraint(x, lay[0]), c)
            return jax.tree.unflatten(treedef, xs)

        def split(c):
            return leafwise(
                lambda x, lay: jax.lax.with_sharding_constraint(x.reshape(-1), lay[1]), c
            )

        def gather(parts):  # a leaf that was not split keeps its shape: reshape is a no-op
            xs = [x.reshape(shape) for x, shape in zip(parts, shapes, strict=True)]
            return pin(jax.tree.unflatten(treedef, xs))

        @jax.custom_vjp
        def block(ls, c):
            return block_fn(ls, c)

        def forward(ls, c):
            c = pin(c)
            return pin(block_fn(ls, c)), (ls, split(c))

        def backward(saved, g):
            ls, parts = saved
            _, vjp = jax.vjp(block_fn, ls, gather(parts))
            return vjp(g)

        block.defvjp(forward, backward)
        return block(layer_state, carry)

    return run
