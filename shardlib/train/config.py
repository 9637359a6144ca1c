"""The training configuration: one nested, frozen section per concern.

``TrainConfig`` holds the model choice and the sections ``run``, ``metrics``, ``dataset``,
``optimizer``, ``precision``, ``checkpoint`` and ``parallel`` (the ``ParallelPlan``: mesh
and strategies). Every field is set on the command line as
``section.field=VALUE`` (``optimizer.lr=1e-3``, ``parallel.pipeline.schedule=1f1b``).
Three short forms are accepted, derived from the sections themselves rather than from a
table of aliases:

* a field name alone, when exactly one section has it (training sections before
  ``parallel``): ``steps=50``, ``lr=1e-3``, ``zero=1``;
* ``section_field`` for a field of a section: ``pipeline_schedule=1f1b``;
* a section name alone sets the section's first field: ``optimizer=lamb``,
  ``precision=bf16``, ``remat=full``, ``dataset=PATH``.

Settings renamed since users first typed them keep their old spelling as an alias
(``RENAMED``): ``data=PATH`` and ``data.batch=8`` still mean ``dataset.path`` and
``dataset.batch`` ("data" is now data parallelism only: the ``data`` mesh axis and its
``parallel.data`` section).

An ambiguous short form is refused with the full names to choose from.

Two families of settings are open-ended: ``model.NAME=VALUE`` (any field of the model's
config or keyword of its factory) and ``rules.NAME=AXIS,...`` (a logical name of the
model's own and the mesh axes it splits over: ``ParallelPlan.custom_names``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from shardlib.core.errors import ShardingError
from shardlib.core.values import replace_path
from shardlib.parallel.plan import ParallelPlan
from shardlib.train.optimizer_config import Optimizer


@dataclass(frozen=True)
class Run:
    """How long and from which seed."""

    steps: int = 100
    """Optimizer steps to run."""
    seed: int = 0
    """Seeds parameter initialisation and the data order."""
    compile_cache: str = "auto"
    """JAX's persistent compilation cache: auto (a per-user directory), off, or a directory.
    A restarted run loads its compiled step instead of compiling it again."""
    profile_steps: str = ""
    """START:END: a ``jax.profiler`` trace of these steps (1-based, both included; START >= 2,
    step 1 warms up); empty: no trace. Open it with TensorBoard's profile plugin or xprof."""
    profile_dir: str = "profiles"
    """Directory of the trace (``plugins/profile/<time>/*.xplane.pb`` below it)."""
    gpu_flags: bool = True
    """On GPUs, add shardlib's XLA performance flags (``shardlib.train.xla_flags``) to XLA_FLAGS;
    a flag already in XLA_FLAGS keeps the user's value."""

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ShardingError(f"config: run.steps={self.steps} must be >= 1. Fix: steps=100.")


@dataclass(frozen=True)
class Metrics:
    """Where each step's record goes; every writer that is set gets it
    (``shardlib.train.metrics``)."""

    jsonl: str | None = None
    """JSON-lines file, one record per step (``metrics=run.jsonl``)."""
    tensorboard: str | None = None
    """Directory of TensorBoard event files (``tensorboard --logdir DIR``)."""
    wandb: str | None = None
    """Weights & Biases project (``pip install wandb``); offline unless WANDB_MODE is set."""
    wandb_dir: str = "wandb"
    """Where W&B keeps its files (offline runs are synced later with ``wandb sync``)."""
    peak_flops: float = 0.0
    """One device's peak FLOP/s for MFU; 0: the table of known devices (measured on CPU)."""


@dataclass(frozen=True)
class Dataset:
    """What one step reads: the dataset, and how much of it per step."""

    path: str | None = None
    """A prepared dataset directory (``shardlib data prepare``: packed, masked, held-out
    split), a flat binary file of uint16 token ids, or None: the embedded stdlib corpus."""
    batch: int = 32
    """Global batch, in sequences, per optimizer step (all micro-batches together)."""
    seq: int = 128
    """Tokens per sequence fed to the model (each example reads seq + 1 tokens)."""
    mix: str = ""
    """Weighted mixture of prepared datasets, ``DIR:WEIGHT,DIR:WEIGHT`` (replaces ``path``);
    each step's documents are drawn from them in these proportions."""
    eval_every: int = 0
    """Evaluate on held-out data every this many steps and at the last step (0: never). The
    held-out data is a prepared dataset's eval split, or for the embedded corpus the stdlib
    source after the training bytes."""
    eval_batches: int = 4
    """Batches of held-out data per evaluation (the same ones every time)."""
    allow_changed: bool = False
    """Resume even though the data differs from what the checkpoint was trained on (size or
    sampled content); without it such a resume is refused."""

    def __post_init__(self) -> None:
        if self.eval_every < 0 or self.eval_batches < 1:
            raise ShardingError(
                f"config: dataset.eval_every={self.eval_every}, dataset.eval_batches="
                f"{self.eval_batches}: every must be >= 0 and batches >= 1. Fix: eval_every=50."
            )
        if self.batch < 1 or self.seq < 2:
            raise ShardingError(
                f"config: dataset.batch={self.batch}, dataset.seq={self.seq}: batch must be >= 1 "
                "and seq >= 2. Fix: e.g. batch=32 seq=128."
            )


