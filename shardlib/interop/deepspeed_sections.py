"""The sections of a ds_config that become training settings: precision, optimizer,
scheduler, activation checkpointing and the monitors (``shardlib.interop.deepspeed`` reads
the batch and ZeRO sections and composes these).

Each function takes the config reader (``deepspeed._Reader``), reads its keys through it so
that every key is accounted for, and returns dotted shardlib settings.
"""

from __future__ import annotations

from pathlib import PurePath
from typing import TYPE_CHECKING, Any

from shardlib.interop.deepspeed_keys import (
    LAMB_DEFAULTS,
    ONEBIT_LAMB_DEFAULTS,
    OPTIMIZERS,
    SCHEDULERS_WHY_NOT,
    WHY_NOT,
)

if TYPE_CHECKING:
    from shardlib.interop.deepspeed import _Reader as Reader

REMAT_OFFLOAD = "offload:attn_residual"
"""``cpu_checkpointing``: the residual stream inside each block goes to host memory (a name
the llama blocks tag, the moe model's dense blocks too)."""


def precision(r: Reader) -> dict[str, Any]:
    fp16 = bool(r.get("fp16.enabled", False))
    bf16 = bool(r.get("bf16.enabled", False) or r.get("bfloat16.enabled", False))
    if fp16 and bf16:
        r.refuse("bf16.enabled", "fp16 and bf16 both enabled; pick one")
    keys = ("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
            "min_loss_scale")  # fmt: skip
    if not fp16:
        for key in keys:
            r.get(f"fp16.{key}")  # inert while fp16 is off, as in DeepSpeed
        return {"precision.compute": "bf16" if bf16 else "fp32"}
    out = {"precision.compute": "fp16"}
    for key in keys:
        value = r.get(f"fp16.{key}")
        if value is not None:
            out[f"precision.{key}"] = value  # loss_scale: 0 dynamic, else static
    return out


def optimizer(r: Reader) -> dict[str, Any]:
    kind = r.get("optimizer.type")
    if kind is None:
        r.notes.append("optimizer: none given (DeepSpeed would use the script's); adamw")
        return {}
    name = OPTIMIZERS.get(str(kind).lower())
    if name is None:
        why = WHY_NOT.get(str(kind).lower())
        why = why or "use one of Adam, AdamW, OneBitAdam, Lamb, OneBitLamb"
        r.refuse("optimizer.type", f"{kind!r}: {why}", listed=str(kind).lower() in WHY_NOT)
        r.used.add("optimizer")  # its params mean nothing without it
        return {}
    p = lambda key, default=None: r.get(f"optimizer.params.{key}", default)  # noqa: E731
    wd = p("weight_decay", 0.0)
    if name == "adam" and wd and p("adam_w_mode", True):
        name = "adamw"  # DeepSpeed's Adam decouples weight decay unless adam_w_mode=false
    elif name == "adam" and wd:
        r.refuse("optimizer.params.adam_w_mode", "false (L2-in-gradient Adam) with decay")
    b1, b2 = p("betas", [0.9, 0.999])
    out = {"optimizer.name": name, "optimizer.b1": b1, "optimizer.b2": b2,
           "optimizer.weight_decay": wd, "optimizer.eps": p("eps", 1e-8)}  # fmt: skip
    if p("lr") is not None:
        out["optimizer.lr"] = p("lr")
    if name == "onebit_adam":
        out["optimizer.freeze_step"] = p("freeze_step", 100000)
    out["optimizer.bias_correction"] = p("bias_correction", True)
    if name == "onebit_lamb":
        for key, default in ONEBIT_LAMB_DEFAULTS.items():
            out[f"optimizer.{key}"] = p(key, default)
        if out["optimizer.bias_correction"]:  # DeepSpeed's OnebitLamb reads it, never applies it
            r.notes.append("optimizer.params.bias_correction: OnebitLamb uses the moments "
                           "uncorrected whatever it says; so does shardlib here")  # fmt: skip
        out["optimizer.bias_correction"] = False
    clip = p("max_grad_norm")  # apex FusedAdam's clipping, from before gradient_clipping
    if clip is not None and r.config.get("gradient_clipping") is None:
        out["optimizer.clip_norm"] = clip
        r.notes.append("optimizer.params.max_grad_norm: the global-norm clipping threshold")
    elif clip is not None:
        r.notes.append("optimizer.params.max_grad_norm: gradient_clipping clips instead")
    if name in ("lamb", "onebit_lamb"):  # DeepSpeed's LAMBs always bound the trust ratio
        out["optimizer.trust_ratio_max"] = p("max_coeff", LAMB_DEFAULTS["max_coeff"])
        out["optimizer.trust_ratio_min"] = p("min_coeff", LAMB_DEFAULTS["min_coeff"])
    return out


def scheduler(r: Reader) -> dict[str, Any]:
    kind = r.get("scheduler.type")
    if kind is None:
        return {"optimizer.schedule": "constant"}
    s = lambda key, default=None: r.get(f"scheduler.params.{key}", default)  # noqa: E731
    out = {"optimizer.warmup": s("warmup_num_steps", 1000),
           "optimizer.warmup_type": s("warmup_type", "log")}  # fmt: skip
    if kind in ("WarmupLR", "WarmupDecayLR"):
        if s("warmup_min_lr", 0.0):
            r.refuse("scheduler.params.warmup_min_lr", "warm-up starts at 0 in shardlib")
        out["optimizer.lr"] = s("warmup_max_lr", 0.001)
        out["optimizer.schedule"] = "warmup_linear"
        out["optimizer.min_lr_ratio"] = 1.0 if kind == "WarmupLR" else 0.0
        if kind == "WarmupDecayLR":
            out["run.steps"] = s("total_num_steps")
    elif kind == "WarmupCosineLR":
        if s("warmup_min_ratio", 0.0):
            r.refuse("scheduler.params.warmup_min_ratio", "warm-up starts at 0 in shardlib")
        out["optimizer.schedule"] = "warmup_cosine"
        out["optimizer.min_lr_ratio"] = s("cos_min_ratio", 0.0001)
        out["run.steps"] = s("total_num_steps")
    elif kind in ("OneCycle", "LRRangeTest"):
        out = cycle(r, kind)
    else:
        why = SCHEDULERS_WHY_NOT.get(kind)
        use = "use WarmupLR, WarmupDecayLR or WarmupCosineLR"
        r.refuse("scheduler.type", f"{kind!r}: {why or use}", listed=why is not None)
        r.used.add("scheduler")
    return {k: v for k, v in out.items() if v is not None}


