"""How the train step runs the model's stack of layers: remat, pipeline, parameter offload.

Everything is derived from three TrainConfig fields and the mesh, in this one place:

* ``remat`` wraps the per-layer ``block_fn`` in ``jax.checkpoint`` (strategies/remat.py);
* a ``stage`` mesh axis of size p > 1 switches the pipeline on: GPipe and circular replace
  the model's ``layers`` function (strategies/pipeline.py), the bounded schedule replaces
  ``jax.value_and_grad`` itself (strategies/pipeline_1f1b.py). The pipeline's micro-batches
  take the place of gradient accumulation's; the loss is the same mean over all of them;
* ``offload_params`` keeps the stacked block weights (and their optimizer state) in
  ``pinned_host`` memory; each scan iteration fetches its layer to the device and the
  fetched copy is never saved for the backward pass (it is fetched again there).

Models plug in through the ``layers=`` argument of their ``__call__``; the bounded schedule
also needs ``embed``/``head`` methods and the stacked weights under ``blocks``.
"""

from __future__ import annotations

import sys

import jax
import optax
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from shardlib.errors import ShardingError
from shardlib.layout import mesh_axes
from shardlib.mesh import Axis
from shardlib.rules import resolve_spec
from shardlib.strategies.pipeline import PipelineSpec, pipeline_layers
from shardlib.strategies.pipeline_1f1b import bounded_value_and_grad
from shardlib.strategies.remat import RematSpec, parse_remat, remat_block

FETCHED = "fetched_param"  # checkpoint name of a layer's weights fetched from host
HOST = "pinned_host"


def model_checkpoint_names(model_cfg) -> tuple[str, ...]:
    """The intermediates a model family tags for remat (``CHECKPOINT_NAMES`` of its module)."""
    return tuple(getattr(sys.modules[type(model_cfg).__module__], "CHECKPOINT_NAMES", ()))


def pipeline_spec(cfg, axes) -> PipelineSpec | None:
    """The pipeline for this mesh, or None when it has no ``stage`` axis of size > 1."""
    p = axes.get(Axis.STAGE, 1)
    if p == 1:
        return None
    return PipelineSpec(
        stages=p,
        microbatches=cfg.pipeline_microbatches or p,
        virtual_stages=cfg.virtual_stages,
        schedule=cfg.pipeline_schedule,
    )


def check(cfg, model_cfg, mesh, rules) -> None:
    """Validate remat, pipeline and offload settings against model and mesh (no compiling)."""
    parse_remat(cfg.remat, model_checkpoint_names(model_cfg))
    axes = mesh_axes(mesh)
    from models.moe import MoeConfig

    if isinstance(model_cfg, MoeConfig) and axes.get(Axis.CONTEXT, 1) > 1:
        raise ShardingError(  # ring/all-gather attention hand the blocks token positions
            f"model {cfg.model}: a context axis splits the sequence for ring attention, which "
            "the MoE model's blocks do not take (they route whole sequences). Fix: drop the "
            "context axis (use expert/data/fsdp/tensor axes) for MoE models."
        )
    spec = pipeline_spec(cfg, axes)
    if spec is None:
        return
    if isinstance(model_cfg, MoeConfig):  # its layer loop carries router statistics
        raise ShardingError(
            f"model {cfg.model}: pipeline stages need one stack of identical blocks; the MoE "
            "model scans groups of dense and expert blocks and is not pipelined. Fix: drop "
            "the stage axis (use expert/data/fsdp/tensor axes) for MoE models."
        )
    spec.check(model_cfg.layers, cfg.microbatch)
    b = cfg.microbatch // spec.microbatches
    what = f"pipeline micro-batch ({cfg.microbatch} sequences / {spec.microbatches})"
    resolve_spec(what, (b, cfg.seq), ("batch", "seq"), rules, axes, "activations")
    if cfg.offload_params:
        raise ShardingError(
            "offload_params with a stage axis: pipelined weights stay on the device. Fix: "
            "drop offload_params or the stage axis."
        )


def _fetch(block_fn, dtype):
    """``block_fn`` reading its layer's weights from host memory into the device."""

    def fetched(layer_state, x):
        layer_state = jax.tree.map(
            lambda w: checkpoint_name(
                jax.device_put(w, jax.memory.Space.Device).astype(dtype), FETCHED
            ),
            layer_state,
        )
        return block_fn(layer_state, x)

    return fetched


def layer_loop(setup):
    """The ``layers`` function the model runs its blocks with, for GPipe/circular/no pipeline."""
    from models.llama import scan_layers

    cfg = setup.cfg
    remat = parse_remat(cfg.remat, model_checkpoint_names(setup.model_cfg))
    offload = cfg.offload_params

    def stage_layers(block_fn, blocks_state, x):
        if offload:
            block_fn = _fetch(block_fn, setup.compute_dtype)
        block_fn = remat_block(block_fn, remat, never_save=(FETCHED,) if offload else ())
        return scan_layers(block_fn, blocks_state, x)

    spec = pipeline_spec(cfg, mesh_axes(setup.mesh))
    if spec is None or spec.schedule == "bounded":
        return stage_layers
    return pipeline_layers(spec, stage_layers)


