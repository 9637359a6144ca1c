"""The Llama family in Hugging Face's form: tensor names, layouts and ``config.json``.

``ADAPTER`` (a ``shardlib.core.model.HFAdapter``) is registered with every Llama preset
(``models.registry``), so ``shardlib.interop`` imports and exports Llamas without naming
one of their parameters. shardlib stacks the blocks (one tensor with a
leading ``layers`` dim) where Hugging Face names each layer; its ``nn.Linear`` weights are
[out, in] where shardlib's are [in, out], heads split out (the layouts of ``HFTensor``).
Hugging Face (and shardlib) rotate feature i with i + head_dim/2; Meta's original
checkpoints rotate neighbours, which import undoes for the ``rotary`` q/k weights.
"""

from __future__ import annotations

from models.llama.lora import merge
from models.llama.rotary import ROPE_TYPES, yarn_attention_factor
from shardlib.core.capabilities import HFAdapter

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
LORA_WEIGHTS = {"q": "attn/wq", "k": "attn/wk", "v": "attn/wv", "o": "attn/wo"}
LORA_WEIGHTS |= {"gate": "mlp/w_gate", "up": "mlp/w_up", "down": "mlp/w_down"}
"""LoRA target -> the block weight its factors adapt (``models.llama.lora``)."""


def rope_settings(hf: dict) -> tuple[tuple | None, str]:
    """``config.json``'s RoPE scaling -> (``rope_scaling``, ``rope_type``): the fields
    ``models.llama.rotary.ROPE_TYPES`` lists, with Hugging Face's defaults filled in."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}  # transformers 5 / 4
    kind = rope.get("rope_type", rope.get("type", "default"))
    max_positions = hf.get("max_position_embeddings", 8192)
    original = rope.get("original_max_position_embeddings") or max_positions
    if kind == "default":
        return None, "llama3"
    if kind == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor")
        return (*(float(rope[k]) for k in keys), int(original)), kind
    if kind == "linear":
        return (float(rope["factor"]),), kind
    if kind == "dynamic":  # Hugging Face scales by max_position_embeddings, not the original
        return (float(rope["factor"]), int(max_positions)), kind
    if kind == "yarn":
        factor = rope.get("factor") or max_positions / original
        attention = rope.get("attention_factor") or yarn_attention_factor(
            factor, rope.get("mscale") or 0.0, rope.get("mscale_all_dim") or 0.0
        )
        beta_fast, beta_slow = rope.get("beta_fast") or 32.0, rope.get("beta_slow") or 1.0
        truncate = 1.0 if rope.get("truncate", True) else 0.0
        return (float(factor), int(original), float(beta_fast), float(beta_slow),
                float(attention), truncate), kind  # fmt: skip
    raise ValueError(f"rope_type={kind!r}; supported: default, {', '.join(ROPE_TYPES)}.")


def rope_json(model: dict) -> dict:
    """``rope_scaling`` and ``rope_type`` -> Hugging Face's ``rope_parameters``."""
    scaling = model.get("rope_scaling")
    if not scaling:
        return {"rope_type": "default", "rope_theta": model["rope_theta"]}
    kind = model.get("rope_type", "llama3")
    rope = {"rope_type": kind, "rope_theta": model["rope_theta"]}
    names = {"original_max_positions": "original_max_position_embeddings"}
    for field, value in zip(ROPE_TYPES[kind], scaling, strict=True):
        rope[names.get(field, field)] = value
    if kind == "dynamic":  # its length is config.json's max_position_embeddings
        del rope["original_max_position_embeddings"]
    if kind == "yarn":  # Hugging Face's defaults left out, as its own configs do
        defaults = {"beta_fast": 32.0, "beta_slow": 1.0, "truncate": 1.0,
                    "attention_factor": yarn_attention_factor(rope["factor"])}  # fmt: skip
        rope = {k: v for k, v in rope.items() if k not in defaults or v != defaults[k]}
        rope = rope | ({"truncate": False} if "truncate" in rope else {})
    return rope


def llama_settings(hf: dict, model_type: str = "llama") -> dict:
    """Hugging Face ``config.json`` -> ``LlamaConfig`` fields (``model.NAME`` values); the
    Llama-shaped families (Qwen2, Mistral) read theirs through it with their own type."""
    if hf.get("model_type", model_type) != model_type:
        raise ValueError(f"model_type={hf.get('model_type')!r}; only {model_type} is read here.")
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            raise ValueError(f"{flag}=true; shardlib's Llama has no biases there.")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={hf['hidden_act']!r}; shardlib's MLP is SwiGLU.")
    heads = hf["num_attention_heads"]
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}  # transformers 5 / 4
    scaling, rope_type = rope_settings(hf)
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
        "rope_type": rope_type,
        "max_positions": hf.get("max_position_embeddings", 8192),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "qkv_bias": False,  # Qwen2's adapter sets it
        "sliding_window": 0,  # Mistral's adapter reads it
    }


def llama_config_json(model: dict) -> dict:
    """``LlamaConfig`` fields -> a ``config.json`` that ``transformers`` loads (4.x and 5.x:
    both rope spellings)."""
    rope = rope_json(model)
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
        "rope_scaling": rope if model.get("rope_scaling") else None,
        "rope_parameters": rope,
        "tie_word_embeddings": bool(model["tie_embeddings"]),
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }


CHECKED = ("rope_theta", "norm_eps", "rope_scaling", "rope_type", "tie_embeddings", "qkv_bias",
           "sliding_window")  # fmt: skip
"""Settings no tensor's shape shows, checked against ``config.json`` on import."""


def merge_lora(flat: dict, model: dict) -> dict:
    """Base weights with (alpha / rank) * A @ B added; adapters dropped. Numpy or jax."""
    return merge(flat, model, LORA_WEIGHTS)


ADAPTER = HFAdapter(
    hf_type="llama",
    preset="llama-tiny",  # every field config.json sets, it sets for any Llama preset
    tensors=TENSORS,
    rotary=("blocks/attn/wq", "blocks/attn/wk"),
    checked=CHECKED,
    settings=llama_settings,
    config_json=llama_config_json,
    merged=merge_lora,
)
