"""A collective's time as NCCL runs it: which of its bytes stay in a host and which cross.

Pricing every byte of a collective whose group spans hosts at one GPU's share of the NICs
(what the planner did before) is right for a group with one member per host (the data axis
of a layout with tensor or FSDP inside the host: each member's ring edge leaves its host on
its own NIC), and wrong by up to the host's GPU count for a group with several. NCCL builds
its rings (one per channel, the channels spread over all the host's NICs) so that a host's
members sit next to each other: each ring leaves and enters a host once, and the bytes that
cross are carried by all the members' NICs together (NCCL's "Performance" notes on
bus bandwidth: https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md, where a
multi-node all-reduce's bus bandwidth is the host's NIC bandwidth, not one NIC's). So, per
kind, for a group of ``g`` devices of which ``g_h`` share a host, spanning ``H = g/g_h``
hosts, with ``W`` the ring's wire bytes per device (``ring_wire_bytes``):

* **all-gather, reduce-scatter, all-reduce** (rings): each device's ``W`` goes over NVLink
  (``g_h - 1`` of each host's ring edges) and over the host's NICs (one edge per host per
  ring, shared by ``g_h`` NICs): ``W / min(intra, g_h x inter)``. With ``g_h = 1`` this is
  one NIC, as before; inside one host, NVLink.
* **all-to-all**: every device sends ``(g - g_h)/g`` of its buffer to other hosts over its
  own NIC (rails), the rest over NVLink at the same time: the crossing share on one NIC.
* **collective-permute** (a pipeline hand-over): the whole buffer over one link, a NIC if
  the peer is in another host.

Latency (small messages): a ring of ``g`` takes ``g - 1`` steps (all-reduce ``2(g - 1)``)
over its hops, ``H`` of them NIC hops and the rest NVLink ones. An all-reduce across hosts
is run by NCCL as a ring or a tree, whichever its tuning model says is faster for the
message (``seconds``), each with its own latency and bandwidth (NCCL ``src/graph/tuning.cc``,
``ncclTopoTuneModel`` and ``ncclTopoGetAlgoTime``): the tree's is
``2 (log2 H x inter + (g_h - 1) x intra)`` hop latencies at ``TREE_BUSBW`` of the ring's
bus bandwidth; the ring's, once the message fills its channels, ``RING_PLATEAU`` times its
hop latencies. (Before, the tree's latency was taken with the ring's bandwidth: a large
all-reduce over many hosts came out faster than either algorithm runs it.) The bandwidths
are the cluster preset's achieved ones (``Cluster.busbw``: the published nccl-tests bus
bandwidths each preset cites), not fitted on training runs.
Hierarchical forms (HSDP's data axis, ZeRO++'s secondary partition inside a host) need no
rule of their own: their groups are priced by the same span.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from shardlib.planner.inputs.cluster import Cluster

RINGS = ("all-gather", "reduce-scatter", "all-reduce")


@dataclass(frozen=True)
class Span:
    """How a collective's group sits on the hosts."""

    group: int
    """Devices per group."""
    per_host: int
    """Of them, in one host."""

    @property
    def hosts(self) -> int:
        return max(1, self.group // self.per_host)


def span(cluster: Cluster, axes: Sequence[tuple[str, int]], names: Sequence[str]) -> Span:
    """The group over mesh axes ``names`` of the mesh ``axes`` (outermost first, the last
    varying fastest over device ids): how many of its devices share a host."""
    inner, group, per_host = 1, 1, 1
    for axis, size in reversed(tuple(axes)):
        if axis in names:
            group *= size
            room = cluster.devices_per_host // inner if inner < cluster.devices_per_host else 1
            per_host *= math.gcd(size, max(room, 1))
        inner *= size
    return Span(group, per_host)


def bandwidth(cluster: Cluster, kind: str, where: Span) -> float:
    """Achieved bytes/s of one device's ring wire bytes (``ring_wire_bytes``) of ``kind``."""
    intra, inter = cluster.busbw(intra=True), cluster.busbw(intra=False)
    if where.hosts == 1:
        return intra
    if kind in RINGS:
        return min(intra, where.per_host * inter)
    if kind == "all-to-all":  # the crossing share of the wire bytes, on the device's own NIC
        crossing = (where.group - where.per_host) / max(where.group - 1, 1)
        return inter / crossing
    return inter  # collective-permute: a peer in another host


TREE_BUSBW = 0.92
"""A tree all-reduce's bus bandwidth across hosts, as a fraction of the ring's: NCCL's tuning
model (``tuning.cc``, NCCL 2.12 onwards) sets the tree's to ``min(0.92 x busBw, nChannels x
perChMaxTreeBw)``; the per-channel cap (Ampere at 4+ nodes: 17.8 GB/s) binds only below
about ten channels, so 0.92. (NCCL 2.7-2.8, 2020-21, capped the tree at 80 GB/s across more
than two nodes.)"""
RING_PLATEAU = 1.4
"""NCCL's factor on a ring all-reduce's latency across nodes once each rank and channel has
64 bytes or more (``ncclTopoGetAlgoTime``, "Plateau effect of ring": 1.4 from compute
capability 8.0, 1.9 before)."""
MAX_CHANNELS = 32
"""NCCL's ``MAXCHANNELS``: the plateau is applied when the buffer has 64 bytes per rank per
channel even with all of them (a lower bound on where NCCL applies it)."""


def latency(cluster: Cluster, kind: str, where: Span) -> float:
    """Seconds of a ring's hop latencies of one collective (message-size independent)."""
    intra, inter = cluster.intra_host_latency, cluster.inter_host_latency
    if kind == "collective-permute":
        return inter if where.hosts > 1 else intra
    g, hosts = where.group, where.hosts
    # a ring's g hops: one leaves each host (a NIC), the rest are NVLink; each of its
    # g - 1 steps (2(g - 1) for an all-reduce) waits on the ring's hops in turn
    hop = (hosts * inter + (g - hosts) * intra) / g if hosts > 1 else intra
    return (2 if kind == "all-reduce" else 1) * (g - 1) * hop


def tree_latency(cluster: Cluster, where: Span) -> float:
    """Seconds of NCCL's tree all-reduce across hosts (a chain inside each): up and down,
    ``log2 H`` NIC hops deep."""
    inter, intra = cluster.inter_host_latency, cluster.intra_host_latency
    return 2 * (math.ceil(math.log2(where.hosts)) * inter + (where.per_host - 1) * intra)


@functools.lru_cache(maxsize=65536)
def priced(cluster: Cluster, kind: str, axes: tuple, names: tuple) -> tuple[float, float]:
    """(bytes/s, seconds of ring latency per collective) of ``kind`` over ``names``."""
    where = span(cluster, axes, names)
    return bandwidth(cluster, kind, where), latency(cluster, kind, where)


def seconds(
    cluster: Cluster, kind: str, axes: tuple, names: tuple, wire: float, buffer: float
) -> float:
    """Seconds of one collective of ``kind`` over ``names`` moving ``wire`` ring wire bytes
    per device (``ring_wire_bytes`` of a ``buffer``-byte message): its ring, or for an
    all-reduce across hosts the faster of NCCL's ring and tree, each at its own latency and
    bandwidth."""
    bw, ring_latency = priced(cluster, kind, axes, names)
    where = span(cluster, axes, names)
    if kind != "all-reduce" or where.hosts == 1:
        return wire / bw + ring_latency
    if buffer >= 64 * MAX_CHANNELS * where.group:
        ring_latency *= RING_PLATEAU
    ring = wire / bw + ring_latency
    tree = wire / (TREE_BUSBW * bw) + tree_latency(cluster, where)
    return min(ring, tree)
