"""``attention_impl=auto``: which attention kernel a run uses, decided by rule, with the reason.

A user should not need to know that on a GPU the fused kernel is what makes training fast
(docs/gpu.md: a 1B Llama at 20-23% MFU with dense attention, 45% with cuDNN's) nor that
dense attention at long sequences runs out of memory. ``choose`` decides once, when the plan
meets the model (``ParallelPlan.for_workload``), and says why; the trainer prints the choice
in its run header and ``explain`` in its report. An explicit ``attention_impl`` is kept as set.

The rule, in order:

1. **cuDNN** (``jax.nn.dot_product_attention(implementation="cudnn")``) on a GPU when its
   constraints hold: bf16/fp16 compute, a head dim that is a multiple of 8 and at most 128
   (256 from Hopper on), an even sequence, and whole naturally ordered sequences per device
   (no context axis, or Ulysses' all-to-all, which hands each device whole sequences).
   Ring and all-gather attention combine per-block results through their log-sum-exp in a
   custom backward pass; JAX's cuDNN call returns the forward's log-sum-exp
   (``return_residual``) but its backward cannot take an outer one, so those keep their own
   blocks (dense or chunked) and the reason says so.
2. **chunked** (online softmax, O(chunk²) temporaries) where dense attention's fp32 scores
   of one layer, on one device, exceed ``SCORES_SHARE`` of the device's memory: XLA's dense
   program holds about two such copies in the backward (docs/gpu.md, seq 8192 on an H200:
   42.4 GiB dense against 25.5 GiB with cuDNN, 2.1 times the 8 GiB of scores).
3. **dense** otherwise, and wherever the device reports no memory limit (the CPU backend).

``Device`` is what the rule asks of the machine; tests pass their own to exercise the GPU
rule on a CPU (``local_device`` and ``device_of`` are the only backend queries; the trainer
asks the mesh's own first device).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax

from shardlib.core.workload import Workload

SCORES_SHARE = 1 / 8
"""Dense attention's one-layer fp32 scores above this share of device memory: chunked."""
FUSED_DTYPES = ("bf16", "fp16", "fp8")
"""Compute precisions whose attention runs in a 16-bit dtype cuDNN's kernel takes (fp8 runs
its attention in bf16)."""


@dataclass(frozen=True)
class Device:
    """What the choice needs to know about the devices a run uses."""

    platform: str
    """``gpu``, ``tpu`` or ``cpu`` (``jax.default_backend()``'s names)."""
    memory_bytes: float | None = None
    """One device's memory, as its runtime reports it (None: not reported, e.g. CPU)."""
    hopper: bool = False
    """Compute capability 9.0 or later (cuDNN takes head dims up to 256 there)."""


def device_of(dev) -> Device:
    """A JAX device, as the choice sees it (``dev.platform``: gpu, tpu or cpu)."""
    try:
        stats = dev.memory_stats()
    except Exception:  # some backends do not report memory at all
        stats = None
    memory = (stats or {}).get("bytes_limit")
    capability = getattr(dev, "compute_capability", None)
    hopper = capability is not None and float(capability) >= 9.0
    return Device(dev.platform, memory, hopper)


def local_device() -> Device:
    """The first local device of JAX's default backend."""
    return device_of(jax.local_devices()[0])


@dataclass(frozen=True)
class AttentionChoice:
    """The kernel a run uses and why (printed in the run header and by ``explain``)."""

    impl: str
    """dense | chunked | cudnn."""
    reason: str
    """One line a user can act on."""

    def describe(self) -> str:
        return f"attention {self.impl}: {self.reason}"


@dataclass(frozen=True)
class Splits:
    """How many ways the plan splits what attention's scores are made of, on one device."""

    batch: int = 1
    heads: int = 1
    seq: int = 1
    """Ways each device's queries are a share of the sequence (a context axis)."""


def scores_bytes(workload: Workload, splits: Splits) -> float:
    """Dense attention's fp32 scores of one layer on one device: b·h·(s/c)·s·4 bytes."""
    b = max(workload.micro_batch // splits.batch, 1)
    h = max(workload.heads // splits.heads, 1)
    return 4.0 * b * h * (workload.seq / splits.seq) * workload.seq


def cudnn_refusal(workload: Workload, kind: str, device: Device) -> str:
    """Why cuDNN's fused kernel cannot run this attention ("" when it can)."""
    if device.platform != "gpu":
        return f"cuDNN's fused kernel runs on GPUs; this run is on {device.platform}"
    if workload.precision not in FUSED_DTYPES:
        return f"cuDNN's fused kernel takes bf16/fp16; this run computes in {workload.precision}"
    top = 256 if device.hopper else 128
    d = workload.head_dim
    if d % 8 or d > top:
        return f"cuDNN takes head dims that are multiples of 8 up to {top}; this model's is {d}"
    if workload.seq % 2:
        return f"cuDNN's masked kernel takes even sequence lengths; seq is {workload.seq}"
    if kind not in ("none", "all_to_all"):
        return (
            f"{kind} attention combines blocks through their log-sum-exp in its own backward "
            "pass, which JAX's cuDNN call cannot take"
        )
    return ""


def choose(
    requested: str, workload: Workload, kind: str, splits: Splits, device: Device
) -> AttentionChoice:
    """The kernel for ``attention_impl=requested`` (``auto``: by the rule above)."""
    if requested != "auto":
        return AttentionChoice(requested, f"attention_impl={requested} as set")
    refusal = cudnn_refusal(workload, kind, device)
    if not refusal:
        return AttentionChoice("cudnn", f"cuDNN fused kernel (GPU, {workload.precision}, "
                                        f"head dim {workload.head_dim})")  # fmt: skip
    scores = scores_bytes(workload, splits)
    gib = scores / 2**30
    if device.memory_bytes and scores > SCORES_SHARE * device.memory_bytes:
        share = scores / device.memory_bytes
        return AttentionChoice(
            "chunked",
            f"{refusal}; dense attention's fp32 scores would be {gib:.1f} GiB per layer "
            f"({share:.0%} of the device's memory, over {SCORES_SHARE:.0%})",
        )
    if not device.memory_bytes:
        return AttentionChoice("dense", f"{refusal}; dense (the device reports no memory limit)")
    return AttentionChoice(
        "dense", f"{refusal}; dense scores {gib:.2f} GiB per layer fit in the device's memory"
    )
