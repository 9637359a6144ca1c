"""The calibration probes: which plans on which workloads ``calibrate.fit`` compiles.

Each group is a tuple of (plan, ``TrainConfig`` words) pairs; ``GROUPS`` names the sets
``python -m shardlib.planner.calibrate.fit --group NAME`` compiles. Kept apart from the fit
itself (``fit.py``), which reads only their measurements.
"""

from __future__ import annotations

from shardlib.parallel.plan import ParallelPlan
from shardlib.planner.calibrate.gpt_probes import GPT_PROBES
from shardlib.planner.candidate import candidate

Probe = tuple[ParallelPlan, str]
"""A plan and the workload it is compiled on (``TrainConfig`` words: model, batch, seq and
``model.NAME``; ``PROBE_BASE`` first)."""

PROBES: tuple[Probe, ...] = (
    (candidate(data=8), "batch=16 model.layers=2"),
    (candidate(data=8), "batch=16 model.layers=4"),
    (candidate(data=8), "batch=16 model.layers=2 model.mlp=2048"),
    (candidate(data=8), "batch=16 model.layers=2 seq=256"),
    (
        candidate(data=8),
        "batch=16 model.layers=2 model.heads=16 model.kv_heads=8 model.head_dim=16",
    ),
    (candidate(data=8), "batch=16 model.layers=2 model.embed=512"),
    (candidate(data=8), "batch=16 model.layers=2 model.vocab=8192"),
    (candidate(data=8), "batch=32 model.layers=4"),
    (candidate(data=4, tensor=2), "batch=8 model.layers=2"),
    (candidate(data=2, tensor=4), "batch=4 model.layers=4"),
    (candidate(fsdp=8), "batch=16 model.layers=2"),
    (candidate(fsdp=8), "batch=16 model.layers=4"),
    (candidate(fsdp=4, tensor=2), "batch=8 model.layers=4"),
    (candidate(data=8), "model=llama-tiny seq=64 batch=16"),
    (candidate(fsdp=8, microbatches=2), "model=llama-tiny seq=64 batch=16"),
    (candidate(data=4, tensor=2), "model=llama-tiny seq=32 batch=8"),
    (candidate(data=8, remat="selective"), "batch=16 model.layers=2"),
    (candidate(data=8, remat="selective"), "batch=16 model.layers=4 seq=256"),
    (candidate(data=4, tensor=2, remat="selective"), "batch=8 model.layers=2 model.mlp=2048"),
    (candidate(fsdp=4, tensor=2, remat="selective"), "batch=16 model.layers=4 seq=256"),
    (candidate(data=8, remat="full"), "batch=16 model.layers=2"),
    (candidate(data=8, remat="full"), "batch=16 model.layers=4 seq=256"),
    (candidate(fsdp=4, tensor=2, remat="full"), "batch=16 model.layers=4 seq=256"),
    (candidate(data=8, remat="full"), "batch=32 model.layers=6"),
    (candidate(data=8, remat="full"), "batch=16 model.layers=2 seq=512"),
    (candidate(data=8, remat="full"), "batch=16 model.layers=4 seq=512"),
    (candidate(data=4, tensor=2, remat="selective"), "batch=8 model.layers=2 seq=512"),
    (candidate(data=8, zero=1), "batch=16 model.layers=2"),
    (candidate(data=8, zero=1), "batch=16 model.layers=4 seq=256"),
    (candidate(data=8, zero=2, microbatches=2), "batch=16 model.layers=2"),
    (candidate(data=4, tensor=2, zero=1, microbatches=2), "batch=16 model.layers=4"),
    (candidate(data=8), "batch=16 model.layers=4 model.mlp=2048"),
    (candidate(data=4, tensor=2), "batch=8 model.layers=4 model.mlp=2048"),
    (
        candidate(data=8),
        "batch=16 model.layers=4 model.heads=16 model.kv_heads=8 model.head_dim=16",
    ),
    (candidate(fsdp=4, tensor=2), "batch=16 model.layers=6 model.kv_heads=8"),
    (candidate(fsdp=2, tensor=4), "batch=16 model.layers=2 model.kv_heads=8 seq=256"),
    (candidate(fsdp=8, microbatches=2), "batch=16 model.layers=4 seq=64"),
    (candidate(fsdp=8, microbatches=4), "batch=32 model.layers=2"),
    (candidate(data=2, fsdp=2, tensor=2), "batch=16 model.layers=4 seq=256"),
    # one sequence per device, as on large meshes
    (candidate(fsdp=4, tensor=2, remat="full"), "batch=4 model.layers=4 seq=256"),
    (candidate(data=2, fsdp=4, remat="selective"), "batch=8 model.layers=4 seq=256"),
    (candidate(fsdp=8, remat="selective"), "batch=8 model.layers=4 seq=256"),
    (candidate(data=8, remat="full"), "batch=8 model.layers=4 seq=256"),
    # published widths (few layers): head_dim 64-128, mlp/h 2.7-4, seq 1024-2048
    (candidate(fsdp=8), "model=llama-1b batch=16 seq=1024 model.layers=4"),
    (candidate(fsdp=8, remat="selective"), "model=llama-1b batch=16 seq=1024 model.layers=4"),
    (candidate(fsdp=4, tensor=2, remat="full"), "model=llama-1b batch=8 seq=2048 model.layers=2"),
    (candidate(fsdp=8), "model=llama-7b batch=8 seq=2048 model.layers=2"),
    (candidate(fsdp=8, remat="selective"), "model=llama-7b batch=16 seq=2048 model.layers=4"),
    (
        candidate(fsdp=4, tensor=2, remat="selective"),
        "model=llama-7b batch=8 seq=1024 model.layers=2",
    ),
    (candidate(data=2, fsdp=4, remat="full"), "model=llama-7b batch=16 seq=1024 model.layers=2"),
    (candidate(fsdp=8, microbatches=2), "model=llama-7b batch=16 seq=2048 model.layers=2"),
    (candidate(fsdp=8), "model=llama-7b batch=8 seq=2048 model.layers=6"),
    (candidate(fsdp=8), "model=llama-1b batch=8 seq=2048 model.layers=8"),
    (candidate(fsdp=4, context=2), "model=llama-7b batch=8 seq=4096 model.layers=3"),
)
_MOE = "model=moe-tiny model.embed=256 model.mlp=1024 model.heads=8 model.kv_heads=4"
_MOE += " model.head_dim=32 model.layers=4 model.moe_every=2 model.expert_mlp=512"
MOE_PROBES: tuple[Probe, ...] = (
    (candidate(expert=8), _MOE),
    (candidate(expert=8), f"{_MOE} seq=256"),
    (candidate(expert=8), f"{_MOE} model.expert_mlp=1024"),
    (candidate(expert=8), f"{_MOE} model.moe_every=1"),
    (candidate(expert=8), f"{_MOE} model.top_k=1"),
    (candidate(data=2, expert=4), f"{_MOE} model.experts=16"),
    (candidate(data=2, expert=4), f"{_MOE} model.moe_every=1 model.layers=2"),
    (candidate(data=2, expert=4), _MOE),
    (candidate(data=2, expert=4), f"{_MOE} model.moe_every=3 model.layers=6"),
    (candidate(expert=4, tensor=2), _MOE),
    (candidate(expert=4, tensor=2), f"{_MOE} model.capacity_factor=1.0 model.expert_mlp=768"),
    (candidate(fsdp=2, expert=4), _MOE),
    (candidate(fsdp=2, expert=4), f"{_MOE} model.embed=128 model.moe_every=1 seq=64 batch=32"),
    (candidate(data=8), _MOE),
)
CONTEXT_PROBES: tuple[Probe, ...] = (
    (candidate(data=4, context=2), "batch=16 model.layers=2"),
    (candidate(data=4, context=2), "batch=16 model.layers=4"),
    (candidate(data=4, context=2), "batch=16 model.layers=2 seq=256"),
    (candidate(data=4, context=2, microbatches=2), "batch=16 model.layers=2"),
    (candidate(data=2, context=4), "batch=16 model.layers=2"),
    (candidate(data=2, context=4), "batch=16 model.layers=4"),
    (candidate(data=2, context=4), "batch=16 model.layers=2 seq=512"),
    (candidate(data=4, context=2), "batch=16 model.layers=2 model.heads=16 model.head_dim=16"),
)
PIPELINE_PROBES: tuple[Probe, ...] = (
    (candidate(data=2, stage=4, schedule="gpipe", microbatches=4), "batch=16 model.layers=4"),
    (candidate(data=2, stage=4, schedule="gpipe", microbatches=2), "batch=16 model.layers=4"),
    (candidate(data=4, stage=2, schedule="gpipe", microbatches=2), "batch=16 model.layers=4"),
    (candidate(stage=4, fsdp=2, schedule="gpipe", microbatches=4), "batch=16 model.layers=4"),
    (candidate(stage=4, tensor=2, schedule="gpipe", microbatches=4), "batch=16 model.layers=4"),
    (
        candidate(data=2, stage=2, tensor=2, schedule="gpipe", microbatches=2),
        "batch=32 model.layers=4",
    ),
    (
        candidate(data=2, stage=4, schedule="gpipe", microbatches=4),
        "batch=16 model.layers=4 model.vocab=16384",
    ),
    (candidate(data=2, stage=4, schedule="1f1b", microbatches=4), "batch=16 model.layers=4"),
    (
        candidate(data=2, stage=4, schedule="circular", virtual=2, microbatches=4),
        "batch=16 model.layers=8",
    ),
    (
        candidate(stage=2, fsdp=4, schedule="circular", virtual=2, microbatches=2),
        "batch=16 model.layers=4",
    ),
    (
        candidate(data=2, stage=2, tensor=2, schedule="circular", virtual=2, microbatches=4),
        "batch=16 model.layers=8 model.mlp=2048",
    ),
    (
        candidate(stage=2, data=4, schedule="circular", virtual=4, microbatches=2),
        "batch=16 model.layers=8 seq=256",
    ),
)
# Published widths at tensor 1-8, with the buffers that grow with them: 7B-class
# (h 4096), 39B-class (h 8192) and 175B-class (h 12288) layers, seq 2048, a few layers each
# (the per-layer parts scale with the count; held-out validation runs the full depth:
# ``benchmarks/planner_scale_validation.py``). Every remat policy, ZeRO-1/2, 1F1B and
# interleaved pipelines; 8 devices, so the fit never needs a large simulated mesh.
_W7 = "model=llama-7b seq=2048"
_W39 = "model=llama-70b model.kv_heads=64 model.mlp=21760 model.vocab=51200 seq=2048"
_W175 = (
    "model=llama-70b model.embed=12288 model.heads=96 model.kv_heads=96 model.mlp=32768 "
    "model.vocab=51200 seq=2048"
)
SCALE_PROBES: tuple[Probe, ...] = (
    # activations outweigh the parameters here (the rest are weight-heavy at 2 layers)
    (candidate(tensor=8, remat="selective"), f"{_W7} batch=8 model.layers=4"),
    (candidate(tensor=8, remat="full"), f"{_W7} batch=8 model.layers=4"),
    (candidate(tensor=8, remat="selective"), f"{_W7} batch=2 model.layers=2"),
    (candidate(tensor=8, remat="selective"), f"{_W175} batch=1 model.layers=2"),
    (candidate(fsdp=2, tensor=4, remat="selective"), f"{_W39} batch=2 model.layers=2"),
    (candidate(fsdp=4, tensor=2, remat="selective"), f"{_W175} batch=4 model.layers=2"),
    (candidate(tensor=8, remat="full"), f"{_W175} batch=2 model.layers=4"),
    (candidate(fsdp=2, tensor=4, remat="full"), f"{_W7} batch=4 model.layers=4"),
    (candidate(tensor=8), f"{_W39} batch=1 model.layers=2"),
    (
        candidate(data=2, tensor=4, zero=1, microbatches=2, remat="selective"),
        f"{_W39} batch=4 model.layers=2",
    ),
    (
        candidate(data=2, tensor=4, zero=2, microbatches=2, remat="full"),
        f"{_W7} batch=4 model.layers=2",
    ),
    (
        candidate(stage=2, tensor=4, schedule="1f1b", microbatches=4, remat="full"),
        f"{_W39} batch=4 model.layers=4",
    ),
    (
        candidate(stage=2, tensor=4, schedule="1f1b", microbatches=2, remat="selective"),
        f"{_W7} batch=4 model.layers=4",
    ),
    (
        candidate(stage=2, tensor=4, schedule="circular", virtual=2, microbatches=2, remat="full"),
        f"{_W39} batch=2 model.layers=4",
    ),
)
# Vocab moved apart from h (h 256-512 at vocab 2048-32768; 7B width at 8192 and 128256),
# where the fitted probes keep vocab / h near 32 at small widths. Measured, not fitted: the
# head's sum of fp32 logits-sized and h-sized buffers does not hold them (coefficients.py).
HEAD_PROBES: tuple[Probe, ...] = tuple(
    (candidate(**plan), words)
    for plan, words in (
        (dict(data=8), "batch=16 model.layers=2 model.vocab=32768"),
        (dict(data=8), "batch=16 model.layers=2 model.vocab=2048"),
        (dict(data=8, remat="full"), "batch=16 model.layers=2 model.vocab=32768 model.embed=512"),
        (dict(fsdp=8), "batch=16 model.layers=2 model.vocab=32768"),
        (dict(fsdp=4, tensor=2, remat="full"), "batch=16 model.layers=4 seq=256 model.vocab=32768"),
        (dict(fsdp=2, tensor=4, remat="full"), "batch=8 model.layers=4 seq=256"),
        (dict(fsdp=2, tensor=4, remat="full"), "batch=8 model.layers=4 seq=256 model.vocab=32768"),
        (
            dict(fsdp=2, tensor=4, remat="full"),
            "batch=8 model.layers=4 seq=256 model.vocab=2048 model.embed=512",
        ),
        (
            dict(data=2, tensor=4, remat="selective"),
            "batch=4 model.layers=2 seq=256 model.vocab=32768",
        ),
        (dict(tensor=8, remat="full"), f"{_W7} batch=2 model.layers=2 model.vocab=128256"),
        (dict(fsdp=4, tensor=2, remat="full"), f"{_W7} batch=4 model.layers=2 model.vocab=8192"),
    )
)
GROUPS: dict[str, tuple[Probe, ...]] = {
    "small": PROBES + CONTEXT_PROBES + MOE_PROBES + PIPELINE_PROBES,
    "scale": SCALE_PROBES,
    "head": HEAD_PROBES,
    "gpt": GPT_PROBES,  # the GPT block's own counts (``--free gpt``; gpt_probes.py)
}
GROUPS["remat"] = tuple(
    (plan, words) for plan, words in GROUPS["small"] if plan.remat.policy != "none"
)
"""The small probes with a remat policy: what ``--free remat`` refits besides ``scale``."""
PROBES = GROUPS["small"] + SCALE_PROBES
PROBE_BASE = "model=llama-small seq=128"
