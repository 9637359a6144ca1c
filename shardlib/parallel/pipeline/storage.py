"""Where an interleaved pipeline keeps the stacked layers between steps: in stage order.

Interleaved schedules (circular, 1F1B with v > 1) run virtual stage r·p + s on device s,
so device s needs layers (r·p + s)·k + i for every round r. Kept in the model's natural
order, the ``layers`` dim split over ``stage`` gives device s the contiguous layers
s·v·k .. (s+1)·v·k - 1 instead, and every step regroups the weights (an all-to-all over
``stage``) and their gradients back: at 39B (t8 x p2, v = 2) 9.7 GiB per device and step,
six times the hand-overs. Megatron-LM keeps each virtual stage's weights where they run.

So do we: the trainer stores the stacked rows of ``params["blocks"]`` (and every optimizer
leaf that mirrors them) in **stage order**, stored row j = s·(v·k) + r·k + i holding layer
(r·p + s)·k + i. The usual ``layers -> stage`` split then hands each device exactly its
chunks, and the pipeline's [p, v, k, ...] view is a local reshape (``views.to_stages``).

The order is the trainer's business only; everything that meets the outside world speaks
natural order:

* ``TrainSetup.init_state`` and ``checkpoint.restore`` return stored order (the train
  step's), and ``run`` keeps it; ``TrainSetup.stored`` / ``natural`` convert;
* checkpoints are written as the step holds them, with ``meta["layer_order"]``; every
  reader (resume, ``init_from``, export, generate) converts by it, so a checkpoint moves
  freely between plans;
* ``train.step.grad_function`` takes natural parameters unless told otherwise, and the
  1F1B evaluation loop (a plain layer scan) reads the stored rows back in order.

Natural order is kept where it costs nothing: v = 1, p = 1, and uneven ``stage_layers``
(whose padded slots the schedules regroup anyway).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

BLOCKS = "blocks"  # the stacked-layer subtree of the parameters (and its optimizer mirrors)


@dataclass(frozen=True)
class LayerOrder:
    """The order of the stacked layers' rows: natural, or stage order for p stages x v."""

    stages: int = 1
    virtual: int = 1

    @classmethod
    def of_spec(cls, spec) -> LayerOrder:
        """Stage order for interleaved pipelines of equal chunks, else natural."""
        if spec is None or spec.virtual_stages == 1 or spec.stages == 1 or spec.stage_layers:
            return cls()
        return cls(spec.stages, spec.virtual_stages)

    @classmethod
    def from_meta(cls, meta: dict | None) -> LayerOrder:
        """The order a checkpoint was written in (older checkpoints: natural)."""
        entry = (meta or {}).get("layer_order") or {}
        return cls(int(entry.get("stages", 1)), int(entry.get("virtual", 1)))

    @property
    def natural(self) -> bool:
        return self.stages == 1 or self.virtual == 1

    def meta(self) -> dict:
        return {"stages": self.stages, "virtual": self.virtual}

    def describe(self) -> str:
        if self.natural:
            return "natural"
        return f"stage order ({self.stages} stages x {self.virtual} virtual)"

    # --- one array ---------------------------------------------------------------------------
    def _check(self, layers: int, what: str) -> None:
        if layers % (self.stages * self.virtual):
            raise ValueError(
                f"{what}: {layers} stacked rows do not split into {self.stages} stages x "
                f"{self.virtual} virtual stages (stage-ordered storage needs equal chunks)."
            )

    def store_rows(self, w_L, what: str = "stacked parameter"):
        """[L, ...] natural -> stage order: rows (r, s, i) -> (s, r, i)."""
        return self._swap_groups(w_L, (self.virtual, self.stages), what)

    def natural_rows(self, w_L, what: str = "stacked parameter"):
        """Inverse of ``store_rows``: rows (s, r, i) -> (r, s, i)."""
        return self._swap_groups(w_L, (self.stages, self.virtual), what)

    def _swap_groups(self, w_L, groups: tuple[int, int], what: str):
        """[L, ...] read as [a, b, k, ...] (``groups`` = (a, b)) with a and b swapped: host
        arrays on the host, device arrays traced."""
        if self.natural:
            return w_L
        self._check(w_L.shape[0], what)
        xp = np if isinstance(w_L, np.ndarray) else jnp
        k = w_L.shape[0] // (self.stages * self.virtual)
        w = xp.swapaxes(w_L.reshape(*groups, k, *w_L.shape[1:]), 0, 1)
        return w.reshape(w_L.shape)


# --- trees -----------------------------------------------------------------------------------
def _in_blocks(path) -> bool:
    return any(getattr(key, "key", None) == BLOCKS for key in path)


def map_blocks(fn, tree, layers: int | None = None):
    """``fn`` on every leaf under a ``blocks`` key whose leading dim is the ``layers`` rows
    (parameters, gradients, and the optimizer leaves that mirror them); others untouched.
    ``layers=None``: every such leaf (a parameter tree, where all of them are stacked)."""

    def one(path, x):
        shape = getattr(x, "shape", ())
        if _in_blocks(path) and len(shape) >= 1 and shape[0] == (layers or shape[0]):
            return fn(x)
        return x

    return jax.tree_util.tree_map_with_path(one, tree)


def reorder(tree, source: LayerOrder, target: LayerOrder, layers: int | None = None):
    """``tree`` (a state, parameters, or gradients) from ``source``'s order to ``target``'s.

    Host (numpy) leaves are permuted on the host; device arrays in one jitted program that
    keeps every leaf's sharding (the stacked rows move by an all-to-all over ``stage``).
    """
    if source == target:
        return tree

    def move(x):
        return target.store_rows(source.natural_rows(x))

    leaves = jax.tree.leaves(tree)
    if all(not isinstance(x, jax.Array) for x in leaves):
        return map_blocks(move, tree, layers)
    shardings = jax.tree.map(lambda x: getattr(x, "sharding", None), tree)
    return jax.jit(lambda t: map_blocks(move, t, layers), out_shardings=shardings)(tree)
