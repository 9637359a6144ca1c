"""Hugging Face Llama checkpoints in and out: names, layouts, config.json, safetensors shards.

Import reads a local directory (``config.json`` + ``*.safetensors``, with or without
``model.safetensors.index.json``) lazily: ``safetensors.safe_open`` maps each shard and
``get_slice`` reads only the rows and columns asked for. ``load_params`` builds every
parameter with ``jax.make_array_from_callback``, so each device (and each process) reads
exactly the slice of the layers it holds, straight into the mesh's layout.

The layouts differ in three ways, all handled here:

* shardlib stacks the blocks (every block weight has a leading ``layers`` dim); Hugging
  Face names each layer (``model.layers.{i}.self_attn.q_proj.weight``);
* Hugging Face stores ``nn.Linear`` weights as [out, in]; shardlib stores [in, out] with
  heads split out: ``wq`` [embed, heads, head_dim] = ``q_proj`` [heads*head_dim, embed];
  ``wo`` [heads, head_dim, embed] = ``o_proj`` [embed, heads*head_dim];
* rotary pairs: Hugging Face (and shardlib) rotate feature i with i + head_dim/2
  ("rotate_half"); Meta's original checkpoints rotate neighbours (2i, 2i+1). Hugging
  Face's conversion script permutes q/k rows once; ``interleaved_rope=True`` applies the
  same permutation for weights still in Meta's order (``meta_to_half``).

LoRA adapters have no Hugging Face name: export merges them into their base weights.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shardlib.checkpoint.store import CheckpointError


class HFError(CheckpointError):
    """A Hugging Face directory that is missing, damaged, or does not fit the model."""


# shardlib parameter path -> (Hugging Face name, layout); "{i}" is the layer index
_LAYER = "model.layers.{i}."
TENSORS = {
    "embedding": ("model.embed_tokens.weight", "same"),
    "final_norm/scale": ("model.norm.weight", "same"),
    "lm_head": ("lm_head.weight", "transpose"),
    "blocks/attn_norm/scale": (_LAYER + "input_layernorm.weight", "same"),
    "blocks/mlp_norm/scale": (_LAYER + "post_attention_layernorm.weight", "same"),
    "blocks/attn/wq": (_LAYER + "self_attn.q_proj.weight", "in_heads"),
    "blocks/attn/wk": (_LAYER + "self_attn.k_proj.weight", "in_heads"),
    "blocks/attn/wv": (_LAYER + "self_attn.v_proj.weight", "in_heads"),
    "blocks/attn/wo": (_LAYER + "self_attn.o_proj.weight", "out_heads"),
    "blocks/mlp/w_gate": (_LAYER + "mlp.gate_proj.weight", "transpose"),
    "blocks/mlp/w_up": (_LAYER + "mlp.up_proj.weight", "transpose"),
    "blocks/mlp/w_down": (_LAYER + "mlp.down_proj.weight", "transpose"),
}
ROTARY = ("blocks/attn/wq", "blocks/attn/wk")  # the weights whose rows rotary pairs up
LORA_WEIGHTS = {"q": "attn/wq", "k": "attn/wk", "v": "attn/wv", "o": "attn/wo"}
LORA_WEIGHTS |= {"gate": "mlp/w_gate", "up": "mlp/w_up", "down": "mlp/w_down"}


# --- config.json ------------------------------------------------------------------------


def model_settings(hf: dict, source: str = "config.json") -> dict:
    """Hugging Face ``config.json`` -> shardlib Llama config fields (``model.NAME`` values)."""
    if hf.get("model_type", "llama") != "llama":
        raise HFError(f"{source}: model_type={hf.get('model_type')!r}; only llama is supported.")
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            raise HFError(f"{source}: {flag}=true; shardlib's Llama has no biases.")
    if hf.get("hidden_act", "silu") != "silu":
        raise HFError(f"{source}: hidden_act={hf['hidden_act']!r}; shardlib's MLP is SwiGLU.")
    heads = hf["num_attention_heads"]
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}  # transformers 5 / 4
    kind = rope.get("rope_type", rope.get("type", "default"))
    scaling = None
    if kind == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor")
        scaling = (*(float(rope[k]) for k in keys), int(rope["original_max_position_embeddings"]))
    elif kind != "default":
        raise HFError(f"{source}: rope_type={kind!r}; supported: default, llama3.")
    return {
        "vocab": hf["vocab_size"],
        "embed": hf["hidden_size"],
        "layers": hf["num_hidden_layers"],
        "heads": heads,
        "kv_heads": hf.get("num_key_value_heads") or heads,
        "head_dim": hf.get("head_dim") or hf["hidden_size"] // heads,
        "mlp": hf["intermediate_size"],
        "rope_theta": float(rope.get("rope_theta", hf.get("rope_theta", 10_000.0))),
        "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "rope_scaling": scaling,
        "max_positions": hf.get("max_position_embeddings", 8192),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
    }


def hf_config(model: dict) -> dict:
    """shardlib Llama config fields -> a ``config.json`` that ``transformers`` loads."""
    scaling = model.get("rope_scaling")
    rope = {"rope_type": "default", "rope_theta": model["rope_theta"]}
    if scaling:
        factor, low, high, original = scaling
        rope = {
            "rope_type": "llama3", "rope_theta": model["rope_theta"], "factor": factor,
            "low_freq_factor": low, "high_freq_factor": high,
            "original_max_position_embeddings": original,
        }  # fmt: skip
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": model["vocab"],
        "hidden_size": model["embed"],
        "intermediate_size": model["mlp"],
        "num_hidden_layers": model["layers"],
        "num_attention_heads": model["heads"],
        "num_key_value_heads": model["kv_heads"],
        "head_dim": model["head_dim"],
        "hidden_act": "silu",
        "max_position_embeddings": model["max_positions"],
        "rms_norm_eps": model["norm_eps"],
        "rope_theta": model["rope_theta"],
        "rope_scaling": rope if scaling else None,
        "rope_parameters": rope,
        "tie_word_embeddings": bool(model["tie_embeddings"]),
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }


def read_config(directory: str | Path) -> dict:
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise HFError(f"{directory}: no config.json. Fix: pass a Hugging Face model directory.")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise HFError(f"{path} is not valid JSON ({err}).") from None


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
    return (shape[2], shape[0] * shape[1])  # out_heads: [heads, hd, embed] <- [embed, heads*hd]


def to_hf(x: np.ndarray, layout: str) -> np.ndarray:
    """One layer of a shardlib tensor in Hugging Face's layout."""
    if layout == "same":
        return x
    if layout == "transpose":
        return x.T
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
            return np.asarray(f.get_slice(name)[index], dtype=np.float32)


