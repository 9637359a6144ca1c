"""Cluster descriptions: how many devices, how much memory, how fast they compute and talk.

A cluster preset is a TOML file with a ``[cluster]`` table (``meshes/clusters/*.toml``); it
describes hardware, where a mesh preset describes a layout: devices per host, the links inside
a host (NVLink, ICI) and between hosts (the NICs), and the bus bandwidths NCCL achieves on
them. How a collective's group sits on those hosts, and so which links carry its bytes, is
``planner.cost.links``'s.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from dataclasses import dataclass
from pathlib import Path

from shardlib.core.errors import ShardingError
from shardlib.core.mesh import MESHES_DIR
from shardlib.parallel.context.choice import Device

CLUSTERS_DIR = MESHES_DIR / "clusters"
DEFAULT_BUSBW_FRACTION = 0.8
"""Achieved fraction of a link's data-sheet bandwidth for presets that cite no nccl-tests
bus bandwidth (TPU ICI, simulated CPU devices): about what the GPU presets' citations show
(meshes/clusters/a100-8.toml)."""


@dataclass(frozen=True)
class Cluster:
    """Hardware the planner plans for. Bandwidths are per device, one direction."""

    name: str
    """What it is, for tables."""
    devices_per_host: int
    """Accelerators in one host (one NVLink domain)."""
    hosts: int
    """Number of hosts."""
    memory_bytes: float
    """Memory per device (HBM)."""
    peak_flops: float
    """Peak dense bf16 FLOP/s per device (the MFU denominator)."""
    intra_host_bw: float
    """Bytes/s each device can send to peers in its host (NVLink, ICI)."""
    inter_host_bw: float
    """Bytes/s each device can send to other hosts (its share of the NICs)."""
    intra_host_busbw: float | None = None
    """Achieved bus bandwidth of a large all-reduce inside one host (nccl-tests ``busbw``,
    bytes/s), cited in the preset. Unset: ``DEFAULT_BUSBW_FRACTION`` of ``intra_host_bw``."""
    inter_host_busbw: float | None = None
    """Achieved bus bandwidth of a large all-reduce over several whole hosts (nccl-tests
    ``busbw``, bytes/s): a host's NICs together, as NCCL's rings use them. Unset:
    ``DEFAULT_BUSBW_FRACTION`` of ``inter_host_bw`` x ``devices_per_host``."""
    intra_host_latency: float = 3e-6
    """Seconds per ring step inside a host."""
    inter_host_latency: float = 10e-6
    """Seconds per ring step across hosts."""
    kernel_launch: float = 0.0
    """Seconds between one GPU kernel and the next that no kernel computes (launch and
    tail), paid per kernel (``throughput.launch_seconds``). Unset: none."""
    host_link_bw: float = 25e9
    """Bytes/s between a device and its host memory (PCIe), for offload."""
    nvme_bw: float = 3e9
    """Bytes/s each way between host memory and the NVMe tier (``offload.nvme_path``): one
    PCIe 4 drive's sequential rate; ``benchmarks/offload_tiers.py`` measures a machine's."""
    matmul_efficiency: float = 0.75
    """Fraction of peak a large, compute-bound bf16 matmul reaches: the ceiling of the
    throughput model's roofline (``planner.cost.throughput``). The A100 presets carry the value
    fitted on published runs (docs/throughput_calibration.md)."""
    sms: int = 0
    """Streaming multiprocessors (or matrix units) that a matmul's output tiles are spread
    over (A100: 108, H100 SXM: 132): small matmuls leave some idle (``planner.cost.throughput``).
    Unset (0): no wave tail."""
    sfu_rate: float = math.inf
    """Special-function results per second (``exp2``, the softmax's exponentials) over the
    whole device: 16 per clock per SM on Ampere and Hopper (CUDA C++ Programming Guide,
    "Arithmetic Instructions" throughput table). Only a described attention kernel
    (``kernels.AttentionKernel.exponentials``) reads it. Unset: free."""
    mma_sync_fraction: float = 1.0
    """Fraction of ``peak_flops`` that Ampere's warp-level ``mma.sync`` instructions reach: 1 up
    to Ampere; on Hopper the peak needs its warpgroup ``wgmma``, and a kernel issuing
    ``mma.sync`` (a 2022-23 Triton or CUTLASS 2 kernel) reaches about 2/3 (Shah et al. 2024,
    FlashAttention-3, section 2.2). Read for ``kernels.AttentionKernel.legacy_mma``."""
    tile_transfers: float = 0.0
    """Output-tile-sized HBM transfers per output tile of a GEMM that its main loop does not
    hide (the tile's store of C and its pipeline's first loads), each at the SM's share of
    HBM bandwidth (``kernels.Matmul.seconds``): what keeps products with a short inner
    dimension (a small model's d_model) below the ceiling, the more so the faster the tensor
    cores against HBM. Fitted on published runs (docs/throughput_calibration.md). Unset (0):
    none."""
    hbm_bw: float = math.inf
    """Bytes/s between a device and its own memory (HBM): the roofline's slope, and the
    rate of elementwise work. Unset: matmuls are never memory-bound, elementwise is free."""
    platform: str | None = None
    """``"cpu"``: simulated CPU devices; plans written for it can run here. ``"tpu"``: TPU
    chips. Unset: GPUs."""
    source: str = "<inline>"
    """The preset file it came from."""

    @property
    def num_devices(self) -> int:
        return self.devices_per_host * self.hosts

    @property
    def device(self) -> Device:
        """One device as ``attention_impl=auto`` sees it (``parallel.context.choice``). The
        presets carry no compute capability: head dims above 128 are costed without cuDNN."""
        return Device(self.platform or "gpu", self.memory_bytes)

    def with_hosts(self, hosts: int) -> Cluster:
        """The same hardware with another number of hosts (``--hosts``)."""
        return dataclasses.replace(self, hosts=hosts, name=f"{self.name} [{hosts} hosts]")

    def busbw(self, intra: bool) -> float:
        """Achieved bytes/s per device of a ring collective: inside a host (NVLink), or one
        device's share of its host's NICs across hosts (``planner.cost.links`` multiplies it
        by the members a group has in a host)."""
        if intra:
            measured = self.intra_host_busbw
            return measured if measured else DEFAULT_BUSBW_FRACTION * self.intra_host_bw
        if self.inter_host_busbw:
            return self.inter_host_busbw / self.devices_per_host
        return DEFAULT_BUSBW_FRACTION * self.inter_host_bw


_FIELDS = {
    "name": ("name", str, 1.0),
    "devices_per_host": ("devices_per_host", int, 1.0),
    "hosts": ("hosts", int, 1.0),
    "memory_gb": ("memory_bytes", float, 1e9),
    "peak_tflops": ("peak_flops", float, 1e12),
    "intra_host_gbps": ("intra_host_bw", float, 1e9),
    "inter_host_gbps": ("inter_host_bw", float, 1e9),
    "intra_host_busbw_gbps": ("intra_host_busbw", float, 1e9),
    "inter_host_busbw_gbps": ("inter_host_busbw", float, 1e9),
    "intra_host_latency_us": ("intra_host_latency", float, 1e-6),
    "inter_host_latency_us": ("inter_host_latency", float, 1e-6),
    "host_link_gbps": ("host_link_bw", float, 1e9),
    "nvme_gbps": ("nvme_bw", float, 1e9),
    "kernel_launch_us": ("kernel_launch", float, 1e-6),
    "matmul_efficiency": ("matmul_efficiency", float, 1.0),
    "hbm_gbps": ("hbm_bw", float, 1e9),
    "sfu_tops": ("sfu_rate", float, 1e12),
    "tile_transfers": ("tile_transfers", float, 1.0),
    "mma_sync_fraction": ("mma_sync_fraction", float, 1.0),
    "sms": ("sms", int, 1.0),
}

_REQUIRED = tuple(
    key
    for key, (field, _, _) in _FIELDS.items()
    if Cluster.__dataclass_fields__[field].default is dataclasses.MISSING and key != "name"
)
"""The preset keys of the fields ``Cluster`` has no default for."""


def cluster_presets() -> list[Path]:
    return sorted(CLUSTERS_DIR.glob("*.toml"))


def load_cluster(path_or_name: str | Path) -> Cluster:
    """Read a cluster preset: a path, or a name from ``meshes/clusters/``."""
    path = Path(path_or_name)
    if not path.exists() and not path.suffix:
        path = CLUSTERS_DIR / f"{path_or_name}.toml"
    if not path.exists():
        known = ", ".join(p.stem for p in cluster_presets())
        raise ShardingError(f"cluster preset {str(path_or_name)!r} not found. Presets: {known}.")
    with path.open("rb") as f:
        doc = tomllib.load(f)
    table = doc.get("cluster")
    if table is None:
        hint = " It is a mesh preset ([mesh])." if "mesh" in doc else ""
        raise ShardingError(
            f"cluster {path}: no [cluster] table.{hint} Fix: pass a cluster preset from "
            f"meshes/clusters/ ({', '.join(p.stem for p in cluster_presets())})."
        )
    unknown = sorted(set(table) - set(_FIELDS))
    missing = [key for key in _REQUIRED if key not in table]
    if missing:
        raise ShardingError(
            f"cluster {path}: [cluster] lacks {', '.join(missing)}. Fix: add them (every "
            f"preset needs {', '.join(_REQUIRED)}; see meshes/clusters/a100-8.toml)."
        )
    if unknown:
        raise ShardingError(
            f"cluster {path}: unknown keys {', '.join(unknown)} in [cluster]. Fix: use only "
            f"{', '.join(_FIELDS)}."
        )
    values = {}
    for key, (field, kind, scale) in _FIELDS.items():
        if key in table and key != "name":
            if isinstance(table[key], bool) or not isinstance(table[key], int | float):
                raise ShardingError(
                    f"cluster {path}: {key} = {table[key]!r} is not a number. Fix: write it "
                    "as a TOML number (memory_gb = 80.0)."
                )
            values[field] = kind(table[key] * scale)
    cluster = Cluster(
        name=table.get("name", path.stem),
        platform=doc.get("platform"),
        source=str(path),
        **values,
    )
    if cluster.devices_per_host < 1 or cluster.hosts < 1 or not cluster.peak_flops > 0:
        raise ShardingError(
            f"cluster {path}: devices_per_host, hosts and peak_tflops must be positive. "
            "Fix: correct them in [cluster]."
        )
    return cluster
