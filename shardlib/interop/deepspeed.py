"""A DeepSpeed ``ds_config.json`` as shardlib settings and a mesh (``train --deepspeed``).

Every key is accounted for, one of three ways:

* mapped to a setting (``train_batch_size`` -> ``dataset.batch``, ``zero_optimization.stage``
  -> ``zero``, ``optimizer`` -> ``optimizer.*``, ...);
* a *note*: a key that tunes how DeepSpeed's runtime does something XLA decides by itself
  (bucket sizes, overlap, contiguous buffers) or only logs; the note says so, and nothing
  changes;
* refused: a key or value shardlib cannot honour. All of them are named in one error, with
  the reason for each, before anything is built: nothing is silently ignored.

DeepSpeed's defaults differ from shardlib's in places, and the DeepSpeed meaning wins: no
``gradient_clipping`` means no clipping; no ``scheduler`` means a constant learning rate;
optimizer parameters left out take DeepSpeed's defaults (weight decay 0, betas 0.9/0.999).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardlib.core.errors import ShardingError
from shardlib.core.mesh import MESHES_DIR, load_mesh

# keys of DeepSpeed's runtime that XLA's compiler and scheduler take care of, or logging
NOTES = {
    "steps_per_print": "shardlib logs every step (metrics=...)",
    "wall_clock_breakdown": "per-step times are in the metrics; profile_steps traces",
    "dump_state": "logging only",
    "zero_allow_untested_optimizer": "shardlib's ZeRO lays out any optimizer's state",
    "memory_breakpoint": "logging only",
    "communication_data_type": "collectives carry the compute dtype (or ZeRO++ codes)",
    "zero_optimization.allgather_partitions": "XLA derives the gathers",
    "zero_optimization.allgather_bucket_size": "XLA fuses and schedules collectives",
    "zero_optimization.overlap_comm": "XLA's scheduler overlaps communication",
    "zero_optimization.reduce_scatter": "XLA picks reduce-scatter or all-reduce",
    "zero_optimization.reduce_bucket_size": "XLA fuses and schedules collectives",
    "zero_optimization.contiguous_gradients": "XLA allocates the gradient buffers",
    "zero_optimization.stage3_prefetch_bucket_size": "XLA schedules the weight gathers",
    "zero_optimization.stage3_param_persistence_threshold": "every weight is sharded",
    "zero_optimization.stage3_max_live_parameters": "XLA's buffer assignment decides",
    "zero_optimization.stage3_max_reuse_distance": "XLA's buffer assignment decides",
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": "`shardlib export` "
    "writes full weights from any layout",
    "zero_optimization.sub_group_size": "the update is one fused XLA program",
    "zero_optimization.round_robin_gradients": "XLA schedules the reductions",
    "zero_optimization.elastic_checkpoint": "checkpoints restore onto any mesh",
    "zero_optimization.ignore_unused_parameters": "every parameter has a gradient",
    "zero_optimization.offload_optimizer.pin_memory": "host offload uses pinned memory",
    "zero_optimization.offload_param.pin_memory": "host offload uses pinned memory",
    "optimizer.params.cuda_aware": "transport choice: XLA's collectives",
    "optimizer.params.comm_backend_name": "transport choice: XLA's collectives",
    "optimizer.params.torch_adam": "kernel choice: XLA compiles the update",
    "fp16.auto_cast": "the model casts to the compute dtype itself",
}
DEFAULTS_ONLY = {  # accepted at DeepSpeed's default value, refused otherwise
    "prescale_gradients": False,
    "gradient_predivide_factor": 1.0,
    "sparse_gradients": False,
    "fp16.consecutive_hysteresis": False,
    "optimizer.params.amsgrad": False,
    "zero_optimization.zero_quantized_nontrainable_weights": False,
}
OPTIMIZERS = {"adam": "adam", "adamw": "adamw", "onebitadam": "onebit_adam", "lamb": "lamb"}
WHY_NOT = {
    "zerooneadam": "0/1 Adam's local steps let workers' parameters drift apart, which "
    "shardlib's one-array-per-parameter state cannot hold (shardlib/train/onebit.py)",
    "onebitlamb": "1-bit LAMB is not implemented; OneBitAdam is",
}


@dataclass(frozen=True)
class DeepSpeedPlan:
    """What a ds_config means in shardlib: settings, mesh axes and notes."""

    settings: dict[str, Any]
    """Full dotted shardlib settings (``dataset.batch``, ``parallel.data.zero``, ...)."""
    mesh: dict[str, int]
    """Mesh axes, outer first: ``data`` (and ``fsdp`` for hpZ's nodes x devices per node)."""
    notes: tuple[str, ...]
    """Keys that need no counterpart, each with the reason."""

    def mesh_argument(self) -> str:
        """A preset in ``meshes/`` with exactly these axes, else a TOML to write."""
        for path in sorted(MESHES_DIR.glob("*.toml")):
            spec = load_mesh(path)
            if dict(spec.axes) == self.mesh and not spec.parallel and not spec.train:
                return path.stem
        return "mesh.toml  # with: [mesh] " + ", ".join(f"{a} = {n}" for a, n in self.mesh.items())

    def command(self) -> str:
        """The equivalent ``shardlib train`` command line."""
        words = [f"{k}={_word(v)}" for k, v in self.settings.items()]
        return f"shardlib train {' '.join(words)} --mesh {self.mesh_argument()}"


def _word(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


class _Reader:
    """Walks the config, recording what each key became; collects refusals."""

    def __init__(self, config: Mapping):
        self.config, self.refused, self.notes, self.used = config, [], [], set()

    def get(self, path: str, default: Any = None) -> Any:
        node: Any = self.config
        for part in path.split("."):
            if not isinstance(node, Mapping) or part not in node:
                return default
            node = node[part]
        self.used.add(path)
        if node == "auto":
            self.refused.append(f"{path}: 'auto' (a Hugging Face placeholder); give a value")
            return default
        return node

    def refuse(self, path: str, why: str) -> None:
        self.refused.append(f"{path}: {why}")

    def leftovers(self) -> None:
        """Every key neither read nor noted is refused; noted keys become notes."""

        def walk(node: Mapping, prefix: str) -> None:
            for key, value in node.items():
                path = prefix + key
                if path in NOTES:
                    self.notes.append(f"{path}: {NOTES[path]}")
                elif path in DEFAULTS_ONLY:
                    if value != DEFAULTS_ONLY[path]:
                        self.refuse(path, f"only {DEFAULTS_ONLY[path]!r} is supported")
                elif isinstance(value, Mapping) and path not in self.used:
                    walk(value, path + ".")
                elif path not in self.used and not any(u.startswith(path + ".") for u in self.used):
                    self.refuse(path, "not supported")

        walk(self.config, "")


def _batch(r: _Reader, devices: int, dp: int) -> dict[str, Any]:
    """DeepSpeed's identity train_batch_size = micro x accumulation x data-parallel size."""
    total = r.get("train_batch_size")
    micro = r.get("train_micro_batch_size_per_gpu")
    accum = r.get("gradient_accumulation_steps")
    given = {k: v for k, v in (("train_batch_size", total),
             ("train_micro_batch_size_per_gpu", micro),
             ("gradient_accumulation_steps", accum)) if v is not None}  # fmt: skip
    if not given:
        r.refuse("train_batch_size", "missing: give two of train_batch_size, "
                 "train_micro_batch_size_per_gpu, gradient_accumulation_steps")  # fmt: skip
        return {}
    if total is None:
        accum = accum or 1
        total = (micro or 1) * accum * dp
    elif micro is None:
        accum = accum or 1
        micro = total // (accum * dp)
    elif accum is None:
        accum = total // (micro * dp)
    if micro * accum * dp != total or min(micro, accum) < 1:
        named = ", ".join(f"{k}={v}" for k, v in given.items())
        r.refuse(
            "train_batch_size",
            f"{named} break DeepSpeed's identity train_batch_size = "
            f"train_micro_batch_size_per_gpu x gradient_accumulation_steps x data-parallel "
            f"size ({dp} of {devices} devices); e.g. train_batch_size="
            f"{max(micro, 1) * max(accum, 1) * dp}, or give two of the three",
        )
        return {}
    return {"dataset.batch": total, "parallel.data.microbatches": accum}


def _precision(r: _Reader) -> dict[str, Any]:
    fp16 = bool(r.get("fp16.enabled", False))
    bf16 = bool(r.get("bf16.enabled", False) or r.get("bfloat16.enabled", False))
    if fp16 and bf16:
        r.refuse("bf16.enabled", "fp16 and bf16 both enabled; pick one")
    if not fp16:
        for key in ("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
                    "min_loss_scale"):  # fmt: skip
            r.get(f"fp16.{key}")  # inert while fp16 is off, as in DeepSpeed
        return {"precision.compute": "bf16" if bf16 else "fp32"}
    out = {"precision.compute": "fp16"}
    if r.get("fp16.loss_scale", 0) != 0:
        r.refuse("fp16.loss_scale", "a static loss scale; shardlib scales dynamically (use 0)")
    for key in ("initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale"):
        value = r.get(f"fp16.{key}")
        if value is not None:
            out[f"precision.{key}"] = value
    return out


def _optimizer(r: _Reader) -> dict[str, Any]:
    kind = r.get("optimizer.type")
    if kind is None:
        r.notes.append("optimizer: none given (DeepSpeed would use the script's); adamw")
        return {}
    name = OPTIMIZERS.get(str(kind).lower())
    if name is None:
        why = WHY_NOT.get(str(kind).lower(), "use one of Adam, AdamW, OneBitAdam, Lamb")
        r.refuse("optimizer.type", f"{kind!r}: {why}")
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
    elif not p("bias_correction", True):
        r.refuse("optimizer.params.bias_correction", f"false with {kind} (always corrected)")
    for key in ("max_coeff", "min_coeff"):
        if p(key) is not None:
            r.refuse(f"optimizer.params.{key}", "optax's LAMB has no trust-ratio bounds")
    return out


def _scheduler(r: _Reader) -> dict[str, Any]:
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
    else:
        r.refuse("scheduler.type", f"{kind!r}: use WarmupLR, WarmupDecayLR or WarmupCosineLR")
        r.used.add("scheduler")
    return {k: v for k, v in out.items() if v is not None}


def _zero(r: _Reader, devices: int) -> tuple[dict[str, Any], dict[str, int]]:
    z = lambda key, default=None: r.get(f"zero_optimization.{key}", default)  # noqa: E731
    out: dict[str, Any] = {"parallel.data.zero": z("stage", 0)}
    for part, setting in (("offload_optimizer", "optimizer"), ("offload_param", "params")):
        device = z(f"{part}.device", "none")
        if device == "cpu":
            out[f"parallel.offload.{setting}"] = True
        elif device not in ("none", None):
            r.refuse(f"zero_optimization.{part}.device", f"{device!r}: only cpu or none")
    if z("cpu_offload", False):  # DeepSpeed's older spelling
        out["parallel.offload.optimizer"] = True
    if z("zero_quantized_weights", False):
        out["parallel.data.quantized_weights"] = True
    if z("zero_quantized_gradients", False):
        out["parallel.data.quantized_gradients"] = True
    hpz = int(z("zero_hpz_partition_size", 1))
    if hpz > 1:
        if devices % hpz or hpz == devices:
            r.refuse("zero_optimization.zero_hpz_partition_size",
                     f"{hpz} must divide the {devices} devices into 2 or more nodes")  # fmt: skip
            return out, {"data": devices}
        out["parallel.data.hpz"] = True
        return out, {"data": devices // hpz, "fsdp": hpz}
    return out, {"data": devices}


def from_deepspeed(config: Mapping, devices: int) -> DeepSpeedPlan:
    """Map a parsed ds_config to shardlib settings on ``devices`` devices (see the module)."""
    r = _Reader(config)
    zero, mesh = _zero(r, devices)
    settings = {**_batch(r, devices, devices), **zero}
    clip = r.get("gradient_clipping", 0.0)
    settings["optimizer.clip_norm"] = clip
    settings.update(_precision(r))
    opt = _optimizer(r)
    settings.update(opt)
    settings.update(_scheduler(r))
    r.leftovers()
    if r.refused:
        raise ShardingError(
            f"ds_config: {len(r.refused)} unsupported setting(s): "
            + "; ".join(r.refused)
            + ". Fix: remove or change them (shardlib README, 'DeepSpeed users')."
        )
    return DeepSpeedPlan(settings=settings, mesh=mesh, notes=tuple(r.notes))


def load_deepspeed(path: str | Path, devices: int) -> DeepSpeedPlan:
    """Read and map a ds_config.json file."""
    try:
        config = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ShardingError(f"ds_config {path}: {err}. Fix: a readable JSON file.") from err
    if not isinstance(config, Mapping):
        raise ShardingError(f"ds_config {path}: not a JSON object.")
    return from_deepspeed(config, devices)
