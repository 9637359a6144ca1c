"""A candidate plan: mesh axis sizes plus the knobs that do not need a mesh axis.

Mesh axes are always laid out in ``AXIS_ORDER`` (outermost first). The last axes vary
fastest over device ids and so stay inside a host: tensor parallelism (an all-reduce on the
critical path of every layer) is innermost, then context, expert and FSDP (per-layer
traffic that overlaps compute), then pipeline stages and data parallelism, whose traffic is
a once-per-step gradient reduction or small point-to-point sends that tolerate a slow link.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from shardlib.mesh import Axis

AXIS_ORDER = (Axis.DATA, Axis.STAGE, Axis.FSDP, Axis.EXPERT, Axis.CONTEXT, Axis.TENSOR)

SCHEDULES = ("none", "gpipe", "1f1b", "interleaved")
"""Pipeline schedules: ``none`` when there is one stage."""
REMAT = ("none", "selective", "full")
"""Rematerialisation policies: keep everything; drop attention scores; keep layer inputs."""
OFFLOAD = ("none", "optimizer")
"""What lives in host memory between steps."""

TRAIN_SCHEDULE = {"gpipe": "gpipe", "1f1b": "bounded", "interleaved": "circular"}
"""Planner schedule -> the trainer's ``pipeline_schedule`` (``strategies/pipeline*.py``):
1F1B is the memory-bounded schedule, interleaved the circular one with v layer groups."""


@dataclass(frozen=True)
class Plan:
    """One point of the search space."""

    data: int = 1
    """Data-parallel replicas (batch split, state replicated unless ``zero`` > 0)."""
    fsdp: int = 1
    """FSDP / ZeRO-3 degree (batch split, parameters, gradients and optimizer state sharded)."""
    tensor: int = 1
    """Megatron tensor-parallel degree (heads, MLP hidden and vocab split)."""
    context: int = 1
    """Context-parallel degree (sequence split, ring attention)."""
    expert: int = 1
    """Expert-parallel degree (experts split; MoE models only)."""
    stage: int = 1
    """Pipeline stages."""
    zero: int = 0
    """ZeRO stage over the ``data`` axis: 1 shards optimizer state, 2 also gradients."""
    microbatches: int = 1
    """Micro-batches per step (gradient accumulation, or the pipeline's micro-batches)."""
    schedule: str = "none"
    """Pipeline schedule (``SCHEDULES``)."""
    virtual: int = 1
    """Virtual stages per device (interleaved schedule)."""
    remat: str = "none"
    """Rematerialisation policy (``REMAT``)."""
    offload: str = "none"
    """Host offload (``OFFLOAD``)."""

    @cached_property
    def axes(self) -> tuple[tuple[str, int], ...]:
        """Mesh axes with size > 1 in ``AXIS_ORDER`` (``data`` alone if all are 1)."""
        sizes = {a: getattr(self, a.value) for a in AXIS_ORDER}
        kept = tuple((str(a), s) for a, s in sizes.items() if s > 1)
        return kept or ((str(Axis.DATA), 1),)

    @property
    def size(self) -> int:
        return self.data * self.fsdp * self.tensor * self.context * self.expert * self.stage

    @property
    def batch_ways(self) -> int:
        """Ways the batch is split: data, FSDP and expert replicas each get their own rows."""
        return self.data * self.fsdp * self.expert

    def train_overrides(self) -> dict[str, object]:
        """The ``TrainConfig`` fields that run this plan (``shardlib train``'s ``[train]``).

        Micro-batches are gradient accumulation without stages and the pipeline's micro-batches
        with them; remat ``selective`` is the trainer's ``selective`` policy (keep matmul
        outputs, recompute the attention core), offload the ZeRO-Offload of optimizer state.
        """
        staged = self.stage > 1
        out: dict[str, object] = {
            "microbatches": 1 if staged else self.microbatches,
            "zero": self.zero,
            "remat": self.remat,
            "offload_optimizer": self.offload == "optimizer",
        }
        if staged:
            out["pipeline_schedule"] = TRAIN_SCHEDULE[self.schedule]
            out["pipeline_microbatches"] = self.microbatches
            out["virtual_stages"] = self.virtual
        return out

    @classmethod
    def from_train(cls, axes: dict[str, int], train: dict) -> Plan:
        """The plan a mesh file runs: its ``[mesh]`` axes and ``[train]`` fields (the inverse
        of ``train_overrides``; fields a plan has no knob for are ignored)."""
        staged = axes.get(str(Axis.STAGE), 1) > 1
        schedules = {v: k for k, v in TRAIN_SCHEDULE.items()}
        return cls(
            **{a.value: axes.get(str(a), 1) for a in AXIS_ORDER},
            zero=train.get("zero", 0),
            microbatches=train.get("pipeline_microbatches" if staged else "microbatches", 1),
            schedule=schedules[train.get("pipeline_schedule", "gpipe")] if staged else "none",
            virtual=train.get("virtual_stages", 1),
            remat=train.get("remat", "none"),
            offload="optimizer" if train.get("offload_optimizer") else "none",
        )

    def mesh_text(self) -> str:
        return " x ".join(f"{n}={s}" for n, s in self.axes)

    def knobs_text(self) -> str:
        zero = f"zero{self.zero}" if self.zero else ""
        pipe = (
            f"{self.schedule}{'x' + str(self.virtual) if self.virtual > 1 else ''}"
            if self.stage > 1
            else ""
        )
        parts = [zero, pipe, f"m={self.microbatches}" if self.microbatches > 1 else ""]
        parts += [f"remat={self.remat}" if self.remat != "none" else ""]
        parts += ["offload" if self.offload != "none" else ""]
        return " ".join(p for p in parts if p) or "-"
