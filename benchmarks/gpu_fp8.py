"""Which kernels the FP8 train step's products compile to on a GPU.

    python benchmarks/gpu_fp8.py [--hlo DIR] [--model llama-small]

``precision=fp8`` puts Flax's quantize-dequantize pattern around each block projection
(``shardlib/train/fp8.py``); XLA's GPU compiler is meant to turn each such product into an
FP8 GEMM (cuBLASLt's ``__cublas$lt$matmul$f8`` custom call, or a Triton GEMM fusion whose
operands are f8). This prints, for the compiled step: the custom-call targets, the number of
GEMM calls and fusions with f8 operands, and the dots still computed in bf16/f32, so a run
that is no faster than bf16 can be told apart from one whose products never became FP8.
Run it once as is and once with ``XLA_FLAGS=--xla_gpu_enable_triton_gemm=false``.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script too


def kernels(text: str) -> dict:
    """Counts of the optimized HLO's GEMM-like instructions by kind and operand type."""
    out = collections.Counter()
    for line in text.splitlines():
        target = re.search(r'custom_call_target="([^"]+)"', line)
        if target:
            out[f"custom-call {target.group(1)}"] += 1
        if '"kind":"__triton_gemm"' in line:
            out["triton gemm fusion" + (" (f8 operands)" if "f8e" in line else "")] += 1
        if re.search(r"\bdot\(", line):
            types = sorted(set(re.findall(r"(f8e\w+|bf16|f32)\[", line)))
            out[f"dot {'/'.join(types)}"] += 1
    return dict(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-small")
    parser.add_argument("--hlo", help="write the optimized HLO here")
    parser.add_argument("--remat", default="none")
    args = parser.parse_args()

    import jax

    from shardlib.core.mesh import MeshSpec
    from shardlib.train.config import train_config
    from shardlib.train.setup import make_setup

    cfg = train_config(
        steps=1, batch=4, seq=256, precision="fp8", model=args.model, remat=args.remat
    )
    mesh = MeshSpec((("data", 1),)).build(jax.devices()[:1])
    setup = make_setup(cfg, mesh)
    lowered = setup.train_step.lower(setup.abstract_state(), setup.abstract_batch())
    text = lowered.compile().as_text()
    flags = os.environ.get("XLA_FLAGS", "")
    device = jax.devices()[0].device_kind
    print(f"{device}, jax {jax.__version__}, remat={args.remat}, XLA_FLAGS={flags!r}")
    for kind, n in sorted(kernels(text).items()):
        print(f"  {n:4d}  {kind}")
    if args.hlo:
        tag = ("notriton" if "triton_gemm=false" in flags else "default") + f"_{args.remat}"
        Path(args.hlo, f"fp8_step_{tag}.hlo.txt").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
