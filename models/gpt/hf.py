"""GPT-2 in Hugging Face's form (``GPT2LMHeadModel``): tensor names, layouts, ``config.json``.

``ADAPTER`` (a ``shardlib.core.capabilities.HFAdapter``) is registered with every GPT preset
(``models.registry``), so ``shardlib.interop`` imports and exports GPT-2 checkpoints without
naming a parameter. Two things differ from the Llama adapter:

* GPT-2's projections are ``Conv1D`` modules, whose weights are stored [in, out], the way
  shardlib stores them: the MLP's are taken as they are, the attention ones only reshaped
  (heads split out: ``heads_last``, ``heads_first``), nothing transposed;
* q, k and v live in one fused tensor, ``c_attn`` [embed, 3 x heads x head_dim] (and its
  bias [3 x heads x head_dim]), in that order: each is a block of its last dim
  (``HFAdapter.fused``), read alone on import and concatenated back on export.

The LM head is the token embedding (``tie_word_embeddings``), so no ``lm_head.weight`` is
read or written. Names carry ``transformer.`` as ``GPT2LMHeadModel.save_pretrained`` writes
them; a base model's files (the hub's ``gpt2``: ``h.0.attn.c_attn.weight``, ``wte.weight``,
with causal-mask buffers ``h.0.attn.bias`` that are not read) import too (``base_prefix``).
"""

from __future__ import annotations

from functools import partial

from models.llama.lora import merge
from shardlib.core.capabilities import HFAdapter

_LAYER = "transformer.h.{i}."
TENSORS = {
    "embedding": ("transformer.wte.weight", "same"),  # [vocab, embed]
    "position_embedding": ("transformer.wpe.weight", "same"),  # [n_positions, embed]
    "final_norm/scale": ("transformer.ln_f.weight", "same"),
    "final_norm/bias": ("transformer.ln_f.bias", "same"),
    "blocks/attn_norm/scale": (_LAYER + "ln_1.weight", "same"),
    "blocks/attn_norm/bias": (_LAYER + "ln_1.bias", "same"),
    "blocks/mlp_norm/scale": (_LAYER + "ln_2.weight", "same"),
    "blocks/mlp_norm/bias": (_LAYER + "ln_2.bias", "same"),
    # c_attn [embed, 3 * heads * head_dim]: q, k, v side by side (FUSED)
    "blocks/attn/wq": (_LAYER + "attn.c_attn.weight", "heads_last"),
    "blocks/attn/wk": (_LAYER + "attn.c_attn.weight", "heads_last"),
    "blocks/attn/wv": (_LAYER + "attn.c_attn.weight", "heads_last"),
    "blocks/attn/bq": (_LAYER + "attn.c_attn.bias", "heads_last"),
    "blocks/attn/bk": (_LAYER + "attn.c_attn.bias", "heads_last"),
    "blocks/attn/bv": (_LAYER + "attn.c_attn.bias", "heads_last"),
    "blocks/attn/wo": (_LAYER + "attn.c_proj.weight", "heads_first"),  # [heads*hd, embed]
    "blocks/attn/bo": (_LAYER + "attn.c_proj.bias", "same"),
    "blocks/mlp/w_fc": (_LAYER + "mlp.c_fc.weight", "same"),  # [embed, mlp]
    "blocks/mlp/b_fc": (_LAYER + "mlp.c_fc.bias", "same"),
    "blocks/mlp/w_proj": (_LAYER + "mlp.c_proj.weight", "same"),  # [mlp, embed]
    "blocks/mlp/b_proj": (_LAYER + "mlp.c_proj.bias", "same"),
}
FUSED = {
    f"blocks/attn/{kind}{part}": (k, 3)
    for kind in ("w", "b")
    for k, part in enumerate(("q", "k", "v"))
}
"""q, k, v: blocks 0, 1, 2 of ``c_attn``'s last dim (weight and bias)."""

GELU_TANH = ("gelu_new", "gelu_pytorch_tanh")
"""Hugging Face's names for GELU's tanh form, which GPT-2 trains with and the model runs."""


def gpt2_settings(hf: dict) -> dict:
    """Hugging Face GPT-2 ``config.json`` -> ``GPTConfig`` fields (``model.NAME`` values);
    ValueError names what shardlib's GPT does not run."""
    if hf.get("model_type", "gpt2") != "gpt2":
        raise ValueError(f"model_type={hf.get('model_type')!r}; only gpt2 is supported.")
    act = hf.get("activation_function", "gelu_new")
    if act not in GELU_TANH:
        raise ValueError(f"activation_function={act!r}; shardlib's GPT runs {GELU_TANH[0]}.")
    if not hf.get("tie_word_embeddings", True):
        raise ValueError("tie_word_embeddings=false; shardlib's GPT ties its LM head.")
    for flag, want in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                       ("reorder_and_upcast_attn", False)):  # fmt: skip
        if hf.get(flag, want) != want:
            raise ValueError(f"{flag}={hf[flag]}; shardlib's GPT has {flag}={want}.")
    embed, heads = hf["n_embd"], hf["n_head"]
    if embed % heads:
        raise ValueError(f"n_embd={embed} is not a multiple of n_head={heads}.")
    return {
        "vocab": hf["vocab_size"],
        "embed": embed,
        "layers": hf["n_layer"],
        "heads": heads,
        "head_dim": embed // heads,
        "mlp": hf.get("n_inner") or 4 * embed,
        "max_positions": hf["n_positions"],
        "norm_eps": float(hf.get("layer_norm_epsilon", 1e-5)),
    }


def gpt2_config_json(model: dict) -> dict:
    """``GPTConfig`` fields -> a ``config.json`` that ``transformers`` loads as GPT-2."""
    embed, heads = model["embed"], model["heads"]
    head_dim = model["head_dim"] or embed // heads
    if head_dim * heads != embed:
        raise ValueError(
            f"export: heads x head_dim = {heads} x {head_dim} != embed = {embed}; GPT-2 has "
            "no separate head width. Fix: export a model with head_dim = embed // heads."
        )
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": model["vocab"],
        "n_positions": model["max_positions"],
        "n_embd": embed,
        "n_layer": model["layers"],
        "n_head": heads,
        "n_inner": model["mlp"] or 4 * embed,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": model["norm_eps"],
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
    }


LORA_WEIGHTS = {"q": "attn/wq", "k": "attn/wk", "v": "attn/wv", "o": "attn/wo"}
LORA_WEIGHTS |= {"fc": "mlp/w_fc", "proj": "mlp/w_proj"}
"""LoRA target -> the block weight its factors adapt (``models.gpt.model.LORA_TARGETS``)."""

ADAPTER = HFAdapter(
    hf_type="gpt2",
    preset="gpt2",  # config.json sets every field that matters for any GPT preset
    tensors=TENSORS,
    rotary=(),
    checked=("norm_eps",),
    settings=gpt2_settings,
    config_json=gpt2_config_json,
    base_prefix="transformer.",  # the hub's gpt2 files are GPT2Model's: h.0..., wte.weight
    fused=FUSED,
    merged=partial(merge, weights=LORA_WEIGHTS),  # LoRA folded into c_attn, c_proj, c_fc
)
