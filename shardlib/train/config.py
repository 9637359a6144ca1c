"""The training configuration and its ``key=value`` command-line overrides."""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass
from typing import Any

from shardlib.errors import ShardingError


@dataclass(frozen=True)
class TrainConfig:
    """Everything a run needs besides the mesh. Every field can be set as ``NAME=VALUE``."""

    model: str = "llama-tiny"
    """Model preset name (see ``models.presets()``)."""
    model_overrides: tuple[tuple[str, Any], ...] = ()
    """Model fields set on the command line as ``model.NAME=VALUE`` (pairs: hashable)."""
    steps: int = 100
    """Optimizer steps to run."""
    batch: int = 32
    """Global batch, in sequences, per optimizer step (all micro-batches together)."""
    seq: int = 128
    """Tokens per sequence fed to the model (each example reads seq + 1 tokens)."""
    microbatches: int = 1
    """Gradient accumulation: the batch is split into this many sequential micro-batches."""
    lr: float = 3e-3
    """Peak learning rate."""
    warmup: int = 10
    """Linear warm-up steps before the cosine decay."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of ``lr``."""
    weight_decay: float = 0.1
    """Decoupled weight decay (AdamW); norms and biases are exempt."""
    b1: float = 0.9
    """Adam beta1."""
    b2: float = 0.95
    """Adam beta2."""
    clip_norm: float = 1.0
    """Global gradient-norm clipping threshold (0 disables it)."""
    precision: str = "fp32"
    """Compute precision: fp32, or bf16/fp16 with fp32 master weights (fp16: loss scaling)."""
    seed: int = 0
    """Seeds parameter initialisation and the data order."""
    data: str | None = None
    """Flat binary file of uint16 token ids; None = the embedded stdlib-source corpus."""
    metrics: str | None = None
    """Path of a JSON-lines file with one record per step."""
    # --- issue 3: ZeRO stages, optimizer offload, optimizers by name, fp16 loss scaling ---
    zero: int = 0
    """ZeRO stage over the ``data`` axis: 0 replicated, 1 + optimizer state sharded,
    2 + gradients sharded, 3 + parameters sharded (FSDP). An ``fsdp`` axis is always ZeRO-3."""
    offload_optimizer: bool = False
    """Keep optimizer state in pinned host memory between steps (ZeRO-Offload)."""
    optimizer: str = "adamw"
    """adamw, adam, sgd (momentum), lamb, lars or adafactor (all from optax)."""
    schedule: str = "warmup_cosine"
    """Learning-rate schedule: constant, warmup_cosine, warmup_linear or inverse_sqrt."""
    momentum: float = 0.9
    """Momentum of sgd and lars."""
    factored_min_dim: int = 128
    """Adafactor factors a weight's second moment when its two largest dims are >= this."""
    initial_scale_power: int = 16
    """fp16: the loss scale starts at 2**initial_scale_power (DeepSpeed's default 16)."""
    loss_scale_window: int = 1000
    """fp16: the scale doubles after this many consecutive steps without overflow."""
    hysteresis: int = 2
    """fp16: overflowing steps tolerated before the scale is halved (DeepSpeed's delayed shift)."""
    min_loss_scale: float = 1.0
    """fp16: an overflow at this scale (hysteresis spent) stops training with an error."""
    # --- issue 6: pipeline parallelism and rematerialisation ---
    pipeline_schedule: str = "gpipe"
    """gpipe | circular | bounded (1F1B-like); used when the mesh has a stage axis > 1."""
    pipeline_microbatches: int = 0
    """Micro-batches streamed through the pipeline per batch; 0 = one per stage."""
    virtual_stages: int = 1
    """Circular schedule: layer groups per device (v); the bubble falls to (p-1)/(m·v)."""
    remat: str = "none"
    """Per-layer rematerialisation: none | full | dots | selective | names:<a,b> | offload:<a,b>."""
    offload_params: bool = False
    """Keep the stacked block weights in pinned_host memory; fetch one layer at a time."""
    # --- issue 4: sequence, context and memory-efficient attention ---
    sequence_parallel: bool = False
    """Megatron-SP: split the residual stream's tokens over the tensor axis."""
    attention: str = "ring"
    """Attention across a ``context`` mesh axis: ring | all_to_all | all_gather."""
    attention_impl: str = "dense"
    """Attention on each device: dense | chunked (online softmax) | cudnn (GPU only)."""
    attention_chunk: int = 512
    """Query/key block length of chunked attention (and of ring attention's inner blocks)."""
    load_balance: bool = True
    """Ring/all-gather attention: zig-zag token order so causal work is equal per device."""
    # --- issue 7: checkpoints, resume and preemption ---
    checkpoint_dir: str | None = None
    """Directory of this run's checkpoints, one sub-directory per step (None: none)."""
    checkpoint_every: int = 100
    """Save every this many steps; also at the end and on SIGTERM/SIGINT (0: only then)."""
    keep: int = 3
    """Checkpoints kept on disk, oldest deleted first (0: keep all)."""
    resume: str = "auto"
    """auto: continue from the latest complete checkpoint if any; require: fail without one;
    never: start fresh (and refuse a checkpoint_dir that already holds checkpoints)."""

    def __post_init__(self) -> None:
        if self.precision not in ("fp32", "bf16", "fp16"):
            raise ShardingError(f"config: precision={self.precision!r}; use fp32, bf16 or fp16.")
        if self.steps < 1 or self.batch < 1 or self.seq < 2 or self.microbatches < 1:
            raise ShardingError("config: steps, batch, microbatches must be >= 1 and seq >= 2.")
        if self.batch % self.microbatches:
            raise ShardingError(
                f"config: batch={self.batch} is not divisible by microbatches="
                f"{self.microbatches}. Fix: choose a batch that is a multiple of microbatches."
            )
        from shardlib.train.optim import check_names  # issue 3

        check_names(self)
        if self.precision == "fp16" and self.pipeline_schedule == "bounded":
            raise ShardingError(
                "config: precision=fp16 with pipeline_schedule=bounded: the bounded schedule "
                "computes its own gradients and does not apply the loss scale. Fix: use "
                "precision=bf16, or pipeline_schedule=gpipe or circular."
            )

    @property
    def microbatch(self) -> int:
        return self.batch // self.microbatches


