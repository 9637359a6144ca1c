"""Load Hugging Face weights into any mesh's layout, and write them back out.

Generic over the model family: its ``HFAdapter`` (``shardlib.core.model``) names each
parameter's Hugging Face tensor and layout and maps ``config.json``. ``load_params`` checks
every tensor's shape against the model (naming the tensor, the expected and the found
shape), the adapter's shape-less settings and every shard's header before a single weight
is read; then each parameter is one ``jax.make_array_from_callback`` whose callback reads,
for the device asking, only its layers and its slice of each layer
(``shardlib.interop.hf.read_slice``). ``export_hf`` writes ``config.json``, shards of at
most ``shard_bytes`` and the index that ``transformers.AutoModelForCausalLM.from_pretrained``
reads, adapters (LoRA) merged.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import jax
import numpy as np

from shardlib.core.capabilities import HFAdapter
from shardlib.interop.hf import (
    Block,
    HFError,
    Shards,
    fused_shape,
    hf_shape,
    model_settings,
    read_config,
    read_slice,
    to_hf,
)


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


def stacked_dims(name: str, path: str) -> tuple[str, ...]:
    """The leading dims of a shardlib tensor that Hugging Face names one tensor each:
    ``i``, the layer of a ``blocks/`` path, then ``e``, the expert of a name with ``{e}``
    (Mixtral's ``experts.{e}.w1``)."""
    return (("i",) if path.startswith("blocks/") else ()) + (("e",) if "{e}" in name else ())


def _hf_names(name: str, path: str, shape: tuple[int, ...]) -> list[str]:
    dims = stacked_dims(name, path)
    return [
        name.format(**dict(zip(dims, at, strict=True))) for at in np.ndindex(shape[: len(dims)])
    ]


def check_directory(directory, model: dict, paths: dict, adapter: HFAdapter) -> Shards:
    """Headers only: every tensor present with the shape ``model`` expects, and the settings
    that shapes do not show (``adapter.checked``) equal. ``paths``: shardlib path -> shape of
    the full tensor (a ``blocks/`` path's leading dim is ``layers``)."""
    source = str(Path(directory) / "config.json")
    settings = model_settings(adapter, read_config(directory), source)
    for field in adapter.checked:
        want, have = model.get(field), settings[field]
        want = tuple(want) if isinstance(want, list) else want
        if want != have:
            raise HFError(
                f"{source}: {field}={have!r} but the model has {field}={want!r}. Fix: "
                f"model.{field}={have} (or `shardlib generate --hf` reads it for you)."
            )
    shards = Shards.open(directory).with_prefix(adapter.base_prefix)
    for path, shape in paths.items():
        hf_name, layout = adapter.tensors[path]
        one = shape[len(stacked_dims(hf_name, path)) :]
        for name in _hf_names(hf_name, path, tuple(shape)):
            if name not in shards.shapes:
                raise HFError(f"{directory}: tensor {name} is missing (needed for {path}).")
            found, expected = shards.shapes[name], hf_shape(tuple(one), layout)
            if path in adapter.fused:  # one block of the tensor's last dim
                expected = fused_shape(expected, adapter.fused[path])
            if found != expected:
                raise HFError(
                    f"{directory}: tensor {name} has shape {list(found)}, the model expects "
                    f"{list(expected)} (shardlib {path} {list(shape)}). Fix: choose the model "
                    "preset or model.* settings that match config.json."
                )
    return shards


def load_params(
    directory, abstract: dict, model: dict, adapter: HFAdapter, *, interleaved_rope=False
) -> dict:
    """Parameters read from a Hugging Face directory into ``abstract``'s shardings.

    ``abstract``: the model's parameter tree of ``jax.ShapeDtypeStruct`` with shardings
    (``shardlib.abstract_params``); ``model``: its config fields; ``adapter``: its family's
    names and layouts (``shardlib.core.model.hf_adapter``). Parameters with no Hugging Face
    name (LoRA adapters) are left out of the result: the caller keeps them.
    """
    flat = flatten(abstract)
    named = {p: spec for p, spec in flat.items() if p in adapter.tensors}
    shards = check_directory(directory, model, {p: x.shape for p, x in named.items()}, adapter)
    out = {}
    for path, spec in named.items():
        name, layout = adapter.tensors[path]
        interleave = interleaved_rope and path in adapter.rotary
        dims, shape = stacked_dims(name, path), tuple(spec.shape)
        source = shards
        if path in adapter.fused:  # read through the block of the fused tensor it is
            width = hf_shape(shape[len(dims) :], layout)[-1]
            source = Block(shards, adapter.fused[path][0], width)

        def callback(
            index, name=name, layout=layout, interleave=interleave, dims=dims,
            shape=shape, dtype=spec.dtype, shards=source,
        ):  # fmt: skip
            n = len(dims)  # the layers (and experts) this device holds, one tensor each
            ranges = [range(*s.indices(m)[:2]) for s, m in zip(index[:n], shape[:n], strict=True)]
            parts = [
                read_slice(shards, name.format(**dict(zip(dims, at, strict=True))), layout,
                           shape[n:], index[n:], interleave)
                for at in itertools.product(*ranges)
            ]  # fmt: skip
            block = np.stack(parts) if n else parts[0]
            return block.reshape(*map(len, ranges), *block.shape[1 if n else 0 :]).astype(dtype)

        out[path] = jax.make_array_from_callback(shape, spec.sharding, callback)
    return unflatten(out)


def export_hf(
    flat: dict,
    model: dict,
    adapter: HFAdapter,
    out: str | Path,
    *,
    shard_bytes: int = 2 << 30,
    dtype="float32",
) -> list[Path]:
    """Write ``flat`` (shardlib path -> host array) as a Hugging Face directory, in the names
    and layouts of ``adapter``; ``model``: the config fields.

    Returns the files written. ``out`` must not exist or be empty: nothing is overwritten.
    """
    from safetensors.numpy import save_file

    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise HFError(f"export: {out} is not empty. Fix: choose a new directory.")
    try:  # first: a model the family's config.json cannot describe writes nothing
        config = adapter.config_json(model) | {"torch_dtype": dtype}
    except ValueError as err:
        raise HFError(str(err)) from None
    flat = adapter.merged({k: np.asarray(v) for k, v in flat.items()}, model)
    parts: dict[str, list] = {}  # Hugging Face name -> its blocks (one unless fused)
    tensors = {}
    for path, x in flat.items():
        if path not in adapter.tensors:
            raise HFError(
                f"export: parameter {path} has no Hugging Face name. Fix: name it in the "
                "model's HFAdapter.tensors, or fold it into one that has in HFAdapter.merged."
            )
        name, layout = adapter.tensors[path]
        k, n = adapter.fused.get(path, (0, 1))
        dims = stacked_dims(name, path)
        for at in np.ndindex(x.shape[: len(dims)]):
            one = to_hf(x[at], layout)
            parts.setdefault(name.format(**dict(zip(dims, at, strict=True))), [None] * n)[k] = one
    for name, blocks in parts.items():  # a fused tensor: its blocks in order, concatenated
        if any(b is None for b in blocks):
            missing = [k for k, b in enumerate(blocks) if b is None]
            raise HFError(f"export: tensor {name} lacks blocks {missing} of {len(blocks)}. "
                          "Fix: give every block a path in HFAdapter.fused.")  # fmt: skip
        tensors[name] = np.concatenate(blocks, axis=-1)
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
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return [*files, out / "model.safetensors.index.json", out / "config.json"]
