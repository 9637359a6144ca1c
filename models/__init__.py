"""Model definitions (Flax NNX), annotated with logical axis names only.

``registry()`` is the ``shardlib.models`` entry point (see pyproject.toml): shardlib finds
these presets through it and never imports this package. ``config(name, **overrides)`` and
``build(cfg, rngs)`` are the direct way in for code that does import it.
"""

from __future__ import annotations

from dataclasses import fields, replace

from flax import nnx

from models import glam, gpt, llama, mistral, moe, qwen2
from models.gpt import hf as gpt_hf
from models.llama import hf as llama_hf
from models.mistral import hf as mistral_hf
from models.moe import hf as moe_hf
from models.qwen2 import hf as qwen2_hf
from shardlib.core.model import ModelEntry

_FAMILIES = {
    "llama": (llama.PRESETS, llama.LlamaConfig, llama.Llama),
    "moe": (moe.PRESETS, moe.MoeConfig, moe.Moe),
    "gpt": (gpt.PRESETS, gpt.GPTConfig, gpt.GPT),
    "qwen2": (qwen2.PRESETS, llama.LlamaConfig, llama.Llama),  # Llama with q/k/v biases
    "mistral": (mistral.PRESETS, llama.LlamaConfig, llama.Llama),  # with a sliding window
    "glam": (glam.PRESETS, glam.GlamConfig, glam.Glam),  # experts in every other layer
}


_HF = {
    "llama": llama_hf.ADAPTER,
    "gpt": gpt_hf.ADAPTER,
    "qwen2": qwen2_hf.ADAPTER,
    "mistral": mistral_hf.ADAPTER,
    "moe": moe_hf.ADAPTER,  # Mixtral
}
"""Each family's Hugging Face names and layouts (``HFAdapter``)."""


def registry() -> dict[str, ModelEntry]:
    """Every preset with the model class that builds it (``model(config, rngs)``) and its
    family's Hugging Face adapter, if any."""
    return {
        name: ModelEntry(config=cfg, model=module, hf=_HF.get(family))
        for family, (presets, _, module) in _FAMILIES.items()
        for name, cfg in presets.items()
    }


def presets() -> dict:
    return {name: cfg for presets, _, _ in _FAMILIES.values() for name, cfg in presets.items()}


def config(name: str, **overrides):
    """A preset's config with fields overridden (values as given, already typed)."""
    table = presets()
    if name not in table:
        raise ValueError(f"unknown model {name!r}. Presets: {', '.join(table)}.")
    cfg = table[name]
    known = {f.name for f in fields(cfg)}
    bad = sorted(set(overrides) - known)
    if bad:
        raise ValueError(
            f"model {name!r} has no field {bad[0]!r}. Fields: {', '.join(sorted(known))}."
        )
    return replace(cfg, **overrides)


def build(cfg, rngs: nnx.Rngs) -> nnx.Module:
    for _, config_type, module in _FAMILIES.values():
        if type(cfg) is config_type:  # exact: MoeConfig extends LlamaConfig
            return module(cfg, rngs)
    raise TypeError(f"no model family for config {type(cfg).__name__}")
