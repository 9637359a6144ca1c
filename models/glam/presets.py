"""GLaM presets: the MoE shapes of Du et al.'s model table (L layers, M model width, H
hidden width, heads x d_head, E experts per MoE layer; experts in every other layer),
the paper's 256K SentencePiece vocabulary, and a tiny one for the tests.

Named as the paper names them: ``glam-<dense size>-<E>e``, the dense model whose every
other MLP became E experts. Parameter counts (``GlamConfig.param_count`` /
``active_param_count``) are checked against the paper's Table 4 in
``tests/models/test_glam.py``. Every preset has the table's shapes and the stated 256K
vocabulary; the table itself counts only 64B/64E with that embedding, the 1.7B and 8B rows
with a 32,000-row one (so those presets hold 224,000 x M more parameters than printed:
0.46B at 1.7B, 0.92B at 8B), and 0.1B/64E's activated 145M fits no embedding size.
"""

from __future__ import annotations

from models.glam.model import GlamConfig

VOCAB = 256_000
"""The paper's SentencePiece vocabulary ("256K")."""


def _glam(layers: int, embed: int, hidden: int, heads: int, head_dim: int, experts: int):
    return GlamConfig(
        vocab=VOCAB,
        embed=embed,
        layers=layers,
        heads=heads,
        kv_heads=heads,  # multi-head attention
        head_dim=head_dim,
        mlp=hidden,
        expert_mlp=hidden,  # experts as wide as the dense MLP (H)
        experts=experts,
        capacity_factor=1.0,  # GShard's 2N/E slots per expert for top-2: k x group / E
        max_positions=1024,  # GLaM trains on 1024-token sequences
    )


PRESETS: dict[str, GlamConfig] = {
    # tests: two (MoE, dense) pairs, 8 experts; 8 heads so tensor 8 splits them
    "glam-tiny": GlamConfig(
        embed=64, layers=4, heads=8, kv_heads=8, head_dim=8, mlp=128, experts=8, expert_mlp=128
    ),
    "glam-0.1b-64e": _glam(12, 768, 3072, 12, 64, 64),
    "glam-1.7b-64e": _glam(24, 2048, 8192, 16, 128, 64),
    "glam-1.7b-256e": _glam(24, 2048, 8192, 16, 128, 256),
    "glam-8b-64e": _glam(32, 4096, 16384, 32, 128, 64),
    # the largest: 1.162T parameters (printed 1.2T), 96.6B activated per token
    "glam-64b-64e": _glam(64, 8192, 32768, 128, 128, 64),
}
