"""A model's parameters read abstractly: shapes, logical names, size, depth and what the
blocks return (``inventory``), the one place parameters are counted.

``nnx.eval_shape`` builds the model without allocating anything, so the planner can read a
70B model on a laptop; the trainer, the planner's ``Workload`` and the user-model path all
start from the ``Inventory`` this returns. Apart from ``core.model`` (the protocol and how a
model name resolves) because it is the one part that traces the model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from shardlib.core.capabilities import ExpertRouting, Routed
from shardlib.core.errors import ShardingError
from shardlib.core.layout import abstract_state, names_at, path_str
from shardlib.core.model import ModelFactory, class_checkpoint_names, decoder_problem, not_a_decoder


class ParamEntry(NamedTuple):
    """One parameter as the planner reads it."""

    path: str
    """Dotted path in the model (``blocks.attn.wq``)."""
    shape: tuple[int, ...]
    """Full shape, the stacked ``layers`` dim included for blocks."""
    names: tuple[str | None, ...] | None
    """Logical dim names (``("layers", "embed", "heads", "head_dim")``)."""


@dataclass(frozen=True)
class Inventory:
    """A model's parameters, read abstractly (nothing allocated)."""

    graphdef: nnx.GraphDef
    shapes: dict
    """Pure nested dict of ``jax.ShapeDtypeStruct`` (the ``nnx.Param`` state)."""
    names: dict
    """The same tree of logical-name tuples."""
    param_count: int
    """Elements over every parameter: the one place a model's size is counted."""
    layers: int
    """Size of the stacked ``layers`` dim of ``blocks`` (0 for a model without blocks)."""
    params: tuple[ParamEntry, ...]
    """Every parameter, flat, in the state's order."""
    checkpoint_names: tuple[str, ...] = ()
    """The intermediates the blocks tag for remat (the model class's ``checkpoint_names``)."""
    block_stats: bool = False
    """The blocks return ``(x, stats)``: statistics the layer loop sums (an MoE router's)."""
    routing: ExpertRouting | None = None
    """The model's mixture-of-experts routing (``Routed``); None for a dense model."""
    max_positions: int | None = None
    """Positions the model attends over (its ``max_positions``, as ``Generator`` declares
    it), which a training sequence must fit; None: the model declares no limit."""
    model_type: type | None = None
    """The class of the model the factory built."""
    block_kind: str = ""
    """The model class's ``block_kind``: which of the planner's per-block fitted memory
    coefficients describe its blocks (``planner.cost.coefficients``); "": the default,
    fitted on Llama blocks."""


_INVENTORIES: dict[tuple, Inventory] = {}  # (preset name, its config, stacked) -> Inventory


def inventory(factory: ModelFactory, *, stacked: bool = True) -> Inventory:
    """Shapes, logical names, size and depth of the model ``factory`` builds, abstractly.

    ``stacked=False``: the model is any module trained through its own loss
    (``train.user_model``), so ``blocks`` is not read as the decoder's stacked layers.

    A preset's inventory is kept per (name, config): building one traces the model (0.17 s
    on average over the FSDP validation's 7B-70B runs), and the planner's validations and a
    test run ask for the same few models hundreds of times. A plain function (no config)
    or an unhashable config is built each time."""
    if factory.config is None:
        return _build_inventory(factory, stacked)
    key = (factory.name, factory.config, stacked)
    try:
        kept = _INVENTORIES.get(key)
    except TypeError:  # a config that cannot be a dict key
        return _build_inventory(factory, stacked)
    if kept is None:
        if len(_INVENTORIES) >= 64:
            _INVENTORIES.clear()
        kept = _INVENTORIES[key] = _build_inventory(factory, stacked)
    return kept


def _build_inventory(factory: ModelFactory, stacked: bool) -> Inventory:
    built: list = []  # (the model's class, its routing), seen once while it is built abstractly

    def make():
        model = factory.make(nnx.Rngs(0))
        routing = model.routing() if isinstance(model, Routed) else None
        built.append((type(model), routing, getattr(model, "max_positions", None)))
        return model

    graphdef, shapes, names = abstract_state(make)
    flat_shapes, _ = jax.tree_util.tree_flatten_with_path(shapes)
    params = []
    for key_path, leaf in flat_shapes:
        node = names_at(names, key_path)
        params.append(ParamEntry(path_str(key_path), tuple(leaf.shape), node))
    read_blocks = stacked
    stacked = {p.shape[0] for p in params if read_blocks and p.path.startswith("blocks.")}
    if len(stacked) > 1:
        raise ShardingError(_not_a_stack(factory.name, built[0][0], sorted(stacked)))
    count = sum(math.prod(p.shape) for p in params)
    return Inventory(
        graphdef,
        shapes,
        names,
        count,
        stacked.pop() if stacked else 0,
        tuple(params),
        checkpoint_names=class_checkpoint_names(built[0][0]),
        block_stats=read_blocks and _returns_stats(graphdef, shapes),
        routing=built[0][1],
        max_positions=built[0][2] if isinstance(built[0][2], int) else None,
        model_type=built[0][0],
        block_kind=getattr(built[0][0], "block_kind", ""),
    )


def _returns_stats(graphdef: nnx.GraphDef, shapes: dict) -> bool:
    """Whether one block returns ``(x, stats)``, read from an abstract trace of embed + block."""
    if "blocks" not in shapes:
        return False

    def probe(params):
        model = nnx.merge(graphdef, params)
        block_graph, blocks_state = nnx.split(model.blocks)
        first = jax.tree.map(lambda a: a[0], blocks_state)
        x_BLD = model.embed(jnp.zeros((1, 2), jnp.int32), dtype=jnp.float32)
        return nnx.merge(block_graph, first)(x_BLD, None)

    with nnx.use_eager_sharding(False):
        return isinstance(jax.eval_shape(probe, shapes), tuple)


def _not_a_stack(name: str, model_type: type, dims: list[int]) -> str:
    reason = decoder_problem(model_type)
    if reason is not None:
        return not_a_decoder(name, reason)
    return (
        f"model {name}: the weights under blocks have leading dims {dims}; the layer loop "
        "needs one uniform stack. Fix: stack every block weight with nnx.vmap over the same "
        "count."
    )
