"""The published runs the throughput model is checked against: each run's source, model
shape, layout, batch, the program it ran (``planner.calibrate.megatron``) and its published
figure, with the FLOP formula that figure was counted with.

The data of ``planner_calibration.py`` (which costs them) and ``fsdp_validation.py``; kept
apart so the tables can be read, and cited, without the costing code.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardlib.planner.calibrate.megatron import Megatron
from shardlib.planner.candidate import AXIS_ORDER

README = "Megatron-LM README (2022), MFU table; layouts: Korthikanti et al. 2022, Table 3"
ABSTRACT = "Korthikanti et al. 2022, arXiv:2205.05198, abstract"
TABLE2 = "Narayanan et al. 2021 (SC21), arXiv:2104.04473, Table 2 (PTD-P rows)"
MTNLG = "Smith et al. 2022 (MT-NLG), arXiv:2201.11990, section 2.4"
NARAYANAN = "Narayanan et al. 2021 (SC21), arXiv:2104.04473, Table 1"

MEGATRON_2021 = Megatron(sequence_parallel=False, grad_bytes=2)
"""Narayanan et al. 2021: fp16, tensor all-reduces, scatter/gather pipeline sends."""
MEGATRON_2022 = Megatron(sequence_parallel=True, grad_bytes=4)
"""Korthikanti et al. 2022: sequence parallelism (with selective recompute), bf16."""
MEGATRON_2022_FULL = Megatron(sequence_parallel=False, grad_bytes=4)
"""Korthikanti et al.'s baseline: tensor parallelism with full recompute."""
DEEPSPEED_PIPELINE = Megatron(scatter_gather=False, grad_bytes=2)
"""MT-NLG: DeepSpeed's pipeline engine sends whole activations; Megatron's tensor slicing."""
A100_PEAK_TFLOPS = 312.0


@dataclass(frozen=True)
class Run:
    """One published measurement and its layout as published (assumptions in ``assumed``)."""

    source: str
    name: str
    heads: int
    hidden: int
    layers: int
    tensor: int
    stage: int
    gpus: int
    global_batch: int
    program: Megatron
    step_s: float | None = None
    """Published seconds per iteration."""
    tflops: float | None = None
    """Published TFLOP/s per GPU (Narayanan et al.'s count, recompute included)."""
    mfu: float | None = None
    """Published model FLOPs utilisation (Korthikanti et al.'s model FLOPs, no recompute)."""
    remat: str = "full"
    micro_batch: int | None = 1
    """Sequences per micro-batch; None where not published: the fastest that fits (1F1B
    memory) is taken."""
    seq: int = 2048
    vocab: int = 51_200
    assumed: str = ""

    @property
    def data(self) -> int:
        return self.gpus // (self.tensor * self.stage)

    def mesh(self) -> dict[str, int]:
        sizes = dict(data=self.data, stage=self.stage, tensor=self.tensor)
        return {str(a): sizes.get(str(a), 1) for a in AXIS_ORDER}

    def flops(self) -> float:
        """FLOPs per iteration by the publication's formula: Korthikanti et al.'s model
        FLOPs 72·B·s·l·h²(1 + s/6h + V/12lh) for an MFU, else Narayanan et al.'s
        96·B·s·l·h²(1 + s/6h + V/16lh) (full recompute counted)."""
        b, s, l, h, v = self.global_batch, self.seq, self.layers, self.hidden, self.vocab
        if self.mfu is not None:
            return 72 * b * s * l * h * h * (1 + s / (6 * h) + v / (12 * l * h))
        return 96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))

    def published_tflops(self) -> float:
        """TFLOP/s per GPU, counted with ``flops``'s formula."""
        if self.mfu is not None:
            return self.mfu * A100_PEAK_TFLOPS
        if self.tflops is not None:
            return self.tflops
        return self.flops() / (self.step_s * self.gpus) / 1e12


