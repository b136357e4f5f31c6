"""The 3D mesh: which rank holds which piece of the model, and the process groups.

World = dp x pp x tp. Tensor-parallel ranks are neighbours (they talk inside
every layer, so they get the fastest links: the NeuronCores of one trn1 chip,
the GPUs of one NVLink island), then data-parallel, then pipeline (docs/design.md section 4):

    rank = (pp_rank * dp + dp_rank) * tp + tp_rank

Example, tp=2, pp=2, dp=2 (8 ranks):

    rank  0  1  2  3  4  5  6  7
    dp    0  0  1  1  0  0  1  1
    pp    0  0  0  0  1  1  1  1
    tp    0  1  0  1  0  1  0  1

    tp groups  [0 1] [2 3] [4 5] [6 7]   (split every layer's matrices)
    dp groups  [0 2] [1 3] [4 6] [5 7]   (same weights, different data)
    pp groups  [0 4] [1 5] [2 6] [3 7]   (stage 0 -> stage 1)

Every rank creates every group in the same order (collective libraries require
it), and a group of size 1 is never created: collectives on it are no-ops.

Four kinds of groups are special cases, each in a labelled section at the end
of this file, to skip on a first reading: the kv groups (only when tp >
n_kv_heads), the pipeline's neighbour pairs in the shape XLA wants, the
expert-parallel groups of a mixture of experts (only with --ep > 1), and the
context-parallel dimension (only with --cp > 1), which sits between tp and dp.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .comm import Group
from .config import ModelConfig, TrainConfig, UserError


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _choices(xs) -> str:
    xs = list(xs)
    return ", ".join(map(str, xs[:-1])) + (" or " if len(xs) > 1 else "") + str(xs[-1])


def validate_layout(model: ModelConfig, tcfg: TrainConfig, world: int) -> int:
    """Refuse a layout that cannot work, before any worker starts. Returns dp."""
    tp, pp, cp = tcfg.tp, tcfg.pp, tcfg.cp
    cp_text = f" x --cp {cp}" if cp > 1 else ""
    if world % (tp * pp * cp):
        raise UserError(f"--tp {tp} x --pp {pp}{cp_text} = {tp * pp * cp} does not divide the world size {world}; "
                        f"choose tp*pp{'*cp' if cp > 1 else ''} among {_choices(divisors(world))}")
    dp = tcfg.dp or world // (tp * pp * cp)
    if tp * pp * cp * dp != world:
        raise UserError(f"--tp {tp} x --pp {pp}{cp_text} x --dp {dp} = {tp * pp * cp * dp} but the world has "
                        f"{world} processes; use --dp {world // (tp * pp * cp)} or leave --dp unset")
    # kv heads: each rank holds n_kv_heads/tp of them, or (tp a multiple of
    # n_kv_heads) a replica of one, shared with tp/n_kv_heads ranks
    kv_fits = lambda d: model.n_kv_heads % d == 0 or d % model.n_kv_heads == 0
    common = [d for d in divisors(model.n_heads) if kv_fits(d) and model.ffn_dim % d == 0
              and model.padded_vocab % d == 0]
    for what, n in (("n_heads", model.n_heads), ("ffn_dim", model.ffn_dim), ("padded vocabulary", model.padded_vocab)):
        if n % tp:
            hint = (f", or a --vocab-multiple that --tp {tp} divides (the vocabulary is padded up to a "
                    f"multiple of it, now {model.vocab_multiple})") if what == "padded vocabulary" else ""
            raise UserError(f"--tp {tp} does not divide {what} {n}; choose {_choices(common)}{hint}")
    if not kv_fits(tp):
        raise UserError(f"--tp {tp} and n_kv_heads {model.n_kv_heads}: one must divide the other (a tp rank holds "
                        f"whole kv heads, or several ranks share one); choose {_choices(common)}")
    if pp > model.n_layers or model.n_layers % pp:
        raise UserError(f"--pp {pp} cannot split {model.n_layers} layers into equal contiguous stages; "
                        f"choose {_choices(divisors(model.n_layers))}")
    v = tcfg.virtual_stages   # > 1: interleaved (config.py checked that the schedule is); the refusal names what failed
    needs = {f"--pp >= 2 (got {pp})": pp >= 2,
             f"--pp x --virtual-stages = {pp * v} chunks of equal size (--n-layers {model.n_layers})": model.n_layers % (pp * v) == 0,
             f"--microbatches {tcfg.microbatches} a multiple of --pp (micro-batches go through the chunks in groups of pp)": tcfg.microbatches % pp == 0}
    if v > 1 and not all(needs.values()):
        raise UserError("--schedule interleaved needs " + "; ".join(need for need, met in needs.items() if not met))
    if tcfg.schedule == "zb-h1" and tcfg.microbatches < pp:
        raise UserError(f"--schedule zb-h1 needs --microbatches >= --pp (got {tcfg.microbatches} < {pp}): W fills "
                        f"the bubble, (p-1)/(3m+p-1), once the pipeline holds a micro-batch per stage")
    per_rank = tcfg.batch_size // dp if tcfg.batch_size % dp == 0 else 0
    if not per_rank or per_rank % tcfg.microbatches:
        raise UserError(f"--batch-size {tcfg.batch_size} must split into dp {dp} x microbatches "
                        f"{tcfg.microbatches} equal micro-batches; use a multiple of {dp * tcfg.microbatches}")
    if tcfg.sequence_parallel and tcfg.seq_len % tp:
        raise UserError(f"--sequence-parallel needs --seq-len {tcfg.seq_len} divisible by --tp {tp}")
    if tcfg.ep > 1:
        check_ep(tcfg, dp, model.moe_experts)
    return dp


def coords(rank: int, tp: int, pp: int, dp: int) -> tuple[int, int, int]:
    """rank -> (dp_rank, pp_rank, tp_rank); the inverse of `rank_of`."""
    # exercise 6a: begin
    return (rank // tp) % dp, rank // (tp * dp), rank % tp
    # exercise 6a: end


def rank_of(dp_rank: int, pp_rank: int, tp_rank: int, tp: int, dp: int) -> int:
    # exercise 6a: begin
    return (pp_rank * dp + dp_rank) * tp + tp_rank
    # exercise 6a: end


def stage_layer_text(n_layers: int, pp: int, stage: int, v: int = 1) -> str:
    """A stage's layers as text: '2-3', or with v chunks each chunk's run, '2-3,10-11'."""
    per = n_layers // (pp * v)
    return ",".join(f"{k * per}-{(k + 1) * per - 1}" for k in range(stage, pp * v, pp))


def layout_table(tp: int, pp: int, dp: int, n_layers: int | None = None, max_rows: int = 64, v: int = 1,
                 cp: int = 1) -> str:
    """The printable rank -> (dp, pp, tp) table (`--plan` and the run's log);
    v: model chunks per stage (interleaved schedule); cp > 1: a cp column too."""
    world = tp * pp * dp * cp
    per = bool(n_layers)
    lines = [f"world {world} = dp {dp} x pp {pp}" + (f" x cp {cp}" if cp > 1 else "") + f" x tp {tp}",
             "rank  dp  pp" + ("  cp" if cp > 1 else "") + "  tp" + ("  layers" if per else "")]
    shown = list(range(world)) if world <= max_rows else list(range(max_rows // 2)) + list(range(world - max_rows // 2, world))
    for i, r in enumerate(shown):
        if i and shown[i - 1] != r - 1:
            lines.append(f"  ... {r - shown[i - 1] - 1} more ranks ...")
        d, p, inner = coords(r, tp * cp, pp, dp)   # (cp, tp) as one inner coordinate: mesh.py's last section
        c, t = divmod(inner, tp)
        row = f"{r:4d} {d:3d} {p:3d}" + (f" {c:3d}" if cp > 1 else "") + f" {t:3d}"
        if per:
            row += f"  {stage_layer_text(n_layers, pp, p, v)}" + ("  +embedding" if p == 0 else "") + ("  +norm,head,loss" if p == pp - 1 else "")
        lines.append(row)
    return "\n".join(lines)


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
    virtual_stages: int = 1     # interleaved: chunks per stage; > 1 needs the wrap pair (last -> first stage)
    ep: int = 1                 # expert parallelism: dp ranks sharing a mixture's experts (ep_groups())
    cp: int = 1                 # context parallelism: ranks sharing each sequence (the last section)

    def __post_init__(self):
        # with cp > 1, (cp, tp) is one inner coordinate of size cp * tp (the last section)
        self.dp_rank, self.pp_rank, inner = coords(self.rank, self.tp * self.cp, self.pp, self.dp)
        self.cp_rank, self.tp_rank = divmod(inner, self.tp)

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    def _all(self, kind: str) -> list[list[int]]:
        """Every group of one kind, as lists of ranks, in a fixed order. 'kv' and
        'pair_even' / 'pair_odd' are the special cases at the end of this file."""
        tp, pp, dp = self.tp, self.pp, self.dp
        if self.cp > 1:
            return cp_partition(self, kind)
        if kind == "kv":
            return kv_groups(tp, pp, dp, self.kv_replicas)
        if kind in ("ep", "ep_dp"):
            return ep_groups(kind, tp, pp, dp, self.ep)
        r = lambda d, p, t: rank_of(d, p, t, tp, dp)
        # exercise 6b: begin
        if kind == "tp":
            return [[r(d, p, t) for t in range(tp)] for p in range(pp) for d in range(dp)]
        if kind == "dp":
            return [[r(d, p, t) for d in range(dp)] for p in range(pp) for t in range(tp)]
        if kind == "pp":
            return [[r(d, p, t) for p in range(pp)] for d in range(dp) for t in range(tp)]
        # exercise 6b: end
        if kind == "pair_wrap":   # interleaved, odd pp >= 3: last stage <-> first, which pair_odd lacks
            odd = self.virtual_stages > 1 and pp > 2 and pp % 2
            return [[r(d, 0, t), r(d, pp - 1, t)] for d in range(dp) for t in range(tp)] if odd else []
        return pair_groups(kind, tp, pp, dp)   # 'pair_even' or 'pair_odd'

    def build_groups(self, device=None) -> "Mesh":
        """Create the process groups. Every rank calls this, in the same order."""
        if device is not None and self.world > 1:
            import torch.distributed as dist
            self.groups["world"] = Group("world", list(range(self.world)), self.rank, dist.group.WORLD, self.ledger)
        for kind in ("tp", "dp", "pp", "pair_even", "pair_odd", "kv", "pair_wrap", "ep", "ep_dp", "cp", "dp_cp"):
            partition = self._all(kind)
            for ranks in partition:
                pg = None
                if len(ranks) > 1 and device is not None:
                    pg = device.new_group(ranks, partition)
                if self.rank in ranks:
                    pair = kind.startswith("pair")
                    g = Group("pp" if pair else kind, ranks, ranks.index(self.rank), pg, self.ledger)
                    key = pair_key(ranks, self.rank, self.tp * self.cp, self.pp, self.dp) if pair else kind
                    self.groups[key] = g
        return self

    def group(self, key: str) -> Group:
        """'tp', 'dp', 'pp', 'world', 'next' (pair with stage+1), 'prev' (pair
        with stage-1), 'kv' (the ranks sharing this rank's kv head), 'wrap'
        (last stage <-> first stage: with pp = 2 the one pair of neighbours),
        'ep' (the dp ranks sharing the experts), 'ep_dp' (those holding the same ones),
        'cp' (the ranks sharing each sequence), 'dp_cp' (dp x cp: see grad_group)."""
        if key == "wrap" and self.pp == 2:
            return self.group("next" if self.is_first_stage else "prev")
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
        other tokens. The dp group, or with --cp > 1 the dp x cp ranks (each cp rank saw other tokens
        of the same sequences)."""
        return self.group("dp_cp") if self.cp > 1 else self.dp_group


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
# come in two kinds, even and odd boundaries, plus the "wrap" pair (last -> first: interleaved).
# Every backend builds them the same way.
# ---------------------------------------------------------------------------

def pair_groups(kind: str, tp: int, pp: int, dp: int) -> list[list[int]]:
    """The pairs of stages b <-> b+1 for even (kind 'pair_even') or odd
    ('pair_odd') boundaries b, each kind a set of disjoint equal-size groups.
    With an even pp > 2 the odd kind also pairs the last stage with the first
    (b = pp-1 <-> 0, the 'wrap' pair: only the interleaved schedule sends on
    it), so that, as in neuronx-distributed, every rank is in one pair of each
    kind. (pp = 2 has one boundary; with an odd pp the ring cannot split into
    disjoint pairs, and the odd kind leaves the last stage out.) Each pair
    lists its ranks in increasing order, the order in which torch.distributed
    numbers a group's members (the wrap pair too: [first stage, last stage])."""
    parity = 0 if kind == "pair_even" else 1
    last = pp if pp > 2 and pp % 2 == 0 else pp - 1
    return [sorted([rank_of(d, b, t, tp, dp), rank_of(d, (b + 1) % pp, t, tp, dp)]) for b in range(parity, last, 2)
            for d in range(dp) for t in range(tp)]


def pair_key(ranks: list[int], rank: int, tp: int, pp: int, dp: int) -> str:
    """The name `rank` gives its pair `ranks`: 'next' (the pair with stage + 1),
    'prev' (with stage - 1), or 'wrap' (last stage <-> first, pp > 2: carries
    the interleaved schedule's wrap-around, else nothing)."""
    mine, theirs = (coords(r, tp, pp, dp)[1] for r in sorted(ranks, key=lambda r: r != rank))
    if pp > 2 and {mine, theirs} == {0, pp - 1}:
        return "wrap"
    return "next" if theirs == mine + 1 else "prev"


# ---------------------------------------------------------------------------
# Expert parallelism, only with --ep > 1 (a mixture of experts, moe.py). Out
# of each dp group, runs of ep neighbouring dp ranks form an "ep" group that
# shares the E experts (E/ep each, tokens sent to them by all-to-all); the dp
# ranks with the same place in their run hold the same experts and form an
# "ep_dp" group (dp/ep ranks), over which those experts' gradients are summed.
# Example dp 4, ep 2: ep groups [0 1] [2 3], ep_dp groups [0 2] [1 3].
# ---------------------------------------------------------------------------

def ep_groups(kind: str, tp: int, pp: int, dp: int, ep: int) -> list[list[int]]:
    """The 'ep' or 'ep_dp' groups as lists of ranks (none when ep = 1)."""
    if ep == 1:
        return []
    r = lambda d, p, t: rank_of(d, p, t, tp, dp)   # noqa: E731
    # exercise 10c: begin
    if kind == "ep":
        return [[r(d, p, t) for d in range(i, i + ep)] for p in range(pp) for t in range(tp) for i in range(0, dp, ep)]
    return [[r(d, p, t) for d in range(j, dp, ep)] for p in range(pp) for t in range(tp) for j in range(ep)]
    # exercise 10c: end


def check_ep(tcfg: TrainConfig, dp: int, n_experts: int) -> None:
    """--ep N: N divides dp and the experts."""
    if dp % tcfg.ep or n_experts % tcfg.ep:
        raise UserError(f"--ep {tcfg.ep} must divide dp {dp} and --moe-experts {n_experts} (each of the ep ranks "
                        f"holds experts / ep of them); choose among {_choices(divisors(math.gcd(dp, n_experts)))}")


# ---------------------------------------------------------------------------
# Context parallelism, only with --cp > 1 (context_parallel.py). The cp ranks
# of one sequence talk in every layer's attention, so they sit next to the tp
# ranks: (cp, tp) together form the inner coordinate,
#
#     rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank
#
# and every other kind of group is the cp = 1 mesh's, once for each cp rank
# (`lift`). Example dp 2, cp 2: cp groups [0 1] [2 3], dp groups [0 2] [1 3],
# dp_cp [0 1 2 3] (all four hold the same weights: gradients summed over them).
# ---------------------------------------------------------------------------

def lift(base_rank: int, cp_rank: int, tp: int, cp: int) -> int:
    """A rank of the cp = 1 mesh (same tp, pp, dp) -> that place at cp rank `cp_rank`."""
    outer, t = divmod(base_rank, tp)
    return (outer * cp + cp_rank) * tp + t


def cp_partition(mesh: Mesh, kind: str) -> list[list[int]]:
    """Every group of one kind when cp > 1 (each list in increasing order, as torch numbers a group)."""
    tp, pp, dp, cp = mesh.tp, mesh.pp, mesh.dp, mesh.cp
    base_world = tp * pp * dp
    if kind == "cp":
        return [[lift(b, c, tp, cp) for c in range(cp)] for b in range(base_world)]
    if kind == "dp_cp":
        return [[lift(rank_of(d, p, t, tp, dp), c, tp, cp) for d in range(dp) for c in range(cp)]
                for p in range(pp) for t in range(tp)]
    base = Mesh(tp, pp, dp, kv_replicas=mesh.kv_replicas, virtual_stages=mesh.virtual_stages, ep=mesh.ep)
    return [[lift(b, c, tp, cp) for b in ranks] for c in range(cp) for ranks in base._all(kind)]
