"""SwiGLU's product as a function whose gradient keeps only gate and up.

Autodiff of ``silu(gate) * up`` keeps silu's own intermediates beside the gate and up the
product's gradient needs: gate again, sigmoid(gate) and silu(gate), three more [batch, seq,
mlp] buffers per block without recompute (16 bytes per token per hidden unit at Llama 7B
in bf16; ``benchmarks/activation_bytes.py``). The gradient written here keeps gate and up
and recomputes the sigmoid from gate, as fused SwiGLU kernels do, and is the plain form's
gradient, bit for bit. A custom VJP rather than ``jax.checkpoint``: the latter's
optimisation barrier moved XLA's fusion elsewhere in the block.
"""

from __future__ import annotations

import jax


def plain(gate_BLF: jax.Array, up_BLF: jax.Array) -> jax.Array:
    """silu(gate) * up, differentiated by autodiff (the reference)."""
    return jax.nn.silu(gate_BLF) * up_BLF


@jax.custom_vjp
def swiglu(gate_BLF: jax.Array, up_BLF: jax.Array) -> jax.Array:  # [b, l, f] x2 -> [b, l, f]
    return plain(gate_BLF, up_BLF)


def _forward(gate_BLF, up_BLF):
    return plain(gate_BLF, up_BLF), (gate_BLF, up_BLF)


def _backward(saved, g_BLF):
    return jax.vjp(plain, *saved)[1](g_BLF)  # the plain form's gradient, recomputed


swiglu.defvjp(_forward, _backward)
