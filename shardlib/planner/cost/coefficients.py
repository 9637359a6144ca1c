"""The cost model's fitted memory coefficients (``python -m shardlib.planner.calibrate.fit``).

Kept apart from the calibration that fits them, so the cost model reads the numbers without
importing the machinery that compiles probes (which itself runs the cost model).
"""

import jaxlib

_JAXLIB = tuple(int(p) for p in jaxlib.__version__.split(".")[:2])
"""The XLA these counts are read from: jaxlib 0.11's and 0.12's keeps one of tanh-GELU's
four fp32 VJP temporaries fewer per GPT layer than 0.10's (one mlp-wide buffer: gpt-tiny at
h 512, mlp 2048, one sequence per device on data 8, 1 MiB per layer fewer at seq 128 and 2 MiB
at seq 256, and 2 MiB at seq 256 on data 2 x tensor 4; 0.11.2 and 0.12.0.1 alike). Where it
was booked anyway, a GPT layer read 5.5% above its compiled bytes there."""

# Fitted on the CPU backend (fp32, jax 0.10.2) with `python -m shardlib.planner.calibrate.fit`.
COEFFICIENTS: dict[str, float] = {
    "layer_scores": 2.568,  # dense attention on a GPU: elements of width heads x seq saved
    # per token per layer (scores, probabilities); the CPU backend's are ``cpu_scores``
    "head_vocab": 0.818,  # fp32 logits-sized buffers of the loss (logits, softmax, gradient)
    "head_h": 11.686,  # fp32 h-sized buffers around the head (as wide as the residual stream)
    "fsdp_layers_live": 0.059,  # gathered layers live at once under FSDP (beyond the grads')
    "fsdp_outer_live": 1.119,  # gathered embedding/head copies live at once
    "grad_layers_live": 0.904,  # a layer's unreduced gradient in flight
    "fixed_bytes": 500562.933,  # runtime scratch independent of the model
    "selective_h": 0.0,  # remat=selective: extra elements of width h per token per layer, beyond
    # terms.remat.KEPT (2h, q/k/v, 2 x mlp); 0: XLA keeps what the policy says, no more
    "selective_qkv": 0.0,  # ... of the q/k/v width
    "selective_mlp": 0.0,  # ... of the MLP width
    "cpu_scores": 2.0,  # remat=none on the CPU backend: score-sized buffers saved per layer
    # (q·kᵀ and its softmax, both fp32: buffer assignment, terms.remat.saved_coefficients)
    "layer_live_scores": 3.25,  # remat=none on the CPU backend: score-sized buffers live once
    # (one layer's attention backward: terms.model.attention_backward_bytes)
    "remat_scores": 1.685,  # remat: heads x seq elements per token of the layer recomputed
    "full_layer_live": 0.0,  # remat=full: share of one layer's none-policy residuals live
    "update_live": 0.148,  # fp32 parameter-sized temporaries of the update, per optimizer shard
    "ring_saved_qkv": 0.0,  # ring attention: elements of the q/k/v width saved per token/layer
    "ring_working_qkv": 4.94,  # ... live once (one layer's ring working set)
    "moe_slot_hidden": 6.408,  # MoE: elements of width expert_mlp saved per slot per MoE block
    "moe_working_hidden": 6.018,  # ... live once (one MoE block's backward)
    "moe_dense_mlp": 6.514,  # MoE models: extra elements of width mlp per dense block
    "pipe_logits": 0.744,  # GPipe/circular: extra fp32 logits buffers (the head after the loop)
    "pipe_tables": 0.0,  # ... extra fp32 vocab x embed tables (their gradients)
    "pipe_1f1b_tables": 0.908,  # 1F1B: extra fp32 embedding+head gradient sets (per stage)
    # the GPT block's own (``for_block``; LayerNorm, biases, GELU MLP). Per layer, read off
    # XLA:CPU's buffer assignment (the forward layer loop's stacked outputs; gpt-tiny widened
    # to h 512, mlp 2048, 8 heads of 96, 4 layers, data 8 and data 2 x tensor 4): 8 h-wide
    # buffers (KEPT's 4, and 4 of the two fp32 LayerNorms' temporaries) and 6 mlp-wide (KEPT's
    # 2 for a GELU MLP, and 4 of tanh-GELU's VJP), booked as counts
    # (``terms.remat.saved_coefficients``), not fitted
    "gpt_cpu_h": 4.0,
    "gpt_cpu_mlp": 4.0 if _JAXLIB < (0, 11) else 3.0,  # (see _JAXLIB)
    # what one layer's backward holds at once beyond them, fitted alone on the 24 GPT probes
    # (``calibrate.gpt_probes``, ``--free gpt``; worst 5.8%, the remat=full probe)
    "gpt_layer_live_h": 0.0,  # elements of width h (Llama's: 0, absent)
    "gpt_layer_live_mlp": 0.861,  # ... of width mlp
    "gpt_layer_live_scores": 2.158,  # dense attention's score-sized buffers (Llama's 3.25)
    "gpt_selective_h": 0.0,
    "gpt_selective_mlp": 0.518,
}
BLOCK_KINDS = ("gpt",)
"""Block kinds (``Workload.block_kind``) with coefficients of their own: ``KIND_NAME`` keys
replace ``NAME`` for that kind's workloads (``for_block``); the rest are shared."""


