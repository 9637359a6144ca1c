"""Host offload (ZeRO-Offload): state kept in ``pinned_host`` memory between steps.

* ``optimizer``: the optimizer state lives in host memory; each step moves it to the
  device for the update and back (the train step's in/out shardings say so);
  with ``per_layer`` (the default) the update streams it one layer at a time instead
  (``offload_stream.py``), so the device never holds more than a layer's worth of it;
  the stacked layers' gradients leave for host memory as the backward produces them
  (``grads``, ``offload_grads.py``);
* ``params``: the stacked block weights (and their optimizer state) live in host memory;
  the layer loop fetches one layer at a time and never saves the fetched copy for the
  backward pass (it is fetched again there).

XLA moves the bytes; nothing here writes a transfer except the per-layer fetch and the
gradients' way out (``offload_grads``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from shardlib.core.errors import ShardingError
from shardlib.core.mesh import Axis

HOST_MEMORY = "pinned_host"
DEVICE_MEMORY = "device"
HOST_KINDS = ("pinned_host", "unpinned_host")
"""Memory kinds that are host memory (what a layout report counts apart from the device's)."""


@dataclass(frozen=True)
class Offload:
    """``[parallel.offload]``: what lives in host memory between steps."""

    axes: ClassVar[dict[str, str]] = {}  # no mesh axis of its own
    logical_names: ClassVar[dict[str, str]] = {}

    optimizer: bool = False
    """Keep optimizer state in pinned host memory between steps (ZeRO-Offload)."""
    params: bool = False
    """Keep the stacked block weights in pinned host memory; fetch one layer at a time."""
    nvme_path: str = ""
    """With ``optimizer``: keep the optimizer state in files under this directory
    (ZeRO-Infinity's NVMe tier, ``offload_nvme``), streamed one layer at a time through
    pinned host buffers; stepped by ``shardlib.train.nvme``. Empty: host memory."""
    nvme_params: bool = False
    """With ``nvme_path``: the stacked block weights in files there too (ZeRO-Infinity's
    ``offload_param.device: nvme``, ``offload_nvme_params``): the layer loop reads each
    layer from the files, forward and backward, and the update writes it back."""
    per_layer: bool = True
    """With ``optimizer``: update the offloaded state one stacked layer at a time, so the
    device holds one layer's state during the update (``offload_stream``; Adam, AdamW,
    SGD). False: the whole state visits the device for the update (any optimizer)."""

    grads: bool = True
    """With ``optimizer`` and ``per_layer`` (weights on the device, one micro-batch, no
    pipeline): each layer's weight gradient leaves for host memory as the backward produces
    it (``offload_grads``, ZeRO-Offload's overlap), so the device never holds them all.
    False: they stay on the device until the streamed update moves them, a layer a trip."""

    def check(self, mesh_axes: Mapping[str, int], rules, workload) -> None:
        if self.nvme_path and not self.optimizer:
            raise ShardingError(
                f"offload.nvme_path={self.nvme_path!r} holds the optimizer state, but "
                "offload.optimizer is off. Fix: offload_optimizer=true, or drop nvme_path."
            )
        if self.nvme_params and (not self.nvme_path or self.params):
            raise ShardingError(
                f"offload.nvme_params keeps the stacked weights in files under nvme_path, but "
                f"nvme_path={self.nvme_path!r}, offload.params={self.params} (host memory). "
                "Fix: offload_nvme_path=DIR with offload_params=false, or drop nvme_params."
            )
        if self.params and mesh_axes.get(Axis.STAGE, 1) > 1:
            raise ShardingError(
                "offload_params with a stage axis: pipelined weights stay on the device. Fix: "
                "drop offload_params or the stage axis."
            )