_K = dict(program=MEGATRON_2022, remat="selective", assumed="micro-batch 1")
_175B = dict(name="175B", heads=96, hidden=12288, layers=96)
_530B = dict(name="530B", heads=128, hidden=20480, layers=105)
_1T = dict(name="1T", heads=160, hidden=25600, layers=128)
CALIBRATION = [
    Run(source=README, name="22B", heads=64, hidden=6144, layers=48, tensor=8, stage=1,
        gpus=8, global_batch=4, mfu=0.415, **_K),
    Run(source=README, **_175B, tensor=8, stage=8, gpus=64, global_batch=64, mfu=0.514, **_K),
    Run(source=README, **_530B, tensor=8, stage=35, gpus=280, global_batch=280, mfu=0.560,
        **_K),
    Run(source=README, **_1T, tensor=8, stage=64, gpus=512, global_batch=512, mfu=0.563, **_K),
    Run(source=ABSTRACT, **_530B, tensor=8, stage=35, gpus=2240, global_batch=2240,
        mfu=0.542, program=MEGATRON_2022, remat="selective",
        assumed="layout t=8 p=35 (as MT-NLG's), batch 2240 (as Table 2's), micro-batch 1"),
    Run(source=ABSTRACT, **_530B, tensor=8, stage=35, gpus=2240, global_batch=2240,
        mfu=0.421, program=MEGATRON_2022_FULL, remat="full",
        assumed="layout t=8 p=35 (as MT-NLG's), batch 2240 (as Table 2's), micro-batch 1"),
    *(
        Run(source=TABLE2, **shape, tensor=8, stage=stage, gpus=gpus, global_batch=batch,
            tflops=tflops, program=MEGATRON_2021, assumed="micro-batch 1")
        for shape, stage, batch, rows in (
            (_175B, 12, 1536, ((384, 153), (768, 149), (1536, 141))),
            (_530B, 35, 2240, ((560, 171), (1120, 167), (2240, 159))),
        )
        for gpus, tflops in rows
    ),
]  # fmt: skip

OTHER_STACK = [
    Run(source=MTNLG, **_530B, tensor=8, stage=35, gpus=gpus, global_batch=1920, step_s=step,
        program=DEEPSPEED_PIPELINE, assumed="micro-batch 1")
    for gpus, step in ((2240, 60.1), (2800, 50.2), (3360, 44.4))
]  # fmt: skip

_N = dict(
    source=NARAYANAN,
    program=MEGATRON_2021,
    micro_batch=None,
    assumed="micro-batch size: the fastest that fits (not in the table)",
)
HELD_OUT = [
    Run(name="1.7B", heads=24, hidden=2304, layers=24, tensor=1, stage=1, gpus=32,
        global_batch=512, tflops=137, **_N),
    Run(name="3.6B", heads=32, hidden=3072, layers=30, tensor=2, stage=1, gpus=64,
        global_batch=512, tflops=138, **_N),
    Run(name="7.5B", heads=32, hidden=4096, layers=36, tensor=4, stage=1, gpus=128,
        global_batch=512, tflops=142, **_N),
    Run(name="18B", heads=48, hidden=6144, layers=40, tensor=8, stage=1, gpus=256,
        global_batch=1024, tflops=135, **_N),
    Run(name="39B", heads=64, hidden=8192, layers=48, tensor=8, stage=2, gpus=512,
        global_batch=1536, tflops=138, **_N),
    Run(name="76B", heads=80, hidden=10240, layers=60, tensor=8, stage=4, gpus=1024,
        global_batch=1792, tflops=140, **_N),
    Run(name="145B", heads=96, hidden=12288, layers=80, tensor=8, stage=8, gpus=1536,
        global_batch=2304, tflops=148, **_N),
    Run(name="310B", heads=128, hidden=16384, layers=96, tensor=8, stage=16, gpus=1920,
        global_batch=2160, tflops=155, **_N),
    Run(**_530B, tensor=8, stage=35, gpus=2520, global_batch=2520, tflops=163, **_N),
    Run(**_1T, tensor=8, stage=64, gpus=3072, global_batch=3072, tflops=163, **_N),
]  # fmt: skip
