"""Offload tiers: optimizer state in host memory or on NVMe, layer weights in host memory.

What the trainer's step holds and moves (``parallel.offload``, ``offload_stream``,
``offload_nvme``), per device:

* optimizer state (``offload.optimizer``), streamed (``per_layer``, the default): the state
  lives in host memory; the device holds one layer's slice and the non-stacked parameters'
  state (embedding, head, norms) during the update (compiled: ``analysis.memory_kinds``).
  With ``per_layer=false`` the whole state visits the device for the update: device memory
  does not fall (measured on an H200: docs/gpu.md), only host memory grows. Either way the state
  crosses the host link twice per step, after the backward pass: nothing overlaps it;
* NVMe (``offload.nvme_path``): the state lives in files; each step reads and writes it
  once at the disk's rate, layer by layer through host buffers (the next layer's read
  overlaps the current update, so the slower of disk and host link sets the time);
* gradients (``offload.grads``, with the streamed optimizer and the weights on the device):
  the backward writes each layer's fp32 gradient to host memory as it produces it
  (``offload_grads``); the device holds one layer's instead of the stacked layers' (compiled,
  llama-tiny x 8 layers: (8 - 1) x a layer's gradient freed, to 0.1%). The way out (4 bytes a
  parameter) is assumed hidden behind the backward, the update's reads (4) are not;
* weights on NVMe (``offload.nvme_params``, with the state's files): the device holds the
  layer being computed (compiled, llama-tiny x 8 layers, remat=full: the gradient
  program's bytes fell by 7.998 layers' weights); each step reads the weights three times
  (forward, backward, update) and writes them once, at the disk's rate;
* weights (``offload.params``): the stacked layers' fp32 weights and their gradients live in
  host memory; the device holds the layer being computed and the next (prefetched), in the
  forward and the backward pass (2 x a layer's weights), and one layer's gradient; the
  update's temporaries shrink to a row's, as the update streams the weights too. The
  fetches (4 bytes a parameter forward, 4 backward) and the gradients' way out (4) are
  assumed hidden behind the layer's compute; the update's trip (weights in and out, the
  gradient in: 12 bytes a parameter) is not.
"""

from __future__ import annotations

from shardlib.parallel.offload_grads import plan_sends_grads_to_host
from shardlib.planner.cost.terms.base import ADAM_BYTES, MASTER_BYTES, Contribution, Step
from shardlib.planner.cost.terms.declare import Knob, Term
from shardlib.planner.cost.terms.state import optimizer_bytes

HOST_LINK_BW = 25e9
"""Host link bytes per second when no cluster is given (memory-only estimates)."""
NVME_BW = 3e9
"""NVMe bytes per second each way when no cluster is given (one PCIe 4 drive, sequential)."""
PREFETCHED_LAYERS = 2  # the layer computed and the next one, fetched behind it


def _state_on_device(step: Step) -> float:
    """What the streamed update stages: one layer's state and the non-stacked state."""
    view = step.view
    shards = view["data"] if view.zero >= 1 else 1
    outer = step.held_elements - step.layer_elements * step.layers_per_device
    return (step.layer_elements + outer) * ADAM_BYTES / shards


def offload(step: Step) -> Contribution:
    settings = step.view.plan.offload
    memory: dict[str, float] = {}
    seconds, notes = 0.0, []
    host_bw = step.cluster.host_link_bw if step.cluster else HOST_LINK_BW
    if settings.optimizer:
        moved = optimizer_bytes(step)
        staged = _state_on_device(step) if settings.per_layer else moved
        memory["optimizer"] = staged - moved
        if settings.nvme_path:
            nvme_bw = step.cluster.nvme_bw if step.cluster else NVME_BW
            memory["nvme: optimizer"] = moved
            seconds += 2 * moved / min(nvme_bw, host_bw)
            notes.append(f"optimizer state on NVMe: {2 * moved / nvme_bw:.3f} s of disk I/O")
            if settings.nvme_params:  # the layer loop reads one layer from the files a trip
                stacked = step.layer_elements * step.layers_per_device * MASTER_BYTES
                memory["params"] = step.layer_elements * MASTER_BYTES - stacked
                memory["nvme: params"] = stacked
                seconds += 4 * stacked / min(nvme_bw, host_bw)  # read 3 times, written once
                notes.append(f"weights on NVMe: {4 * stacked / nvme_bw:.3f} s of disk I/O")
        else:
            memory["host: optimizer"] = moved
            seconds += 2 * moved / host_bw
    if plan_sends_grads_to_host(step.view.plan):
        stacked = step.layer_elements * step.layers_per_device * MASTER_BYTES
        memory["grads"] = step.layer_elements * MASTER_BYTES - stacked
        memory["host: grads"] = stacked / (step.view["data"] if step.view.zero >= 2 else 1)
        seconds += memory["host: grads"] / host_bw  # the update reads them back, a layer a trip
        notes.append(f"gradients' way out assumed hidden: {stacked / host_bw:.3f} s")
    if settings.params:
        stacked = step.layer_elements * step.layers_per_device * MASTER_BYTES
        layer = step.layer_elements * MASTER_BYTES
        memory["params"] = PREFETCHED_LAYERS * layer - stacked
        # and the update's temporaries are one row's (state term: ``update_live`` of all):
        # compiled, llama-tiny x 32 layers, the step's total fell by 3.8 MB of 9.5 MB weights
        shards = step.view["data"] if step.view.zero >= 1 else 1
        update = step.calib["update_live"] * (stacked - layer) / shards
        memory["grads"] = layer - stacked - update
        memory["host: params"] = memory["host: grads"] = stacked
        seconds += 3 * stacked / host_bw  # the update's trip: weights in and out, grads in
        notes.append(f"layer fetches assumed hidden: {3 * stacked / host_bw:.3f} s of transfers")
    return Contribution(memory=memory, seconds=seconds, notes=tuple(notes))


TERM = Term(
    "offload",
    cost=offload,
    knobs=(Knob("offload", (False, True), trades=True),),
    settings=lambda view: {"offload": view.plan.offload.optimizer},
    knobs_text=lambda view: "offload" if view.offload else "",
)
