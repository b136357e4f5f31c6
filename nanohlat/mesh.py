"""The 3D mesh: which rank holds which piece of the model, and the process groups.

World = dp x pp x tp. Tensor-parallel ranks are neighbours (they talk inside
every layer, so they get the fastest links: the NeuronCores of one trn1 chip,
the GPUs of one NVLink island), then data-parallel, then pipeline (docs/design.md
section 4): `coords` and `rank_of` number the ranks so, and a group of each kind
holds the ranks that differ in that coordinate only. A tp group splits every
layer's matrices, a dp group holds the same weights and sees different data, a
pp group runs one stage each (tutorial.md chapter 6 numbers the ranks of an
example).

Every rank creates every group in the same order (collective libraries require
it), and a group of size 1 is never created: collectives on it are no-ops.

Two kinds of groups are special cases, each in a labelled section at the end
of this file, to skip on a first reading: the kv groups (only when tp >
n_kv_heads) and the pipeline's neighbour pairs in the shape XLA wants. A mesh
can be given kinds of groups of its own (`extra`) before its groups are built.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .comm import Group
from .config import ModelConfig


def coords(rank: int, tp: int, pp: int, dp: int) -> tuple[int, int, int]:
    """rank -> (dp_rank, pp_rank, tp_rank); the inverse of `rank_of`."""
    # exercise 6a: begin
    return (rank // tp) % dp, rank // (tp * dp), rank % tp
    # exercise 6a: end


def rank_of(dp_rank: int, pp_rank: int, tp_rank: int, tp: int, dp: int) -> int:
    # exercise 6a: begin
    return (pp_rank * dp + dp_rank) * tp + tp_rank
    # exercise 6a: end


@dataclass
class Mesh:
    """Coordinates of this rank and the groups it belongs to. Built once, passed explicitly."""

    tp: int
    pp: int
    dp: int
    rank: int = 0
    ledger: object = None
    groups: dict = field(default_factory=dict)
    kv_replicas: int = 1        # tp ranks per kv head when tp > n_kv_heads (kv_replicas())
    # kinds of group given to this mesh: kind -> function(mesh) -> its groups, drawn from the mesh it is
    # given (a seam: docs/design.md 1)
    extra: dict = field(default_factory=dict)
    grad_kind = "dp"            # the kind of group a gradient is summed over (a seam: docs/design.md 1)

    def __post_init__(self):
        self.dp_rank, self.pp_rank, self.tp_rank = coords(self.rank, self.tp, self.pp, self.dp)

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    def kinds(self) -> tuple:
        """Every kind of group, in the order every rank creates them."""
        return ("tp", "dp", "pp", "pair_even", "pair_odd", "kv") + tuple(self.extra)

    def _all(self, kind: str) -> list[list[int]]:
        """Every group of one kind, as lists of ranks, in a fixed order. 'kv' and
        'pair_even' / 'pair_odd' are the special cases at the end of this file."""
        tp, pp, dp = self.tp, self.pp, self.dp
        if kind in self.extra:
            return self.extra[kind](self)
        if kind == "kv":
            return kv_groups(tp, pp, dp, self.kv_replicas)
        r = lambda d, p, t: rank_of(d, p, t, tp, dp)
        # exercise 6b: begin
        if kind == "tp":
            return [[r(d, p, t) for t in range(tp)] for p in range(pp) for d in range(dp)]
        if kind == "dp":
            return [[r(d, p, t) for d in range(dp)] for p in range(pp) for t in range(tp)]
        if kind == "pp":
            return [[r(d, p, t) for p in range(pp)] for d in range(dp) for t in range(tp)]
        # exercise 6b: end
        return pair_groups(kind, tp, pp, dp)   # 'pair_even' or 'pair_odd'

    def build_groups(self, device=None) -> "Mesh":
        """Create the process groups. Every rank calls this, in the same order."""
        if device is not None and self.world > 1:
            import torch.distributed as dist
            everyone = list(range(self.world))
            self.groups["world"] = Group("world", everyone, self.rank, dist.group.WORLD, self.ledger)
        for kind in self.kinds():
            partition = self._all(kind)
            for ranks in partition:
                pg = None
                if len(ranks) > 1 and device is not None:
                    pg = device.new_group(ranks, partition)
                if self.rank in ranks:
                    pair = kind.startswith("pair")
                    g = Group("pp" if pair else kind, ranks, ranks.index(self.rank), pg, self.ledger)
                    self.groups[pair_key(ranks, self.rank, self.stage_of, self.pp) if pair else kind] = g
        return self

    def group(self, key: str) -> Group:
        """'tp', 'dp', 'pp', 'world', 'next' (pair with stage+1), 'prev' (pair
        with stage-1), 'kv' (the ranks sharing this rank's kv head), 'wrap'
        (last stage <-> first stage, pp > 2), or a kind given in `extra`."""
        if key not in self.groups:  # single process, or no such neighbour
            self.groups[key] = Group(key, [self.rank], 0, None, self.ledger)
        return self.groups[key]

    @property
    def tp_group(self) -> Group:
        return self.group("tp")

    @property
    def dp_group(self) -> Group:
        return self.group("dp")

    @property
    def pp_group(self) -> Group:
        return self.group("pp")

    @property
    def grad_group(self) -> Group:
        """The ranks over which a parameter's gradient is summed: those holding the same weights and
        other tokens (grad_kind: the dp group)."""
        return self.group(self.grad_kind)

    def stage_of(self, rank: int) -> int:
        """The pipeline stage of `rank`."""
        return coords(rank, self.tp, self.pp, self.dp)[1]

    def sequence_part(self, inputs, targets) -> tuple:
        """The part of each of this rank's sequences it trains on, inputs and targets (mb, T): all of it."""
        return inputs, targets


# ---------------------------------------------------------------------------
# Kv-head replication, only when tp > n_kv_heads (tensor_parallel.py's last
# section says why): the "kv groups" of ranks holding copies of one kv head.
# ---------------------------------------------------------------------------

def kv_replicas(model: ModelConfig, tp: int) -> int:
    """How many tp ranks hold a copy of each kv head: tp / n_kv_heads when tp
    is larger (HLAT-70B: 32 / 8 = 4), else 1 (each rank has its own kv heads)."""
    return tp // model.n_kv_heads if tp > model.n_kv_heads else 1


def kv_groups(tp: int, pp: int, dp: int, k: int) -> list[list[int]]:
    """The kv groups: each tp group cut into runs of k neighbouring ranks
    ([0 1] [2 3] at tp 4 with 2 kv heads, k = 2); none when k = 1."""
    if k == 1:
        return []
    return [[rank_of(d, p, t, tp, dp) for t in range(i, i + k)]
            for p in range(pp) for d in range(dp) for i in range(0, tp, k)]


# ---------------------------------------------------------------------------
# Pipeline neighbour pairs, shaped for XLA: only when pp > 1. The pipeline
# sends activations and gradients between stages b and b+1 through a 2-rank
# group (comm.exchange), which is all a first reading needs:
# mesh.group("next") and mesh.group("prev"). The rest is there because the
# xla backend wants each kind of group to be a partition of the ranks into
# disjoint groups of one size, which the chain of pairs is not: so the pairs
# come in two kinds, even and odd boundaries (the odd one closes the ring).
# Every backend builds them the same way.
# ---------------------------------------------------------------------------

def pair_groups(kind: str, tp: int, pp: int, dp: int) -> list[list[int]]:
    """The pairs of stages b <-> b+1 for even (kind 'pair_even') or odd
    ('pair_odd') boundaries b, each kind a set of disjoint equal-size groups.
    With an even pp > 2 the odd kind also pairs the last stage with the first
    (b = pp-1 <-> 0, the 'wrap' pair: for a schedule that goes round the stages
    more than once), so that, as in neuronx-distributed, every rank is in one
    pair of each kind. (pp = 2 has one boundary; with an odd pp the ring cannot split into
    disjoint pairs, and the odd kind leaves the last stage out.) Each pair
    lists its ranks in increasing order, the order in which torch.distributed
    numbers a group's members (the wrap pair too: [first stage, last stage])."""
    parity = 0 if kind == "pair_even" else 1
    last = pp if pp > 2 and pp % 2 == 0 else pp - 1
    return [sorted([rank_of(d, b, t, tp, dp), rank_of(d, (b + 1) % pp, t, tp, dp)])
            for b in range(parity, last, 2) for d in range(dp) for t in range(tp)]


def pair_key(ranks: list[int], rank: int, stage_of, pp: int) -> str:
    """The name `rank` gives its pair `ranks` (stage_of: a rank's stage): 'next' (the pair
    with stage + 1), 'prev' (with stage - 1), or 'wrap' (last stage <-> first, pp > 2)."""
    mine, theirs = (stage_of(r) for r in sorted(ranks, key=lambda r: r != rank))
    if pp > 2 and {mine, theirs} == {0, pp - 1}:
        return "wrap"
    return "next" if theirs == mine + 1 else "prev"
