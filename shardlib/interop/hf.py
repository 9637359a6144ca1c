"""Hugging Face checkpoints in and out: config.json, layouts, safetensors shards.

Import reads a local directory (``config.json`` + ``*.safetensors``, with or without
``model.safetensors.index.json``) lazily: ``safetensors.safe_open`` maps each shard and
``get_slice`` reads only the rows and columns asked for. ``load_params`` builds every
parameter with ``jax.make_array_from_callback``, so each device (and each process) reads
exactly the slice of the layers it holds, straight into the mesh's layout.

Nothing here names an architecture's parameters: a model family's ``HFAdapter``
(``shardlib.core.model``, registered with its presets) maps each parameter path to a
Hugging Face name and one of the layouts below, and ``config.json`` to config fields. The
layouts differ from shardlib's in these ways, all handled here:

* shardlib stacks the blocks (every block weight has a leading ``layers`` dim); Hugging
  Face names each layer (``model.layers.{i}.self_attn.q_proj.weight``);
* Hugging Face stores ``nn.Linear`` weights as [out, in]; shardlib stores [in, out] with
  heads split out: ``in_heads`` [embed, heads, head_dim] = [heads*head_dim, embed];
  ``out_heads`` [heads, head_dim, embed] = [embed, heads*head_dim]; ``Conv1D`` weights
  (GPT-2) are stored [in, out], so theirs are plain reshapes: ``heads_last`` [..., heads,
  head_dim] = [..., heads*head_dim] and ``heads_first`` [heads, head_dim, ...] =
  [heads*head_dim, ...];
* fused tensors: one Hugging Face tensor holds several shardlib tensors as equal blocks of
  its last dim (GPT-2's ``c_attn``: q, k, v; ``HFAdapter.fused``), each read as its block;
* rotary pairs: Hugging Face (and shardlib) rotate feature i with i + head_dim/2
  ("rotate_half"); Meta's original checkpoints rotate neighbours (2i, 2i+1). Hugging
  Face's conversion script permutes q/k rows once; ``interleaved_rope=True`` applies the
  same permutation to an adapter's ``rotary`` weights still in Meta's order
  (``meta_to_half``).

Parameters without a Hugging Face name (LoRA adapters) are not imported; export folds them
into their base weights (``HFAdapter.merged``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from shardlib.checkpoint.store import CheckpointError
from shardlib.core.capabilities import HFAdapter
from shardlib.core.model import registry


class HFError(CheckpointError):
    """A Hugging Face directory that is missing, damaged, or does not fit the model."""


# --- config.json ------------------------------------------------------------------------


def read_config(directory: str | Path) -> dict:
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise HFError(f"{directory}: no config.json. Fix: pass a Hugging Face model directory.")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise HFError(f"{path} is not valid JSON ({err}).") from None


def adapter_for(hf: dict, source: str = "config.json") -> HFAdapter:
    """The registered adapter that reads ``config.json``'s ``model_type``."""
    kind = hf.get("model_type")
    readers: dict[str, HFAdapter] = {}
    for adapter in {e.hf for e in registry().values() if e.hf is not None}:
        if readers.setdefault(adapter.hf_type, adapter) is not adapter:
            raise HFError(
                f"two registered HFAdapters read model_type={adapter.hf_type!r}. Fix: "
                "uninstall one of the model packages that register them."
            )
    if kind not in readers:
        known = ", ".join(sorted(readers)) or "none"
        raise HFError(
            f"{source}: model_type={kind!r}; no registered model reads it (registered: "
            f"{known}). Fix: convert the checkpoint to one of those, or register an HFAdapter "
            "for it with its model's presets."
        )
    return readers[kind]


def model_settings(adapter: HFAdapter, hf: dict, source: str = "config.json") -> dict:
    """``config.json`` -> the model's config fields, by ``adapter``; what it cannot represent
    (or a missing key) raises ``HFError`` naming ``source``."""
    try:
        return adapter.settings(hf)
    except KeyError as err:
        raise HFError(f"{source}: no {err.args[0]!r}. Fix: a complete config.json.") from None
    except ValueError as err:
        raise HFError(f"{source}: {err}") from None


