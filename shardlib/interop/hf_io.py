"""Load Hugging Face Llama weights into any mesh's layout, and write them back out.

``load_params`` checks every tensor's shape against the model (naming the tensor, the
expected and the found shape) and every shard's header before a single weight is read;
then each parameter is one ``jax.make_array_from_callback`` whose callback reads, for the
device asking, only its layers and its slice of each layer (``shardlib.interop.hf.read_slice``).
``export_hf`` writes ``config.json``, shards of at most ``shard_bytes`` and the index that
``transformers.AutoModelForCausalLM.from_pretrained`` reads, LoRA adapters merged.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from shardlib.interop.hf import (
    LORA_WEIGHTS,
    ROTARY,
    TENSORS,
    HFError,
    Shards,
    hf_config,
    hf_shape,
    model_settings,
    read_config,
    read_slice,
    to_hf,
)

SETTINGS_CHECKED = ("rope_theta", "norm_eps", "rope_scaling", "tie_embeddings")
"""Config fields that change the function without changing any shape: checked too."""


def flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}/"))
        else:
            out[prefix + str(key)] = value
    return out


def unflatten(flat: dict) -> dict:
    tree: dict = {}
    for name, value in flat.items():
        *parents, leaf = name.split("/")
        node = tree
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return tree


def _hf_names(path: str, layers: int) -> list[str]:
    name, _ = TENSORS[path]
    return [name.format(i=i) for i in range(layers)] if path.startswith("blocks/") else [name]


def check_directory(directory, model: dict, paths: dict) -> Shards:
    """Headers only: every tensor present with the shape ``model`` expects, and the settings
    that shapes do not show equal. ``paths``: shardlib path -> shape of the full tensor."""
    source = str(Path(directory) / "config.json")
    settings = model_settings(read_config(directory), source)
    for field in SETTINGS_CHECKED:
        want, have = model.get(field), settings[field]
        want = tuple(want) if isinstance(want, list) else want
        if want != have:
            raise HFError(
                f"{source}: {field}={have!r} but the model has {field}={want!r}. Fix: "
                f"model.{field}={have} (or `shardlib generate --hf` reads it for you)."
            )
    shards = Shards.open(directory)
    for path, shape in paths.items():
        layout = TENSORS[path][1]
        one = shape[1:] if path.startswith("blocks/") else shape
        for name in _hf_names(path, model["layers"]):
            if name not in shards.shapes:
                raise HFError(f"{directory}: tensor {name} is missing (needed for {path}).")
            found, expected = shards.shapes[name], hf_shape(tuple(one), layout)
            if found != expected:
                raise HFError(
                    f"{directory}: tensor {name} has shape {list(found)}, the model expects "
                    f"{list(expected)} (shardlib {path} {list(shape)}). Fix: choose the model "
                    "preset or model.* settings that match config.json."
                )
    return shards


def load_params(directory, abstract: dict, model: dict, *, interleaved_rope=False) -> dict:
    """Parameters read from a Hugging Face directory into ``abstract``'s shardings.

    ``abstract``: the model's parameter tree of ``jax.ShapeDtypeStruct`` with shardings
    (``shardlib.abstract_params``); ``model``: its config fields. Parameters with no
    Hugging Face name (LoRA adapters) are left out of the result: the caller keeps them.
    """
    flat = flatten(abstract)
    wanted = {p: tuple(x.shape) for p, x in flat.items() if p in TENSORS}
    shards = check_directory(directory, model, wanted)
    out = {}
    for path, spec in flat.items():
        if path not in TENSORS:
            continue
        name, layout = TENSORS[path]
        hd = model["head_dim"] if interleaved_rope and path in ROTARY else 0
        stacked, shape = path.startswith("blocks/"), tuple(spec.shape)

        def callback(
            index, name=name, layout=layout, hd=hd, stacked=stacked, shape=shape, dtype=spec.dtype
        ):
            if not stacked:
                return read_slice(shards, name, layout, shape, index).astype(dtype)
            first, stop, _ = index[0].indices(shape[0])
            parts = [
                read_slice(shards, name.format(i=i), layout, shape[1:], index[1:], hd)
                for i in range(first, stop)
            ]
            return np.stack(parts).astype(dtype)

        out[path] = jax.make_array_from_callback(shape, spec.sharding, callback)
    return unflatten(out)


def merge_lora(flat: dict, model: dict) -> dict:
    """Base weights with (alpha / rank) * A @ B added; adapters dropped. Numpy or jax."""
    rank = model.get("lora_rank", 0)
    out = {k: v for k, v in flat.items() if "/lora_" not in k}
    if not rank:
        return out
    scale = model["lora_alpha"] / rank
    for target, weight in LORA_WEIGHTS.items():
        module = weight.rpartition("/")[0]
        a = flat.get(f"blocks/{module}/lora_{target}_a")
        if a is None:
            continue
        b = flat[f"blocks/{module}/lora_{target}_b"]
        w = out[f"blocks/{weight}"]
        xp = np if isinstance(w, np.ndarray) else jnp
        layers = w.shape[0]
        a_LIR, b_LRO = a.reshape(layers, -1, rank), b.reshape(layers, rank, -1)
        delta = xp.matmul(a_LIR, b_LRO).reshape(w.shape)  # [layers, *in, *out]
        out[f"blocks/{weight}"] = (w + scale * delta).astype(w.dtype)
    return out


def export_hf(
    flat: dict, model: dict, out: str | Path, *, shard_bytes: int = 2 << 30, dtype="float32"
) -> list[Path]:
    """Write ``flat`` (shardlib path -> host array) as a Hugging Face Llama directory.

    Returns the files written. ``out`` must not exist or be empty: nothing is overwritten.
    """
    from safetensors.numpy import save_file

    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise HFError(f"export: {out} is not empty. Fix: choose a new directory.")
    flat = merge_lora({k: np.asarray(v) for k, v in flat.items()}, model)
    tensors = {}
    for path, x in flat.items():
        if path not in TENSORS:
            raise HFError(f"export: parameter {path} has no Hugging Face name.")
        name, layout = TENSORS[path]
        if not path.startswith("blocks/"):
            tensors[name] = to_hf(x, layout)
            continue
        for i in range(x.shape[0]):
            tensors[name.format(i=i)] = to_hf(x[i], layout)
    tensors = {k: np.ascontiguousarray(v.astype(dtype)) for k, v in sorted(tensors.items())}
    groups, size = [[]], 0
    for name, x in tensors.items():
        if groups[-1] and size + x.nbytes > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += x.nbytes
    out.mkdir(parents=True, exist_ok=True)
    files, weight_map = [], {}
    for k, names in enumerate(groups):
        fname = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file({n: tensors[n] for n in names}, out / fname, metadata={"format": "pt"})
        files.append(out / fname)
        weight_map |= dict.fromkeys(names, fname)
    index = {"metadata": {"total_size": sum(x.nbytes for x in tensors.values())}}
    index["weight_map"] = weight_map
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    config = hf_config(model) | {"torch_dtype": dtype}
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return [*files, out / "model.safetensors.index.json", out / "config.json"]
