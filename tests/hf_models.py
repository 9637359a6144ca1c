"""Tiny random Llamas made with ``transformers`` (nothing is downloaded), in two styles.

Llama 2 style: multi-head attention, plain RoPE, a separate LM head. Llama 3 style:
grouped-query attention, llama3 RoPE scaling, tied embeddings. Shared by the import/export
tests (``test_hf.py``) and the fine-tuning chain (``test_hf_finetune.py``).
"""

import numpy as np

STYLES = {
    "llama2": dict(num_key_value_heads=4, tie_word_embeddings=False),
    "llama3": dict(
        num_key_value_heads=2,
        tie_word_embeddings=True,
        rope_parameters=dict(
            rope_type="llama3", rope_theta=500_000.0, factor=8.0, low_freq_factor=1.0,
            high_freq_factor=4.0, original_max_position_embeddings=16,
        ),
    ),
}  # fmt: skip


def make_hf(style: str, out, vocab: int, seed: int = 0):
    """A ``style`` Llama with ``vocab`` tokens (2 layers, 64 positions), saved to ``out``."""
    import torch
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, head_dim=8, max_position_embeddings=64, rms_norm_eps=1e-5,
        initializer_range=0.2,  # std 0.02 (the default) caps a frozen head's |logits| below 1
        **STYLES[style],
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(out, safe_serialization=True)
    return model


def hf_logits(model_or_dir, tokens):
    """transformers' logits [batch, seq, vocab] for ``tokens`` [batch, seq]."""
    import torch
    import transformers

    model = model_or_dir
    if not hasattr(model, "forward"):
        model = transformers.AutoModelForCausalLM.from_pretrained(model_or_dir).eval()
    with torch.no_grad():
        return model(torch.tensor(np.asarray(tokens))).logits.numpy()


def rel_err(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))) / np.max(np.abs(b)))
