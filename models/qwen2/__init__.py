"""Qwen2: a Llama-shaped decoder whose q, k and v projections carry biases
(``LlamaConfig.qkv_bias``), built by ``models.llama.Llama``; its presets here and its
Hugging Face names and ``config.json`` in ``hf``."""

from dataclasses import replace

from models.llama.model import LlamaConfig

PRESETS: dict[str, LlamaConfig] = {
    # tests: llama-tiny's shapes with q/k/v biases
    "qwen2-tiny": LlamaConfig(qkv_bias=True, rope_theta=1_000_000.0, norm_eps=1e-6),
    # published Hugging Face shapes (config.json of Qwen/Qwen2-*)
    "qwen2-0.5b": LlamaConfig(
        vocab=151_936, embed=896, layers=24, heads=14, kv_heads=2, head_dim=64, mlp=4864,
        rope_theta=1_000_000.0, norm_eps=1e-6, max_positions=32_768, tie_embeddings=True,
        qkv_bias=True,
    ),
    "qwen2-7b": LlamaConfig(
        vocab=152_064, embed=3584, layers=28, heads=28, kv_heads=4, head_dim=128, mlp=18_944,
        rope_theta=1_000_000.0, norm_eps=1e-6, max_positions=32_768, qkv_bias=True,
    ),
}  # fmt: skip


def preset(name: str, **overrides) -> LlamaConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}. Presets: {', '.join(PRESETS)}.")
    return replace(PRESETS[name], **overrides)
