"""Calibration probes of the GPT block (``models.gpt``: LayerNorm with biases, biased
projections, a two-matrix GELU MLP), for its own per-layer coefficients (``gpt_*`` in
``planner.cost.coefficients``, read for workloads whose ``block_kind`` is ``gpt``).

The Llama probes (``probes.PROBES``) fit what a Llama block saves; a GPT block's LayerNorms and
GELU keep other buffers (gpt3-13b on 64 devices with remat=none read 0.881 of compiled with
Llama's counts). Same widths and layouts as the small Llama probes, plus published GPT-3
widths at 2 layers, and 8 layers beside 2-4 at the same shapes (what a layer keeps apart
from what is live once); ``python -m shardlib.planner.calibrate.fit --group gpt --free gpt``
compiles them and refits the fitted ``gpt_*`` counts alone (what one layer's backward holds
at once, selective's extras), the Llama ones untouched. What a GPT layer keeps under
remat=none is counted, not fitted (``gpt_cpu_h``, ``gpt_cpu_mlp``): per-width counts fitted
on 2-4 layers put a layer's buffers into a once-live term (39 h-wide) and read 0.78 of
compiled at 16 layers on tensor 4, 2.07 under 1F1B.
"""

from __future__ import annotations

from shardlib.planner.candidate import candidate

_GPT = "model=gpt-tiny model.vocab=8192 model.embed=256 model.heads=8"  # llama-small's widths
_GPT3 = "model.vocab=50304 model.layers=2"  # published widths, Megatron's padded vocab

GPT_PROBES = tuple(
    (candidate(**plan), words)
    for plan, words in (
        (dict(data=8), f"{_GPT} batch=16 model.layers=2"),
        (dict(data=8), f"{_GPT} batch=16 model.layers=4"),
        (dict(data=8), f"{_GPT} batch=16 model.layers=2 model.mlp=2048"),
        (dict(data=8), f"{_GPT} batch=16 model.layers=2 seq=256"),
        (dict(data=8), f"{_GPT} batch=16 model.layers=2 model.embed=512"),
        (dict(data=4, tensor=2), f"{_GPT} batch=8 model.layers=2"),
        (dict(data=2, tensor=4), f"{_GPT} batch=4 model.layers=4"),
        (dict(fsdp=8), f"{_GPT} batch=16 model.layers=4"),
        (dict(fsdp=4, tensor=2), f"{_GPT} batch=8 model.layers=4"),
        (dict(data=2, fsdp=2, tensor=2), f"{_GPT} batch=16 model.layers=4 seq=256"),
        (dict(fsdp=8), f"model=gpt3-1.3b {_GPT3} batch=8 seq=2048"),
        (dict(fsdp=4, tensor=2), f"model=gpt3-6.7b {_GPT3} batch=4 seq=1024"),
        (dict(fsdp=4, tensor=2, microbatches=2), f"model=gpt3-13b {_GPT3} batch=8 seq=2048"),
        (dict(data=2, fsdp=2, tensor=2), f"model=gpt3-2.7b {_GPT3} batch=8 seq=2048"),
        # deeper: the saved layers outweigh the rest, as at full depth
        (dict(fsdp=8), f"model=gpt3-1.3b {_GPT3} batch=8 seq=2048 model.layers=8"),
        (
            dict(fsdp=4, tensor=2, microbatches=2),
            f"model=gpt3-6.7b {_GPT3} batch=8 seq=2048 model.layers=6",
        ),
        (
            dict(data=2, fsdp=2, tensor=2, microbatches=2),
            f"model=gpt3-13b {_GPT3} batch=8 seq=2048 model.layers=4",
        ),
        # 8 layers beside 2-4 at the same shapes: what a layer keeps apart from what is
        # live once (the two read alike at 2-4 layers), unsplit and under tensor 4
        (dict(data=8), f"{_GPT} batch=16 model.layers=8 seq=256"),
        (dict(data=2, tensor=4), f"{_GPT} batch=8 model.layers=8 seq=256"),
        (dict(data=8, remat="selective"), f"{_GPT} batch=16 model.layers=4 seq=256"),
        (dict(fsdp=4, tensor=2, remat="selective"), f"{_GPT} batch=16 model.layers=4 seq=256"),
        (dict(tensor=8, remat="selective"), f"model=gpt3-6.7b {_GPT3} batch=4 seq=2048"),
        (dict(tensor=8, remat="selective"), f"model=gpt3-13b {_GPT3} batch=4 seq=2048"),
        (dict(fsdp=4, tensor=2, remat="full"), f"{_GPT} batch=16 model.layers=4 seq=256"),
    )
)
"""(plan, workload words) of each GPT probe; ``probes.PROBE_BASE`` (seq=128) goes first."""

GPT_FREE = ("gpt_layer_live_h", "gpt_layer_live_scores",
            "gpt_layer_live_mlp", "gpt_selective_h", "gpt_selective_mlp")  # fmt: skip
"""The coefficients ``--free gpt`` refits on these probes."""
