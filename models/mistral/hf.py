"""Mistral in Hugging Face's form (``MistralForCausalLM``): Llama's tensor names, and
``config.json`` with ``model_type="mistral"`` and its ``sliding_window``.

``ADAPTER`` is registered with the Mistral presets (``models.registry``). Hugging Face lets
query i see key j when i - window < j <= i, as ``ops.attention(window=...)`` masks; a null
``sliding_window`` (Mistral 7B v0.2 on) is full causal attention.
"""

from __future__ import annotations

from models.llama.hf import CHECKED, TENSORS, llama_config_json, llama_settings, merge_lora
from shardlib.core.capabilities import HFAdapter


def mistral_settings(hf: dict) -> dict:
    """Mistral ``config.json`` -> ``LlamaConfig`` fields (its window included)."""
    return llama_settings(hf, "mistral") | {"sliding_window": hf.get("sliding_window") or 0}


def mistral_config_json(model: dict) -> dict:
    """``LlamaConfig`` fields -> a ``config.json`` that ``transformers`` loads as Mistral."""
    out = llama_config_json(model) | {"architectures": ["MistralForCausalLM"]}
    for key in ("attention_bias", "mlp_bias"):
        del out[key]
    return out | {"model_type": "mistral", "sliding_window": model["sliding_window"] or None}


ADAPTER = HFAdapter(
    hf_type="mistral",
    preset="mistral-tiny",
    tensors=TENSORS,
    rotary=("blocks/attn/wq", "blocks/attn/wk"),
    checked=CHECKED,
    settings=mistral_settings,
    config_json=mistral_config_json,
    merged=merge_lora,
)