def cycle(r: Reader, kind: str) -> dict[str, Any]:
    """DeepSpeed's OneCycle and LRRangeTest as shardlib's one_cycle and range_test schedules
    (``train/cycles.py``: the same rate at every step). OneCycle cycles Adam's beta1 too by
    default, and then sets beta2 to 0.99, as DeepSpeed does; its stair counts are stored but
    never read by DeepSpeed, so they are notes."""
    s = lambda key, default=None: r.get(f"scheduler.params.{key}", default)  # noqa: E731
    if kind == "LRRangeTest":
        return {"optimizer.schedule": "range_test",
                "optimizer.lr": s("lr_range_test_min_lr", 1e-3),
                "optimizer.interval_steps": s("lr_range_test_step_size", 2000),
                "optimizer.interval_rate": s("lr_range_test_step_rate", 1.0),
                "optimizer.staircase": s("lr_range_test_staircase", False)}  # fmt: skip
    lo, hi = s("cycle_min_lr"), s("cycle_max_lr")
    if lo is None or hi is None or not 0 <= lo <= hi or not hi:
        r.refuse("scheduler.params.cycle_max_lr", f"OneCycle needs 0 <= cycle_min_lr <= "
                 f"cycle_max_lr, cycle_max_lr > 0 (got {lo}, {hi})")  # fmt: skip
        return {}
    out = {"optimizer.schedule": "one_cycle", "optimizer.lr": hi, "optimizer.min_lr_ratio": lo / hi,
           "optimizer.warmup": s("cycle_first_step_size", 2000),
           "optimizer.cycle_down_steps": s("cycle_second_step_size", 0),
           "optimizer.interval_steps": s("decay_step_size", 0),
           "optimizer.interval_rate": s("decay_lr_rate", 0.0)}  # fmt: skip
    for key in ("cycle_first_stair_count", "cycle_second_stair_count"):
        if s(key) is not None:
            r.notes.append(f"scheduler.params.{key}: stored by DeepSpeed's OneCycle, never read")
    momentum = s("cycle_momentum", True)
    optimizer = str(r.get("optimizer.type", "adam")).lower()
    if momentum and optimizer not in ("adam", "adamw"):
        why = "true (the default) cycles beta1, which shardlib does with Adam and AdamW only"
        r.refuse("scheduler.params.cycle_momentum", f"{why}, not {optimizer}: set it to false")
    elif momentum:
        out.update({"optimizer.b1": s("cycle_max_mom", 0.9), "optimizer.b2": 0.99,
                    "optimizer.b1_min": s("cycle_min_mom", 0.8),
                    "optimizer.b1_decay_rate": s("decay_mom_rate", 0.0)})  # fmt: skip
    else:
        for key in ("cycle_min_mom", "cycle_max_mom", "decay_mom_rate"):
            s(key)  # read, unused without cycle_momentum (as in DeepSpeed)
    return out


def activation_checkpointing(r: Reader) -> dict[str, Any]:
    """DeepSpeed's checkpointing of each layer's input, partitioned and/or on the CPU."""
    section = "activation_checkpointing"
    partition = r.get(f"{section}.partition_activations", False)
    cpu = r.get(f"{section}.cpu_checkpointing", False)
    if cpu:
        r.notes.append(f"{section}.cpu_checkpointing: remat={REMAT_OFFLOAD} (each block's "
                       "residual stream in host memory, the rest recomputed)"
                       + ("; partition_activations applies under remat=full only" if partition
                          else ""))  # fmt: skip
        return {"parallel.remat.policy": REMAT_OFFLOAD}
    if partition:
        r.notes.append(f"{section}.partition_activations: remat=full, each block's saved "
                       "input split over the tensor axis where it is replicated "
                       "(partition_saved_inputs)")  # fmt: skip
        return {"parallel.remat.policy": "full"}
    return {}


def monitors(r: Reader) -> dict[str, Any]:
    """DeepSpeed's monitors as shardlib's metric writers (``[metrics]``)."""
    out: dict[str, Any] = {}
    for name, setting in (("tensorboard", "tensorboard"), ("csv_monitor", "jsonl")):
        on = r.get(f"{name}.enabled", False)
        path = str(PurePath(r.get(f"{name}.output_path", "") or ".",
                            r.get(f"{name}.job_name", "DeepSpeedJobName")))  # fmt: skip
        if on and setting == "jsonl":
            r.notes.append(f"csv_monitor: the same records as JSON lines, {path}.jsonl")
            path += ".jsonl"
        if on:
            out[f"metrics.{setting}"] = path
    if r.get("wandb.enabled", False):
        out["metrics.wandb"] = r.get("wandb.project", "deepspeed")
    for key in ("team", "group"):
        if r.get(f"wandb.{key}") is not None:
            r.notes.append(f"wandb.{key}: set WANDB_ENTITY / WANDB_RUN_GROUP in the environment")
    return out