def cast_params(setup, params):
    """Master weights to the compute dtype; offloaded blocks are cast layer by layer instead."""
    dtype = setup.compute_dtype
    keep = {"blocks"} if setup.cfg.offload_params else set()  # models without blocks: all cast
    return {
        k: v if k in keep else jax.tree.map(lambda p: p.astype(dtype), v) for k, v in params.items()
    }


def param_shardings(shardings: dict, cfg) -> dict:
    """Parameter shardings with the stacked blocks in ``pinned_host`` when offloading."""
    if not cfg.offload_params:
        return shardings
    host = jax.tree.map(lambda s: s.with_memory_kind(HOST), shardings["blocks"])
    return {**shardings, "blocks": host}


def on_device(tree):
    """The optimizer update runs on device memory (XLA cannot compute on pinned_host)."""
    return jax.tree.map(lambda x: jax.device_put(x, jax.memory.Space.Device), tree)


def make_grad_fn(setup, loss_fn, *, has_aux: bool = False):
    """``(params, tokens) -> (loss, grads)``: ``jax.value_and_grad`` or the bounded pipeline.

    With ``has_aux`` the loss is ``(loss, metrics)``; the bounded schedule reports none.
    """
    spec = pipeline_spec(setup.cfg, mesh_axes(setup.mesh))
    if spec is None or spec.schedule != "bounded":
        return jax.value_and_grad(loss_fn, has_aux=has_aux)
    bounded = _bounded_grad_fn(setup, spec)
    if not has_aux:
        return bounded

    def with_aux(params, tokens_BL1):
        loss, grads = bounded(params, tokens_BL1)
        return (loss, {}), grads

    return with_aux


def _bounded_grad_fn(setup, spec: PipelineSpec):
    from models.llama import scan_layers

    graphdef, dtype = setup.graphdef, setup.compute_dtype
    remat: RematSpec = parse_remat(setup.cfg.remat, model_checkpoint_names(setup.model_cfg))
    rest_shardings = {k: v for k, v in setup.param_shardings.items() if k != "blocks"}

    def value_and_grad(params, tokens_BL1):
        cast = cast_params(setup, params)
        block_graph, blocks_state = nnx.split(nnx.merge(graphdef, cast).blocks)
        rest = {k: v for k, v in cast.items() if k != "blocks"}

        def model(r):
            return nnx.merge(graphdef, {**r, "blocks": cast["blocks"]})

        def embed(r, tokens_BL):
            return model(r).embed(tokens_BL, dtype=dtype)

        def head_loss(r, x_BLD, targets_BL):
            logits_BLV = model(r).head(x_BLD, dtype=dtype)
            return optax.softmax_cross_entropy_with_integer_labels(logits_BLV, targets_BL).mean()

        def block_fn(layer_state, x):
            return nnx.merge(block_graph, layer_state)(x)

        run = bounded_value_and_grad(
            spec,
            block_fn=remat_block(block_fn, remat),
            stage_layers=scan_layers,
            embed=embed,
            head_loss=head_loss,
        )
        loss, g_rest, g_blocks = run(rest, blocks_state, tokens_BL1, rest_shardings)
        grads = {**g_rest, "blocks": nnx.to_pure_dict(g_blocks)}
        return loss, jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)

    return value_and_grad


def layer_stack_program(setup):
    """``(jitted, args)``: the stacked blocks alone, forward and backward, as the step runs them.

    The pipeline's bubble is extra FLOPs of the blocks; the embedding, head and optimizer
    stay replicated over ``stage`` and would blur it. ``explain(jitted, *args)`` of this
    program on p stages against the same on one device gives the bubble ratio directly.
    """
    from shardlib.layout import constrain, use_layout

    graphdef, layers = setup.graphdef, layer_loop(setup)
    names = ("batch", "seq", "embed")
    x_sharding = jax.sharding.NamedSharding(setup.mesh, setup.rules.spec(names))

    def stack_loss(params, x_BLD):
        with use_layout(setup.mesh, setup.rules):
            model = nnx.merge(graphdef, cast_params(setup, params))
            block_graph, blocks_state = nnx.split(model.blocks)

            def block_fn(layer_state, x):
                return nnx.merge(block_graph, layer_state)(x)

            y_BLD = layers(block_fn, blocks_state, constrain(x_BLD, names))
            return jax.numpy.mean(jax.numpy.square(y_BLD.astype(jax.numpy.float32)))

    params = setup.abstract_state()["params"]
    x = jax.ShapeDtypeStruct(
        (setup.cfg.microbatch, setup.cfg.seq, setup.model_cfg.embed),
        setup.compute_dtype,
        sharding=x_sharding,
    )
    shardings = (setup.param_shardings, x_sharding)
    jitted = jax.jit(jax.grad(stack_loss, argnums=(0, 1)), in_shardings=shardings)
    return jitted, (params, x)
