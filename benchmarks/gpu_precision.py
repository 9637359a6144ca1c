"""fp32 training on the GPU against one CPU device: first-step gradients, leaf by leaf.

    JAX_PLATFORMS=cuda,cpu python benchmarks/gpu_precision.py default highest
    NVIDIA_TF32_OVERRIDE=0 JAX_PLATFORMS=cuda,cpu python benchmarks/gpu_precision.py default

For each matmul precision named (JAX's ``default``, or ``highest`` through
``jax.default_matmul_precision``) it prints the largest ||g_gpu - g_cpu|| / ||g_cpu|| over
the parameters of llama-tiny's first step (``parity.first_grads`` from ``random_state``) and
the next three leaves. On an H200 with jax 0.11.2 (docs/gpu.md): default 1.1e-7 (with or
without ``NVIDIA_TF32_OVERRIDE=0``), highest 8.9e-4: the reason ``tests/tools/test_gpu.py``'s CPU
parity test runs at the default precision.
"""

import os
import sys

import jax
import numpy as np

from shardlib.core.mesh import MeshSpec
from shardlib.tools import parity
from shardlib.train.config import train_config
from shardlib.train.setup import make_setup

CFG = train_config(steps=3, batch=4, seq=64, compile_cache="off")


def grads(platform: str) -> dict:
    setup = make_setup(CFG, MeshSpec((("data", 1),)).build(jax.devices(platform)[:1]))
    return parity.first_grads(setup, parity.random_state(setup)["params"])


def main() -> int:
    cpu = grads("cpu")
    for mode in sys.argv[1:] or ["default", "highest"]:
        if mode == "highest":
            with jax.default_matmul_precision("highest"):
                got = grads("gpu")
        else:
            got = grads("gpu")
        rel = jax.tree.map(
            lambda a, b: float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)), got, cpu
        )
        flat = jax.tree_util.tree_flatten_with_path(rel)[0]
        errs = sorted(((e, jax.tree_util.keystr(p)) for p, e in flat), reverse=True)
        tf32 = os.environ.get("NVIDIA_TF32_OVERRIDE")
        print(f"{mode} (NVIDIA_TF32_OVERRIDE={tf32}): max {errs[0]}, next {errs[1:4]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
