"""FP8 training (``precision=fp8``): Transformer Engine's delayed scaling, with Flax's ops.

Its own module because it owns a piece of the train state and of the step that bf16 and
fp16 do not have: the per-projection scales and amax histories, their refusals, and the
form of ``ops.matmul`` that reads them. The numerics are ``flax.linen.fp8_ops``', not
written again here:

* each projection of a block (``ops.matmul``: q/k/v, o, gate/up, down) quantizes both
  operands to e4m3 and back (``fp8_ops.in_qdq``) and the gradient of its output to e5m2 and
  back (``fp8_ops.out_qdq``). XLA on Hopper rewrites this quantize-dequantize pattern
  around a dot into an FP8 GEMM; on CPU it runs as written, with the same rounding. The
  embedding lookup, the norms, attention's softmax and the LM head stay in bf16 (as
  Transformer Engine and MaxText keep the head);
* delayed scaling: a tensor is quantized with ``scale = max(amax history) / fp8_max``
  (``fp8_ops.compute_scale``, margin 0) from the steps before this one, and this step's
  amax enters the history (``fp8_ops.compute_amax_history``: the newest at index 0, the
  last ``fp8_amax_history`` values kept);
* the state (``state["fp8"]``, beside ``params``) is ``{projection: {input_scale [layers,
  1], input_amax_history [layers, H], kernel_*, output_grad_*}}``: one set per projection
  and layer, stacked like the blocks' weights, so it travels through the layer loop beside
  them (``ops.run_blocks``' ``layer_extras``). It enters the loss as a differentiable input,
  and its "gradient" is its next value (Flax's overwrite-with-gradient custom VJPs): the
  step writes that back and the optimizer, weight decay, clipping and the gradient norm
  never see it;
* data parallelism: an amax is ``max(|x|)`` over the whole (logical) tensor, so under
  GSPMD a batch split over ``data``/``fsdp`` (or heads and MLP over a 1D ``tensor`` axis)
  reduces it with an all-reduce of max and every replica holds the same new history and
  scale (the layout parity tests check it).

Layouts whose gradient is not one ``jax.value_and_grad`` of the whole batch under GSPMD
(micro-batches summed, pipelines, ZeRO++, 1-bit momentum, offloaded layer weights) or
whose projections do not go through ``ops.matmul`` (MoE experts, LoRA adapters) are
refused by ``check`` before anything is compiled.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from flax.linen import fp8_ops

from shardlib.core.errors import ShardingError
from shardlib.core.mesh import Axis
from shardlib.core.ops import use_matmul

E4M3 = jnp.float8_e4m3fn  # forward operands: activations and weights (max 448)
E5M2 = jnp.float8_e5m2  # gradients (max 57344)
KEY = "fp8"  # the state's entry, and the meta's entry in the loss's differentiable input
ROLES = ("input", "kernel", "output_grad")  # Flax's names (``Fp8DotGeneralBase``)


def enabled(prec) -> bool:
    return prec.compute == "fp8"


def init_projection(history: int) -> dict:
    """One projection's scales [1] (ones) and amax histories [history] (zeros), Flax's init."""
    out = {}
    for role in ROLES:
        out[f"{role}_scale"] = jnp.ones((1,), jnp.float32)  # [1]
        out[f"{role}_amax_history"] = jnp.zeros((history,), jnp.float32)  # [history]
    return out


def init_meta(names: tuple[str, ...], layers: int, history: int) -> dict:
    """``{name: {leaf: [layers, ...]}}``: every projection's state, one per stacked block."""
    one = init_projection(history)
    return {n: jax.tree.map(lambda x: jnp.broadcast_to(x, (layers, *x.shape)), one) for n in names}


def qdq_matmul(spec: str, x, w, name: str, layer_meta):
    """``einsum(spec, x, w)`` with both operands quantize-dequantized to e4m3 and the
    output's gradient to e5m2, with ``name``'s scales in this layer (``ops.MatmulForm``)."""
    if layer_meta is None or name not in layer_meta:
        raise ShardingError(
            f"precision=fp8: projection {name!r} ran outside the layer loop or was not found "
            f"when the FP8 state was built (known: {sorted(layer_meta or {})}). Fix: call "
            "ops.matmul only inside the model's stacked blocks, or use precision=bf16."
        )
    m, dt = layer_meta[name], x.dtype
    x_q = fp8_ops.in_qdq(dt, E4M3, x, m["input_scale"], m["input_amax_history"])
    w_q = fp8_ops.in_qdq(dt, E4M3, w.astype(dt), m["kernel_scale"], m["kernel_amax_history"])
    y = jnp.einsum(spec, x_q, w_q)
    return fp8_ops.out_qdq(dt, E5M2, y, m["output_grad_scale"], m["output_grad_amax_history"])


