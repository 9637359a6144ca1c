"""``ParallelPlan``: one description of a parallel layout, shared by trainer, planner and CLI.

A plan is the mesh (named axes and sizes) plus one section per strategy. A mesh axis
switches its strategy on (``fsdp`` -> FSDP, ``tensor`` -> Megatron, ...); a section holds
that strategy's knobs. The plan alone yields the rules, runs every strategy's own checks
and hands the trainer its layer loop (``parallel.layer_loop``) and its one gradient path
(``parallel.gradients``). A mesh TOML carries it as ``[mesh]`` plus ``[parallel.<section>]``
tables, read straight into the sections' fields; ``shardlib plan`` writes the same tables.

The composition order of the rules is written once, in ``rules``.

A section is a frozen dataclass in its strategy's module (``shardlib/parallel/``) that
declares what it brings, so nothing else has to list it:

* ``axes`` (class attribute): the mesh axis names it switches on, each with what it does.
  The plan accepts a mesh whose axes are all declared by some section, and nothing else;
* ``logical_names`` (class attribute): names it adds to the models' vocabulary
  (``rules.LOGICAL_NAMES``), replicated unless a rule splits them;
* ``rules(mesh_axes) -> list[Rules]`` for the axes present; optional ``refine(rules)``
  derives entries from the composed table; optional ``check(mesh_axes, rules, workload)``
  holds the strategy's refusals (``workload``: the model and step, ``core.workload``).

Adding a strategy is its module, one field here (and its place in ``rules``' order), an
op in ``shardlib.core.ops`` if the model has to call one, and one planner term.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from shardlib.core.errors import ShardingError
from shardlib.core.mesh import MESHES_DIR, Axis, MeshSpec, load_mesh
from shardlib.core.ops import use_ops
from shardlib.core.resolve import Indivisible, divides
from shardlib.core.rules import Rules, base_rules, compose
from shardlib.core.values import replace_path
from shardlib.core.workload import Workload
from shardlib.parallel import gradients
from shardlib.parallel.context import ContextParallel, choice
from shardlib.parallel.context.choice import AttentionChoice, Device
from shardlib.parallel.data import DataParallel
from shardlib.parallel.expert import ExpertParallel
from shardlib.parallel.fsdp import vocab_parallel_pays
from shardlib.parallel.layer_loop import layer_loop
from shardlib.parallel.loss import LossChunks
from shardlib.parallel.names import axes_of, rules_table, with_custom_names
from shardlib.parallel.offload import Offload
from shardlib.parallel.pipeline.gpipe import PipelineParallel
from shardlib.parallel.remat import Remat
from shardlib.parallel.tensor import TensorParallel
from shardlib.parallel.zero import StateRules, zero


@dataclass(frozen=True)
class ParallelPlan:
    """The mesh and every parallelism strategy's settings."""

    mesh: MeshSpec = field(default_factory=lambda: MeshSpec((("data", -1),)))
    """Named mesh axes, outermost first (``-1``: the devices that are left)."""
    data: DataParallel = field(default_factory=DataParallel)
    """``data`` and ``fsdp`` axes: batch split; ZeRO stage over ``data``."""
    tensor: TensorParallel = field(default_factory=TensorParallel)
    """``tensor`` (+ ``tensor2``, ``tensor3`` or ``tensor_depth``) axes: Megatron 1D/2D/3D,
    2.5D (Tesseract), sequence parallel."""
    context: ContextParallel = field(default_factory=ContextParallel)
    """``context`` axis: sequence split and the attention kernel."""
    expert: ExpertParallel = field(default_factory=ExpertParallel)
    """``expert`` axis: experts split and the token exchange."""
    pipeline: PipelineParallel = field(default_factory=PipelineParallel)
    """``stage`` axis: pipeline schedule and micro-batches."""
    remat: Remat = field(default_factory=Remat)
    """Per-block rematerialisation policy."""
    offload: Offload = field(default_factory=Offload)
    """Optimizer state or block weights in host memory."""
    loss: LossChunks = field(default_factory=LossChunks)
    """The LM head and loss in slices of the sequence (no whole fp32 logits)."""
    custom_names: tuple[tuple[str, tuple[str, ...]], ...] = field(
        default=(), metadata={"setting": "rules.NAME"}
    )
    """The model's own logical names (``classes``) -> mesh axes, in both tables (no strategy
    knows them; ``parallel.names``): ``[rules]`` in a mesh file, ``rules.NAME=AXIS,...``."""

    def __post_init__(self) -> None:
        names = tuple((str(n), axes_of(n, a)) for n, a in dict(self.custom_names).items())
        object.__setattr__(self, "custom_names", names)
        known = self.known_axes()
        unknown = [n for n, _ in self.mesh.axes if n not in known]
        if unknown:
            listed = "; ".join(f"{a} ({what})" for a, what in known.items())
            raise ShardingError(
                f"mesh {self.mesh.source}: unknown mesh axis {unknown[0]!r}; no strategy "
                f"switches on with it. Fix: use one of {listed}."
            )

    @property
    def sections(self) -> tuple:
        return tuple(getattr(self, name) for name in _section_names())

    @classmethod
    def known_axes(cls) -> dict[str, str]:
        """Every mesh axis a section declares, with what it does (``axes``)."""
        return _declared("axes")

    @classmethod
    def logical_names(cls) -> tuple[str, ...]:
        """Logical names the sections add to the models' vocabulary (``logical_names``)."""
        return tuple(_declared("logical_names"))

    @cached_property
    def mesh_axes(self) -> dict[str, int]:
        """Axis sizes; a ``-1`` axis must have been resolved (``with_devices``) first."""
        sizes = dict(self.mesh.axes)
        if -1 in sizes.values():
            raise ShardingError(
                f"mesh {self.mesh.source}: an axis is -1 until the plan meets its devices. "
                "Fix: call plan.with_devices(n) (or build the mesh) first."
            )
        return sizes

    def with_devices(self, num_devices: int) -> ParallelPlan:
        """The plan with ``-1`` resolved against ``num_devices`` (and the product checked)."""
        sizes = self.mesh.sizes(num_devices)
        mesh = dataclasses.replace(self.mesh, axes=tuple(sizes.items()))
        return dataclasses.replace(self, mesh=mesh)

    def with_mesh_axes(self, axes: Mapping[str, int]) -> ParallelPlan:
        """The same strategy settings on other axis sizes (a built mesh's, say)."""
        mesh = dataclasses.replace(self.mesh, axes=tuple(axes.items()))
        return dataclasses.replace(self, mesh=mesh)

    def build_mesh(self, devices: list | None = None):
        """A ``jax.sharding.Mesh`` with Auto axes over ``devices`` (default: all)."""
        return self.mesh.build(devices)

    # --- rules ---------------------------------------------------------------------------
    @cached_property
    def rules(self) -> Rules:
        """Parameter and activation rules of every strategy the mesh switches on.

        Order matters only for names two strategies both split: the activation ``batch``
        takes the mesh axes in the order given here, which is the mesh's outer-to-inner
        order of the axes that split it (stage, data, fsdp, ..., expert). Context comes
        before tensor so that ``res_seq`` splits over (context, tensor) with sequence
        parallelism; expert comes last because GShard folds it innermost into the batch.
        """
        axes = self.mesh_axes
        order = (self.pipeline, self.data, self.context, self.tensor, self.expert)
        parts = [base_rules(self.logical_names())]
        for section in order:
            parts += section.rules(axes)
        rules = compose(*parts)
        for section in order:
            refine = getattr(section, "refine", None)
            rules = refine(rules) if refine is not None else rules
        rules = with_custom_names(rules, self.custom_names)  # the model's own, last
        rules.check_mesh(axes, where="plan")
        return rules

    def with_names(self, table: Mapping[str, Any]) -> ParallelPlan:
        """This plan knowing more of the model's own logical names: ``{"classes": "tensor",
        "patches": ()}`` (an axis, axes, ``"fsdp,tensor"``, or empty/``none``: replicated).
        A name given again takes the new axes."""
        merged = {**dict(self.custom_names), **table}
        return dataclasses.replace(self, custom_names=tuple(merged.items()))

    @cached_property
    def state_rules(self) -> StateRules:
        """Rules per role of the training state (parameters, gradients, optimizer state)."""
        return zero(self.rules, stage=self.data.zero, mesh_axes=self.mesh_axes)

    def for_workload(self, workload: Workload, device: Device | None = None) -> ParallelPlan:
        """The plan for this model: what depends on its shapes (uneven pipeline stages,
        whether FSDP's head runs vocab-parallel: ``parallel.fsdp.vocab_parallel_pays``) and
        on the devices (``attention_impl=auto``: ``parallel.context.choice``; ``device``
        defaults to the local one)."""
        pipeline = self.pipeline.for_layers(workload.blocks, self.mesh_axes)
        data = self.data
        if data.vocab_parallel and not self._vocab_parallel_pays(workload):
            data = dataclasses.replace(data, vocab_parallel=False)
        context = self.with_attention(self.attention_choice(workload, device)).context
        if (pipeline, data, context) == (self.pipeline, self.data, self.context):
            return self
        return dataclasses.replace(self, pipeline=pipeline, data=data, context=context)

    def attention_choice(self, workload: Workload, device: Device | None = None) -> AttentionChoice:
        """Which attention kernel this plan runs for ``workload`` and why."""
        device = choice.local_device() if device is None else device
        return self.context.choose(self.mesh_axes, self.rules, workload, device)

    def with_attention(self, picked: AttentionChoice) -> ParallelPlan:
        """This plan with ``attention_impl=auto`` replaced by ``picked``'s kernel (an explicit
        kernel stays as set)."""
        if self.context.attention_impl != "auto":
            return self
        context = dataclasses.replace(self.context, attention_impl=picked.impl)
        return dataclasses.replace(self, context=context)

    def _vocab_parallel_pays(self, workload: Workload) -> bool:
        """Under a pipeline, never: the head runs outside the stage loop on the whole data
        shard, where the vocab-split tables cost more memory than they save (fsdp 2 x
        stage 4, llama-small: +33 MiB per device, jax 0.10.2, CPU), and the planner costs
        whole-table gathers there (``planner.cost.terms.fsdp.vocab_tables``). Under
        ZeRO++, never: its quantized gathers need every parameter's data and fsdp splits on
        one dim, and ZeRO never splits vocab over data (``parallel.zero``)."""
        axes = self.mesh_axes
        if axes.get(Axis.FSDP, 1) <= 1 or "vocab" not in workload.dims:
            return True  # nothing to decide (no fsdp axis, or a model without vocab)
        if axes.get(Axis.STAGE, 1) > 1 or self.data.zeropp:
            return False
        others = math.prod(axes[a] for a in self.rules.activations["batch"] if a != Axis.FSDP)
        tensor = math.prod(axes[a] for a in self.rules.params["vocab"] if a != Axis.FSDP)
        tokens = workload.global_batch * workload.seq // max(others, 1)
        return vocab_parallel_pays(tokens, workload.dims["vocab"], axes[Axis.FSDP], tensor)

    # --- checks ----------------------------------------------------------------------------
    def check(self, workload: Workload) -> None:
        """Every strategy's own refusals, before anything is compiled or allocated."""
        rules, axes = self.state_rules.params, self.mesh_axes
        with suggest_presets(batch=workload.micro_batch):
            for section in self.sections:
                check = getattr(section, "check", None)
                if check is not None:
                    check(axes, rules, workload)
        gradients.check(self)  # what spans sections: 1-bit momentum's plain data parallelism

    # --- what the trainer runs ---------------------------------------------------------------
    def ops(self):
        """Context manager: the model's ops (``shardlib.core.ops``) take this plan's forms,
        each given by the section that owns it (``section.ops(mesh_axes)``: context
        parallelism's attention, expert parallelism's exchange)."""
        forms = {}
        for section in self.sections:
            if hasattr(section, "ops"):
                forms.update(section.ops(self.mesh_axes))
        return use_ops(**forms)

    def split_tokens(self, tokens_BL1):
        """(inputs, targets, positions) of a [b, seq + 1] batch in the order the model sees
        (context parallelism's zig-zag order; positions None for the natural order)."""
        return self.context.split_tokens(tokens_BL1, self.mesh_axes)

    def check_packed(self) -> None:
        """Refuse packed rows (document masks) where attention cannot keep them apart."""
        self.context.check_packed(self.mesh_axes)

    def layer_loop(self, workload: Workload, dtype):
        """``layers(block_fn, blocks_state, carry)``: how the model's stacked blocks run
        (remat policy, GPipe/circular pipeline, per-layer fetch of offloaded weights)."""
        return layer_loop(self, workload, dtype)

    def value_and_grad(
        self, loss_fn, layout: gradients.StepLayout, *, has_aux=False, loss_scale=None
    ):
        """``(params, batch) -> (loss, grads)`` of the trainer's loss on this layout, averaged
        over ``data.microbatches``: plain, 1-bit momentum's per-device, ZeRO++'s or the
        1F1B schedule's, one path for all (``parallel.gradients``)."""
        return gradients.value_and_grad(
            self, loss_fn, layout, has_aux=has_aux, loss_scale=loss_scale
        )

    def pipeline_spec(self):
        """The pipeline on this mesh (None without a ``stage`` axis of size > 1)."""
        return self.pipeline.spec(self.mesh_axes)

    # --- TOML ---------------------------------------------------------------------------------
    @classmethod
    def from_mesh_spec(cls, spec: MeshSpec) -> ParallelPlan:
        """A mesh file's ``[mesh]`` and ``[parallel.*]`` tables as a plan."""
        plan = cls(mesh=spec).with_names(rules_table(spec.rules, f"mesh {spec.source}"))
        for name, table in spec.parallel.items():
            if name not in _section_names():
                raise ShardingError(
                    f"mesh {spec.source}: unknown table [parallel.{name}]. Fix: use one of "
                    f"{', '.join(_section_names())}."
                )
            if not isinstance(table, Mapping):
                raise ShardingError(
                    f"mesh {spec.source}: parallel.{name} must be a table of settings."
                )
            for key, value in table.items():
                plan = replace_path(plan, [name, key], value, where=f"mesh {spec.source}")
        return plan

    def tables(self) -> dict[str, dict[str, Any]]:
        """The ``[parallel.*]`` settings that differ from the defaults (what a file needs)."""
        out = {}
        for name in _section_names():
            have, default = getattr(self, name), type(getattr(self, name))()
            diff = {
                f.name: getattr(have, f.name)
                for f in dataclasses.fields(have)
                if getattr(have, f.name) != getattr(default, f.name)
            }
            if diff:
                out[name] = diff
        return out

    def describe(self) -> str:
        """``stage=2 x fsdp=2 x tensor=2; pipeline.schedule=1f1b`` (one line)."""
        shape = " x ".join(f"{n}={s}" for n, s in self.mesh.axes)
        knobs = [f"{s}.{k}={v}" for s, t in self.tables().items() for k, v in t.items()]
        knobs += [f"rules.{n}={','.join(a) or 'none'}" for n, a in self.custom_names]
        return "; ".join([shape, *knobs]) if knobs else shape


