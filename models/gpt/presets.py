"""GPT presets: Brown et al. 2020, Table 2.1 (the GPT-3 family), GPT-2 small, and a tiny one.

Every GPT-3 preset has the table's n_layers, d_model, n_heads and d_head, a context of
2048 and GPT-2's BPE vocabulary of 50257, unpadded (shardlib pads no vocabulary: a tensor
degree that does not divide 50257 = 29 x 1733 is refused with the dim named; set
``model.vocab=50304``, a multiple of 128, to split the tables, at 47 x d_model more
parameters). ``PUBLISHED`` is the table's n_params column, which the tests check the
models' counts against: within 1%, or within the rounding of the printed digits (2.7B is
2.65B). Two rows are not as printed: XL's heads (see below), and Medium's count: its shape
gives 356M under any counting (GPT-2 medium, the same shape at 1024 positions, is 355M),
1.7% over the printed 350M.
"""

from __future__ import annotations

from dataclasses import replace

from models.gpt.model import GPTConfig

GPT_VOCAB = 50_257
"""GPT-2's byte-level BPE vocabulary, which GPT-3 reuses."""


def _gpt3(layers: int, embed: int, heads: int, head_dim: int) -> GPTConfig:
    return GPTConfig(
        vocab=GPT_VOCAB, embed=embed, layers=layers, heads=heads, head_dim=head_dim,
        max_positions=2048,
    )  # fmt: skip


# Table 2.1: name -> (n_layers, d_model, n_heads, d_head); n_params in PUBLISHED
GPT3_SHAPES = {
    "gpt3-125m": (12, 768, 12, 64),  # GPT-3 Small
    "gpt3-350m": (24, 1024, 16, 64),  # GPT-3 Medium
    "gpt3-760m": (24, 1536, 16, 96),  # GPT-3 Large
    # GPT-3 XL: printed as 24 heads x 128 = 3072 != d_model, which gives 1.52B, not 1.3B;
    # 16 x 128 = d_model (as GPT-Neo 1.3B and Pythia 1.4B) gives the table's count
    "gpt3-1.3b": (24, 2048, 16, 128),
    "gpt3-2.7b": (32, 2560, 32, 80),
    "gpt3-6.7b": (32, 4096, 32, 128),
    "gpt3-13b": (40, 5140, 40, 128),  # d_model 5140 as printed (40 x 128 = 5120)
    "gpt3-175b": (96, 12288, 96, 128),  # "GPT-3"
}
PUBLISHED = {
    "gpt3-125m": 125e6,
    "gpt3-350m": 350e6,
    "gpt3-760m": 760e6,
    "gpt3-1.3b": 1.3e9,
    "gpt3-2.7b": 2.7e9,
    "gpt3-6.7b": 6.7e9,
    "gpt3-13b": 13.0e9,
    "gpt3-175b": 175.0e9,
}
"""Brown et al. Table 2.1, n_params."""

PRESETS: dict[str, GPTConfig] = {
    # tests: a few hundred thousand parameters, 8 heads so that tensor=8 divides them
    "gpt-tiny": GPTConfig(),
    # GPT-2 small (Radford et al. 2019; Hugging Face "gpt2"): 124M, context 1024
    "gpt2": GPTConfig(vocab=GPT_VOCAB, embed=768, layers=12, heads=12, max_positions=1024),
    **{name: _gpt3(*shape) for name, shape in GPT3_SHAPES.items()},
}


def preset(name: str, **overrides) -> GPTConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}. Presets: {', '.join(PRESETS)}.")
    return replace(PRESETS[name], **overrides)
