"""Mistral: a Llama-shaped decoder with sliding-window attention
(``LlamaConfig.sliding_window``), built by ``models.llama.Llama``; its presets here and its
Hugging Face names and ``config.json`` in ``hf``."""

from dataclasses import replace

from models.llama.model import LlamaConfig

PRESETS: dict[str, LlamaConfig] = {
    # tests: llama-tiny's shapes, each token seeing the 8 tokens up to itself
    "mistral-tiny": LlamaConfig(sliding_window=8),
    # published Hugging Face shapes (config.json of mistralai/Mistral-7B-v0.1)
    "mistral-7b": LlamaConfig(
        vocab=32_000, embed=4096, layers=32, heads=32, kv_heads=8, head_dim=128, mlp=14_336,
        norm_eps=1e-5, max_positions=32_768, sliding_window=4096,
    ),
}  # fmt: skip


def preset(name: str, **overrides) -> LlamaConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}. Presets: {', '.join(PRESETS)}.")
    return replace(PRESETS[name], **overrides)
