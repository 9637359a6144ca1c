"""The train state's layout: the shapes and shardings of parameters, optimizer state, step
counter, loss scale and FP8 scales, as one tree (``state_shardings``, ``abstract_state``).

A mixin of ``TrainSetup`` (``train.setup``), kept apart so that the setup module stays about
binding a config to a mesh: it reads the setup's ``tx``, ``plan``, ``mesh``, ``cfg``,
``workload``, ``graphdef`` and parameter shapes, names and shardings.
"""

from __future__ import annotations

from functools import cached_property

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardlib.parallel import state as layouts
from shardlib.parallel.offload import HOST_MEMORY
from shardlib.parallel.pipeline import two_bw
from shardlib.train import fp8, precision, two_bw_state


class StateLayout:
    """Shapes and shardings of the whole train state (a ``TrainSetup`` mixin)."""

    @cached_property
    def _abstract_opt_state(self):
        return jax.eval_shape(self.tx.init, self.param_shapes)

    @cached_property
    def opt_state_shardings(self):
        """Each state tensor laid out like its parameter under the optimizer-state rules
        (factored statistics keep their remaining dims' splits); counters replicated; in
        pinned host memory with ``offload.optimizer``."""
        specs = layouts.opt_state_specs(
            self.tx,
            self._abstract_opt_state,
            self.param_shapes,
            self.mesh,
            self.plan.state_rules.opt_state,
            names=self.param_names,
        )
        if self.plan.data.onebit_momentum:  # 1-bit Adam's error buffers: one per device
            from shardlib.train.onebit import error_specs

            specs = error_specs(specs, self._abstract_opt_state)
        kind = HOST_MEMORY if self.plan.offload.optimizer else None
        return layouts.shardings(specs, self.mesh, kind)

    @cached_property
    def fp8_names(self) -> tuple[str, ...]:
        """The projections that run in FP8 (``ops.matmul``'s names in one block)."""
        return fp8.matmul_names(self.graphdef, self.param_shapes)

    def init_fp8(self) -> dict:
        """The FP8 scales and amax histories, one set per projection and stacked block."""
        layers = self.workload.blocks
        return fp8.init_meta(self.fp8_names, layers, self.cfg.precision.fp8_amax_history)

    @cached_property
    def fp8_shardings(self) -> dict | None:
        """Replicated scales and histories (None without FP8)."""
        if not fp8.enabled(self.cfg.precision):
            return None
        replicated = NamedSharding(self.mesh, P())
        return jax.tree.map(lambda _: replicated, jax.eval_shape(self.init_fp8))

    @property
    def stale_weights(self) -> bool:
        """Whether the state keeps the previous step's weights (``pipeline_schedule=2bw``
        on a stage axis: ``parallel/pipeline/two_bw.py``)."""
        return two_bw.stale(self.plan.pipeline_spec())

    @property
    def _carry_init(self):
        """2bw's ``init_carry(params, tokens)`` (``train.two_bw_state``)."""
        return two_bw_state.carry_init(self)

    @cached_property
    def carry_shapes(self) -> dict:
        """2bw's in-flight pipeline work between steps, abstractly (``two_bw_loop``)."""
        return two_bw_state.carry_shapes(self)

    @cached_property
    def carry_shardings(self) -> dict:
        """Its layout (``train.two_bw_state.carry_shardings``)."""
        return two_bw_state.carry_shardings(self)

    @cached_property
    def state_shardings(self) -> dict:
        replicated = NamedSharding(self.mesh, P())
        out = {
            "params": self.param_shardings,
            "opt_state": self.opt_state_shardings,
            "step": replicated,
        }
        if self.stale_weights:  # 2bw's W(t-1), laid out like the parameters, and its carry
            out[two_bw.PREV_PARAMS] = self.param_shardings
            out[two_bw.CARRY] = self.carry_shardings
        if precision.uses_loss_scale(self.cfg.precision):
            out["loss_scale"] = jax.tree.map(
                lambda _: replicated, precision.abstract_loss_scale(self.cfg.precision)
            )
        if self.fp8_shardings is not None:
            out[fp8.KEY] = self.fp8_shardings
        return out

    def abstract_state(self) -> dict:
        """ShapeDtypeStructs with shardings: compile (``explain``) without allocating."""
        return jax.tree.map(
            lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
            self.state_shapes(),
            self.state_shardings,
        )

    def state_shapes(self) -> dict:
        """The train state's ShapeDtypeStructs (``state_shardings``' tree)."""
        shapes = {
            "params": self.param_shapes,
            "opt_state": self._abstract_opt_state,
            "step": jax.ShapeDtypeStruct((), jnp.int32),
        }
        if self.stale_weights:
            shapes[two_bw.PREV_PARAMS] = self.param_shapes
            shapes[two_bw.CARRY] = self.carry_shapes
        if precision.uses_loss_scale(self.cfg.precision):
            shapes["loss_scale"] = precision.abstract_loss_scale(self.cfg.precision)
        if fp8.enabled(self.cfg.precision):
            shapes[fp8.KEY] = jax.eval_shape(self.init_fp8)
        return shapes
