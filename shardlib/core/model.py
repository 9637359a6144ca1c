"""What the library needs from a model, and how it finds one without importing a model zoo.

The trainer and the planner never import ``models/``: a model is named on the command line
(a registered preset such as ``llama-tiny``, or ``package.module:function``) and
``resolve_model`` turns the name into a ``ModelFactory``. Presets come from Python entry
points in the ``shardlib.models`` group, so any installed package can add its own.
``core.inventory`` reads a model's parameter shapes and logical names abstractly
(``nnx.eval_shape``: nothing is allocated), the one place parameters are counted.

A model the trainer drives follows the ``Decoder`` protocol below: it owns the embedding,
one uniform stack of blocks and the head, and the library owns the layer loop between them
(``shardlib.core.ops.run_blocks``), where remat, pipelining and offload plug in. A family
that has a Hugging Face form registers an ``HFAdapter`` with its presets: the library's
import, export and ``init_from`` read every name and ``config.json`` field from it.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
from flax import nnx

from shardlib.core.capabilities import HFAdapter
from shardlib.core.errors import ShardingError
from shardlib.core.values import convert_value

ENTRY_POINT_GROUP = "shardlib.models"

RESIDUAL = ("batch", "res_seq", "res_embed")
"""Logical names of the residual stream [batch, seq, embed] between a ``Decoder``'s blocks
(the layer loop's carry). Its own names, apart from ``seq``/``embed`` inside attention and
the MLP, let Megatron-SP and 2D/3D tensor parallelism split it alone; the library reads the
carry's layout from them (``parallel.remat.partition_saved_inputs``)."""


@runtime_checkable
class Decoder(Protocol):
    """A decoder the library can lay out, remat, pipeline and train.

    * ``blocks``: an nnx module whose every Param has a leading ``layers`` dim (built with
      ``nnx.vmap(..., transform_metadata={nnx.PARTITION_NAME: "layers"})``), one uniform
      stack. A block runs as ``nnx.merge(block_graph, layer_state)(x_BLD, positions_L)`` and
      returns ``x_BLD`` or ``(x_BLD, stats)``: ``stats`` is a pytree the layer loop sums over
      the blocks. ``positions_L`` are the tokens' true positions (context parallelism
      reorders tokens); None means 0..L-1.
    * ``aux(totals, tokens) -> dict`` (only when blocks return stats): metrics from the
      summed stats; its ``"loss"`` entry is added to the training objective.
    * ``checkpoint_names`` (class attribute, optional): the intermediates the blocks tag with
      ``checkpoint_name``, which a remat policy may save or offload by name.

    What a model may offer besides, each optional, is in ``core.capabilities``: ``Generator``
    (KV-cache generation), ``Routed`` (mixture-of-experts routing), ``HFAdapter``.
    """

    blocks: nnx.Module

    def embed(self, tokens_BL: jax.Array, *, dtype: Any) -> jax.Array:
        """Token ids [batch, seq] -> residual stream [batch, seq, embed] entering the blocks.

        A model whose embedding depends on position (GPT's learned absolute positions) adds
        a keyword ``positions_L=None``: the trainer then hands it the tokens' true positions
        whenever they are not 0..L-1 in order (context parallelism's zig-zag order, a
        packed row's ``Packed``), as the blocks get them (``embed_takes_positions``)."""
        ...

    def head(self, x_BLD: jax.Array, *, dtype: Any) -> jax.Array:
        """Residual stream after the blocks -> fp32 logits [batch, seq, vocab]."""
        ...

    def __call__(self, tokens_BL: jax.Array, *, positions_L=None, dtype=jnp.float32) -> Any:
        """One-device forward: embed, every block, head; logits or ``(logits, aux)``."""
        ...


def embed_takes_positions(model) -> bool:
    """Whether ``model.embed`` takes the tokens' positions (``positions_L``: ``Decoder``)."""
    return "positions_L" in inspect.signature(type(model).embed).parameters


@dataclass(frozen=True)
class ModelEntry:
    """One preset a model package registers: a config and what builds the model from it."""

    config: Any
    """A frozen dataclass; ``resolve_model`` overrides its fields by name."""
    model: Callable[[Any, nnx.Rngs], nnx.Module]
    """``model(config, rngs)``: usually the model class (its ``checkpoint_names`` is read)."""
    hf: HFAdapter | None = None
    """Its names and layouts in Hugging Face checkpoints; None: it has no Hugging Face form."""


@dataclass(frozen=True)
class ModelFactory:
    """A resolved model name: how to build it, and its config when it has one."""

    name: str
    """The name it was resolved from (a preset, or ``package.module:function``)."""
    config: Any | None
    """The preset's config with overrides applied; None for a plain function."""
    make: Callable[[nnx.Rngs], nnx.Module]
    """``make(rngs)`` builds the model (call it under ``nnx.eval_shape`` to stay abstract)."""
    model_type: type | None = None
    """The class ``make`` returns, when known without building (for ``checkpoint_names``)."""


@functools.cache
def _registry() -> dict[str, tuple[str, ModelEntry]]:
    table: dict[str, tuple[str, ModelEntry]] = {}
    for point in entry_points(group=ENTRY_POINT_GROUP):
        try:
            presets = point.load()()
        except Exception as err:
            raise ShardingError(
                f"model registry {point.name} = {point.value!r} failed to load: {err}. Fix: "
                "repair that package, or uninstall it."
            ) from err
        for name, entry in presets.items():
            if name in table:
                raise ShardingError(
                    f"model preset {name!r} is registered by both {table[name][0]} and "
                    f"{point.value}. Fix: rename one of them."
                )
            table[name] = (point.value, entry)
    return table


def registry() -> dict[str, ModelEntry]:
    """Every registered preset: ``{name: ModelEntry}`` from the ``shardlib.models`` group."""
    return {name: entry for name, (_, entry) in _registry().items()}


def resolve_model(name: str, overrides: Mapping[str, str | object] | None = None) -> ModelFactory:
    """The factory for a preset name or ``package.module:function``, with overrides applied.

    Preset overrides are config fields; function overrides are keyword arguments of
    ``function(rngs, **overrides)``. String values are converted to the annotated type.
    """
    overrides = dict(overrides or {})
    if ":" in name:
        return _function_factory(name, overrides)
    table = registry()
    if name not in table:
        known = ", ".join(sorted(table)) or "none (is shardlib installed with pip install -e .?)"
        raise ShardingError(
            f"model {name!r} is not a registered preset. Fix: use one of {known}, or "
            "package.module:function for your own model."
        )
    entry = table[name]
    hints = typing.get_type_hints(type(entry.config))
    known = {f.name for f in dataclasses.fields(entry.config)}
    typed = {}
    for key, raw in overrides.items():
        if key not in known:
            raise ShardingError(
                f"model {name!r} has no field {key!r}. Fix: use one of {', '.join(sorted(known))}."
            )
        typed[key] = convert_value(f"model.{key}", raw, hints[key])
    try:
        config = dataclasses.replace(entry.config, **typed)
    except ShardingError:
        raise
    except (TypeError, ValueError) as err:  # the config's own checks
        raise ShardingError(f"model {name!r}: {err}") from err
    model_type = entry.model if isinstance(entry.model, type) else None
    return ModelFactory(name, config, functools.partial(entry.model, config), model_type)


def hf_adapter(model: str | ModelFactory | Any, hf_type: str | None = None) -> HFAdapter:
    """The Hugging Face adapter of a preset (its name or factory) or of a preset's config
    (by its exact type: a family's presets share one config class). Where several families
    share a config class (Qwen2 and Mistral are Llamas), ``hf_type`` (``config.json``'s
    ``model_type``) picks among their adapters."""
    name = model.name if isinstance(model, ModelFactory) else model
    if isinstance(name, str):
        entry = registry().get(name)
        adapters = {entry.hf} if entry else set()
    else:  # a plain function's settings are a dict naming it (``Setup.model_cfg``)
        name = model.get("factory") if isinstance(model, dict) else type(model).__name__
        adapters = {e.hf for e in registry().values() if type(e.config) is type(model)}
    if hf_type is not None and len(adapters) > 1:
        adapters = {a for a in adapters if a is not None and a.hf_type == hf_type} or adapters
    if len(adapters) == 1 and None not in adapters:
        return adapters.pop()
    raise ShardingError(
        f"model {name} has no Hugging Face adapter (or its presets register several): its "
        "parameters have no Hugging Face names. Fix: register its presets with ModelEntry(..., "
        "hf=HFAdapter(...)) (shardlib.core.capabilities; models/llama/hf.py is one), "
        "or use a model that has one."
    )


def _function_factory(name: str, overrides: dict) -> ModelFactory:
    module_name, _, attr = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ShardingError(
            f"model {name!r}: cannot import {module_name!r} ({err}). Fix: put the package on "
            "PYTHONPATH (or install it), or use a registered preset."
        ) from err
    function = getattr(module, attr, None)
    if not callable(function):
        public = sorted(n for n, v in vars(module).items() if callable(v) and n[:1] != "_")
        raise ShardingError(
            f"model {name!r}: {module_name} has no function {attr!r}. Fix: use one of "
            f"{', '.join(public) or '(none)'} as {module_name}:NAME."
        )
    params = list(inspect.signature(function).parameters.values())[1:]  # after rngs
    hints = typing.get_type_hints(function)
    known = {p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}
    kwargs = {}
    for key, raw in overrides.items():
        if key not in known:
            raise ShardingError(
                f"model {name!r} takes no argument {key!r}. Fix: use one of "
                f"{', '.join(sorted(known)) or '(none)'}."
            )
        kwargs[key] = convert_value(f"model.{key}", raw, hints.get(key, Any))
    returns = hints.get("return")
    model_type = returns if isinstance(returns, type) else None
    return ModelFactory(name, None, functools.partial(function, **kwargs), model_type)


def checkpoint_names(factory_or_model: ModelFactory | nnx.Module) -> tuple[str, ...]:
    """The intermediates a model tags for remat (its class's ``checkpoint_names``)."""
    if isinstance(factory_or_model, ModelFactory):
        model_type = factory_or_model.model_type
        if model_type is None:  # a plain function: build abstractly to learn the class
            with nnx.use_eager_sharding(False):
                model_type = type(nnx.eval_shape(lambda: factory_or_model.make(nnx.Rngs(0))))
    else:
        model_type = type(factory_or_model)
    return class_checkpoint_names(model_type)


def class_checkpoint_names(model_type: type) -> tuple[str, ...]:
    """A model class's ``checkpoint_names``, read without building it."""
    return tuple(getattr(model_type, "checkpoint_names", ()))


def decoder_problem(model_type: type | None) -> str | None:
    """Why a model class cannot run as a decoder (``Decoder``: ``embed``, ``head``), or None."""
    if model_type is None:
        return None
    missing = [m for m in ("embed", "head") if not callable(getattr(model_type, m, None))]
    if not missing:
        return None
    return f"{model_type.__name__} has no {' or '.join(missing)} method"


def not_a_decoder(name: str, reason: str) -> str:
    """The one message for a model the token trainer cannot drive: it names the generic
    trainer (``loss=``, ``data=``), the way any annotated NNX model trains."""
    return (
        f"model {name} is not a decoder ({reason}): the token trainer drives the decoder "
        "protocol (embed, stacked blocks, head on token data). Fix: train it through its "
        "own loss, loss=pkg.mod:loss_fn data=pkg.mod:batches on the command line, or "
        "shardlib.train_model(factory, loss_fn, batches) in Python (README: Train your own "
        "model); or implement shardlib.core.model.Decoder."
    )