# --- layouts ----------------------------------------------------------------------------


def meta_to_half(rows_RE: np.ndarray, head_dim: int) -> np.ndarray:
    """q/k rows [heads*head_dim, embed] from Meta's pair order (2i, 2i+1) to (i, i+d/2)."""
    r, e = rows_RE.shape
    return rows_RE.reshape(r // head_dim, head_dim // 2, 2, e).transpose(0, 2, 1, 3).reshape(r, e)


def half_to_meta(rows_RE: np.ndarray, head_dim: int) -> np.ndarray:
    """The inverse of ``meta_to_half``."""
    r, e = rows_RE.shape
    return rows_RE.reshape(r // head_dim, 2, head_dim // 2, e).transpose(0, 2, 1, 3).reshape(r, e)


def hf_shape(shape: tuple[int, ...], layout: str) -> tuple[int, ...]:
    """The Hugging Face shape of one layer of a shardlib tensor of ``shape``."""
    if layout == "same":
        return shape
    if layout == "transpose":
        return shape[::-1]
    if layout == "in_heads":  # [embed, heads, hd] <- [heads*hd, embed]
        return (shape[1] * shape[2], shape[0])
    if layout == "heads_last":  # [..., heads, hd] <- [..., heads*hd]
        return (*shape[:-2], shape[-2] * shape[-1])
    if layout == "heads_first":  # [heads, hd, ...] <- [heads*hd, ...]
        return (shape[0] * shape[1], *shape[2:])
    return (shape[2], shape[0] * shape[1])  # out_heads: [heads, hd, embed] <- [embed, heads*hd]


def fused_shape(shape: tuple[int, ...], part: tuple[int, int]) -> tuple[int, ...]:
    """The whole Hugging Face tensor of which ``shape`` is one of ``part[1]`` blocks."""
    return (*shape[:-1], shape[-1] * part[1])


def to_hf(x: np.ndarray, layout: str) -> np.ndarray:
    """One layer of a shardlib tensor in Hugging Face's layout."""
    if layout == "same":
        return x
    if layout == "transpose":
        return x.T
    if layout in ("heads_last", "heads_first"):
        return x.reshape(hf_shape(x.shape, layout))
    if layout == "in_heads":
        return x.transpose(1, 2, 0).reshape(hf_shape(x.shape, layout))
    return x.transpose(2, 0, 1).reshape(hf_shape(x.shape, layout))


@dataclass(frozen=True)
class Shards:
    """The tensors of a directory of safetensors shards: which file, shape and dtype each
    has, read from the headers only (nothing else is read until ``read``)."""

    files: dict
    """tensor name -> Path of its shard"""
    shapes: dict
    dtypes: dict
    stored: dict = field(default_factory=dict)
    """name asked for -> name in the shard, where they differ (``with_prefix``)"""

    def with_prefix(self, prefix: str) -> Shards:
        """These tensors also as ``prefix + name`` when none has the prefix: a checkpoint
        saved from the base model (the hub's ``gpt2``: ``h.0.attn.c_attn.weight``) where the
        adapter names the LM model's (``transformer.h.0.attn.c_attn.weight``)."""
        if not prefix or any(name.startswith(prefix) for name in self.files):
            return self
        alias = {prefix + name: name for name in self.files}
        return Shards(
            {**self.files, **{a: self.files[n] for a, n in alias.items()}},
            {**self.shapes, **{a: self.shapes[n] for a, n in alias.items()}},
            {**self.dtypes, **{a: self.dtypes[n] for a, n in alias.items()}},
            {**self.stored, **alias},
        )

    @classmethod
    def open(cls, directory: str | Path) -> Shards:
        from safetensors import safe_open

        directory = Path(directory)
        paths = sorted(directory.glob("*.safetensors"))
        if not paths:
            raise HFError(f"{directory}: no *.safetensors files. Fix: save with "
                          "save_pretrained(..., safe_serialization=True).")  # fmt: skip
        files, shapes, dtypes = {}, {}, {}
        for path in paths:
            try:
                with safe_open(path, framework="numpy") as f:
                    for name in f.keys():  # noqa: SIM118 (a safe_open handle, not a dict)
                        part = f.get_slice(name)
                        files[name], shapes[name] = path, tuple(part.get_shape())
                        dtypes[name] = part.get_dtype()
            except Exception as err:  # safetensors raises its own error type for bad bytes
                raise HFError(
                    f"safetensors shard {path} is corrupt ({type(err).__name__}: {err}). "
                    "Fix: copy or download that file again."
                ) from None
            if path.stat().st_size == 0:
                raise HFError(f"safetensors shard {path} is empty. Fix: copy it again.")
        return cls(files, shapes, dtypes)

    def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        """``tensor[index]`` as float32, reading only that slice from disk."""
        from safetensors import safe_open

        framework = "flax" if self.dtypes[name] in ("BF16", "F16") else "numpy"  # no np bf16
        with safe_open(self.files[name], framework=framework) as f:
            return np.asarray(f.get_slice(self.stored.get(name, name))[index], dtype=np.float32)


@dataclass(frozen=True)
class Block:
    """Shards seen through one block of the last dim: tensor ``[..., k*width:(k+1)*width]``
    (a fused tensor's part, ``HFAdapter.fused``), read without the other blocks."""

    shards: Shards
    k: int
    width: int

    def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        *lead, last = index
        lo, hi, _ = last.indices(self.width)
        offset = self.k * self.width
        return self.shards.read(name, (*lead, slice(offset + lo, offset + hi)))


def _bounds(index: tuple, shape: tuple[int, ...]) -> list[tuple[int, int]]:
    return [s.indices(n)[:2] for s, n in zip(index, shape, strict=True)]


def read_slice(shards: Shards, name: str, layout: str, shape, index, interleave=False):
    """Slice ``index`` of one layer (shardlib ``shape``) read from Hugging Face tensor ``name``.

    Only the rows/columns covering the slice are read; ``interleave`` reorders an
    ``in_heads`` tensor's rows from Meta's rotary order (``meta_to_half``) whole heads at a
    time.
    """
    b = _bounds(index, shape)
    if layout == "same":
        return shards.read(name, tuple(slice(lo, hi) for lo, hi in b))
    if layout == "transpose":
        (r0, r1), (c0, c1) = b
        return shards.read(name, (slice(c0, c1), slice(r0, r1))).T
    if layout in ("heads_last", "heads_first"):  # whole heads read, head_dim sliced after
        at = len(shape) - 2 if layout == "heads_last" else 0
        hd, (h0, h1), (d0, d1) = shape[at + 1], b[at], b[at + 1]
        rest = [slice(lo, hi) for lo, hi in b]
        block = shards.read(name, (*rest[:at], slice(h0 * hd, h1 * hd), *rest[at + 2 :]))
        block = block.reshape(*block.shape[:at], h1 - h0, hd, *block.shape[at + 1 :])
        return block[(slice(None),) * (at + 1) + (slice(d0, d1),)]
    hd = shape[1] if layout == "out_heads" else shape[2]
    heads, (d0, d1) = (b[0], b[1]) if layout == "out_heads" else (b[1], b[2])
    rows = slice(heads[0] * hd, heads[1] * hd)
    nh = heads[1] - heads[0]
    if layout == "in_heads":  # [heads*hd, embed] -> [embed, heads, hd]
        (e0, e1) = b[0]
        block = shards.read(name, (rows, slice(e0, e1)))
        if interleave:
            block = meta_to_half(block, hd)
        return block.reshape(nh, hd, e1 - e0).transpose(2, 0, 1)[:, :, d0:d1]
    (e0, e1) = b[2]  # out_heads: [embed, heads*hd] -> [heads, hd, embed]
    block = shards.read(name, (slice(e0, e1), rows))
    return block.reshape(e1 - e0, nh, hd).transpose(1, 2, 0)[:, d0:d1, :]
