"""What a pipeline runs, as numbers: p stages, m micro-batches, v virtual stages, the
schedule, and the checks every schedule's trainer and the planner apply before compiling.

``PipelineParallel.spec`` (``gpipe.py``) builds it from the plan on a mesh; the schedules
(``gpipe.py``, ``one_f_one_b.py``) and the planner's loop arithmetic read it.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardlib.core.errors import ShardingError
from shardlib.parallel.pipeline.partition import balanced_stages

SCHEDULES = ("gpipe", "circular", "1f1b", "chimera", "terapipe", "2bw")
FUSED_SCHEDULES = ("1f1b", "chimera", "2bw")  # forward and backward in one loop: a value_and_grad
SCHEDULE_ALIASES = {
    "bounded": "1f1b",  # older name of 1f1b, still accepted
    "pipedream-flush": "1f1b",  # Narayanan et al. 2021's name for 1F1B with a flush per step
    "pipedream-2bw": "2bw",
}


@dataclass(frozen=True)
class PipelineSpec:
    """How the stacked layers run over the stage axis."""

    stages: int
    """p: devices along the ``stage`` mesh axis."""
    microbatches: int
    """m: micro-batches streamed through the stages per (accumulation) batch."""
    virtual_stages: int = 1
    """v: layer groups per device (circular, or interleaved 1F1B); 1 for GPipe."""
    schedule: str = "gpipe"
    """gpipe | circular | 1f1b | chimera | terapipe | 2bw (see the module docstrings); under
    terapipe ``microbatches`` counts the sequence's token slices; 2bw is PipeDream-2BW's
    loop without a flush between steps (``pipeline/two_bw_loop.py``)."""
    gather_weights: str = "microbatch"
    """When FSDP-sharded stage weights are all-gathered: per micro-batch or once per step
    (``pipeline/replicas.py``)."""
    stage_layers: tuple[int, ...] = ()
    """Real layers per (virtual) stage, in stage order; () = L/(p·v) each."""
    split_saved_inputs: bool = False
    """1F1B: keep the saved layer inputs split over ``tensor`` (``stage_work``)."""

    @property
    def fused(self) -> bool:
        """Whether the schedule writes forward and backward into one loop (1F1B, Chimera)."""
        return self.schedule in FUSED_SCHEDULES

    def iterations(self) -> int:
        """Loop trips: GPipe m+p-1, circular v·m+p-1, (interleaved) 1F1B v·m+v·p+p-2 over
        its three phases (``pipeline.timetable.Schedule``), Chimera m+2p-3
        (``pipeline.chimera_timetable``), 2bw m (no flush: ``pipeline.two_bw_loop``)."""
        p, m, v = self.stages, self.microbatches, self.virtual_stages
        if self.schedule == "chimera":
            return m + 2 * p - 3
        if self.schedule == "2bw":  # steady trips only (``pipeline.two_bw_loop``)
            return m
        if self.schedule == "1f1b":
            return v * m + v * p + p - 2
        return v * m + p - 1

    def executed(self) -> int:
        """Chunk forwards (each with its backward) a stage executes: the loop trips, but
        1F1B's warm-up runs only forwards and its cool-down only backwards: v·m+p-1;
        Chimera's m+p-2; 2bw's m (every trip is a steady one)."""
        if self.schedule == "chimera":
            return self.microbatches + self.stages - 2
        if self.schedule == "2bw":
            return self.microbatches
        if self.schedule == "1f1b":
            return self.virtual_stages * self.microbatches + self.stages - 1
        return self.iterations()

    def bubble_ratio(self) -> float:
        """Executed over ideal stage work: 1 + (p-1)/(m·v) for GPipe, circular and 1F1B
        (v = 1 for GPipe), 1 + (p-2)/m for Chimera, measured from FLOPs in
        ``tests/test_pipeline*.py`` and ``tests/parallel/test_pipeline_*.py``."""
        return self.executed() / (self.virtual_stages * self.microbatches)

    def check(self, layers: int, batch: int) -> None:
        """Divisibility and schedule constraints, with the fix, before anything compiles."""
        p, m, v = self.stages, self.microbatches, self.virtual_stages
        if self.schedule not in SCHEDULES:
            raise ShardingError(
                f"pipeline_schedule={self.schedule!r}. Fix: one of {', '.join(SCHEDULES)}."
            )
        if v < 1 or (v > 1 and self.schedule == "gpipe"):
            raise ShardingError(
                f"virtual_stages={v} needs pipeline_schedule=circular or 1f1b (interleaved "
                f"1F1B), got {self.schedule}."
            )
        if self.schedule == "chimera":
            self._check_chimera()
        if self.schedule == "2bw" and v != 1:
            raise ShardingError(
                f"pipeline_schedule=2bw with virtual_stages={v}: PipeDream-2BW's stale "
                "weights are kept for one chunk per device, as in the paper; interleaving is "
                "not implemented with them. Fix: virtual_stages=1, or pipeline_schedule=1f1b "
                "for interleaved 1F1B."
            )
        if self.schedule == "2bw" and m < 2 * p - 2:
            raise ShardingError(
                f"pipeline_schedule=2bw with pipeline_microbatches={m} over {p} stages: a "
                f"step's last backwards run 2p-2 = {2 * p - 2} trips into the next step "
                f"(``pipeline.two_bw_loop``), which has only {m}. Fix: "
                f"pipeline_microbatches={2 * p - 2} or more."
            )
        if self.stage_layers:
            counts = self.stage_layers
            if len(counts) != p * v or sum(counts) != layers or min(counts) < 1:
                raise ShardingError(
                    f"pipeline stage_layers={counts} does not split model layers={layers} "
                    f"into {p} stages x {v} virtual stages (needs {p * v} counts >= 1 summing "
                    f"to {layers}). Fix: leave stage_layers empty (balanced automatically)."
                )
        elif layers < p * v:
            raise ShardingError(
                f"model layers={layers} < {p} stages x {v} virtual stages: a stage would run "
                "no layer. Fix: fewer stages or virtual_stages."
            )
        elif layers % (p * v) and v > 1:
            fits = [n for n in range(1, layers // p + 1) if layers % (p * n) == 0]
            raise ShardingError(
                f"model layers={layers} do not split into {p} stages x {v} virtual stages of "
                f"equal size ({layers / (p * v):g} layers each). Interleaved schedules need "
                "equal chunks, as Megatron-LM's --num-layers-per-virtual-pipeline-stage does; "
                f"padding them would run {p * v * -(-layers // (p * v)) - layers} identity "
                "layers per step and keep the stacked weights replicated over stage. Fix: "
                f"virtual_stages in {fits}, or stage_layers (one count per virtual stage)."
            )
        elif layers % (p * v):
            raise ShardingError(
                f"model layers={layers} cannot be split evenly into {p} stages x {v} virtual "
                f"stages. Fix: set pipeline stage_layers (``balanced_stages({layers}, "
                f"{p * v})`` = {balanced_stages(layers, p * v)}; the trainer does this itself) "
                f"or make model.layers a multiple of {p * v}."
            )
        if self.schedule == "terapipe":  # m slices of the sequence (``pipeline.terapipe``)
            return
        if m < 1 or batch % m:
            raise ShardingError(
                f"batch {batch} is not divisible by pipeline_microbatches={m}. Fix: choose a "
                "batch that is a multiple of the pipeline micro-batches."
            )
        if v > 1 and self.schedule == "1f1b" and m % p:
            raise ShardingError(
                f"interleaved 1F1B (pipeline_schedule=1f1b, virtual_stages={v}) runs "
                f"micro-batches in groups of the {p} stages; pipeline_microbatches={m} is not "
                f"a multiple of {p} (Megatron-LM's rule). Fix: pipeline_microbatches="
                f"{' or '.join(map(str, sorted({max(p, m - m % p), m + p - m % p})))}, or "
                "virtual_stages=1."
            )
        if v > 1 and m < p:
            raise ShardingError(
                f"circular schedule with pipeline_microbatches={m} < {p} stages: a micro-batch "
                "would re-enter stage 0 before it left the last stage. Fix: use at least "
                f"{p} micro-batches."
            )

    def _check_chimera(self) -> None:
        """Chimera's timetable (``pipeline.chimera_timetable``) needs what it pairs: two
        directions of m/2 micro-batches over an even number of stages, one chunk each."""
        p, m, v = self.stages, self.microbatches, self.virtual_stages
        if v != 1:
            raise ShardingError(
                f"pipeline_schedule=chimera with virtual_stages={v}: each device already "
                "holds two stages (its down stage s and up stage p-1-s), and interleaving "
                "them further is not implemented. Fix: virtual_stages=1, or "
                "pipeline_schedule=1f1b for interleaved 1F1B."
            )
        if p % 2:
            raise ShardingError(
                f"pipeline_schedule=chimera over {p} stages: the two directions alternate "
                "by trip parity, which only keeps every device to one forward per trip when "
                f"the stage count is even (as in the paper). Fix: a stage axis of {p - 1} or "
                f"{p + 1}, or pipeline_schedule=1f1b."
            )
        if m < 2 or m % 2:
            raise ShardingError(
                f"pipeline_schedule=chimera with pipeline_microbatches={m}: half the "
                "micro-batches go down the pipeline and half up, so their count must be "
                f"even. Fix: pipeline_microbatches={max(2, m + m % 2)}."
            )
