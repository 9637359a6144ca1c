"""The Llama presets: the tests' and the default run's, and the published shapes (Meta's
papers and the ``config.json`` files of meta-llama/* on the Hugging Face hub), which
``init_from`` checks an imported checkpoint against."""

from __future__ import annotations

from dataclasses import replace

from models.llama.model import LlamaConfig

# Llama 3.1's published RoPE scaling (factor, low_freq_factor, high_freq_factor, original ctx)
LLAMA31_ROPE = (8.0, 1.0, 4.0, 8192)

PRESETS: dict[str, LlamaConfig] = {
    # tests and the default training run: a few hundred thousand parameters
    "llama-tiny": LlamaConfig(),
    # ~12M parameters: memory and communication measurements
    "llama-small": LlamaConfig(
        vocab=8192, embed=256, layers=8, heads=8, kv_heads=4, head_dim=32, mlp=1024
    ),
    # the published shapes, for `explain` with abstract inputs (nothing is allocated)
    "llama-1b": LlamaConfig(
        vocab=128_256,
        embed=2048,
        layers=16,
        heads=32,
        kv_heads=8,
        head_dim=64,
        mlp=8192,
        rope_theta=500_000.0,
    ),
    "llama-7b": LlamaConfig(
        vocab=32_000, embed=4096, layers=32, heads=32, kv_heads=32, head_dim=128, mlp=11_008
    ),
    "llama-70b": LlamaConfig(
        vocab=32_000, embed=8192, layers=80, heads=64, kv_heads=8, head_dim=128, mlp=28_672
    ),
    # published Hugging Face shapes (config.json of meta-llama/*): `init_from` checks them
    "llama2-7b": LlamaConfig(
        vocab=32_000, embed=4096, layers=32, heads=32, kv_heads=32, head_dim=128, mlp=11_008,
        norm_eps=1e-5, max_positions=4096,
    ),
    "llama2-13b": LlamaConfig(
        vocab=32_000, embed=5120, layers=40, heads=40, kv_heads=40, head_dim=128, mlp=13_824,
        norm_eps=1e-5, max_positions=4096,
    ),
    "llama2-70b": LlamaConfig(
        vocab=32_000, embed=8192, layers=80, heads=64, kv_heads=8, head_dim=128, mlp=28_672,
        norm_eps=1e-5, max_positions=4096,
    ),
    "llama3-8b": LlamaConfig(  # Llama 3.1 8B
        vocab=128_256, embed=4096, layers=32, heads=32, kv_heads=8, head_dim=128, mlp=14_336,
        rope_theta=500_000.0, norm_eps=1e-5, rope_scaling=LLAMA31_ROPE, max_positions=131_072,
    ),
    "llama3-70b": LlamaConfig(  # Llama 3.1 70B
        vocab=128_256, embed=8192, layers=80, heads=64, kv_heads=8, head_dim=128, mlp=28_672,
        rope_theta=500_000.0, norm_eps=1e-5, rope_scaling=LLAMA31_ROPE, max_positions=131_072,
    ),
    "llama3-405b": LlamaConfig(  # Llama 3.1 405B
        vocab=128_256, embed=16_384, layers=126, heads=128, kv_heads=8, head_dim=128,
        mlp=53_248, rope_theta=500_000.0, norm_eps=1e-5, rope_scaling=LLAMA31_ROPE,
        max_positions=131_072,
    ),
}  # fmt: skip


def preset(name: str, **overrides) -> LlamaConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}. Presets: {', '.join(PRESETS)}.")
    return replace(PRESETS[name], **overrides)
