"""Chapter 7, stochastic rounding of fp32 to bf16 (7a).

With given noise, bit for bit against the carry rule (an element rounds up
exactly when its low 16 bits plus the noise carry), x and the noise left as
they were; unbiased over many draws;
NaN stays NaN and infinities stay themselves for odd bit patterns and any
noise; with noise drawn by the function, repeatable from its generator.
"""

from __future__ import annotations

import torch

from nanohlat.classroom.checks.grading import Kept, case, compare, untouched


def _bf16_neighbours(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bf16 values just below and just above each fp32 x, in magnitude (x's sign)."""
    bits = x.view(torch.int32).long() & 0xFFFFFFFF
    down = (bits & 0xFFFF0000).to(torch.int64)
    up = down + 0x10000
    as_float = lambda b: torch.tensor((b - ((b >> 31) << 32)).tolist(), dtype=torch.int32).view(torch.float32)
    return as_float(down), as_float(up)


def _from_bits(bits: list[int]) -> torch.Tensor:
    """fp32 numbers with these 32-bit patterns (0x7FFFFFFF ...)."""
    return torch.tensor([b - (1 << 32) if b >= 1 << 31 else b for b in bits], dtype=torch.int32).view(torch.float32)


def _unbiased(name: str, rounded: torch.Tensor, value: float) -> str | None:
    mean = rounded.double().mean().item()
    if abs(mean - value) > 4 * 2 ** -7 * 0.5 / rounded.numel() ** 0.5:   # 4 standard errors
        return (f"{name}: rounding {value:.6f} {rounded.numel()} times averages {mean:.6f}: the rounding is "
                f"biased (it must round up with probability (low 16 bits) / 2^16)")
    return None


def check_stochastic_rounding() -> str | None:
    from nanohlat.precision import stochastic_round_to_bf16
    g = torch.Generator().manual_seed(71)
    name = case("given noise: each element rounds up exactly when its low 16 bits + noise carry")
    x = torch.cat([torch.randn(2000, generator=g) * 0.02, torch.randn(2000, generator=g) * 300,
                   torch.tensor([1.0, -1.0, 0.0, 2.0 ** -130, 1 + 2 ** -9, -(1 + 2 ** -9)])])
    noise = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, generator=g)
    down, up = _bf16_neighbours(x)
    low = x.view(torch.int32).long() & 0xFFFF
    goes_up = low + noise.long() >= 1 << 16          # the carry: probability low / 2^16
    want = torch.where(goes_up, up, down)
    given, given_noise = Kept(x), Kept(noise)
    got = stochastic_round_to_bf16(x, noise=noise)
    if got.dtype != torch.bfloat16:
        return f"{name}: stochastic_round_to_bf16 returned {got.dtype}, expected torch.bfloat16"
    v = (compare(f"{name}: stochastic_round_to_bf16(x, noise)", got.float(), want, rtol=0, atol=0)
         or untouched(f"{name}: stochastic_round_to_bf16(x, noise)", "its input x", given,
                      "a rounding returns a new tensor and leaves x to its caller (the optimizer drops its fp32 "
                      "result once rounded, so there it would work by luck); x.float().contiguous() of a "
                      "contiguous fp32 x is x itself and x.view(torch.int32) shares its bytes, so bits += noise "
                      "writes into x: write bits + noise")
         or untouched(f"{name}: stochastic_round_to_bf16(x, noise)", "the noise it was given", given_noise,
                      "the caller's noise is its own (rounding_noise: a function of the step and the element); "
                      "write bits + noise, not noise += bits"))
    if v:
        return v
    # unbiased: the mean over many noise draws of one value approaches the value
    name = case("unbiased with given noise")
    val = torch.full((20000,), 1 + 3 * 2 ** -10)     # 3/8 of the way from 1 to the next bf16 (1 + 2^-7)
    noise = torch.randint(0, 1 << 16, val.shape, dtype=torch.int32, generator=g)
    v = _unbiased(name, stochastic_round_to_bf16(val, noise=noise), val[0].item())
    if v:
        return v
    # NaN has many bit patterns; the noise must not carry a NaN's full mantissa into the sign bit
    # (0x7FFFFFFF + 1 -> 0x80000000, -0.0) nor truncate it to the infinity pattern (0x7F800001 -> inf)
    name = case("odd NaN and infinity bit patterns")
    bits = [0x7FFFFFFF, 0xFFFFFFFF, 0x7F800001, 0xFF800001, 0x7FC00000, 0x7FBFFFFF, 0x7F800000, 0xFF800000]
    special = _from_bits(bits)
    for fill in (1, 0xFFFF, 0x8000, 0):
        out = stochastic_round_to_bf16(special, noise=torch.full((len(bits),), fill, dtype=torch.int32)).float()
        for b, o in zip(bits, out.tolist()):
            is_nan = (b & 0x7F800000) == 0x7F800000 and b & 0x7FFFFF
            ok = o != o if is_nan else o == (float("inf") if b < 1 << 31 else -float("inf"))
            if not ok:
                return (f"{name}: fp32 bits {b:#010x} ({'NaN' if is_nan else 'an infinity'}) with noise {fill:#x} "
                        f"rounded to {o}; NaN must stay NaN and +-inf +-inf, whatever the noise")
    # noise=None: the function draws the noise itself, from `generator`
    name = case("noise drawn by the function (noise=None, a generator)")
    val = torch.full((20000,), 1 + 3 * 2 ** -10)
    first = stochastic_round_to_bf16(val, generator=torch.Generator().manual_seed(5))
    again = stochastic_round_to_bf16(val, generator=torch.Generator().manual_seed(5))
    if first.dtype != torch.bfloat16:
        return f"{name}: returned {first.dtype}, expected torch.bfloat16"
    lo, hi = _bf16_neighbours(val[:1])
    if not ((first.float() == lo) | (first.float() == hi)).all():
        return f"{name}: an element rounded to neither of the two bf16 neighbours {lo.item()} and {hi.item()}"
    if not torch.equal(first, again):
        return (f"{name}: two calls with generators seeded alike rounded differently: draw the noise from "
                f"`generator` (torch.randint(..., generator=generator)), or a run cannot be repeated")
    return _unbiased(name, first, val[0].item())
