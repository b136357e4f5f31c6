"""Eight-bit floating point: the two formats, a saturating scaled cast, and the scales of five recipes.

An FP8 number has 1 sign bit and 7 bits to share between exponent and mantissa (OCP's 8-bit
floating point specification; Micikevicius et al. 2022, "FP8 formats for deep learning"):

    format   exponent  mantissa  largest   smallest normal  smallest subnormal   torch dtype
    E4M3FN   4 bits    3 bits      448     2^-6             2^-9                 float8_e4m3fn
    E5M2     5 bits    2 bits    57344     2^-14            2^-16                float8_e5m2

E4M3 has one more mantissa bit (relative step 2^-3 against 2^-2), E5M2 seven more binades
at each end of its range. Weights and activations go in E4M3; gradients, whose magnitudes spread
over more binades, in E5M2 (torchao's and Transformer Engine's default; DeepSeek-V3 used E4M3
everywhere with finer scales: --fp8-grad-format e4m3). "FN" says the format has no infinities, and one NaN pattern only.

Neither format has the range of a tensor's values, so every cast is scaled: q = cast(x * s), and the
product of two casts is divided by both scales afterwards (the matmul accumulates in fp32). A scale
is chosen from the amax, the largest |x| of the elements it covers, so that the amax lands on the
format's largest value: s = largest / amax. What elements one scale covers is the recipe's choice:

    recipe      one scale per                                      chosen from                  scale
    tensorwise  tensor                                             this tensor's amax now       fp32
    delayed     tensor                                             the amaxes of past steps     fp32
    rowwise     row of the operand along its matmul's reduction   that row's amax now          a power of 2
    blockwise   1 x 128 tile of an activation or gradient along    the tile's or block's amax   fp32
                the reduction, 128 x 128 block of a weight
    mx          32 elements along the reduction (OCP MX)           the block's amax: E8M0       a power of 2

`saturating_cast` clamps to the format's largest value before casting: torch's own cast does not
saturate everywhere (torch 2.9 turns 500 into NaN in E4M3FN, and 2.13 still turns 1e6 into inf in
E5M2). Every scale rule below, its block layout (`Axis`, `block_ids`) and the amax of each block
(`block_amax`), whatever ranks hold the tensor's pieces, are in this file; fp8.py runs the linears.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanohlat import comm

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FORMATS = {"e4m3": E4M3, "e5m2": E5M2}
LARGEST = {E4M3: 448.0, E5M2: 57344.0}
# the exponent of the largest power of two each format holds (448 = 1.75 x 2^8, 57344 = 1.75 x 2^15):
# the OCP MX specification's emax_elem
EMAX = {E4M3: 8, E5M2: 15}
SMALLEST = {E4M3: 2.0 ** -9, E5M2: 2.0 ** -16}   # the smallest subnormal: half of it and below flush to zero
# where the clamp starts to change a value: the largest value's rounding interval ends half a step above it
# (448 + 32 / 2 in E4M3, 57344 + 8192 / 2 in E5M2); below, the cast would round to the largest value anyway
SATURATES = {E4M3: 464.0, E5M2: 61440.0}
EPS = 1e-12   # an all-zero tensor's amax is taken as this: a finite scale (torchao's floor)
RECIPES = ("tensorwise", "delayed", "rowwise", "blockwise", "mx")
TILE, MX_BLOCK = 128, 32   # DeepSeek-V3's tiles and blocks; the OCP MX block


def saturating_cast(x: torch.Tensor, scale, fmt: torch.dtype) -> torch.Tensor:
    """x * scale in the FP8 format `fmt` (a tensor of that dtype): each value the nearest the format
    holds, and a value beyond the format's largest becomes that largest value, of its sign (a NaN
    stays NaN). The product x * scale is formed in fp32 whatever x's dtype (as torchao does)."""
    # exercise 7b: begin
    # torch's cast rounds to nearest but does not saturate everywhere (inf in E5M2; NaN in E4M3FN on
    # torch 2.9): clamp first, then cast
    big = LARGEST[fmt]
    return (x.float() * scale).clamp(-big, big).to(fmt)
    # exercise 7b: end