@dataclass(frozen=True)
class Precision:
    """Compute dtype and fp16 loss scaling, dynamic or static (DeepSpeed's rules)."""

    compute: str = "fp32"
    """fp32, or bf16/fp16 with fp32 master weights (fp16: loss scaling), or fp8:
    bf16 with the blocks' projections in FP8 (e4m3 forward, e5m2 gradients, delayed
    scaling; ``shardlib.train.fp8``)."""
    loss_scale: float = 0.0
    """fp16: 0 scales dynamically (the settings below); a positive value is a static scale,
    used every step and never changed (DeepSpeed's ``fp16.loss_scale``)."""
    initial_scale_power: int = 16
    """fp16: the loss scale starts at 2**initial_scale_power (DeepSpeed's default 16)."""
    loss_scale_window: int = 1000
    """fp16: the scale doubles after this many consecutive steps without overflow."""
    hysteresis: int = 2
    """fp16: overflowing steps tolerated before the scale is halved (DeepSpeed's delayed shift)."""
    min_loss_scale: float = 1.0
    """fp16: an overflow at this scale (hysteresis spent) stops training with an error."""
    fp8_amax_history: int = 1024
    """fp8: steps of amax history per tensor; its maximum sets the next step's scale
    (delayed scaling; Transformer Engine's and MaxText's default 1024)."""

    def __post_init__(self) -> None:
        from shardlib.train.precision import check_precision

        check_precision(self)


@dataclass(frozen=True)
class Checkpoint:
    """Where and how often the run saves (orbax), and whether it resumes."""

    dir: str | None = None
    """Directory of this run's checkpoints, one sub-directory per step (None: none)."""
    every: int = 100
    """Save every this many steps; also at the end and on SIGTERM/SIGINT (0: only then)."""
    keep: int = 3
    """Checkpoints kept on disk, oldest deleted first (0: keep all)."""
    resume: str = "auto"
    """auto: continue from the latest complete checkpoint if any; require: fail without one;
    never: start fresh (and refuse a checkpoint dir that already holds checkpoints)."""
    local_dir: str | None = None
    """The fast-restart tier: a directory on this host's local storage (a local SSD), saved
    to every ``local_every`` steps and holding only the newest two; a resume takes the newest
    complete checkpoint of either tier (``shardlib.checkpoint.tiers``). With several processes
    each writes its whole copy into ``local_dir/process-<i>-of-<n>``. None: no local tier."""
    local_every: int = 10
    """Save to ``local_dir`` every this many steps (>= 1; steps the persistent tier saves
    are not saved twice)."""
    init_from: str | None = None
    """A fresh run starts from these parameters (fresh optimizer, step 0): a shardlib
    checkpoint_dir or a Hugging Face Llama directory (``shardlib.train.init_from``)."""


@dataclass(frozen=True)
class Lora:
    """LoRA fine-tuning: adapters on chosen projections, the base weights frozen."""

    rank: int = 0
    """Adapter rank (0: no adapters, every parameter trains)."""
    alpha: float = 16.0
    """The update is (alpha / rank) * A @ B."""
    targets: str = "q,v"
    """Comma-separated projections the model offers: q, k, v, o, gate, up, down (Llama
    family), q, k, v, o, fc, proj (GPT)."""

    def model_settings(self) -> dict:
        """The model config fields that build the adapters (none when rank is 0)."""
        if not self.rank:
            return {}
        targets = tuple(t.strip() for t in self.targets.split(",") if t.strip())
        return {"lora_rank": self.rank, "lora_alpha": self.alpha, "lora_targets": targets}


@dataclass(frozen=True)
class TrainConfig:
    """Everything a run needs: the model and one section per concern."""

    model: str = "llama-tiny"
    """A registered model name (``core.model.registered()``) or ``package.module:factory``."""
    model_overrides: tuple[tuple[str, Any], ...] = ()
    """Model settings given as ``model.NAME=VALUE`` (pairs: hashable)."""
    run: Run = field(default_factory=Run)
    metrics: Metrics = field(default_factory=Metrics)
    dataset: Dataset = field(default_factory=Dataset)
    optimizer: Optimizer = field(default_factory=Optimizer)
    precision: Precision = field(default_factory=Precision)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    lora: Lora = field(default_factory=Lora)
    parallel: ParallelPlan = field(default_factory=ParallelPlan)
    """The mesh and every parallelism strategy (``shardlib.parallel.plan``)."""

    @staticmethod
    def current_key(key: str) -> str:
        """A dotted setting under today's section names (``RENAMED``)."""
        return current_key(key)


