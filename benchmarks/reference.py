"""Published formulas that shardlib's measurements are compared with (../shared/REFERENCE.md).

Each function returns bytes *per device per training step* and names its source, so a
benchmark or test can print measured / formula side by side. Ψ is the parameter count and
``param_bytes`` the bytes of one parameter (4 in fp32).
"""

from __future__ import annotations

from shardlib.analysis.report import ring_wire_bytes


def dp_gradient_allreduce(psi: int, n: int, param_bytes: int = 4) -> float:
    """Plain data parallel: one ring all-reduce of the gradients, 2(N-1)/N · Ψ·bytes."""
    return ring_wire_bytes("all-reduce", psi * param_bytes, n)


def zero_wire(stage: int, psi: int, n: int, param_bytes: int = 4) -> float:
    """ZeRO (Rajbhandari et al. 2020): stages 0-2 move 2Ψ, stage 3 moves 3Ψ (in ring units).

    Stage 3 = all-gather forward + all-gather backward + reduce-scatter of gradients, each
    (N-1)/N · Ψ·bytes.
    """
    m = psi * param_bytes
    if stage in (0, 1, 2):
        return 2 * (n - 1) / n * m
    if stage == 3:
        return 3 * (n - 1) / n * m
    raise ValueError(f"ZeRO stage {stage} is not 0-3")


def zero_memory(
    stage: int,
    psi: int,
    n: int,
    param_bytes: int = 4,
    grad_bytes: int = 4,
    optimizer_bytes: int = 8,
) -> float:
    """Model-state bytes per device (fp32 Adam: 4Ψ params + 4Ψ grads + 8Ψ moments)."""
    p, g, o = psi * param_bytes, psi * grad_bytes, psi * optimizer_bytes
    return {0: p + g + o, 1: p + g + o / n, 2: p + (g + o) / n, 3: (p + g + o) / n}[stage]


def megatron_tp_layer(b: int, s: int, h: int, t: int, act_bytes: int = 4) -> dict[str, float]:
    """Megatron 1D tensor parallel, one transformer layer (Shoeybi et al. 2019).

    Two all-reduces of the b·s·h activations in forward and two in backward; returns the
    count, the buffer bytes of each, and the ring wire bytes of all four.
    """
    m = b * s * h * act_bytes
    return {"count": 4, "buffer_bytes": m, "wire_bytes": 4 * ring_wire_bytes("all-reduce", m, t)}
