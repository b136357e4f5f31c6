"""The machines a plan is for: each device's memory, which devices a --device
plans for, the interconnects inside and between nodes, and the dp ring hop
by hop on them."""

from __future__ import annotations

import dataclasses
import functools

from nanohlat.mesh import Mesh
from nanohlat.plan.fmt import GiB


# Memory of ONE process's device (one NeuronCore / GPU), for "does it fit".
# trn1: 32 GiB HBM per Trainium chip, 2 NeuronCore-v2 each (trn1.32xlarge:
# 512 GiB for 32 cores). GPUs: the datasheet sizes of the SXM parts.
DEVICE_MEMORY = {"NeuronCore-v2": 16 * GiB, "A100": 80e9, "H100": 80e9, "H200": 141e9}

# --device -> the devices of the time estimate and the "does it fit" lines.
PLAN_DEVICES = {"xla": ["NeuronCore-v2"], "cuda": ["A100", "H100", "H200"], "cpu": ["cpu"],
                "auto": ["NeuronCore-v2", "H100", "cpu"]}


@dataclasses.dataclass(frozen=True)
class Network:
    """How fast one process's device talks to the others: inside its node (one
    instance / server) and across nodes, in bytes/s sent per device in one
    direction, and a fixed cost per collective call."""
    node: str
    per_node: int            # devices (processes) in one node
    inside: float            # B/s a device sends to devices of its own node
    across: float            # B/s a device sends to other nodes: its share of the node's network
                             # (tp, pp); the dp ring instead divides the whole, across x per_node,
                             # by the hops that leave the node at once (dp_ring)
    latency_inside: float    # s per collective call, inside a node  (assumption)
    latency_across: float    # s per collective call, across nodes   (assumption)
    note: str                # printed with the estimate: what is stated and what is assumed


NETWORKS = {
    # trn1.32xlarge: 16 Trainium chips = 32 NeuronCore-v2, linked by NeuronLink-v2
    # (a 4D hypercube; 4 links per chip), and 800 Gbps of EFA to other instances
    # (AWS Neuron docs, "Trn1/Trn1n Architecture"; "Trainium/Inferentia2
    # Architecture Guide for NKI"). EFA: 800e9 / 8 B/s shared by the 32 cores.
    # The docs give no NeuronLink-v2 bandwidth: 100 GB/s per core is an assumption.
    "NeuronCore-v2": Network("trn1.32xlarge", 32, 100e9, 800e9 / 8 / 32, 10e-6, 30e-6,
                             "32 NeuronCores per trn1.32xlarge and 800 Gbps EFA per instance (Neuron docs); "
                             "NeuronLink-v2 at 100 GB/s per core is an ASSUMPTION (the docs give no figure; "
                             "measure with nccom-test)"),
    # DGX A100: 8 GPUs, NVLink 3 at 600 GB/s per GPU, both directions together
    # (A100 datasheet); 8 x 200 Gb/s HDR InfiniBand, one per GPU (DGX A100 datasheet).
    "A100": Network("DGX A100", 8, 300e9, 200e9 / 8, 10e-6, 20e-6,
                    "NVLink 600 GB/s per GPU (both directions), 200 Gb/s InfiniBand per GPU (NVIDIA datasheets)"),
    # DGX H100: 8 GPUs, NVLink 4 at 900 GB/s per GPU, both directions (H100
    # datasheet); 8 x 400 Gb/s ConnectX-7 InfiniBand, one per GPU (DGX H100 datasheet).
    "H100": Network("DGX H100", 8, 450e9, 400e9 / 8, 10e-6, 20e-6,
                    "NVLink 900 GB/s per GPU (both directions), 400 Gb/s InfiniBand per GPU (NVIDIA datasheets)"),
    # HGX H200: the same NVLink 900 GB/s per GPU (H200 datasheet); nodes built
    # like the DGX H100, one 400 Gb/s InfiniBand port per GPU (assumed).
    "H200": Network("HGX H200", 8, 450e9, 400e9 / 8, 10e-6, 20e-6,
                    "NVLink 900 GB/s per GPU (H200 datasheet); 400 Gb/s InfiniBand per GPU, as in a DGX H100 "
                    "(assumed)"),
    # gloo over the loopback of one machine: memory copies through the kernel.
    # On the 2-core development machine, busy with other work, a 16 MiB all-reduce
    # between 2 processes ran at 0.18 GB/s and a 4-byte one took ~6 ms; quiet, it
    # does several times better. Stated, not measured per run.
    "cpu": Network("one machine", 1 << 30, 1e9, 1e9, 50e-6, 50e-6,
                   "gloo over loopback: 1 GB/s per process and 50 us per call, STATED (a busy 2-core machine "
                   "measured 0.18 GB/s)"),
}
NETWORKS["NeuronCore-v2 (trn1n)"] = dataclasses.replace(          # trn1n.32xlarge: twice the EFA
    NETWORKS["NeuronCore-v2"], node="trn1n.32xlarge", across=1600e9 / 8 / 32,
    note="trn1n.32xlarge: the same, with 1600 Gbps EFA per instance (Neuron docs)")


