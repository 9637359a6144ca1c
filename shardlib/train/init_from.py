"""Parameters only, from a shardlib checkpoint or a Hugging Face directory (fine-tuning).

``checkpoint.init_from=DIR`` (``shardlib train --load-params DIR``) starts a fresh run -
step 0, a new optimizer state - from the parameters in ``DIR``: the latest step of a
shardlib ``checkpoint_dir``, or a Hugging Face directory (``config.json`` +
``*.safetensors``) of a model family that registers an ``HFAdapter`` (Llama does). Both are
read straight into the run's parameter shardings, each device reading only its slice; every
tensor's shape is checked first, naming the tensor. A Hugging Face directory's
``config.json`` also gives the model's settings (``with_source_model``).
Parameters the source does not have (LoRA adapters added for fine-tuning) keep their fresh
initialisation. A run that resumes from its own ``checkpoint_dir`` ignores ``init_from``.
"""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np

from shardlib.checkpoint.store import (
    CheckpointError,
    error_summary,
    fingerprints,
    jsonable,
    load_orbax,
    read_meta,
)
from shardlib.core.model import hf_adapter
from shardlib.interop.hf_io import flatten, load_params, unflatten
from shardlib.parallel.pipeline.storage import LayerOrder, reorder


def is_hf_directory(path: str | Path) -> bool:
    path = Path(path)
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def with_source_model(cfg):
    """``cfg`` with the model settings of ``checkpoint.init_from``'s ``config.json`` when it
    is a Hugging Face directory, so that ``--load-params DIR`` alone describes the model;
    ``model.NAME`` settings given explicitly win. Other sources, and a model factory of the
    user's (``pkg.module:make_model``), leave ``cfg`` as it is; a preset without a Hugging
    Face adapter is refused, naming the fix."""
    source = cfg.checkpoint.init_from
    if not source or ":" in cfg.model or not is_hf_directory(source):
        return cfg
    from shardlib.interop.hf import adapter_for, model_settings, read_config
    from shardlib.train.config import TrainConfig, override

    where, hf = f"{source}/config.json", read_config(source)
    adapter = hf_adapter(cfg.model)
    if cfg.model == TrainConfig.model and adapter.hf_type != hf.get("model_type"):
        # no model named: the family whose adapter reads this model_type (GPT-2, ...)
        adapter = adapter_for(hf, where)
        cfg = override(cfg, {"model": adapter.preset})
    settings = model_settings(adapter, hf, where)
    settings |= dict(cfg.model_overrides)
    return override(cfg, {f"model.{k}": v for k, v in settings.items()})


def load_checkpoint_params(directory: str | Path, abstract: dict) -> dict:
    """The parameters of ``directory``'s latest step that ``abstract`` has (shapes checked),
    restored into ``abstract``'s shardings; adapters absent from the checkpoint are left out.
    """
    directory = Path(directory).absolute()
    step, meta = read_meta(directory)
    saved = {
        n.removeprefix("params/"): t for n, t in meta["tensors"].items() if n.startswith("params/")
    }
    wanted = {}
    for path, spec in flatten(abstract).items():
        if path not in saved:
            if "/lora_" in path:
                continue  # fine-tuning adds adapters to a base model's checkpoint
            raise CheckpointError(f"init_from {directory}: tensor params/{path} is missing.")
        if list(spec.shape) != saved[path]["shape"]:
            raise CheckpointError(
                f"init_from {directory}: tensor params/{path} has shape {saved[path]['shape']}, "
                f"the model expects {list(spec.shape)}. Fix: use the model settings the "
                "checkpoint was trained with (its meta lists them)."
            )
        wanted[path] = spec
    ocp = load_orbax()
    item = {"params": unflatten(wanted)}
    args = jax.tree.map(lambda s: ocp.ArrayRestoreArgs(sharding=s.sharding, dtype=s.dtype), item)
    where = directory / str(step)
    try:
        params = ocp.PyTreeCheckpointer().restore(
            where / "state",
            args=ocp.args.PyTreeRestore(item=item, restore_args=args, partial_restore=True),
        )["params"]
    except Exception as err:  # orbax/tensorstore: many types, one meaning
        raise CheckpointError(
            f"init_from {where} cannot be read ({type(err).__name__}: {error_summary(err)})."
        ) from None
    flat = flatten(params)
    for path, fp in zip(flat, fingerprints(list(flat.values())), strict=True):
        if saved[path]["fingerprint"] != fp:
            raise CheckpointError(
                f"init_from {where} is damaged: tensor params/{path} does not read back as "
                "saved (fingerprint differs). Fix: use an earlier step."
            )
    return reorder(params, LayerOrder.from_meta(meta), LayerOrder())  # rows in layer order


def load_initial_params(source: str | Path, abstract: dict, model_cfg) -> dict:
    """Parameters from ``source`` (see the module docstring) in ``abstract``'s shardings.
    ``model_cfg``: the model's preset config (its class finds the Hugging Face adapter)."""
    if not Path(source).is_dir():
        raise CheckpointError(
            f"init_from {source}: no such directory. Fix: a checkpoint_dir of an earlier run "
            "or a Hugging Face directory (config.json + *.safetensors)."
        )
    if is_hf_directory(source):
        from shardlib.interop.hf import read_config

        adapter = hf_adapter(model_cfg, read_config(source).get("model_type"))
        return load_params(source, abstract, jsonable(model_cfg), adapter)
    return load_checkpoint_params(source, abstract)


def overlay(fresh: dict, loaded: dict) -> dict:
    """``fresh`` with every leaf ``loaded`` has replaced (adapters stay fresh)."""
    flat = flatten(fresh)
    flat.update(flatten(loaded))
    return unflatten(flat)


def max_abs_difference(a: dict, b: dict) -> float:
    """Largest |a - b| over the leaves both trees have (tests, reports)."""
    fa, fb = flatten(a), flatten(b)
    return max(float(np.max(np.abs(np.asarray(fa[k]) - np.asarray(fb[k])))) for k in fa if k in fb)


def model_factory(source: str | Path):
    """The model a checkpoint was trained with, or a Hugging Face directory's: the preset of
    the adapter that reads its ``model_type``, every shape from its ``config.json``."""
    from shardlib.core.model import resolve_model
    from shardlib.interop.hf import adapter_for, model_settings, read_config

    if is_hf_directory(source):
        config, where = read_config(source), f"{source}/config.json"
        adapter = adapter_for(config, where)
        return resolve_model(adapter.preset, model_settings(adapter, config, where))
    _, meta = read_meta(Path(source).absolute())
    name = meta["config"]["model"]
    if ":" in name:  # a model factory of the user's: its keyword settings
        return resolve_model(name, dict(meta["config"]["model_overrides"]))
    fields = {k: tuple(v) if isinstance(v, list) else v for k, v in meta["model"].items()}
    return resolve_model(name, fields)


def load_model(source: str | Path, mesh, rules):
    """The model of ``source`` with its parameters, sharded on ``mesh`` by ``rules``."""
    from flax import nnx

    from shardlib.parallel.state import abstract_params

    factory = model_factory(source)
    graphdef, abstract = abstract_params(lambda: factory.make(nnx.Rngs(0)), mesh, rules)
    params = load_initial_params(source, abstract, factory.config)
    return nnx.merge(graphdef, params)
