"""``ParallelPlan``: one description of a parallel layout, shared by trainer, planner and CLI.

A plan is the mesh (named axes and sizes) plus one section per strategy. A mesh axis
switches its strategy on (``fsdp`` -> FSDP, ``tensor`` -> Megatron, ...); a section holds
that strategy's knobs. The plan alone yields the rules, runs every strategy's own checks
and hands the trainer its layer loop and gradient function (``shardlib.staging``). A mesh
TOML carries it as ``[mesh]`` plus ``[parallel.<section>]`` tables, read straight into the
sections' fields; ``shardlib plan`` writes the same tables.

The composition order of the rules is written once, in ``rules``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from shardlib.errors import ShardingError
from shardlib.mesh import MeshSpec
from shardlib.rules import Rules, base_rules, compose
from shardlib.staging import layer_loop, make_grad_fn
from shardlib.strategies.context import ContextParallel, reorder_tokens
from shardlib.strategies.data import DataParallel
from shardlib.strategies.expert import ExpertParallel, with_dispatched_batch
from shardlib.strategies.offload import Offload
from shardlib.strategies.pipeline import PipelineParallel
from shardlib.strategies.remat import Remat
from shardlib.strategies.tensor import TensorParallel
from shardlib.strategies.zero import StateRules, zero
from shardlib.target import Target
from shardlib.values import replace_path


@dataclass(frozen=True)
class ParallelPlan:
    """The mesh and every parallelism strategy's settings."""

    mesh: MeshSpec = field(default_factory=lambda: MeshSpec((("data", -1),)))
    """Named mesh axes, outermost first (``-1``: the devices that are left)."""
    data: DataParallel = field(default_factory=DataParallel)
    """``data`` and ``fsdp`` axes: batch split; ZeRO stage over ``data``."""
    tensor: TensorParallel = field(default_factory=TensorParallel)
    """``tensor`` (+ ``tensor2``, ``tensor3``) axes: Megatron 1D/2D/3D, sequence parallel."""
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

    @property
    def sections(self) -> tuple:
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "mesh")

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
        parts = [base_rules()]
        for section in (self.pipeline, self.data, self.context, self.tensor, self.expert):
            parts += section.rules(axes)
        rules = with_dispatched_batch(compose(*parts))
        rules.check_mesh(axes, where="plan")
        return rules

    @cached_property
    def state_rules(self) -> StateRules:
        """Rules per role of the training state (parameters, gradients, optimizer state)."""
        return zero(self.rules, stage=self.data.zero, mesh_axes=self.mesh_axes)

    def for_target(self, target: Target) -> ParallelPlan:
        """The plan for this model: what depends on its shapes (uneven pipeline stages)."""
        pipeline = self.pipeline.for_layers(target.layers, self.mesh_axes)
        return self if pipeline == self.pipeline else dataclasses.replace(self, pipeline=pipeline)

    # --- checks ----------------------------------------------------------------------------
    def check(self, target: Target) -> None:
        """Every strategy's own refusals, before anything is compiled or allocated."""
        rules, axes = self.state_rules.params, self.mesh_axes
        for section in self.sections:
            check = getattr(section, "check", None)
            if check is not None:
                check(axes, rules, target)

    # --- what the trainer runs ---------------------------------------------------------------
    def attention_plan(self):
        """How ``shardlib.ops.attention`` runs on this mesh."""
        return self.context.attention_plan(self.mesh_axes)

    def split_tokens(self, tokens_BL1):
        """(inputs, targets, positions) of a [b, seq + 1] batch in the order the model sees
        (context parallelism's zig-zag order; positions None for the natural order)."""
        return reorder_tokens(tokens_BL1, self.attention_plan())

    def layer_loop(self, target: Target, dtype):
        """``layers(block_fn, blocks_state, carry)``: how the model's stacked blocks run
        (remat policy, GPipe/circular pipeline, per-layer fetch of offloaded weights)."""
        return layer_loop(self, target, dtype)

    def value_and_grad(self, loss_fn, **model_parts):
        """``jax.value_and_grad(loss_fn)``, or the bounded pipeline's own gradient function
        (``staging.make_grad_fn``: ``graphdef``, ``dtype``, ``target``, ``rest_shardings``,
        ``has_aux``)."""
        return make_grad_fn(self, loss_fn, **model_parts)

    def pipeline_spec(self):
        """The pipeline on this mesh (None without a ``stage`` axis of size > 1)."""
        return self.pipeline.spec(self.mesh_axes)

    # --- TOML ---------------------------------------------------------------------------------
    @classmethod
    def from_mesh_spec(cls, spec: MeshSpec) -> ParallelPlan:
        """A mesh file's ``[mesh]`` and ``[parallel.*]`` tables as a plan."""
        plan = cls(mesh=spec)
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
        """``stage=2 x fsdp=2 x tensor=2; pipeline.schedule=bounded`` (one line)."""
        shape = " x ".join(f"{n}={s}" for n, s in self.mesh.axes)
        knobs = [f"{s}.{k}={v}" for s, t in self.tables().items() for k, v in t.items()]
        return "; ".join([shape, *knobs]) if knobs else shape


def _section_names() -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(ParallelPlan) if f.name != "mesh")


def rules_for_mesh(mesh_axes: Mapping[str, int], *, sequence_parallel: bool = False) -> Rules:
    """The rules of the default plan on a mesh: each mesh axis switches on its strategy."""
    plan = ParallelPlan(
        mesh=MeshSpec(tuple(mesh_axes.items())),
        tensor=TensorParallel(sequence_parallel=sequence_parallel),
    )
    return plan.rules
