"""MosaicML llm-foundry's program (2023): what its published FSDP benchmark runs computed.

llm-foundry's benchmark tables (``benchmarks/fsdp_runs.py``) trained MPT models with PyTorch
FSDP (FULL_SHARD) in eager mode, on the image ``mosaicml/pytorch:2.1.0_cu121-nightly20230827``
for both the A100 and the H100 rows (the ``Image`` column of ``scripts/train/benchmarking/
h100new.md`` at mosaicml/llm-foundry@beb8dee). Costed as shardlib's program, the H100 rows came
out 1.1-1.9x faster than published, the more so the longer the sequence, and the A100 rows with
64-wide heads (125M, 350M) 1.2x. What differs is the program, so, as for Megatron-LM's runs
(``planner.calibrate.megatron``), the runs are costed with their own:

* **attention**: ``attn_impl: triton`` (``submit_benchmarks.py``'s default), the FlashAttention
  kernel written in the pre-MLIR Triton (``triton-pre-mlir``, branch ``triton_pre_mlir_sm90``,
  llm-foundry's ``setup.py``), which issues Ampere's ``mma.sync`` on Hopper too. It is costed
  by what it issues (``TRITON_ATTENTION``): its products at a fraction of the tensor cores'
  rate for ``mma.sync`` (on Hopper 2/3 of the peak: ``Cluster.mma_sync_fraction``), plus one
  exponential per computed score on the special-function units (``Cluster.sfu_rate``). The
  one fitted number is that fraction, on the A100 fit rows only
  (``benchmarks/fsdp_validation.py``); the H100 rows are predicted from it, the A100 fit of
  the presets' ``matmul_efficiency`` and ``tile_transfers``, and the Hopper figures above.
* **the MPT block**: LayerNorm, ALiBi (a bias the kernel adds: no rotary pass), a GELU MLP of
  4 x d_model (the bytes of shardlib's SwiGLU over 8d/3); no dropout (p = 0 launches no
  kernel); flash-attn's fused cross-entropy for the loss.
* **FSDP's mixed precision** (the ``MP Mode`` column): Composer's 2023 ``get_mixed_precision``
  (``composer/trainer/mosaic_fsdp.py``) maps ``DEFAULT`` to no ``param_dtype`` (the fp32
  parameters are gathered as they are) with ``reduce_dtype`` bf16, and ``PURE`` to bf16
  throughout. Under ``DEFAULT`` the gathers carry 4 bytes a parameter, the gradient
  reductions 2, and torch's autocast casts every gathered weight to bf16 on each forward
  (the recomputed one too) and its bf16 weight gradient back to fp32, which FSDP casts to bf16
  again before reducing: passes over each layer's full weights at HBM bandwidth
  (``CAST_BYTES``), per micro-batch. Under ``PURE``, 2 and 2, and no casts.
* **FSDP's gradient memory**: PyTorch FSDP reduce-scatters each layer's gradient as the
  backward produces it and adds the shard into the one fp32 gradient shard each flat
  parameter keeps (``_accumulate_sharded_grad`` in ``torch/distributed/fsdp/
  _runtime_utils.py``: ``_saved_grad_shard += sharded_grad``), across micro-batches too; and
  Composer's ``DecoupledAdamW`` updates one parameter at a time. So the step holds one
  gradient shard and a layer's unreduced gradient, not shardlib's accumulator beside each
  micro-batch's gradients and the whole-state update temporaries (``terms.state``): 18 GiB
  less per GPU for 30B on 8 GPUs, which ran in 80 GB and was booked at 88 GiB.
* **the loss head's memory**: the tied head's bf16 logits go to flash-attn's fused
  cross-entropy (``ComposerMPTCausalLM``'s default ``loss_fn``, ``inplace_backward`` off),
  which saves the logits and writes a bf16 gradient beside them: 4 bytes per logit, where
  shardlib's head keeps fp32 logits, softmax and gradient (``terms.model``). Around it, the
  final LayerNorm's input and output and the hidden state's gradient, bf16: 6 bytes per token
  and hidden unit.
"""

from __future__ import annotations

import dataclasses

from shardlib.planner.cost import total as cost
from shardlib.planner.cost.kernels import AttentionKernel, BlockTraffic
from shardlib.planner.cost.terms import TERMS, model, state
from shardlib.planner.cost.terms.base import MASTER_BYTES, Contribution, Step
from shardlib.planner.cost.terms.fsdp import layer_elements_gathered

