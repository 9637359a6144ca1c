"""The ds_config keys ``train --deepspeed`` accounts for without a setting: notes and refusals.

Three tables, each a dotted key -> the reason, read by ``shardlib.interop.deepspeed``:

* ``NOTES``: keys that tune how DeepSpeed's runtime does something XLA decides by itself
  (bucket and prefetch sizes, overlap, contiguous buffers, persistence thresholds), only log,
  or that DeepSpeed itself ignores (misspellings in its own examples). Printed, nothing
  changes.
* ``DEFAULTS_ONLY``: keys accepted at DeepSpeed's default value and refused otherwise.
* ``NO_COUNTERPART``: features shardlib does not have. A config that turns one on is refused
  with the key and this reason. With NVMe offload (``NVME``) and the optimizers of
  ``WHY_NOT`` these are the only refusals a well-formed config meets
  (``DeepSpeedRefusal.unlisted`` is empty).
"""

from __future__ import annotations

XLA = "XLA fuses and schedules collectives"
PERSIST = "every weight is sharded; XLA's buffer assignment decides what stays live"
NOTES = {
    "steps_per_print": "shardlib logs every step (metrics=...)",
    "wall_clock_breakdown": "per-step times are in the metrics; profile_steps traces",
    "dump_state": "logging only",
    "zero_allow_untested_optimizer": "shardlib's ZeRO lays out any optimizer's state",
    "memory_breakpoint": "logging only",
    "communication_data_type": "collectives carry the compute dtype (or ZeRO++ codes)",
    "prescale_gradients": "where DeepSpeed divides fp16 gradients around the all-reduce; the "
    "mean is the same, XLA reduces it",
    "gradient_predivide_factor": "where DeepSpeed divides fp16 gradients around the "
    "all-reduce; the mean is the same, XLA reduces it",
    "flops_profiler": "shardlib prints MFU every step; `shardlib explain` counts the FLOPs",
    "autotuning": "DeepSpeed's autotuner is not run; `shardlib plan` searches layouts",
    "aio": "asynchronous NVMe I/O tuning",
    "comms_logger": "logging only; `shardlib explain` lists the collectives per mesh axis",
    "checkpoint": "DeepSpeed's checkpoint I/O options; shardlib's (orbax) restore onto any mesh",
    "zero_force_ds_cpu_optimizer": "the offloaded update is one XLA program",
    "zero_optimization.allgather_partitions": "XLA derives the gathers",
    "zero_optimization.allgather_bucket_size": XLA,
    "zero_optimization.overlap_comm": "XLA's scheduler overlaps communication",
    "zero_optimization.reduce_scatter": "XLA picks reduce-scatter or all-reduce",
    "zero_optimization.reduce_bucket_size": XLA,
    "zero_optimization.contiguous_gradients": "XLA allocates the gradient buffers",
    "zero_optimization.stage3_prefetch_bucket_size": "XLA schedules the weight gathers",
    "zero_optimization.stage3_param_persistence_threshold": PERSIST,
    "zero_optimization.stage3_model_persistence_threshold": PERSIST,
    "zero_optimization.stage3_max_live_parameters": "XLA's buffer assignment decides",
    "zero_optimization.stage3_max_reuse_distance": "XLA's buffer assignment decides",
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": "`shardlib export` "
    "writes full weights from any layout",
    "zero_optimization.stage3_gather_fp16_weights_on_model_save": "`shardlib export` "
    "writes full weights from any layout",
    "zero_optimization.sub_group_size": "the update is one fused XLA program",
    "zero_optimization.round_robin_gradients": "XLA schedules the reductions",
    "zero_optimization.elastic_checkpoint": "checkpoints restore onto any mesh",
    "zero_optimization.ignore_unused_parameters": "every parameter has a gradient",
    "zero_optimization.load_from_fp32_weights": "checkpoints hold fp32 master weights",
    "zero_optimization.cpu_offload_use_pin_memory": "host offload uses pinned memory",
    "zero_optimization.offload_optimizer.pin_memory": "host offload uses pinned memory",
    "zero_optimization.offload_param.pin_memory": "host offload uses pinned memory",
    "zero_optimization.offload_optimizer.buffer_count": "offload buffers: XLA's transfers",
    "zero_optimization.offload_optimizer.fast_init": "offload initialisation tuning",
    "zero_optimization.offload_param.buffer_count": "offload buffers: XLA's transfers",
    "zero_optimization.offload_param.buffer_size": "offload buffers: XLA's transfers",
    "zero_optimization.offload_param.max_in_cpu": "NVMe offload tuning",
    # misspellings in DeepSpeed's own examples: DeepSpeed (then) ignored unknown keys too
    "zero_optimization.stage3_param_persitance_threshold": "a misspelling DeepSpeed ignores "
    "(of stage3_param_persistence_threshold, itself tuning)",
    "zero_optimization.stage3_param_persitence_threshold": "a misspelling DeepSpeed ignores "
    "(of stage3_param_persistence_threshold, itself tuning)",
    "zero_optimization.comm_overlap": "a misspelling DeepSpeed ignores (of overlap_comm, "
    "itself tuning)",
    "activation_checkpointing.contiguous_memory_optimization": "XLA allocates the saved "
    "activations",
    "activation_checkpointing.number_checkpoints": "contiguous-buffer sizing; XLA allocates",
    "activation_checkpointing.synchronize_checkpoint_boundary": "a device synchronisation "
    "for profiling; XLA orders the program",
    "activation_checkpointing.profile": "timing logs; profile_steps traces",
    "fp16.fp16_master_weights_and_grads": "shardlib keeps fp32 master weights and gradients "
    "(DeepSpeed's option trades their precision for memory)",
    "optimizer.params.cuda_aware": "transport choice: XLA's collectives",
    "optimizer.params.comm_backend_name": "transport choice: XLA's collectives",
    "optimizer.params.torch_adam": "kernel choice: XLA compiles the update",
    "fp16.auto_cast": "the model casts to the compute dtype itself",
}
DEFAULTS_ONLY = {  # accepted at DeepSpeed's default value, refused otherwise
    "sparse_gradients": False,
    "fp16.consecutive_hysteresis": False,
    "optimizer.params.amsgrad": False,
    "zero_optimization.zero_quantized_nontrainable_weights": False,
}
NVME = (
    "NVMe offload of parameters alone (ZeRO-Infinity): shardlib keeps the weights' files "
    "next to the optimizer state's (parallel.offload.nvme_params under nvme_path); set "
    "offload_optimizer.device: nvme too, or use 'cpu'"
)
NVME_PARTITIONED = (
    "NVMe offload of parameters partitioned by ZeRO stage {stage} (ZeRO-Infinity's per-rank "
    "files): shardlib's NVMe tiers keep each tensor whole in one file on one process "
    "(zero=0); use stage 0 with offload_optimizer and offload_param on nvme, or 'cpu'"
)
NVME_DEFAULT_PATH = "/local_nvme"  # DeepSpeed's default nvme_path
NO_COUNTERPART = {
    "sparse_attention": "DeepSpeed's block-sparse attention kernels; shardlib's attention is "
    "dense (flash, ring or Ulysses); remove the section to train dense",
    "compression_training": "DeepSpeed Compression (XTC, ZeroQuant pruning and quantization)",
    "quantize_training": "MoQ quantization-aware training",
    "progressive_layer_drop": "progressive layer dropping",
    "curriculum_learning": "curriculum learning (sequence-length schedules)",
    "data_efficiency": "DeepSpeed's data sampling and routing library",
    "eigenvalue": "eigenvalue-based MoQ schedules",
    "elasticity": "DeepSpeed's elastic batch sizes (shardlib resumes onto any mesh instead)",
    "pipeline": "DeepSpeed's PipelineModule settings; use [parallel.pipeline]",
}
OPTIMIZERS = {"adam": "adam", "adamw": "adamw", "onebitadam": "onebit_adam", "lamb": "lamb",
              "onebitlamb": "onebit_lamb"}  # fmt: skip
