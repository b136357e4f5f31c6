"""Chapter 7, eight bits: the saturating scaled cast and its scale (7b), the block scales (7c).

7b against an oracle of the FP8 grid written here (round half to even on the format's grid of
normals and subnormals, in fp64; not torch's cast): a cast in range, a value beyond the range
(clamped to the largest, whatever torch's cast would do), NaN, the scale that puts the amax on the
largest value (fp64 division, rounded once to fp32), and each operand's format. 7c: OCP MX's shared
scale against math.frexp (a power of two, the amax landing in [2^emax, 2^(emax+1)), 1 for a block of
zeros), and, on 2 gloo ranks, the amax of a tensor cut over tp: every rank's scale must be the whole
tensor's, as one process's (a cast tensor's scale from one shard's amax is a different FP8 run).
"""

from __future__ import annotations

import math

import torch

from nanohlat.classroom.checks.grading import case, compare, make_group, spawn

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
GRID = {E4M3: (3, -6, 448.0), E5M2: (2, -14, 57344.0)}   # mantissa bits, smallest normal exponent, largest


def _grid(v: torch.Tensor, fmt) -> torch.Tensor:
    """The oracle: v (fp64) to the nearest value of the format, ties to even, beyond the range clamped."""
    m, emin, largest = GRID[fmt]
    e = torch.floor(torch.log2(v.abs().clamp(min=2.0 ** -300)))
    quantum = torch.exp2(torch.clamp(e, min=emin) - m)
    return torch.where(torch.isnan(v), v, (torch.round(v / quantum) * quantum).clamp(-largest, largest))


def check_fp8_cast() -> str | None:
    from nanohlat.beyond.fp8_scaling import amax_scale, operand_format, saturating_cast
    g = torch.Generator().manual_seed(72)
    for fmt, name in ((E4M3, "E4M3"), (E5M2, "E5M2")):
        largest = GRID[fmt][2]
        name_in = case(f"saturating_cast into {name}, in range: each value the nearest on the grid (ties to even)")
        x = torch.cat([torch.randn(3000, generator=g) * s for s in (1e-3, 0.3, 30)])
        s = torch.tensor(2.5)
        got = saturating_cast(x, s, fmt)
        if got.dtype != fmt:
            return f"{name_in}: returned {got.dtype}, expected {fmt}"
        v = compare(f"{name_in}: saturating_cast(x, 2.5, {name})", got.float(), _grid((x.float() * s).double(), fmt),
                    rtol=0, atol=0)
        if v:
            return v + " (is x multiplied by the scale, not divided?)"
        name_big = case(f"saturating_cast into {name}, beyond the range: clamped to +-{largest:g}")
        big = torch.tensor([largest * 1.2, -largest * 3, 1e30, largest])
        got = saturating_cast(big, torch.tensor(1.0), fmt).float()
        want = torch.tensor([largest, -largest, largest, largest])
        v = compare(f"{name_big}: saturating_cast of {big.tolist()}", got, want, rtol=0, atol=0)
        if v:
            return (v + f"; torch's cast does not saturate everywhere (1e30 becomes inf in E5M2, NaN in E4M3FN "
                    f"on torch 2.9): clamp to the format's largest value before casting")
        name_nan = case(f"saturating_cast into {name}: NaN stays NaN")
        if not torch.isnan(saturating_cast(torch.tensor([float("nan")]), torch.tensor(1.0), fmt).float()).all():
            return f"{name_nan}: a NaN came out a number; a NaN must stay NaN (the step is then skipped)"
        name_scale = case(f"amax_scale for {name}: the amax lands on the largest value, {largest:g} / amax in fp32")
        amax = torch.cat([torch.rand(50, generator=g) * 10 ** float(k) for k in (-6, -2, 0, 3)])
        want = torch.tensor([float(torch.tensor(largest / a, dtype=torch.float64)) for a in amax.double().tolist()],
                            dtype=torch.float64).float()
        got = amax_scale(amax, fmt)
        v = compare(f"{name_scale}: amax_scale(amax, {name})", got, want, rtol=0, atol=0)
        if v:
            return v + " (a scale multiplies x into the format: largest / amax, not amax / largest)"
        if not torch.isfinite(amax_scale(torch.zeros(1), fmt)).all():
            return f"{name_scale}: an amax of 0 (a tensor of zeros) gave a scale that is not finite; floor the amax"
    name = case("operand_format: E4M3 for weights and activations, the gradients' format for dY")
    for role, grad, want in (("x", E5M2, E4M3), ("w", E5M2, E4M3), ("dy", E5M2, E5M2), ("dy", E4M3, E4M3)):
        got = operand_format(role, grad)
        if got != want:
            return (f"{name}: operand_format({role!r}, {grad}) is {got}, expected {want}: a gradient spans more "
                    f"binades than E4M3's (its largest is 448, E5M2's 57,344), and one that grew past the amax of "
                    f"its (delayed) scale saturates in E4M3; weights and activations want E4M3's extra mantissa bit")
    return None