def amax_scale(amax: torch.Tensor, fmt: torch.dtype) -> torch.Tensor:
    """tensorwise, blockwise: the scale that puts `amax` on the format's largest value (fp32, rounded
    once from the exact quotient, as torchao's amax_to_scale); an amax of 0 counts as EPS."""
    # exercise 7b: begin
    # largest / amax in fp64, then to fp32: one rounding
    return (LARGEST[fmt] / amax.double().clamp(min=EPS)).float()
    # exercise 7b: end


def operand_format(role: str, grad_format: torch.dtype) -> torch.dtype:
    """The format an operand is cast to: E4M3 for the weights and the activations ('w', 'x'), the
    gradients' format (E5M2 unless --fp8-grad-format e4m3) for the output's gradient ('dy'): a gradient
    spans more binades, and (with a delayed scale) may grow past the amax its scale was made for."""
    # exercise 7b: begin
    return grad_format if role == "dy" else E4M3
    # exercise 7b: end


def power_of_two_below(scale: torch.Tensor) -> torch.Tensor:
    """rowwise: the scale rounded down to a power of two, 2^floor(log2 s), so that dividing by it is exact
    (torchao's round_scales_to_power_of_2, computed as it does: log2 in fp32)."""
    return torch.exp2(torch.floor(torch.log2(scale)))


def mx_scale(amax: torch.Tensor, fmt: torch.dtype) -> torch.Tensor:
    """mx: the scale 1/X of the OCP MX v1.0 shared scale X = 2^(floor(log2 amax) - emax_elem), an E8M0
    number (a power of two from 2^-127 to 2^127; EMAX holds each format's emax_elem). The block's amax
    then lands in [2^emax, 2^(emax+1)): an E4M3 block whose amax is above 448 x 2^(e-8) saturates there
    (the specification allows it; it keeps the elements below the amax one binade further from the
    flush to zero). A block of zeros gets scale 1."""
    # exercise 7c: begin
    # floor(log2 amax), exactly, from the exponent: frexp gives amax = m 2^e with m in [0.5, 1)
    _, e = torch.frexp(amax.float())
    shared = (e - 1 - EMAX[fmt]).clamp(-127, 127)
    shared = torch.where(amax > 0, shared, torch.zeros_like(shared))
    return torch.exp2(-shared.float())
    # exercise 7c: end


def delayed_scale(history: torch.Tensor, scale: torch.Tensor, largest, margin: int) -> torch.Tensor:
    """delayed (Transformer Engine's DelayedScaling, amax_compute_algo "max"): the next step's scale from
    the amax history (..., length), (largest / max over the history) / 2^margin, in fp32 (`largest`: the
    format's largest value, or a tensor of them, one per scale); where that amax is 0 or not finite the
    scale stays what it was (`scale`)."""
    amax = history.amax(dim=-1)
    new = (largest / amax) / (2.0 ** margin)
    return torch.where((amax > 0) & torch.isfinite(amax), new, scale)


def block_sizes(recipe: str, role: str) -> tuple[int, int]:
    """(across, along): the block of one scale for an operand of `role` ('x', 'w', 'dy') of a matmul,
    across its reduction and along it; 0 is the whole extent (one block), 1 one element."""
    if recipe in ("tensorwise", "delayed"):
        return 0, 0
    if recipe == "rowwise":
        return 1, 0
    if recipe == "blockwise":
        return (TILE, TILE) if role == "w" else (1, TILE)
    return 1, MX_BLOCK   # mx


# ---------------------------------------------------------------------------
# Blocks, whichever ranks hold a tensor's pieces. A scale is a function of its block's amax, and the
# block is one process's: a tensor cut over tp (a column-parallel weight's rows, a row-parallel input's
# columns) or cp (a sequence's tokens, zigzag) has blocks whose elements lie on several ranks. Each rank
# then takes the amax of its part of every block, and the ranks holding the other parts take the max of
# theirs (an all-gather of the small table of block amaxes, then a max: comm.py has no max-reduce, and
# the vocab-parallel loss takes its max the same way), so that every rank's scale is the whole block's.
# A block inside one rank's part needs none of it: only where a block straddles a cut is there a
# collective (`Axis.straddles`).
# ---------------------------------------------------------------------------