def _section_names() -> tuple[str, ...]:
    """The strategy sections: every field but the mesh and the model's own names."""
    return tuple(
        f.name for f in dataclasses.fields(ParallelPlan) if f.name not in ("mesh", "custom_names")
    )


@functools.cache
def _declared(attribute: str) -> dict[str, str]:
    """The union of one declared class attribute over the section types, in field order."""
    hints = typing.get_type_hints(ParallelPlan)
    out: dict[str, str] = {}
    for name in _section_names():
        for key, what in getattr(hints[name], attribute).items():
            out[str(key)] = what
    return out


def presets_that_fit(fail: Indivisible, batch: int | None = None) -> list[str]:
    """Mesh presets of the same device count on which the failing tensor, and the batch,
    divide, judged by each preset's own plan and rules.

    Matching the preset's axis *names* against the failing rule is not enough: with batch=3,
    ``cpu-8-fsdp`` has no ``data`` axis but splits the batch 8 ways over ``fsdp``. ``batch``
    (one micro-batch, where known) must divide too, so a preset that mends a weight but
    breaks the batch is not offered, and two presets never send the user back and forth.
    """
    fits = []
    for path in sorted(Path(MESHES_DIR).glob("*.toml")):
        try:
            spec = load_mesh(path)
            if spec.fixed_size != fail.devices:
                continue
            plan = ParallelPlan.from_mesh_spec(spec)
            rules, axes = plan.state_rules.params, plan.mesh_axes
        except (ShardingError, OSError, ValueError, TypeError):
            continue
        if not divides(fail.shape, fail.names, rules.table(fail.kind), axes):
            continue
        if batch is not None and not divides((batch,), ("batch",), rules.activations, axes):
            continue
        fits.append(path.stem)
    return fits


@contextlib.contextmanager
def suggest_presets(batch: int | None = None) -> Iterator[None]:
    """Re-raise a "dim does not divide" error with the presets that would fit it.

    The error comes from ``resolve.resolve_spec``, which knows one tensor and no presets;
    the suggestion needs each preset's plan, so it is added here, where plans are known.
    """
    try:
        yield
    except ShardingError as error:
        fail = getattr(error, "indivisible", None)
        if fail is None or getattr(error, "suggested", False):
            raise
        fits = presets_that_fit(fail, batch)
        hint = f" Presets that fit: {', '.join(fits)}." if fits else ""
        better = ShardingError(f"{error}{hint}")
        better.indivisible, better.suggested = fail, True
        raise better from None