WHY_NOT = {  # optimizer.type values with no counterpart, and why
    "zerooneadam": "0/1 Adam's local steps let workers' parameters drift apart, which "
    "shardlib's one-array-per-parameter state cannot hold (shardlib/train/onebit.py)",
}
SCHEDULERS_WHY_NOT: dict[str, str] = {}  # scheduler.type values with no counterpart (none)
LAMB_DEFAULTS = {"max_coeff": 10.0, "min_coeff": 0.01}
"""DeepSpeed's FusedLamb (and OnebitLamb) trust-ratio bounds when a config leaves them out."""
ONEBIT_LAMB_DEFAULTS = {"freeze_step": 100000, "coeff_beta": 0.9, "factor_max": 4.0,
                        "factor_min": 0.5, "factor_threshold": 0.1}  # fmt: skip
"""DeepSpeed's OnebitLamb settings beyond LAMB's when a config leaves them out."""
AUTO_SETTINGS = {
    "train_batch_size": ("dataset.batch",),
    "gradient_accumulation_steps": ("parallel.data.microbatches",),
    "gradient_clipping": ("optimizer.clip_norm",),
    "fp16.enabled": ("precision.compute",),
    "bf16.enabled": ("precision.compute",),
    "optimizer.params.lr": ("optimizer.lr",),
    "optimizer.params.betas": ("optimizer.b1", "optimizer.b2"),
    "optimizer.params.eps": ("optimizer.eps",),
    "optimizer.params.weight_decay": ("optimizer.weight_decay",),
    "scheduler.params.warmup_max_lr": ("optimizer.lr",),
    "scheduler.params.warmup_num_steps": ("optimizer.warmup",),
    "scheduler.params.total_num_steps": ("run.steps",),
}
"""Keys Hugging Face's Trainer fills in when they say ``"auto"``: left so, the settings they
map to stay shardlib's own (its defaults, or NAME=VALUE words)."""
AUTOTUNED = (
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "zero_optimization.stage",
)
"""Keys DeepSpeed's autotuner accepts a list of values to search for; shardlib takes the
first."""
