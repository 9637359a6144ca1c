"""XLA performance flags for GPUs: a documented preset, applied only where a GPU runs.

XLA reads ``XLA_FLAGS`` once, when the first backend starts, so ``apply_gpu_defaults`` must
run before anything asks JAX for its devices (the CLI calls it right after reading the
settings). It adds each flag of ``GPU_FLAGS`` that the user's ``XLA_FLAGS`` does not
already set, so a user's value always wins, and does nothing on a machine without a CUDA
build of jaxlib or with ``JAX_PLATFORMS`` excluding the GPU. Turn it off with
``run.gpu_flags=false``. The existence of XLA flags depends on the jaxlib version; every
flag below is accepted by the jaxlib versions shardlib supports (``tests/train/test_metrics.py``
starts XLA with them).
"""

from __future__ import annotations

import importlib.metadata
import os

# (flag, value, why, source)
GPU_FLAGS = (
    (
        "xla_gpu_enable_latency_hiding_scheduler",
        "true",
        "schedule collectives early so they overlap with compute",
        "JAX GPU performance tips; NVIDIA JAX-Toolbox image default",
    ),
    (
        "xla_gpu_enable_pipelined_all_gather",
        "true",
        "FSDP: start the next layer's weight all-gather inside the current scan iteration",
        "NVIDIA JAX-Toolbox, GPU performance guide",
    ),
    (
        "xla_gpu_enable_pipelined_reduce_scatter",
        "true",
        "FSDP: overlap a layer's gradient reduce-scatter with the next layer's backward",
        "NVIDIA JAX-Toolbox, GPU performance guide",
    ),
    (
        "xla_gpu_enable_pipelined_all_reduce",
        "true",
        "data parallel: overlap per-layer gradient all-reduces with the backward pass",
        "NVIDIA JAX-Toolbox, GPU performance guide",
    ),
    (
        "xla_gpu_enable_while_loop_double_buffering",
        "true",
        "double-buffer scan carries so the pipelined collectives above have room to overlap",
        "NVIDIA JAX-Toolbox, GPU performance guide",
    ),
    (
        "xla_gpu_enable_triton_gemm",
        "false",
        "products through cuBLAS(Lt), not Triton GEMM fusions: on one H200 (jax 0.11.2) bf16 "
        "steps ran 2-3% faster (7B width 182.3 -> 176.3 ms, 1B 147.6 -> 142.6 ms), and only "
        "then does precision=fp8's quantize-dequantize become cuBLASLt FP8 GEMMs (Triton "
        "claimed the products and ran them in bf16: fp8 was 4.6% slower than bf16)",
        "measured: docs/gpu.md (benchmarks/gpu_fp8.py and gpu_train.py on one H200)",
    ),
)

_CUDA_PLUGINS = ("jax-cuda12-plugin", "jax-cuda13-plugin", "jaxlib-cuda")


def gpu_platform_expected() -> bool:
    """A CUDA jaxlib plugin is installed and JAX_PLATFORMS does not rule the GPU out."""
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms and not any(p in platforms for p in ("cuda", "gpu")):
        return False
    for name in _CUDA_PLUGINS:
        try:
            importlib.metadata.version(name)
            return True
        except importlib.metadata.PackageNotFoundError:
            continue
    return False


def with_gpu_flags(xla_flags: str) -> str:
    """``xla_flags`` with every preset flag it does not set appended."""
    have = {part.split("=")[0].lstrip("-") for part in xla_flags.split()}
    extra = [f"--{flag}={value}" for flag, value, _, _ in GPU_FLAGS if flag not in have]
    return " ".join([xla_flags.strip(), *extra]).strip()


def apply_gpu_defaults(enabled: bool = True) -> list[str]:
    """Add the preset to ``XLA_FLAGS`` on a GPU machine; the flags added (none elsewhere)."""
    if not enabled or not gpu_platform_expected():
        return []
    before = os.environ.get("XLA_FLAGS", "")
    after = with_gpu_flags(before)
    os.environ["XLA_FLAGS"] = after
    return after.split()[len(before.split()) :]
