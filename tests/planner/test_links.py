"""Collectives priced as NCCL runs them (``planner.cost.links``): the bytes that cross hosts
ride all of a host's NICs for a ring, one NIC for an all-to-all's crossing share or a
hand-over; latencies of a ring or, for an all-reduce across hosts, a tree."""

from __future__ import annotations

import dataclasses
import math

import pytest

from shardlib.planner import load_cluster
from shardlib.planner.cost import links
from shardlib.planner.inputs.cluster import DEFAULT_BUSBW_FRACTION


@pytest.fixture(scope="module")
def a100():
    return load_cluster("a100-8").with_hosts(8)  # 64 GPUs, 8 per host


def test_span_counts_a_groups_devices_per_host(a100):
    axes = (("data", 4), ("fsdp", 16))  # fsdp: 16 devices over 2 hosts; data: 1 per host
    assert links.span(a100, axes, ("fsdp",)) == links.Span(16, 8)
    assert links.span(a100, axes, ("data",)) == links.Span(4, 1)
    assert links.span(a100, axes, ("data", "fsdp")) == links.Span(64, 8)
    assert links.span(a100, (("fsdp", 4),), ("fsdp",)).hosts == 1


def test_ring_across_hosts_uses_the_hosts_nics_together(a100):
    nic = a100.busbw(intra=False)
    assert nic == pytest.approx(a100.inter_host_busbw / 8)  # one GPU's share of 192 GB/s
    axes = (("data", 4), ("fsdp", 16))
    for kind in ("all-gather", "reduce-scatter", "all-reduce"):
        bw, _ = links.priced(a100, kind, axes, ("fsdp",))
        assert bw == pytest.approx(8 * nic)  # all eight NICs: 8x one NIC
        assert bw < a100.busbw(intra=True)  # and slower than NVLink
    # one member per host (HSDP's data axis): each ring edge leaves on its own NIC
    assert links.priced(a100, "all-reduce", axes, ("data",))[0] == pytest.approx(nic)
    # inside a host: NVLink's achieved bus bandwidth
    assert links.priced(a100, "all-gather", (("fsdp", 8),), ("fsdp",))[0] == a100.busbw(True)


def test_all_to_all_and_permute_cross_on_one_nic(a100):
    axes = (("expert", 16),)  # 16 devices over 2 hosts: 8 of each device's 15 peers elsewhere
    bw, _ = links.priced(a100, "all-to-all", axes, ("expert",))
    crossing = (16 - 8) / (16 - 1)
    assert bw == pytest.approx(a100.busbw(intra=False) / crossing)
    assert links.priced(a100, "collective-permute", (("stage", 16),), ("stage",))[0] == (
        a100.busbw(intra=False)
    )


def test_latency_ring_hops_and_the_tree_for_all_reduce(a100):
    big = a100.with_hosts(64)  # 512 GPUs
    axes = (("fsdp", 512),)
    where = links.span(big, axes, ("fsdp",))
    ring_hop = (64 * big.inter_host_latency + 448 * big.intra_host_latency) / 512
    assert links.latency(big, "all-gather", where) == pytest.approx(511 * ring_hop)
    assert links.latency(big, "all-reduce", where) == pytest.approx(2 * 511 * ring_hop)
    tree = 2 * (math.log2(64) * big.inter_host_latency + 7 * big.intra_host_latency)
    assert links.tree_latency(big, where) == pytest.approx(tree)
    assert tree < 2 * 511 * ring_hop


def test_all_reduce_across_hosts_is_the_faster_of_ring_and_tree_each_at_its_own_price(a100):
    """NCCL picks ring or tree per message; the tree's low latency comes with its own (lower)
    bandwidth, never with the ring's."""
    big = a100.with_hosts(64)
    axes, names = (("fsdp", 512),), ("fsdp",)
    where = links.span(big, axes, names)
    bw, _ = links.priced(big, "all-reduce", axes, names)
    ring_lat = links.latency(big, "all-reduce", where) * links.RING_PLATEAU
    tree_lat = links.tree_latency(big, where)

    def seconds(buffer):
        wire = 2 * buffer * 511 / 512
        return links.seconds(big, "all-reduce", axes, names, wire, buffer), wire

    small, wire = seconds(64 * 1024)  # latency-bound: the tree
    assert small == pytest.approx(wire / (links.TREE_BUSBW * bw) + tree_lat)
    huge, wire = seconds(64e9)  # bandwidth-bound: the ring, plateau and all
    assert huge == pytest.approx(wire / bw + ring_lat)
    for buffer in (64 * 1024, 1e8, 1e9, 64e9):  # never the tree's latency at the ring's rate
        t, wire = seconds(buffer)
        assert t > wire / bw + tree_lat
    # inside one host, or any other kind: the ring as before
    one = links.seconds(big, "all-gather", axes, names, 1e9, 1e9)
    assert one == pytest.approx(1e9 / bw + links.latency(big, "all-gather", where))


def test_presets_without_measured_bus_bandwidth_take_the_default_fraction(a100):
    bare = dataclasses.replace(a100, intra_host_busbw=None, inter_host_busbw=None)
    assert bare.busbw(intra=True) == DEFAULT_BUSBW_FRACTION * bare.intra_host_bw
    assert bare.busbw(intra=False) == DEFAULT_BUSBW_FRACTION * bare.inter_host_bw
