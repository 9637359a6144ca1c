"""Offload tiers: device memory by kind, disk bandwidth, step time, H200 prediction.

    python benchmarks/offload_tiers.py [--layers 32] [--nvme-dir DIR] [--skip-steps]

1. Compiled on one simulated CPU device (llama-tiny, ``--layers`` stacked layers): device and
   host bytes per tier, with the formula (``analysis.memory_kinds``: the CPU backend reports
   every memory kind together, so host bytes come from the ``S(5)`` entry layouts and the
   device copies of host data from the jaxpr), next to the planner's prediction.
2. This machine's disk: sequential write and read through ``numpy.memmap`` (written with
   ``fsync``, read after ``posix_fadvise(DONTNEED)`` so that the page cache does not serve it).
3. Step time on CPU per tier (no offload, host memory streamed, NVMe files), 4 layers.
4. The planner's prediction for one H200 (``meshes/clusters/h200-1.toml``): the largest Llama
   preset that fits without offload and with each tier, memory and step time. A prediction:
   no GPU ran it.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from shardlib.analysis.memory_kinds import loop_staged, memory_by_kind  # noqa: E402
from shardlib.core.mesh import single_device_mesh  # noqa: E402
from shardlib.core.workload import Workload  # noqa: E402
from shardlib.parallel.offload import Offload  # noqa: E402
from shardlib.planner.candidate import candidate  # noqa: E402
from shardlib.planner.cost.total import estimate  # noqa: E402
from shardlib.planner.inputs.cluster import load_cluster  # noqa: E402
from shardlib.train.config import override, train_config  # noqa: E402
from shardlib.train.setup import make_setup  # noqa: E402

TIERS = {
    "none": {},
    "optimizer, whole update": {"offload_optimizer": True, "offload_per_layer": False},
    "optimizer, streamed, grads kept": {"offload_optimizer": True, "offload_grads": False},
    "optimizer, streamed": {"offload_optimizer": True},  # grads leave in the backward
    "params (+ streamed update)": {"offload_params": True},
    "params + optimizer": {"offload_params": True, "offload_optimizer": True},
}
GPU_TIERS = {
    "none": Offload(),
    "optimizer -> host": Offload(optimizer=True),
    "optimizer -> NVMe": Offload(optimizer=True, nvme_path="/nvme"),
    "params + optimizer -> host": Offload(optimizer=True, params=True),
    "params -> host, optimizer -> NVMe": Offload(optimizer=True, params=True, nvme_path="/nvme"),
    "params + optimizer -> NVMe": Offload(optimizer=True, nvme_path="/nvme", nvme_params=True),
}
PRESETS = ("llama-1b", "llama3-8b", "llama2-13b", "llama2-70b", "llama3-405b")
MiB = 2**20


def _nbytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def cpu_memory(layers: int) -> None:
    cfg = train_config(steps=1, batch=4, seq=16, **{"model.layers": layers})
    print(f"\n1. compiled step, llama-tiny x {layers} layers, one CPU device (bytes)")
    plain = None
    for name, settings in TIERS.items():
        setup = make_setup(override(cfg, settings), single_device_mesh())
        state = setup.abstract_state()
        m = memory_by_kind(setup.train_step, state, setup.abstract_batch())
        plain = plain or m
        pred = estimate(setup.workload, setup.plan, backend="cpu")
        print(f"  {name:28s} {m.formula()}")
        freed = plain.device_bytes - m.device_bytes
        print(f"  {'':28s} host {m.host_bytes + m.host_temp_bytes:,}; planner: device "
              f"{pred.memory_bytes:,.0f} (x{pred.memory_bytes / m.device_bytes:.3f}), host "
              f"{pred.host_bytes:,.0f}; freed vs none {freed:,}")  # fmt: skip
        if name == "none":
            opt, blocks = _nbytes(state["opt_state"]), _nbytes(state["params"]["blocks"])
            print(f"  {'':28s} optimizer state {opt:,}; stacked weights {blocks:,} "
                  f"(one layer {blocks // layers:,})")  # fmt: skip
        if settings.get("offload_params"):
            loops = loop_staged(setup.train_step.trace(state, setup.abstract_batch()).jaxpr.jaxpr)
            print(f"  {'':28s} staged per loop trip: forward {loops[0][1]:,}, backward "
                  f"{loops[1][1]:,}, update {loops[-1][1]:,}")  # fmt: skip


def disk_bandwidth(directory: Path, mib: int = 512) -> tuple[float, float]:
    path = directory / "bandwidth.bin"
    data = np.random.default_rng(0).integers(0, 255, mib * MiB, dtype=np.uint8)
    t = time.perf_counter()
    out = np.memmap(path, np.uint8, "w+", shape=data.shape)
    out[:] = data
    out.flush()
    os.fsync(os.open(path, os.O_RDONLY))
    write = data.nbytes / (time.perf_counter() - t)
    del out
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    t = time.perf_counter()
    back = np.array(np.memmap(path, np.uint8, "r", shape=data.shape))
    read = back.nbytes / (time.perf_counter() - t)
    path.unlink()
    print(f"\n2. disk under {directory}: write {write / 1e9:.2f} GB/s, read {read / 1e9:.2f} GB/s "
          f"({mib} MiB through numpy.memmap, fsync / fadvise DONTNEED)")  # fmt: skip
    return write, read


def step_times(directory: Path, steps: int = 5) -> None:
    from shardlib.tools import parity
    from shardlib.train.nvme import build_nvme_step, nvme_state

    cfg = train_config(steps=steps, batch=8, seq=64, **{"model.layers": 4})
    batches = [np.random.default_rng(s).integers(0, 256, (8, 65)).astype(np.int32)
               for s in range(steps + 1)]  # fmt: skip
    print("\n3. step time on CPU, llama-tiny x 4 layers, batch 8 x 64 (median of "
          f"{steps} after one warm-up step)")  # fmt: skip
    host = {"offload_optimizer": True}
    for name, settings in (("none", {}), ("optimizer -> host, streamed", host)):
        setup = make_setup(override(cfg, settings), single_device_mesh())
        state = jax.device_put(setup.stored(parity.random_state(setup)), setup.state_shardings)
        times = []
        for batch in batches:
            t = time.perf_counter()
            state, metrics = setup.train_step(state, batch)
            jax.block_until_ready(metrics["loss"])
            times.append(time.perf_counter() - t)
        print(f"  {name:30s} {np.median(times[1:]) * 1e3:8.1f} ms/step")
    nvme = {"offload_optimizer": True, "offload_nvme_path": str(directory / "state")}
    setup = make_setup(override(cfg, nvme), single_device_mesh())
    params = jax.device_put(parity.random_state(setup)["params"], setup.param_shardings)
    store = nvme_state(setup, params)
    step, times = build_nvme_step(setup, store), []
    for batch in batches:
        store.io.read = store.io.written = 0
        t = time.perf_counter()
        params, metrics = step(params, batch)
        jax.block_until_ready(metrics["loss"])
        times.append(time.perf_counter() - t)
    print(f"  {'optimizer -> NVMe files':30s} {np.median(times[1:]) * 1e3:8.1f} ms/step; "
          f"read {store.io.read:,} B, written {store.io.written:,} B per step (state "
          f"{store.nbytes:,} B)")  # fmt: skip


def h200_prediction() -> None:
    import dataclasses

    cluster = load_cluster("h200-1")
    limit = cluster.memory_gb * 1e9 if hasattr(cluster, "memory_gb") else None
    print(f"\n4. PREDICTION (planner, no GPU ran this): one H200, {cluster.name}; batch 1 x 2048, "
          "bf16, remat=full; 'fits' = device bytes <= the preset's memory")  # fmt: skip
    for tier, offload in GPU_TIERS.items():
        largest = None
        for preset in PRESETS:
            w = Workload.from_preset(preset, 1, 2048, "bf16")
            plan = dataclasses.replace(candidate(data=1, remat="full"), offload=offload)
            est = estimate(w, plan, cluster)
            if est.fits:
                largest = (preset, w.param_count, est)
        if largest is None:
            print(f"  {tier:34s} none of {', '.join(PRESETS)} fits")
            continue
        preset, params, est = largest
        print(f"  {tier:34s} largest: {preset} ({params / 1e9:.1f} B params), device "
              f"{est.memory_bytes / 1e9:.1f} GB, host {est.host_bytes / 1e9:.0f} GB, NVMe "
              f"{est.nvme_bytes / 1e9:.0f} GB, step {est.step_s:.2f} s "
              f"(host transfers {est.host_s:.2f} s)")  # fmt: skip
    del limit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--nvme-dir", type=Path, default=None)
    parser.add_argument("--skip-steps", action="store_true")
    args = parser.parse_args()
    cpu_memory(args.layers)
    with tempfile.TemporaryDirectory(dir=args.nvme_dir) as tmp:
        disk_bandwidth(Path(tmp))
        if not args.skip_steps:
            step_times(Path(tmp))
    h200_prediction()


if __name__ == "__main__":
    main()
