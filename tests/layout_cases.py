"""What the layout test files share: a mesh over the first devices, one one-device reference
per config, and the two checks each case runs (parity with it, or a refusal naming the fix).

A reference trace and its initial state are computed once per config and process: initial
values do not depend on the layout, so every case compiles only its own step.
"""

import math
from functools import cache

import jax
import pytest

from shardlib import ShardingError, mesh_spec
from shardlib.tools.parity import FP32_TOLERANCE, compare, trace
from shardlib.train.config import TrainConfig, override
from shardlib.train.setup import make_setup


def first_devices_mesh(**axes: int):
    """A mesh of these axis sizes over the first prod(sizes) devices."""
    return mesh_spec(**axes).build(jax.devices()[: math.prod(axes.values())])


@cache
def one_device_reference(cfg: TrainConfig):
    """(trace, initial host state) of ``cfg`` on one device."""
    setup = make_setup(cfg, first_devices_mesh(data=1))
    state = jax.device_get(setup.init_state())
    return trace(setup, state), state


def assert_parity(cfg: TrainConfig, axes: dict, overrides: dict) -> None:
    """``cfg`` with ``overrides`` on ``axes`` trains like one device (fp32 tolerance)."""
    ref, state = one_device_reference(cfg)
    setup = make_setup(override(cfg, overrides), first_devices_mesh(**axes))
    result = compare(setup, ref, state)
    assert result.max_rel_loss_err <= FP32_TOLERANCE, result
    assert result.ok(), result


def assert_refused(cfg: TrainConfig, axes: dict, overrides: dict, words: list[str]) -> None:
    """Setting up ``cfg`` with ``overrides`` on ``axes`` fails before compiling, and the
    error says each of ``words``."""
    with pytest.raises(ShardingError) as err:
        make_setup(override(cfg, overrides), first_devices_mesh(**axes))
    for word in words:
        assert word in str(err.value), err.value
