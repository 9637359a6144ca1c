"""FLOPs of an optimized HLO module, counted per device with every loop trip included.

``cost_analysis()`` counts a while body once; this walks the module with the trip-count
multipliers of ``hlo.call_multipliers`` so pipeline and layer loops are counted as run (see
REFERENCE.md). Kept beside the HLO reader, apart from it: the reader finds what runs, this
prices it.
"""

from __future__ import annotations

import math
import re

from shardlib.analysis.hlo import HloModule, Instruction, parse_type

# Elementwise ops that cost one FLOP per output element (the convention of XLA's cost model,
# except that we also count transcendentals as one FLOP, which XLA reports separately).
ELEMENTWISE_OPS = frozenset({
    "add", "subtract", "multiply", "divide", "remainder", "maximum", "minimum", "power",
    "atan2", "negate", "abs", "sign", "exponential", "exponential-minus-one", "log",
    "log-plus-one", "logistic", "tanh", "sqrt", "rsqrt", "cbrt", "sine", "cosine", "tan",
    "erf", "floor", "ceil", "round-nearest-afz", "round-nearest-even", "compare", "select",
    "clamp",
})  # fmt: skip


def _dims(attrs: str, key: str) -> list[int]:
    m = re.search(rf"\b{key}=\{{([\d,\s]*)\}}", attrs)
    return [int(x) for x in m.group(1).split(",") if x.strip()] if m else []


def instruction_flops(inst: Instruction, types: dict[str, str]) -> int:
    """FLOPs of one instruction, not counting computations it calls (those are walked).

    dot: 2 x result elements x contracted size. convolution: 2 x result elements x kernel
    elements per output feature. custom-call matmuls (oneDNN and the like, which carry no
    contracting dims) are taken as [.., M, K] x [.., K, N]. Elementwise: one per element;
    reduce: one per input element.
    """
    out = sum(a.elements for a in inst.arrays)
    operands = [parse_type(types[o]) for o in inst.operands if o in types]
    if inst.opcode == "dot" and operands:
        lhs = operands[0][0]
        return 2 * out * math.prod(lhs.dims[d] for d in _dims(inst.attrs, "lhs_contracting_dims"))
    if inst.opcode == "convolution" and len(operands) == 2:
        rhs = operands[1][0]
        labels = re.search(r"dim_labels=[^_]*_([^-]*)->", inst.attrs)
        o_dim = labels.group(1).index("o") if labels and "o" in labels.group(1) else -1
        return 2 * out * (rhs.elements // max(rhs.dims[o_dim], 1)) if rhs.dims else 0
    if inst.opcode == "custom-call" and len(operands) >= 2:
        target = re.search(r'custom_call_target="([^"]*)"', inst.attrs)
        if target and re.search(r"matmul|gemm|dot", target.group(1), re.IGNORECASE):
            lhs = operands[0][0]
            return 2 * out * (lhs.dims[-1] if lhs.dims else 1)
        return 0
    if inst.opcode in ELEMENTWISE_OPS:
        return out
    if inst.opcode == "reduce" and operands:
        data = operands[: max(len(operands) // 2, 1)]
        return sum(a.elements for arrays in data for a in arrays)
    return 0


def count_flops(module: HloModule, multipliers: dict[str, int]) -> int:
    """Per-device FLOPs of one run of ENTRY, with every loop body counted per trip."""
    total = 0
    for comp in module.computations.values():
        mult = multipliers.get(comp.name, 0)
        if mult:
            types = comp.types()
            total += mult * sum(instruction_flops(i, types) for i in comp.instructions)
    return total