def for_block(calib: dict, kind: str) -> dict:
    """``calib`` as a ``kind`` block reads it: its own ``kind_*`` counts in place of the
    Llama-fitted ones (the per-layer saved sets, which depend on the block's norms and MLP)."""
    if not kind:
        return calib
    own = {k.removeprefix(f"{kind}_"): v for k, v in calib.items() if k.startswith(f"{kind}_")}
    return {**calib, **own}


# Refitted on all 99 probes (``calibrate.fit.PROBES``) after the memory changes of 2026-11 (RMSNorm
# keeps only its input, q/k/v and gate/up cut by split, full remat's input split over tensor:
# terms.remat.saved_input_split), fixed_bytes kept (runtime scratch: those changes do not touch
# it; freed, the fit moves 47 KB into it and llama-tiny's validation plan in test_planner.py
# goes to 1.109): memory within 8.1% (max), collective bytes exact. The remat
# coefficients (selective_*, full_layer_live, remat_scores) were then refitted alone (``--free
# remat``) on the remat probes and the published-width probes (``calibrate.fit.REMAT_RECORDS``,
# tensor 1-8, h up to 12288; 34 probes, regenerated): worst 7.8% among them, 8.1% over all 99.
# remat=full keeps exactly its input per layer (terms.remat.KEPT, split over tensor where the
# trainer splits it); the fit finds nothing else of the layer live (full_layer_live 0).
# Held-out (benchmarks/planner_validation.py, 2026-11-26): 45 of 46 plans within 10%; over
# is the 64-device fsdp 16 x tensor 4 remat=full plan (1.117: the loss head's buffers
# outweigh one layer's, and the sum counts both). Refits that take the larger of the head's
# and a layer's working set (22%) moved the miss elsewhere and were not kept; so did probes
# that move vocab apart from h (vocab 2048-32768 at h 256-512, tensor 1-4: they show two
# fp32 logits-sized buffers live where the fit books 0.8 plus 11.7 h-wide ones; refitted
# with them the worst probe is 12.5% and 9 held-out plans miss).
# The pipeline coefficients (pipe_*) were refitted alone (``--free pipeline``, 102 probes)
# after two fixes to the circular schedule (``parallel.pipeline.gpipe._round_policy``): it kept
# per-trip copies of a round's weights, and its checkpoint sat outside the block's remat
# policy, which JAX then ignores (remat=full kept everything). The 70B-width circular probe
# went from 22.6 to 14.3 GB. Circular now needs little beyond GPipe's terms and its
# regrouped copy (pipe_circular_weights 0.1, was 1.6 copies per loop trip); the circular
# held-out plan went from 1.165 to 1.094, the pipeline probes' worst is 7.2%.
# Refitted alone again (``--free pipeline``, 122 records: the small group and the remat and
# published-width records, all re-measured) after the 1F1B schedule moved to Megatron's
# program (``parallel.pipeline.stage_work``: per-layer saved inputs, per-stage head and
# embedding): pipe_1f1b_tables is new (0.78 of an fp32 embedding + head gradient set per
# device beside the accumulator), the others moved by <= 0.001; worst 8.1% over all.
# Known miss, not fitted: GPipe and circular at published widths with 8 or more layers per
# device are under-predicted (8 devices, 39B-class width, tensor 2-4: GPipe 0.87-0.98,
# circular 0.79; the 39B layout of benchmarks/pipeline_scale.py at full depth: GPipe
# 0.83-0.93, circular 0.81-0.85), while the probes (2-4 layers) and the held-out plans read
# within 10%. XLA's live-range dump shows weight-sized fp32 buffers of the stage in the
# loop's backward beyond the accumulated gradients; terms for them (a trip's stage gradients,
# a recomputed layer's working set) fitted 0.83 and 0 and left the W39 circular probes at
# 1.14 and 0.86, so they were not kept. GPipe picks the stage's layers inside each block
# now, like circular (27.1 -> 24.5 GiB on the first probe above: no hoisted weight forms
# with gradients accumulated in their form). The search picks GPipe at four points of
# benchmarks/planner_scale.py (1.7B-39B on 1024-3072 GPUs) and circular at one (175B on
# 3072: predicted 73.4 GiB, compiled 69.8 GiB at data 16 of 32, 1.052); 1F1B is costed
# within 8% (pipeline_scale.py).
# SwiGLU's backward keeps gate and up only (``models.llama.swiglu``, a
# custom VJP: autodiff of silu kept three more mlp-wide buffers). All probes re-measured
# (``--group small``, ``--group scale``; the remat records regenerated from them: one
# remat=none record moved, 0.983); ``layer_mlp`` refitted alone (5.005 -> 2.152: the three
# buffers), then the pipeline coefficients alone (``--free pipeline``: pipe_logits 0.974 ->
# 0.744, pipe_circular_weights 0.101 -> 0.13, pipe_1f1b_tables 0.782 -> 0.908); worst probe
# 9.0%. Freeing all layer_* counts moved layer_h to 0 and put qkv at 5.3 (the probes cannot
# tell the widths apart), and a full refit missed 4 held-out plans: neither kept.
# Interleaved pipelines (circular, 1F1B with v > 1) store the stacked layers in stage order
# (``parallel.pipeline.storage``): no regrouped copy and no all-to-all of the weights, so
# ``pipe_circular_weights`` (its way back) is gone. The small group re-measured and the
# 70B-width circular record with it (memory unchanged there, 1.00; its stage wire 6.9 ->
# 5.3 GB): with the other coefficients as they were, the pipeline probes read 0.917-1.041
# and the worst of all 122 records is 9.0%, as before; a ``--free pipeline`` refit moved
# pipe_logits to 0.817 and pipe_tables to 0.363 for no gain in the worst case: not kept.
# benchmarks/planner_validation.py --devices 8: 27 of 28 within 10%; over is llama-7b
# layers=4 fsdp=4 x context=2 remat=none (1.102: ring attention's saved set is the fitted
# dense-attention counts', which the non-negative ring_saved_qkv cannot lower).
# Read the layer counts as a sum: the probes vary q/k/v, h and mlp widths only partly
# independently, so XLA's fused buffers are shared out between them by the fit.
# remat=none on the CPU backend (2026-11-27): the Llama block is booked by definition
# (``terms.remat.saved_coefficients``: KEPT["none"], and ``cpu_scores`` 2 score sets, q·kᵀ and its
# softmax), plus one layer's attention backward live once (``layer_live_scores`` 3.25: the
# gradients of probabilities and scores, their product, a byte-per-score mask), both read
# off the buffer assignment of llama-7b (4 layers, fsdp 8, 8x2048 tokens per device). The
# fitted ``layer_*`` counts (now read by no Llama workload; GPT's own replace them) put the
# scores' bytes into the per-layer q/k/v count at seq 128 and over-booked the 7B pick
# (fsdp 64, 32 layers) by 24%: 502.1 -> 405.5 GiB against 403.5 compiled (1.005). The 68
# small remat=none probes measured again move by -8.3 to +9.6 points; worst 1.137 (was
# 1.041): fsdp 2 x tensor 4, seq 256, vocab 8192 at h 256, where the head's booked logits
# (36 MiB) and the attention backward's (13 MiB) add though XLA reuses one's buffers for
# the other (as at 7B); booking the larger of the two hides a chunked loss's fall
# (terms.model.attention_backward_bytes), so that probe is a known miss, not refitted.
# layers=1 at 7B width reads 1.21 (no layer loop: the one layer's temporaries overlap).
# benchmarks/planner_validation.py --devices 8: 28 of 28 within 10%, worst 7.0% (the ring
# attention row above: 1.102 -> 0.956). Not booked under 1F1B (terms.model). Under TeraPipe
# a score set is a slice's L/s queries against the whole sequence's keys, and each trip's
# causal mask is saved (terms.terapipe): data 2 x stage 4, s = 4 reads 1.034 (0.861 when
# the sets were booked as (L/s)² and the masks not at all).
# Stacked weights (2026-11-29): a block's fused products (q/k/v; gate/up) stack their
# weights inside the layer loop, and under remat=none the loop keeps that stacked copy for
# the backward pass, one per layer. GPT's block now rebuilds it there
# (``core.ops.stacked_matmul``; FLOPs and collectives unchanged), and its probes were
# re-measured with it. Llama's and GLaM's blocks still keep it: with it removed (measured,
# not kept) the 39B-width tensor 8 record (``REMAT_RECORDS``, 2 layers, one sequence)
# compiles to 7.396 GB, not 7.954, and benchmarks/planner_validation.py --devices 8's 16
# remat=none plans outside pipelines 2.0-6.5% smaller (the rest unchanged to the byte); the
# shared coefficients above, fitted with the copies in, then over-book those plans (ZeRO-2
# on data 4 x tensor 2: 1.035 -> 1.107; llama-small data 8 ZeRO-2 at seq 64: 1.047 ->
# 1.133), and no refit on the 88 small probes re-measured with the remat and published-width
# records kept both the counts read off buffer assignment (cpu_scores, layer_live_scores)
# and the held-out plans within 10%. Removing Llama's copy waits for that refit.
# Tried again with every small probe re-measured without the copies (88 probes, and the 39B
# record: 7.954 -> 7.396 GB): at 64 devices the plans fall 2-12% (ZeRO-2 on data 64: 81.2 ->
# 71.2 MB, 1.075 -> 1.226), and no refit holds both held-out sets: the full refit (all but
# the counted ones, fixed_bytes and the GPU-only layer_scores) reads 8.1% on the probes but
# 1.107-1.145 on the 7B plans and 0.683 on fsdp 64; update_live and grad_layers_live alone,
# 0.891-1.206 at 64 devices. The sum of parts over-books weight-heavy plans once the copies
# are gone: llama-small, 2 layers, seq 64, data 8 ZeRO-2 compiles to 60.4 MB, of which the
# weights, the state shard and one whole gradient are 52.9, while 15.6 more are booked beside
# them (activations 6.6, logits 4.7, gradient extras 3.8): what the forward keeps is mostly
# dead when the whole gradient exists, so the peak is a maximum over phases, not a sum; the
# copies hid that. The removal (the models' q/k/v and gate/up through ``ops.stacked_matmul``)
# waits for that model of the peak.