def matmul_names(graphdef: nnx.GraphDef, param_shapes: dict) -> tuple[str, ...]:
    """The names the model's blocks give ``ops.matmul``, in call order, read from one
    abstract forward pass (nothing is computed)."""
    names: list[str] = []

    def record(spec, x, w, name, _layer_meta):
        names.append(name)
        return jnp.einsum(spec, x, w)

    def forward(params):
        with use_matmul(record):
            return nnx.merge(graphdef, params)(jnp.zeros((1, 2), jnp.int32))

    jax.eval_shape(forward, param_shapes)
    if not names:
        raise ShardingError(
            "precision=fp8: the model's blocks call no ops.matmul, so nothing would run in "
            "FP8. Fix: route the block's projections through shardlib.core.ops.matmul, or "
            "use precision=bf16."
        )
    return tuple(dict.fromkeys(names))


def with_meta(params: dict, meta: dict | None) -> dict:
    """The loss's differentiable input: the parameters and, under FP8, the meta."""
    return params if meta is None else {**params, KEY: meta}


def split_meta(tree: dict) -> tuple[dict, dict | None]:
    """(parameters, meta or None) of ``with_meta``'s tree (or of its gradient)."""
    if KEY not in tree:
        return tree, None
    return {k: v for k, v in tree.items() if k != KEY}, tree[KEY]


def eval_params(state: dict) -> dict:
    """What the eval step reads of the state: the parameters (and the FP8 meta)."""
    return with_meta(state["params"], state.get(KEY))


def advice(prec, remat: str, platform: str) -> str:
    """What an FP8 run on a GPU should know about its remat policy ("" if nothing).

    XLA turns the quantize-dequantize pattern into FP8 GEMMs only where a product sees it:
    without full recompute the backward products read the dequantized operands the forward
    saved and run in bf16 (4 of 15 products FP8 on an H200, jax 0.11.2; 15 of 15 under
    ``remat=full``, 1.37x bf16's tokens/s: docs/gpu.md)."""
    if not enabled(prec) or platform != "gpu" or remat == "full":
        return ""
    return (
        f"precision=fp8 with remat={remat}: only the forward products become FP8 GEMMs on "
        "this XLA; remat=full makes the backward ones FP8 too (1.37x bf16 measured)"
    )


def check(cfg, plan, workload) -> None:
    """Refuse, before compiling, the layouts FP8 does not run on (the module docstring)."""
    if not enabled(cfg.precision):
        return
    axes = plan.mesh_axes
    refusals = [
        (plan.pipeline_spec() is not None, "a pipeline (stage axis)",
         "a mesh without a stage axis (data/fsdp)"),
        (workload.routing is not None, "a mixture-of-experts model (expert products are not "
         "FP8 projections)", "a dense model"),
        (cfg.lora.rank > 0, "LoRA adapters", "lora.rank=0"),
        (any(axes.get(a, 1) > 1 for a in (Axis.TENSOR2, Axis.TENSOR3, Axis.TENSOR_DEPTH)),
         "2D/2.5D/3D tensor parallelism",
         "one tensor axis (Megatron 1D) with data/fsdp"),
        (axes.get(Axis.CONTEXT, 1) > 1, "context parallelism", "a mesh without a context axis"),
        (axes.get(Axis.EXPERT, 1) > 1, "expert parallelism", "a mesh without an expert axis"),
        (plan.data.microbatches > 1, f"parallel.data.microbatches={plan.data.microbatches} "
         "(the amax of summed micro-batch gradients would be their mean, not their max)",
         "microbatches=1 with a batch that fits"),
        (plan.data.zeropp, "ZeRO++ (its gradient path is a shard_map)", "zero=3 without ZeRO++"),
        (plan.data.onebit_momentum, "1-bit momentum (per-device gradients)", "optimizer=adamw"),
        (plan.offload.params, "offloaded layer weights (the layer fetch casts the layer's "
         "state)", "offload.params=false"),
    ]  # fmt: skip
    for refused, layout, fix in refusals:
        if refused:
            raise ShardingError(
                f"precision=fp8 does not run with {layout}: the FP8 scales and amax "
                f"histories would not update as delayed scaling needs. Fix: {fix}, or "
                "precision=bf16."
            )