MPT_TRAFFIC = BlockTraffic(embed=10, rotary=0, mlp=3)
"""The MPT block per token of one block's forward, in widths of bf16: two LayerNorms (read,
write: 4) and two residual adds (read two, write one: 6) over d_model; GELU over 4 x d_model
(read, write), 3 widths of shardlib's 8d/3 MLP width; ALiBi inside the kernel, no rotary."""

TRITON_ATTENTION = AttentionKernel(ceiling=0.76, legacy_mma=True, exponentials=True)
"""llm-foundry's Triton FlashAttention: ``ceiling`` fitted on the A100 fit rows
(``benchmarks/fsdp_validation.py --fit``), the rest from what it issues (module docstring)."""


CAST_BYTES = 6
"""HBM bytes of one cast between fp32 and bf16 of one element: read 4, write 2 (or read 2,
write 4)."""


def llmfoundry_program(
    mixed_precision: str = "DEFAULT", attention: AttentionKernel = TRITON_ATTENTION
) -> cost.Program:
    """llm-foundry's program as a ``cost.Program``: shardlib's terms (the same FSDP layout's
    FLOPs, state and activations) with FSDP's traffic in the dtypes of ``mixed_precision``
    (``"DEFAULT"`` or ``"PURE"``), MPT's elementwise traffic and its Triton attention kernel."""
    if mixed_precision not in ("DEFAULT", "PURE"):
        raise ValueError(f"mixed_precision {mixed_precision!r}: DEFAULT or PURE")
    return cost.Program(lambda step: _terms(step, mixed_precision), MPT_TRAFFIC, attention)


def _terms(step: Step, mixed_precision: str) -> list[Contribution]:
    if step.view["fsdp"] <= 1:
        return cost.contributions(step)
    own = {state.TERM.name: _fsdp_state, model.TERM.name: _mpt_head}
    parts = [own.get(term.name, term.cost)(step) for term in TERMS]
    # bf16 gradient reductions (shardlib's: fp32); DEFAULT gathers fp32 weights (shardlib's:
    # the compute dtype)
    w = step.workload
    scale = {"grads": w.compute_bytes / 4}
    if mixed_precision == "DEFAULT":
        scale["weights"] = 4 / w.compute_bytes
    parts = [
        dataclasses.replace(
            part,
            comms=tuple(
                dataclasses.replace(c, buffer_bytes=c.buffer_bytes * scale[c.what])
                if c.strategy == "fsdp" and c.what in scale
                else c
                for c in part.comms
            ),
        )
        for part in parts
    ]
    if mixed_precision == "PURE":
        return parts
    return [*parts, Contribution(seconds=_cast_seconds(step))]


def _fsdp_state(step: Step) -> Contribution:
    """shardlib's state term with PyTorch FSDP's gradients (module docstring): the fp32
    gradient shard every micro-batch adds into, and one layer's gradient before its
    reduce-scatter."""
    part = state.state(step)
    in_flight = layer_elements_gathered(step) * step.calib["grad_layers_live"] * MASTER_BYTES
    grads = step.held_elements * MASTER_BYTES + in_flight
    return dataclasses.replace(part, memory={**part.memory, "grads": grads})


XENTROPY_LOGIT_BYTES = 4
"""A bf16 logit saved by flash-attn's fused cross-entropy and its bf16 gradient."""
HEAD_HIDDEN_BYTES = 6
"""Per token and hidden unit around the head: the final LayerNorm's input and output and the
gradient of the hidden state, each bf16."""


def _mpt_head(step: Step) -> Contribution:
    """shardlib's model term with the head's memory of MPT's loss (module docstring)."""
    part = model.TERM.cost(step)
    tokens = model.head_rows(step) * step.local_seq
    w = step.workload
    logits = w.vocab / step.view["tensor"] * XENTROPY_LOGIT_BYTES + w.embed * HEAD_HIDDEN_BYTES
    return dataclasses.replace(part, memory={**part.memory, "logits": tokens * logits})


def _cast_seconds(step: Step) -> float:
    """autocast's casts of the gathered fp32 weights (each forward, the recomputed one too),
    of their bf16 gradients to fp32, and FSDP's back to bf16 before the reduction."""
    view = step.view
    if step.cluster is None:
        return 0.0
    casts = 3 + (1 if view.remat == "full" else 0)
    elements = step.layer_elements * view["fsdp"] * step.layers_per_device  # gathered, whole
    return casts * CAST_BYTES * elements * view.microbatches / step.cluster.hbm_bw