def _convert(name: str, raw: str, annotation: Any) -> Any:
    """Turn a command-line string into the field's type (int, float, bool, str, optional)."""
    if isinstance(annotation, str):
        annotation = eval(annotation, vars(typing) | {"Any": Any})  # noqa: S307 - our own hints
    origin = typing.get_origin(annotation)
    if origin in (types.UnionType, typing.Union):
        if raw.lower() in ("none", "null", ""):
            return None
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
    try:
        if annotation is bool:
            if raw.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(raw)
            return raw.lower() in ("true", "1", "yes")
        if annotation in (int, float, str):
            return annotation(raw)
    except ValueError:
        raise ShardingError(
            f"override {name}={raw!r}: expected {annotation.__name__}. Fix: e.g. {name}=1."
        ) from None
    return raw


def field_types(cls) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def apply_overrides(obj, pairs: dict[str, str], what: str):
    """``dataclasses.replace`` with string values converted to each field's type."""
    types_ = field_types(type(obj))
    typed = {}
    for key, raw in pairs.items():
        if key not in types_:
            raise ShardingError(
                f"{what} has no setting {key!r}. Settings: {', '.join(sorted(types_))}."
            )
        typed[key] = _convert(key, raw, types_[key]) if isinstance(raw, str) else raw
    return dataclasses.replace(obj, **typed)


def parse_overrides(args: list[str], base: TrainConfig | None = None) -> TrainConfig:
    """``["steps=50", "model.layers=4"]`` -> TrainConfig (model fields are checked later)."""
    top: dict[str, str] = {}
    model: dict[str, str] = dict(base.model_overrides) if base else {}
    for arg in args:
        key, sep, value = arg.partition("=")
        if not sep or not key:
            raise ShardingError(f"override {arg!r} is not NAME=VALUE (e.g. steps=50).")
        if key.startswith("model."):
            model[key.removeprefix("model.")] = value
        else:
            top[key] = value
    cfg = apply_overrides(base or TrainConfig(), top, "train config")
    return dataclasses.replace(cfg, model_overrides=tuple(model.items()))