def check_mx_scale() -> str | None:
    from nanohlat.beyond.fp8_scaling import mx_scale
    g = torch.Generator().manual_seed(73)
    for fmt, name, emax in ((E4M3, "E4M3", 8), (E5M2, "E5M2", 15)):
        name_case = case(f"mx_scale for {name}: 2^-(floor(log2 amax) - {emax}), a power of two (E8M0)")
        amax = torch.cat([torch.rand(200, generator=g) * 10 ** float(k) for k in (-8, -3, 0, 2, 5)]
                         + [torch.tensor([1.0, 448.0, 2.0 ** -20, 3.0])])
        want = torch.tensor([2.0 ** -(math.frexp(a)[1] - 1 - emax) for a in amax.double().tolist()])
        got = mx_scale(amax, fmt)
        v = compare(f"{name_case}: mx_scale(amax, {name})", got, want, rtol=0, atol=0)
        if v:
            powers = bool((torch.frexp(got.float())[0] == 0.5).all())
            return v + ("" if powers else "; an MX scale is an E8M0 number, a power of two: take floor(log2 amax) "
                                          "(torch.frexp reads it off exactly), not log2 amax")
        if not bool(torch.equal(mx_scale(torch.zeros(2), fmt), torch.ones(2))):
            return f"{name_case}: a block of zeros gave scale {mx_scale(torch.zeros(2), fmt).tolist()}, expected 1"
    return None


def _amax_over_tp(rank, world):
    from nanohlat.beyond.fp8_scaling import Axis, E4M3 as fmt, cast
    group = make_group(rank, world, "tp")
    g = torch.Generator().manual_seed(74)
    full = torch.randn(8, 16 * world, generator=g)
    full[3, 5] = 40.0   # the tensor's amax, on rank 0's columns only
    n = 16
    mine = full[:, rank * n:(rank + 1) * n]
    cols = Axis(n, n * world, start=rank * n, piece=n, groups=(group,))   # a row-parallel input: columns cut
    name = case("a tensor cut over tp: every rank's tensor-wise scale is the whole tensor's")
    c = cast(mine, Axis(8), cols, (0, 0), "amax", fmt)
    want = torch.tensor([[448.0 / 40.0]])
    v = compare(f"{name}: the scale of rank {rank}'s columns", c.scale.float(), want, rank=rank, rtol=1e-6, atol=0)
    if v:
        return v + ("; a block's amax is the max over every rank holding a piece of it (an all-gather of the "
                    "amax table, then a max), or the ranks cast one tensor with different scales")
    name = case("a tensor cut over tp, blocks of 1 x 16 along the cut (each inside one rank): no collective")
    c = cast(mine, Axis(8), cols, (1, 16), "amax", fmt)
    want = 448.0 / mine.abs().amax(dim=1, keepdim=True).double()
    return compare(f"{name}: each row's scale on rank {rank}", c.scale.double(), want, rank=rank, rtol=1e-6, atol=0)


def check_block_amax_over_ranks() -> str | None:
    return spawn(_amax_over_tp, 2)
