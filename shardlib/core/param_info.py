"""One parameter tensor as the planner and the plan's checks see it: its logical dims and
sizes, whether it is stacked over the layers, and how many copies each decoder layer holds.

Kept apart from ``shardlib.core.workload`` (the model and the step) because the cost terms
and the trainer need the tensor facts alone.
"""

from __future__ import annotations

from dataclasses import dataclass

LAYERS = "layers"
"""The logical name of the stacked blocks' leading dim (``nnx.vmap``'s partition name)."""


@dataclass(frozen=True)
class ParamInfo:
    """One parameter tensor (per layer when ``per_layer``; stacked over blocks in the model)."""

    name: str
    """Path in the model, e.g. ``blocks.attn.wq``."""
    dims: tuple[tuple[str | None, int], ...]
    """(logical name, size) per dim, without the leading ``layers`` dim (None: unnamed)."""
    per_layer: bool
    """Inside the stacked blocks (it has a leading ``layers`` dim)."""
    share: float = 1.0
    """Copies per decoder layer: the stacked dim's size over the model's layers. 1 for a
    Llama block; 1/moe_every for each block of an MoE model's stacked groups."""

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


def plain_shape(shape) -> tuple[int, ...]:
    """A shape given as a tuple or as an array-like (``jax.ShapeDtypeStruct``)."""
    return tuple(shape.shape if hasattr(shape, "shape") else shape)


def param_infos(entries, layers: int) -> tuple[ParamInfo, ...]:
    """``ParamInfo``s from an inventory's ``(path, shape, names)`` entries.

    A parameter whose first logical name is ``layers`` is per layer: its copies are that
    dim's size, spread over the model's ``layers`` decoder layers. An empty stack (zero
    copies) is no tensor of the program and is left out.
    """
    out = []
    for path, shape, names in entries:
        path = path if isinstance(path, str) else ".".join(str(k) for k in path)
        shape = plain_shape(shape)
        names = tuple(names) if names is not None else (None,) * len(shape)
        stacked = bool(names) and names[0] == LAYERS
        if stacked:
            copies, shape, names = shape[0], shape[1:], names[1:]
            if copies == 0:
                continue
        dims = tuple(zip(names, shape, strict=True))
        out.append(ParamInfo(path, dims, stacked, copies / layers if stacked else 1.0))
    return tuple(out)
