"""The 3D mesh: which rank holds which piece of the model, and the process groups.

World = dp x pp x tp. Tensor-parallel ranks are neighbours (they talk inside
every layer, so they get the fastest links: the NeuronCores of one trn1 chip,
the GPUs of one NVLink island), then data-parallel, then pipeline (DESIGN 4):

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
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .config import ModelConfig, TrainConfig, UserError


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _choices(xs) -> str:
    xs = list(xs)
    return ", ".join(map(str, xs[:-1])) + (" or " if len(xs) > 1 else "") + str(xs[-1])


def validate_layout(model: ModelConfig, train: TrainConfig, world: int) -> int:
    """Refuse a layout that cannot work, before any worker starts. Returns dp."""
    tp, pp = train.tp, train.pp
    if world % (tp * pp):
        raise UserError(f"--tp {tp} x --pp {pp} = {tp * pp} does not divide the world size {world}; "
                        f"choose tp*pp among {_choices(divisors(world))}")
    dp = train.dp or world // (tp * pp)
    if tp * pp * dp != world:
        raise UserError(f"--tp {tp} x --pp {pp} x --dp {dp} = {tp * pp * dp} but the world has {world} "
                        f"processes; use --dp {world // (tp * pp)} or leave --dp unset")
    common = [d for d in divisors(model.n_heads) if model.n_kv_heads % d == 0 and model.ffn_dim % d == 0
              and model.padded_vocab % d == 0]
    for what, n in (("n_heads", model.n_heads), ("n_kv_heads", model.n_kv_heads),
                    ("ffn_dim", model.ffn_dim), ("padded vocabulary", model.padded_vocab)):
        if n % tp:
            raise UserError(f"--tp {tp} does not divide {what} {n}; choose {_choices(common)}")
    if pp > model.n_layers or model.n_layers % pp:
        raise UserError(f"--pp {pp} cannot split {model.n_layers} layers into equal contiguous stages; "
                        f"choose {_choices(divisors(model.n_layers))}")
    per_rank = train.batch_size // dp if train.batch_size % dp == 0 else 0
    if not per_rank or per_rank % train.microbatches:
        raise UserError(f"--batch-size {train.batch_size} must split into dp {dp} x microbatches "
                        f"{train.microbatches} equal micro-batches; use a multiple of {dp * train.microbatches}")
    if train.sequence_parallel and train.seq_len % tp:
        raise UserError(f"--sequence-parallel needs --seq-len {train.seq_len} divisible by --tp {tp}")
    if train.zero1 and dp == 1 and world > 1:
        pass  # allowed: ZeRO-1 over one rank is plain AdamW, useful for comparisons
    return dp


def coords(rank: int, tp: int, pp: int, dp: int) -> tuple[int, int, int]:
    """rank -> (dp_rank, pp_rank, tp_rank); the inverse of `rank_of`."""
    # exercise 6.1: begin
    return (rank // tp) % dp, rank // (tp * dp), rank % tp
    # exercise 6.1: end


def rank_of(dp_rank: int, pp_rank: int, tp_rank: int, tp: int, dp: int) -> int:
    # exercise 6.1: begin
    return (pp_rank * dp + dp_rank) * tp + tp_rank
    # exercise 6.1: end


def layout_table(tp: int, pp: int, dp: int, n_layers: int | None = None, max_rows: int = 64) -> str:
    """The printable rank -> (dp, pp, tp) table (`--plan` and the run's log)."""
    world = tp * pp * dp
    per = n_layers // pp if n_layers else None
    lines = [f"world {world} = dp {dp} x pp {pp} x tp {tp}", "rank  dp  pp  tp" + ("  layers" if per else "")]
    shown = list(range(world)) if world <= max_rows else list(range(max_rows // 2)) + list(range(world - max_rows // 2, world))
    for i, r in enumerate(shown):
        if i and shown[i - 1] != r - 1:
            lines.append(f"  ... {r - shown[i - 1] - 1} more ranks ...")
        d, p, t = coords(r, tp, pp, dp)
        row = f"{r:4d} {d:3d} {p:3d} {t:3d}"
        if per:
            row += f"  {p * per}-{(p + 1) * per - 1}" + ("  +embedding" if p == 0 else "") + ("  +norm,head,loss" if p == pp - 1 else "")
        lines.append(row)
    return "\n".join(lines)


@dataclass
class Group:
    """One process group as this rank sees it: who is in it and where I stand."""

    name: str                   # 'tp', 'dp', 'pp', 'pair' ... (the comm ledger's key)
    ranks: list[int]
    rank: int                   # my index inside `ranks`
    pg: object = None           # torch.distributed ProcessGroup, None when size 1
    ledger: object = None       # comm.CommLedger shared by all groups of the mesh

    @property
    def size(self) -> int:
        return len(self.ranks)


@dataclass
class Mesh:
    """Coordinates of this rank and the groups it belongs to. Built once, passed explicitly."""

    tp: int
    pp: int
    dp: int
    rank: int = 0
    ledger: object = None
    groups: dict = field(default_factory=dict)

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

    def _all(self, kind: str) -> list[list[int]]:
        """Every group of one kind, as lists of ranks, in a fixed order."""
        tp, pp, dp = self.tp, self.pp, self.dp
        r = lambda d, p, t: rank_of(d, p, t, tp, dp)
        # exercise 6.2: begin
        if kind == "tp":
            return [[r(d, p, t) for t in range(tp)] for p in range(pp) for d in range(dp)]
        if kind == "dp":
            return [[r(d, p, t) for d in range(dp)] for p in range(pp) for t in range(tp)]
        if kind == "pp":
            return [[r(d, p, t) for p in range(pp)] for d in range(dp) for t in range(tp)]
        # exercise 6.2: end
        # Pipeline neighbour pairs, stage b <-> b+1. Even and odd boundaries are
        # two kinds so that each kind is a set of disjoint equal-size groups
        # (what the xla backend wants as its replica-group partition).
        parity = 0 if kind == "pair_even" else 1
        return [[r(d, b, t), r(d, b + 1, t)] for b in range(parity, pp - 1, 2)
                for d in range(dp) for t in range(tp)]

    def build_groups(self, device=None) -> "Mesh":
        """Create the process groups. Every rank calls this, in the same order."""
        if device is not None and self.world > 1:
            import torch.distributed as dist
            self.groups["world"] = Group("world", list(range(self.world)), self.rank, dist.group.WORLD, self.ledger)
        for kind in ("tp", "dp", "pp", "pair_even", "pair_odd"):
            partition = self._all(kind)
            for ranks in partition:
                pg = None
                if len(ranks) > 1 and device is not None:
                    pg = device.new_group(ranks, partition)
                if self.rank in ranks:
                    name = "pp" if kind.startswith("pair") else kind
                    g = Group(name, ranks, ranks.index(self.rank), pg, self.ledger)
                    key = kind
                    if kind.startswith("pair"):
                        key = "next" if ranks[0] == self.rank else "prev"
                    self.groups[key] = g
        return self

    def group(self, key: str) -> Group:
        """'tp', 'dp', 'pp', 'world', 'next' (pair with stage+1), 'prev' (pair with stage-1)."""
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
