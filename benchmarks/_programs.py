"""Programs compiled by the benchmarks and tests: parts of the train step, measured alone."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from shardlib.core.layout import constrain, use_layout
from shardlib.parallel.layer_loop import cast_params, master_blocks


def layer_stack_program(setup, *, forward_only: bool = False):
    """``(jitted, args)``: the stacked blocks alone, forward and backward, as the step runs them.

    The pipeline's bubble is extra FLOPs of the blocks; the embedding, head and optimizer
    stay replicated over ``stage`` and would blur it. ``explain(jitted, *args)`` of this
    program on p stages against the same on one device gives the bubble ratio directly.
    The blocks run through the plan's layer loop (remat policy, pipeline schedule, parameter
    offload) on one gradient-accumulation micro-batch; ``forward_only``: the loss alone,
    whose FLOPs are the forward pass a recompute repeats.
    """
    plan, workload = setup.plan, setup.workload
    graphdef, dtype = setup.graphdef, setup.compute_dtype
    layers = plan.layer_loop(workload, dtype)
    names = ("batch", "seq", "embed")
    x_sharding = jax.sharding.NamedSharding(setup.mesh, setup.rules.spec(names))

    def stack_loss(params, x_BLD):
        with use_layout(setup.mesh, setup.rules):
            cast = cast_params(params, dtype, keep_blocks=master_blocks(plan))
            model = nnx.merge(graphdef, cast)
            block_graph, blocks_state = nnx.split(model.blocks)

            def block_fn(layer_state, x):
                return nnx.merge(block_graph, layer_state)(x, None)  # natural token order

            with plan.ops():
                y_BLD = layers(block_fn, blocks_state, constrain(x_BLD, names))
            return jnp.mean(jnp.square(y_BLD.astype(jnp.float32)))

    params = setup.abstract_state()["params"]
    x = jax.ShapeDtypeStruct(
        (workload.micro_batch, workload.seq, workload.dims["embed"]),  # [batch, seq, embed]
        setup.compute_dtype,
        sharding=x_sharding,
    )
    shardings = (setup.param_shardings, x_sharding)
    fn = stack_loss if forward_only else jax.grad(stack_loss, argnums=(0, 1))
    jitted = jax.jit(fn, in_shardings=shardings)
    return jitted, (params, x)
