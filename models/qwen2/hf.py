"""Qwen2 in Hugging Face's form (``Qwen2ForCausalLM``): Llama's tensor names plus the q, k
and v biases, and ``config.json`` with ``model_type="qwen2"``.

``ADAPTER`` is registered with the Qwen2 presets (``models.registry``). The biases are
[heads x head_dim] vectors in Hugging Face, [heads, head_dim] here (``heads_last``). Qwen2's
optional sliding window (``use_sliding_window``, on the layers from ``max_window_layers``
up) is per layer, which the scanned blocks cannot express: such a checkpoint is refused.
"""

from __future__ import annotations

from models.llama.hf import CHECKED, TENSORS, llama_config_json, llama_settings, merge_lora
from shardlib.core.capabilities import HFAdapter

_LAYER = "model.layers.{i}."
QWEN2_TENSORS = TENSORS | {
    "blocks/attn/bq": (_LAYER + "self_attn.q_proj.bias", "heads_last"),  # [heads, hd]
    "blocks/attn/bk": (_LAYER + "self_attn.k_proj.bias", "heads_last"),  # [kv_heads, hd]
    "blocks/attn/bv": (_LAYER + "self_attn.v_proj.bias", "heads_last"),  # [kv_heads, hd]
}


def qwen2_settings(hf: dict) -> dict:
    """Qwen2 ``config.json`` -> ``LlamaConfig`` fields (q/k/v biases on)."""
    if hf.get("use_sliding_window"):
        raise ValueError(
            "use_sliding_window=true: Qwen2 windows only the layers from max_window_layers "
            "on, and shardlib's scanned blocks share one attention. Fix: a checkpoint "
            "without it (the published Qwen2 configs leave it off)."
        )
    return llama_settings(hf, "qwen2") | {"qkv_bias": True}


def qwen2_config_json(model: dict) -> dict:
    """``LlamaConfig`` fields -> a ``config.json`` that ``transformers`` loads as Qwen2."""
    if not model.get("qkv_bias"):
        raise ValueError("export: a Qwen2 checkpoint has q/k/v biases; this model has none.")
    out = llama_config_json(model) | {"architectures": ["Qwen2ForCausalLM"]}
    for key in ("attention_bias", "mlp_bias"):
        del out[key]
    return out | {"model_type": "qwen2", "use_sliding_window": False}


ADAPTER = HFAdapter(
    hf_type="qwen2",
    preset="qwen2-tiny",
    tensors=QWEN2_TENSORS,
    rotary=("blocks/attn/wq", "blocks/attn/wk"),
    checked=CHECKED,
    settings=qwen2_settings,
    config_json=qwen2_config_json,
    merged=merge_lora,
)
