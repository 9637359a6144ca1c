"""Rematerialisation: save less in the forward pass, recompute it in the backward pass.

The policies are the trainer's (``shardlib/parallel/remat.py``). What each one keeps is,
first, the buffers the policy keeps by definition (``KEPT``, elements per token per layer
by width, in the compute dtype), and on top of them what XLA's fusion keeps besides,
fitted to compiled programs (``calibrate.fit``: the ``selective_*``/``full_*``
coefficients are these extras, non-negative):

- ``selective`` (Korthikanti et al. 2022; ``dots_with_no_batch_dims_saveable``): the outputs
  of the projections the backward needs: q, k, v (the q/k/v width, split by tensor), the
  MLP's gate and up (2 x mlp, split), and the attention output projection's, whose width is
  h *whatever the tensor degree* (the row-parallel product before its all-reduce), plus the
  layer input the scan keeps: 2h that tensor parallelism does not shrink. Fitting these
  counts on tensor 1-2 probes hid the h part in the MLP count and under-predicted tensor 8
  by 1.76x. The scores and softmax are dropped; the backward recomputes q·kᵀ
  and the softmax: half the attention forward, 2·a·s·d FLOPs per token.
- ``full``: the layer input only (REFERENCE.md's "full recompute 2sbh" in fp16 bytes), and
  the whole layer forward again: about one extra forward pass (~33%). Outside a pipeline
  and context parallelism the trainer keeps that input split over ``tensor`` too
  (``parallel.remat.partition_saved_inputs``): h/t per token (``saved_input_split``).
A term whose backward recomputes q·kᵀ whatever the policy says so
(``Term.recomputes_scores``).

Either way one layer's recomputed intermediates are live while its backward runs
(``working_bytes``): the attention probabilities (``remat_scores``) and, under ``full``,
the rest of the layer's residuals (``full_layer_live``: a fraction of the ``none`` set).

Sublinear-memory checkpointing (``segments:k``, ``sqrt``, each with an optional
``+policy`` inside; Chen et al. 2016, ``parallel.segments``): a device keeps the k
segment inputs (``full``'s per-layer count, k times) and, while one segment's backward
runs, that segment's L/k layers under the inner policy (``segment_working``); the outer
recompute is one more forward pass on top of the inner policy's. Under GPipe the segments
are a stage's L/p layers and each loop trip keeps its k inputs (``Term.scales_saved``:
the trips); under circular a round's L/(p·v) (``trip_layers``). 1F1B, which saves what
its schedule decides, is not costed with segments.
"""

from __future__ import annotations

from shardlib.core.errors import ShardingError
from shardlib.parallel.pipeline.spec import FUSED_SCHEDULES
from shardlib.parallel.segments import parse_segments, segment_count
from shardlib.planner.cost.terms.base import Step
from shardlib.planner.cost.terms.declare import Knob, Term

REMAT = ("none", "selective", "full")
"""Remat policies the cost model knows, lightest first: keep everything; drop attention
scores; keep layer inputs (``Remat.policy``)."""

KEPT: dict[str, dict[str, float]] = {
    # what the block's backward needs, each once, in the compute dtype (a GPU's program):
    # the block input (the first norm's), the first norm's output (q/k/v's input), the
    # residual between attention and MLP (the second norm's input) and the second norm's
    # output; the attention output (``q``: heads x head_dim, the output projection's input,
    # which a fused kernel keeps as its own output too: one buffer); q, k, v after rotary;
    # gate, up and silu(gate) * up. The scores are the attention kernel's (``_saved`` of
    # terms.context: none when fused; dense attention's fitted count otherwise). Korthikanti
    # et al.'s 34·sbh is this block's 2·(5h + 3h + 3·mlp)/h ~ 32 at Llama 7B's widths.
    "none": {"h": 4.0, "q": 1.0, "qkv": 1.0, "mlp": 3.0},
    "selective": {"h": 2.0, "qkv": 1.0, "mlp": 2.0},
    "full": {"h": 1.0},
}
"""Elements per token per layer a policy keeps by definition, by width (see the docstring):
``h`` the model width, ``q`` the attention output's (heads x head_dim), ``qkv`` the q/k/v
projection's, ``mlp`` the MLP's. On the CPU backend a block kind's fp32 extras are added to
``none`` (``saved_coefficients``)."""

WIDTHS = ("h", "q", "qkv", "mlp", "scores")
"""The widths the saved counts are given in (``terms.model``)."""


def segmented(policy: str) -> tuple[int, str] | None:
    """(segments: k or ``segments.SQRT``, the per-layer policy inside) of ``segments:k`` /
    ``sqrt`` with an optional ``+policy``; None for a per-layer policy."""
    outer, _, inner = policy.partition("+")
    segments = parse_segments(outer, policy)
    return (segments, inner or "none") if segments else None


def modelled_segments(policy: str) -> bool:
    """Whether ``policy`` is a ``segments:k``/``sqrt`` spelling the cost model describes
    (its inner policy one of ``REMAT``); ``plan --fix remat=sqrt+full`` searches it."""
    try:
        seg = segmented(policy)
    except ShardingError:
        return False
    return seg is not None and seg[1] in REMAT


def per_layer(policy: str) -> str:
    """The per-layer policy: the one inside the segments, or the policy itself."""
    seg = segmented(policy)
    return seg[1] if seg else policy