@dataclass
class Axis:
    """One axis of an operand as one process has it: `n` positions here of `size` in all. Where other
    ranks hold the rest (`groups`), each holds runs of `piece` consecutive positions, this rank's the
    global positions `index` (None: n consecutive ones from `start`). `segments`: runs of positions that
    are tensors of their own (an expert's tokens from one source): blocks begin anew in each."""

    n: int
    size: int = 0
    start: int = 0
    index: torch.Tensor | None = None
    piece: int = 0
    groups: tuple = ()
    segments: list | None = None

    def __post_init__(self):
        self.size = self.size or self.n
        self.groups = tuple(g for g in self.groups if g is not None and g.size > 1)

    def straddles(self, block: int) -> bool:
        """Whether a block of `block` positions (0: all of them) has positions on other ranks."""
        if not self.groups or block == 1:
            return False
        return block == 0 or self.piece % block != 0

    def positions(self, device) -> torch.Tensor:
        return self.index.to(device) if self.index is not None else \
            torch.arange(self.start, self.start + self.n, device=device)


def block_count(axis: Axis, block: int) -> tuple[int, tuple]:
    """(count, groups): how many blocks of `block` positions (0: the whole axis, or each segment) the amax
    table has along the axis, and the groups it is reduced over (those of a straddling block): `block_ids`'
    rule, which the plan counts with (plan/fp8_costs.py). Segments' tiles depend on their lengths (the data's)."""
    if axis.segments is not None:
        count = len(axis.segments) if block == 0 else sum(-(-n // block) for n in axis.segments)
        return count, (axis.groups if block != 1 else ())
    if not axis.straddles(block):
        return -(-axis.n // (block or axis.n or 1)), ()
    return (1 if block == 0 else -(-axis.size // block)), axis.groups


def block_ids(axis: Axis, block: int, device) -> tuple[torch.Tensor | int, int, tuple]:
    """(ids, count, groups): each of the axis's positions here mapped to its block, the blocks' count
    and the groups to take their amax over. ids is an int b where the blocks are runs of b positions
    here (the last one may be shorter), else a tensor (n,). A block inside this rank's part is numbered
    here; a straddling one by its place in the whole axis (every rank numbering it alike)."""
    if axis.segments is not None:   # separate tensors: blocks numbered segment after segment
        sizes = torch.tensor(axis.segments, dtype=torch.long)
        per = torch.ones_like(sizes) if block == 0 else (sizes + block - 1) // block
        first = torch.cumsum(per, 0) - per
        local = torch.arange(axis.n) - torch.repeat_interleave(torch.cumsum(sizes, 0) - sizes, sizes)
        ids = torch.repeat_interleave(first, sizes) + (0 if block == 0 else local // block)
        return (ids.to(device), *block_count(axis, block))
    count, groups = block_count(axis, block)
    if not groups:
        return (block or axis.n or 1), count, ()
    ids = torch.zeros(axis.n, dtype=torch.long, device=device) if block == 0 else axis.positions(device) // block
    return ids, count, groups


def _amax_along(a: torch.Tensor, dim: int, ids, count: int) -> torch.Tensor:
    """The amax of each block along `dim` (runs of `ids` positions, or an index per position)."""
    n = a.shape[dim]
    if isinstance(ids, int):
        if n % ids == 0:
            return a.unflatten(dim, (n // ids, ids)).amax(dim=dim + 1)
        ids = torch.arange(n, device=a.device) // ids
    shape = list(a.shape)
    shape[dim] = count
    index = ids.view(-1, 1) if dim == 0 else ids.view(1, -1)
    return a.new_zeros(shape).scatter_reduce_(dim, index.expand_as(a), a, "amax")


def _spread(t: torch.Tensor, dim: int, ids, n: int) -> torch.Tensor:
    """Each block's value back on its positions along `dim`."""
    if isinstance(ids, int):
        return t.repeat_interleave(ids, dim=dim).narrow(dim, 0, n)
    return t.index_select(dim, ids)


@dataclass
class Cast:
    """One operand in FP8: `q` (its shape, an FP8 dtype) and, per element, `inverse`, 1/scale (fp32),
    so that q * inverse is its value; `amax` and `scale`, one per block (for the log); with `count`,
    how many elements saturated (the clamp changed them: |x s| >= SATURATES) and flushed to zero."""

    q: torch.Tensor
    inverse: torch.Tensor
    amax: torch.Tensor
    scale: torch.Tensor
    saturated: torch.Tensor | None = None
    flushed: torch.Tensor | None = None


def block_amax(x: torch.Tensor, rows: Axis, cols: Axis, blocks: tuple[int, int], what: str = "fp8 amax"):
    """The amax of every block of x (rows x cols) as one process has it: (table, row ids, col ids), the
    same table on every rank of the groups that hold other parts of a straddling block (`groups`,
    through comm.py: `what` names the collective)."""
    r_ids, r_n, r_groups = block_ids(rows, blocks[0], x.device)
    c_ids, c_n, c_groups = block_ids(cols, blocks[1], x.device)
    a = x.detach().abs().float()
    if isinstance(r_ids, int) and isinstance(c_ids, int) and r_n == 1 and c_n == 1:
        table = a.amax().view(1, 1) if a.numel() else a.new_zeros(1, 1)
    else:
        table = _amax_along(_amax_along(a, 0, r_ids, r_n), 1, c_ids, c_n)
    groups = r_groups + tuple(g for g in c_groups if not any(g is h for h in r_groups))   # (each group once)
    # exercise 7c: begin
    # every rank holds the amaxes of its parts of the blocks: the block's is the max of them, and
    # comm.py has no max-reduce, so gather the tables and take the max (as the vocab-parallel loss does)
    for group in groups:
        table = comm.all_gather(table.unsqueeze(0), group, what=what).amax(dim=0)
    # exercise 7c: end
    return table, r_ids, c_ids


def cast(x: torch.Tensor, rows: Axis, cols: Axis, blocks: tuple[int, int], rule: str, fmt: torch.dtype,
         scale: torch.Tensor | None = None, count: bool = False) -> Cast:
    """x (2-D) in FP8 with one scale per block (`blocks`: rows x cols of a block, 0 the whole extent), each
    from the whole block's amax by `rule` ('amax', 'pow2', 'mx'), or given (`scale`, delayed: one for the
    tensor, then no amax is reduced here: the step's end does it for the history). `count`: the
    saturated and flushed elements too (--fp8-stats)."""
    if scale is not None:   # delayed: the scale is known before the tensor is seen
        table = x.detach().abs().float().amax().view(1, 1) if x.numel() else x.new_zeros(1, 1, dtype=torch.float32)
        r_ids, c_ids, s = x.shape[0] or 1, x.shape[1] or 1, scale.view(1, 1)
    else:
        table, r_ids, c_ids = block_amax(x, rows, cols, blocks)
        s = amax_scale(table, fmt)
        if rule == "pow2":
            s = power_of_two_below(s)
        elif rule == "mx":
            s = mx_scale(table, fmt)
    each = _spread(_spread(s, 0, r_ids, x.shape[0]), 1, c_ids, x.shape[1])
    q = saturating_cast(x, each, fmt)
    c = Cast(q, each.reciprocal(), table, s)
    if count:
        c.saturated = ((x.detach().float() * each).abs() >= SATURATES[fmt]).sum()
        c.flushed = ((q.float() == 0) & (x.detach() != 0)).sum()
    return c


def mm(a: Cast, b: Cast, transpose_a: bool = False, transpose_b: bool = False) -> torch.Tensor:
    """The FP8 product with fp32 accumulation, emulated: each operand's value q * (1/scale), exact in fp32
    for every FP8 value times a power of two (and what torch._scaled_mm's CPU kernel computes, per tensor,
    row or column: dequantise to fp32, multiply in fp32), then one fp32 matmul."""
    x = a.q.float() * a.inverse
    y = b.q.float() * b.inverse
    return (x.t() if transpose_a else x) @ (y.t() if transpose_b else y)


def reduction_is_tiled(size: int, block: int) -> bool:
    """Whether a reduction of `size` is cut into whole blocks (or is one shorter block, as if padded)."""
    return block == 0 or size <= block or size % block == 0


def describe_padding(size: int, block: int) -> str:
    return f"{size} (one block of {block}, as if zero-padded: every amax and sum unchanged)"

