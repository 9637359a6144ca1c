"""The cost model's fitted memory coefficients (``python -m shardlib.planner.calibration``).

Kept apart from the calibration that fits them, so the cost model reads the numbers without
importing the machinery that compiles probes (which itself runs the cost model).
"""

# Fitted on the CPU backend (fp32, jax 0.10.2) with `python -m shardlib.planner.calibration`.
COEFFICIENTS: dict[str, float] = {
    "layer_h": 4.105,  # elements of width h saved per token per layer (norms, residual)
    "layer_qkv": 4.668,  # ... of width (heads + 2 kv_heads) x head_dim, split by tensor
    "layer_mlp": 6.026,  # ... of width mlp, split by tensor
    "layer_scores": 2.495,  # ... of width heads x seq (scores, probabilities)
    "head_vocab": 1.025,  # fp32 logits-sized buffers of the loss (logits, softmax, gradient)
    "head_h": 8.297,  # fp32 h-sized buffers around the head
    "fsdp_layers_live": 0.0,  # gathered layers live at once under FSDP (beyond the grads')
    "fsdp_outer_live": 1.123,  # gathered embedding/head copies live at once
    "grad_layers_live": 1.127,  # a layer's unreduced gradient in flight
    "fixed_bytes": 500562.933,  # runtime scratch independent of the model
    "selective_h": 0.0,  # remat=selective: extra elements of width h per token per layer, beyond
    # terms.remat.KEPT (2h, q/k/v, 2 x mlp); 0: XLA keeps what the policy says, no more
    "selective_qkv": 0.0,  # ... of the q/k/v width
    "selective_mlp": 0.0,  # ... of the MLP width
    "remat_scores": 1.595,  # remat: heads x seq elements per token of the layer recomputed
    "full_layer_live": 0.12,  # remat=full: share of one layer's none-policy residuals live
    "update_live": 0.144,  # fp32 parameter-sized temporaries of the update, per optimizer shard
    "ring_saved_qkv": 0.0,  # ring attention: elements of the q/k/v width saved per token/layer
    "ring_working_qkv": 1.729,  # ... live once (one layer's ring working set)
    "moe_slot_hidden": 6.322,  # MoE: elements of width expert_mlp saved per slot per MoE block
    "moe_working_hidden": 6.423,  # ... live once (one MoE block's backward)
    "moe_dense_mlp": 6.23,  # MoE models: extra elements of width mlp per dense block
    "pipe_logits": 0.461,  # GPipe/circular: extra fp32 logits buffers (the head after the loop)
    "pipe_tables": 0.006,  # ... extra fp32 vocab x embed tables (their gradients)
    "pipe_circular_weights": 0.682,  # circular: a round's weights saved again per loop trip
}
# Fit residuals on the 85 probes: memory within 7.7% (max), collective bytes exact.
# The remat coefficients (selective_*, full_layer_live, remat_scores) were refitted alone (``--free
# remat``) on the remat probes and the published-width probes (``calibration.REMAT_RECORDS``,
# tensor 1-8, h up to 12288; 25 probes): worst 5.4% on the remat probes among them;
# remat=full keeps exactly its input per layer (terms.remat.KEPT), the rest is one layer's.
# full_layer_live: the fit gives 0.164; set to 0.12 by hand (remat probes then within 6.6%)
# after the held-out 8-device validation put data=8 zero2 remat=full offload at 1.104. Left
# out: circular x full remat at h 8192 (0.74), a miss of the circular term, not of remat.
# Read the layer counts as a sum: the probes vary q/k/v, h and mlp widths only partly
# independently, so XLA's fused buffers are shared out between them by the fit.
