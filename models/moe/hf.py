"""Mixtral in Hugging Face's form (``MixtralForCausalLM``): tensor names, layouts and
``config.json``, onto ``models.moe`` with an MoE block in every layer.

``ADAPTER`` is registered with the MoE presets (``models.registry``). Attention is Llama's
(its names under ``block_sparse_moe``'s sibling ``self_attn``); the router ``gate`` [E,
embed] is shardlib's [embed, E] transposed; each expert is three ``nn.Linear``s per layer
and expert (``experts.{e}.w1`` gate, ``w3`` up, ``w2`` down), one slice of shardlib's
stacked [layers, experts, ...] weights each (``{e}``: ``shardlib.interop.hf_io``).

Mixtral routes without capacity (every token reaches its top 2): the import sets
``no_drop``, so the logits are transformers' whatever the batch. Its training-time router
loss coefficient becomes ``aux_loss_weight`` (no z-loss). An MoE model with dense blocks
between its MoE blocks (``moe_every`` > 1) has no Mixtral form: its export is refused.
"""

from __future__ import annotations

from models.llama.hf import CHECKED, llama_config_json, llama_settings
from shardlib.core.capabilities import HFAdapter

_LAYER = "model.layers.{i}."
_EXPERT = _LAYER + "block_sparse_moe.experts.{e}."
TENSORS = {
    "embedding": ("model.embed_tokens.weight", "same"),
    "final_norm/scale": ("model.norm.weight", "same"),
    "lm_head": ("lm_head.weight", "transpose"),
    "blocks/moe/attn_norm/scale": (_LAYER + "input_layernorm.weight", "same"),
    "blocks/moe/mlp_norm/scale": (_LAYER + "post_attention_layernorm.weight", "same"),
    "blocks/moe/attn/wq": (_LAYER + "self_attn.q_proj.weight", "in_heads"),
    "blocks/moe/attn/wk": (_LAYER + "self_attn.k_proj.weight", "in_heads"),
    "blocks/moe/attn/wv": (_LAYER + "self_attn.v_proj.weight", "in_heads"),
    "blocks/moe/attn/wo": (_LAYER + "self_attn.o_proj.weight", "out_heads"),
    "blocks/moe/moe/router": (_LAYER + "block_sparse_moe.gate.weight", "transpose"),  # [E, D]
    "blocks/moe/moe/experts/w_gate": (_EXPERT + "w1.weight", "transpose"),  # [mlp, embed]
    "blocks/moe/moe/experts/w_up": (_EXPERT + "w3.weight", "transpose"),  # [mlp, embed]
    "blocks/moe/moe/experts/w_down": (_EXPERT + "w2.weight", "transpose"),  # [embed, mlp]
}


def mixtral_settings(hf: dict) -> dict:
    """Mixtral ``config.json`` -> ``MoeConfig`` fields (an MoE block in every layer,
    dropless top-k routing)."""
    out = llama_settings(hf, "mixtral")
    return out | {
        "sliding_window": hf.get("sliding_window") or 0,
        "experts": hf["num_local_experts"],
        "expert_mlp": hf["intermediate_size"],
        "top_k": hf.get("num_experts_per_tok", 2),
        "moe_every": 1,
        "no_drop": True,
        "aux_loss_weight": float(hf.get("router_aux_loss_coef", 0.001)),
        "z_loss_weight": 0.0,
    }


def mixtral_config_json(model: dict) -> dict:
    """``MoeConfig`` fields -> a ``config.json`` that ``transformers`` loads as Mixtral."""
    if model["moe_every"] != 1:
        raise ValueError(
            f"export: moe_every={model['moe_every']} puts dense blocks between the MoE ones; "
            "Mixtral has an MoE block in every layer. Fix: export a model with moe_every=1."
        )
    out = llama_config_json(model) | {"architectures": ["MixtralForCausalLM"]}
    for key in ("attention_bias", "mlp_bias"):
        del out[key]
    return out | {
        "model_type": "mixtral",
        "intermediate_size": model["expert_mlp"],
        "num_local_experts": model["experts"],
        "num_experts_per_tok": model["top_k"],
        "router_aux_loss_coef": model["aux_loss_weight"],
        "router_jitter_noise": 0.0,
        "sliding_window": model["sliding_window"] or None,
    }


ADAPTER = HFAdapter(
    hf_type="mixtral",
    preset="mixtral-tiny",
    tensors=TENSORS,
    rotary=("blocks/moe/attn/wq", "blocks/moe/attn/wk"),
    checked=(*CHECKED, "no_drop"),
    settings=mixtral_settings,
    config_json=mixtral_config_json,
)