def group_inside_node(ranks: list[int], per_node: int) -> bool:
    """Whether every rank of a group sits in the same node (ranks fill nodes in order)."""
    return len({r // per_node for r in ranks}) == 1


# ---------------------------------------------------------------------------
# The dp ring, hop by hop
#
# A ring collective over n ranks in rank order sends, at every one of its
# steps, one chunk from each rank to the next (the last to the first), all
# hops at once; the step ends when the slowest hop has delivered. With 4 dp
# ranks per node (hlat-7b: tp 8 on a 32-core trn1.32xlarge) the dp ring
# 0 -> 8 -> 16 -> 24 -> 32 -> ... stays on NeuronLink for 3 hops of 4 and
# leaves the node on the 4th. The hops that leave a node at the same time,
# one per ring that runs then (8 rings: one per tp rank), share its EFA.
# ---------------------------------------------------------------------------

def ring_hops(ranks: list[int], per_node: int) -> list[tuple[int, int, bool]]:
    """The hops of a ring over `ranks` in their order: (sender, receiver, leaves the node)."""
    n = len(ranks)
    return [(ranks[i], ranks[(i + 1) % n], ranks[i] // per_node != ranks[(i + 1) % n] // per_node)
            for i in range(n)] if n > 1 else []


def dp_groups(tp: int, pp: int, dp: int) -> list[list[int]]:
    """Every dp group, ranks in ring order, as mesh.py builds them: one per (stage, tp rank), rank 0's
    first; all reduce at the same time."""
    return Mesh(tp, pp, dp)._all("dp")


def rings_leaving_a_node(groups: list[list[int]], per_node: int) -> int:
    """The most hops, over all nodes, that leave one node at the same time when
    every ring in `groups` runs at once: the ways its network is shared."""
    leaving: dict[int, int] = {}
    for ranks in groups:
        for sender, _, off in ring_hops(ranks, per_node):
            if off:
                leaving[sender // per_node] = leaving.get(sender // per_node, 0) + 1
    return max(leaving.values(), default=0)


@dataclasses.dataclass(frozen=True)
class Ring:
    """Rank 0's dp ring on a network: its hops, and what sets its pace."""
    ranks_per_node: int      # ranks of the ring in rank 0's node
    on_node: int             # hops that stay inside a node (NeuronLink / NVLink)
    off_node: int            # hops over the network (EFA / InfiniBand)
    sharing: int             # hops leaving one node at once, all rings together
    off_node_bw: float       # B/s of one off-node hop: the node's network / sharing
    bandwidth: float         # B/s of the slowest hop: the ring's pace
    latency: float           # s per collective call (across, if any hop leaves the node)


@functools.lru_cache(maxsize=4096)
def dp_ring(tp: int, pp: int, dp: int, net: Network) -> Ring:
    """Rank 0's dp ring, hop by hop, on `net` (every dp ring has the same shape)."""
    rings = dp_groups(tp, pp, dp)
    hops = ring_hops(rings[0], net.per_node)
    off = sum(1 for *_, o in hops if o)
    sharing = rings_leaving_a_node(rings, net.per_node) if off else 0
    off_bw = net.across * net.per_node / sharing if off else 0.0   # the node's whole network, shared
    on_node = len(hops) - off
    bandwidth = min([net.inside] * (on_node > 0) + [off_bw] * (off > 0), default=net.inside)
    per_node = sum(1 for r in rings[0] if r // net.per_node == 0)
    return Ring(per_node, on_node, off, sharing, off_bw, bandwidth,
                net.latency_across if off else net.latency_inside)