def trip_layers(step: Step) -> int:
    """Layers one call of the layer loop runs on a device: all of its layers, or under the
    circular schedule one round's, L/(p·v) (``parallel.layer_loop.stage_layers``)."""
    view = step.view
    v = view.virtual if view["stage"] > 1 and view.schedule == "circular" else 1
    return step.layers_per_device // v


def segments_of(step: Step) -> int:
    """k segments of one layer-loop call's layers under ``segments``/``sqrt`` (0 otherwise)."""
    seg = segmented(step.view.remat)
    return segment_count(seg[0], trip_layers(step)) if seg else 0


def _unmodelled(view) -> str:
    seg = segmented(view.remat)
    if seg is None:
        return f"remat={view.remat}" if view.remat not in REMAT else ""
    if seg[1] not in REMAT:
        return f"remat={view.remat} (inner policy {seg[1]})"
    if view.schedule in FUSED_SCHEDULES:  # the schedule saves what it decides
        return f"remat={view.remat} with the {view.schedule} schedule"
    return ""


def on_cpu(step: Step) -> bool:
    """Whether the program is XLA:CPU's (``backend="cpu"``, what compiled validation
    measures, or a cluster of simulated CPU devices)."""
    cpu_cluster = step.cluster is not None and step.cluster.platform == "cpu"
    return step.backend == "cpu" or cpu_cluster


def saved_coefficients(
    policy: str, calib: dict, *, mlp_matrices: int = 3, cpu: bool = False, scanned: bool = True
) -> dict[str, float]:
    """Elements saved per token per layer, by width (``WIDTHS``; see ``terms.model``): what
    ``policy`` keeps by definition (``KEPT``) plus the fitted extras XLA keeps beside it
    (``{policy}_{width}``).

    remat=none on the CPU backend (``cpu``) adds what XLA:CPU's fp32 program of the block
    keeps beyond the definition in a layer loop (``scanned``: not a fused pipeline's
    one-layer VJP, ``terms.model.scanned``), read off its buffer assignment (``cpu_{width}``,
    per block kind: ``coefficients.for_block``): nothing for Llama's block (RMSNorm keeps its input,
    SwiGLU's VJP gate and up: eight h-wide and three mlp-wide stacked buffers at llama-7b,
    4 layers, 8x2048 tokens per device), and for GPT's the fp32 LayerNorms' centred and
    normalised copies (four h-wide) and tanh-GELU's VJP temporaries (four mlp-wide); and
    dense attention's score matrix twice (``cpu_scores``: q·kᵀ and its softmax, fp32),
    where a GPU's dense count is the fitted ``layer_scores`` and a fused kernel keeps none
    (``terms.context``). Counts fitted per width instead (the earlier ``layer_*``), on
    probes of 2-4 layers at seq 128, could not tell a layer's buffers from the scores nor
    from what is live once: Llama's over-booked 32 layers by 24%, GPT's read 1.35 of
    compiled at 2 layers and 0.78 at 16 under tensor 4.
    ``mlp_matrices``: ``KEPT`` counts SwiGLU's three; a two-matrix (GELU) MLP keeps one
    mlp-wide buffer fewer (its fc output and activation under none, the fc output alone
    under selective, where SwiGLU keeps gate, up and their product, or gate and up)."""
    if policy not in KEPT:
        raise ValueError(f"unknown remat policy {policy!r}")
    kept = dict(KEPT[policy])
    if "mlp" in kept:
        kept["mlp"] += mlp_matrices - 3
    out = {k: kept.get(k, 0.0) + calib.get(f"{policy}_{k}", 0.0) for k in WIDTHS}
    if policy == "none":
        if cpu and scanned:  # the block kind's fp32 extras in a layer loop
            for k in ("h", "mlp"):
                out[k] += calib.get(f"cpu_{k}", 0.0)
        # dense attention's score matrix (a fused kernel keeps none: terms.context)
        out["scores"] = calib["cpu_scores"] if cpu else calib.get("layer_scores", 0.0)
    return out


def saved_input_split(step: Step) -> int:
    """Ways ``full`` keeps a layer's input split beyond the residual stream's own layout:
    the tensor degree where ``partition_saved_inputs`` applies (no pipeline stages, no
    axis splitting the tokens of a sequence; the planner searches no sequence
    parallelism), else 1."""
    view = step.view
    whole = view.ways("layers") == 1 and view.ways("seq") == 1
    return view["tensor"] if view.remat == "full" and whole else 1


def recompute_flops(step: Step, tokens: float, layer_flops: float, attn_flops: float) -> float:
    """FLOPs the backward pass spends recomputing forward work, per device per step.

    A term may recompute the attention's probabilities in its backward whatever the policy
    (``Term.recomputes_scores``: ring attention's blocks): q·kᵀ again, as selective does.
    """
    policy, layers = per_layer(step.view.remat), step.layers_per_device
    extra = 0.0
    if segmented(step.view.remat):  # the outer recompute: each segment's forward once more
        extra += tokens * layers * (layer_flops + attn_flops)
    scores = policy == "selective" or any(
        recomputes(step) for recomputes in step.hooks("recomputes_scores")
    )
    if scores:  # q·kᵀ: half the attention FLOPs
        extra += tokens * layers * attn_flops / 2
    if policy == "full":
        extra += tokens * layers * (layer_flops + attn_flops)
    return extra


TERM = Term(
    "remat",
    knobs=(Knob("remat", REMAT, trades=True),),
    settings=lambda view: {"remat": view.plan.remat.policy},
    unmodelled=_unmodelled,
    knobs_text=lambda view: f"remat={view.remat}" if view.remat != "none" else "",
)
