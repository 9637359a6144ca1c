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
  forward pass and back to the device in the backward pass; recompute everything else.

The policy wraps the per-layer ``block_fn`` that the model hands to its ``layers``
function, so it applies the same way inside the plain scan and inside pipeline stages.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import jax

from shardlib.errors import ShardingError

MODES = ("none", "full", "dots", "selective", "names", "offload")


@dataclass(frozen=True)
class RematSpec:
    """A parsed ``remat=`` setting."""

    mode: str = "none"
    """One of ``MODES``."""
    names: tuple[str, ...] = ()
    """Checkpoint names kept (``names``) or offloaded to host (``offload``)."""

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
    """``"offload:mlp_hidden,attn_context"`` -> RematSpec, checking names against the model."""
    mode, _, rest = text.partition(":")
    names = tuple(n.strip() for n in rest.split(",") if n.strip())
    if mode not in MODES:
        raise ShardingError(
            f"remat={text!r}: unknown mode {mode!r}. Fix: one of none, full, dots, selective, "
            "names:<a,b>, offload:<a,b>."
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
    """none | full | dots | selective | names:<a,b> | offload:<a,b> (module docstring)."""

    def __post_init__(self) -> None:
        parse_remat(self.policy)  # unknown modes fail when the plan is made

    def spec(self, target=None) -> RematSpec:
        """The parsed policy; names are checked against the model's tagged intermediates."""
        return parse_remat(self.policy, target.checkpoint_names if target else ())

    def check(self, mesh_axes, rules, target) -> None:
        self.spec(target)


def remat_block(block_fn: Callable, spec: RematSpec, never_save: tuple[str, ...] = ()) -> Callable:
    """``block_fn`` under ``jax.checkpoint`` with the spec's policy (unchanged for none).

    ``never_save`` names values that must be recomputed even under ``none`` (weights fetched
    from host memory: saving them would keep every layer on the device). The other
    policies save only dots or listed names, so they never save those anyway.
    ``prevent_cse=False``: the block runs inside a scan, whose loop boundary already keeps
    XLA from merging the recomputation back into the forward pass (JAX's advice for scans).
    """
    if not spec.active:
        if not never_save:
            return block_fn
        policy = jax.checkpoint_policies.save_anything_except_these_names(*never_save)
        return jax.checkpoint(block_fn, policy=policy, prevent_cse=False)
    return jax.checkpoint(block_fn, policy=spec.policy(), prevent_cse=False)