def _sections(obj, prefix: str = "") -> dict[str, Any]:
    """``{"run": Run(), "parallel.pipeline": PipelineParallel(), ...}``: every nested section
    (the mesh is not a setting: it comes from ``--mesh``)."""
    out = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value) and f.name != "mesh":
            out[prefix + f.name] = value
            out.update(_sections(value, f"{prefix}{f.name}."))
    return out


def _leaves(section) -> list[str]:
    """A section's settings: its plain fields, less those set in a form of their own
    (``metadata["setting"]``: the plan's ``custom_names`` are ``rules.NAME=AXES``)."""
    fields = dataclasses.fields(section)
    return [
        f.name
        for f in fields
        if not dataclasses.is_dataclass(getattr(section, f.name)) and "setting" not in f.metadata
    ]


def _unique(candidates: list[str]) -> str | None:
    """The one candidate, preferring training sections over ``parallel``; else None."""
    train = [c for c in candidates if not c.startswith("parallel.")]
    pick = train or candidates
    return pick[0] if len(pick) == 1 else None


RENAMED = {"data": "dataset"}
"""Old section names -> new ones, for settings typed (and checkpoints recorded) before."""


def current_key(key: str) -> str:
    """``key`` with a renamed section's old name replaced (``data.batch`` -> ``dataset.batch``)."""
    head, dot, rest = key.partition(".")
    return RENAMED[head] + dot + rest if head in RENAMED else key


def canonical_key(key: str, cfg: TrainConfig) -> str:
    """The full dotted name a setting refers to (see the module docstring's short forms)."""
    key = current_key(key)
    sections = _sections(cfg)
    leaves = {f"{s}.{n}": (s, n) for s, sec in sections.items() for n in _leaves(sec)}
    if key in leaves or key == "model":
        return key
    short = [
        # a section alone: its first field
        [f"{s}.{_leaves(sec)[0]}" for s, sec in sections.items() if s.rpartition(".")[2] == key],
        # a field alone
        [full for full, (_, n) in leaves.items() if n == key],
        # section_field
        [full for full, (s, n) in leaves.items() if f"{s.rpartition('.')[2]}_{n}" == key],
    ]
    for candidates in short:
        if candidates:
            found = _unique(candidates)
            if found is None:
                raise ShardingError(
                    f"setting {key!r} is ambiguous. Fix: write one of {', '.join(candidates)}."
                )
            return found
    section = key.rpartition(".")[0]
    if section in sections:  # a known section, an unknown field: list that section's
        known = ", ".join(_leaves(sections[section]))
        raise ShardingError(f"config has no setting {key!r}. Fix: {section} has {known}.")
    raise ShardingError(
        f"config has no setting {key!r}. Settings: model, model.NAME, rules.NAME, "
        f"{', '.join(sorted(leaves))}."
    )


def override(cfg: TrainConfig, settings: Mapping[str, Any]) -> TrainConfig:
    """``cfg`` with settings applied; keys in any accepted form, values typed or strings.

    ``model.NAME`` keys collect into ``model_overrides`` (checked when the model is built);
    ``rules.NAME`` keys give a logical name of the model's own its mesh axes
    (``ParallelPlan.custom_names``).
    """
    model = dict(cfg.model_overrides)
    for key, value in settings.items():
        if key.startswith("model."):
            model[key.removeprefix("model.")] = value
            continue
        if key.startswith("rules."):
            name = key.removeprefix("rules.")
            if not name or "." in name:
                raise ShardingError(
                    f"setting {key!r}: rules.NAME takes one logical name. Fix: e.g. "
                    "rules.classes=tensor (or rules.classes= for replicated)."
                )
            parallel = cfg.parallel.with_names({name: value})
            cfg = dataclasses.replace(cfg, parallel=parallel)
            continue
        cfg = replace_path(cfg, canonical_key(key, cfg).split("."), value)
    return dataclasses.replace(cfg, model_overrides=tuple(model.items()))


def train_config(**settings) -> TrainConfig:
    """``train_config(steps=5, batch=8, model="llama-tiny")``: the Python form of the CLI."""
    return override(TrainConfig(), {k.replace("__", "."): v for k, v in settings.items()})


def parse_overrides(args: list[str], base: TrainConfig | None = None) -> TrainConfig:
    """``["steps=50", "model.layers=4"]`` -> TrainConfig (model fields are checked later)."""
    pairs = {}
    for arg in args:
        key, sep, value = arg.partition("=")
        if not sep or not key:
            raise ShardingError(f"override {arg!r} is not NAME=VALUE (e.g. steps=50).")
        pairs[key] = value
    return override(base or TrainConfig(), pairs)