def _bounds(index: tuple, shape: tuple[int, ...]) -> list[tuple[int, int]]:
    return [s.indices(n)[:2] for s, n in zip(index, shape, strict=True)]


def read_slice(shards: Shards, name: str, layout: str, shape, index, interleave_hd=0):
    """Slice ``index`` of one layer (shardlib ``shape``) read from Hugging Face tensor ``name``.

    Only the rows/columns covering the slice are read; ``interleave_hd`` > 0 reorders q/k
    rows from Meta's rotary order (``meta_to_half``) whole heads at a time.
    """
    b = _bounds(index, shape)
    if layout == "same":
        return shards.read(name, tuple(slice(lo, hi) for lo, hi in b))
    if layout == "transpose":
        (r0, r1), (c0, c1) = b
        return shards.read(name, (slice(c0, c1), slice(r0, r1))).T
    hd = shape[1] if layout == "out_heads" else shape[2]
    heads, (d0, d1) = (b[0], b[1]) if layout == "out_heads" else (b[1], b[2])
    rows = slice(heads[0] * hd, heads[1] * hd)
    nh = heads[1] - heads[0]
    if layout == "in_heads":  # [heads*hd, embed] -> [embed, heads, hd]
        (e0, e1) = b[0]
        block = shards.read(name, (rows, slice(e0, e1)))
        if interleave_hd:
            block = meta_to_half(block, interleave_hd)
        return block.reshape(nh, hd, e1 - e0).transpose(2, 0, 1)[:, :, d0:d1]
    (e0, e1) = b[2]  # out_heads: [embed, heads*hd] -> [heads, hd, embed]
    block = shards.read(name, (slice(e0, e1), rows))
    return block.reshape(e1 - e0, nh, hd).transpose(1, 2, 0)[:, d0:d1, :]
