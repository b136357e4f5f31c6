"""Number formats: fp32, bf16 and stochastic rounding.

BF16 keeps fp32's 8 exponent bits but only 7 mantissa bits: near 1.0 the gap
between neighbouring values is 2^-7 ~ 0.008. An AdamW update of lr 3e-4 to a
weight of size ~1 is far below half that gap, so round-to-nearest returns the
old weight: pure-bf16 training with round-to-nearest silently stops learning
once updates get small. Stochastic rounding (SR) rounds up with probability
equal to the distance already covered, so E[round(x)] = x: small updates
survive *on average*. HLAT-7B trained in pure bf16 with the Trainium
hardware's stochastic rounding (NEURON_RT_STOCHASTIC_ROUNDING_EN=1); HLAT-70B
kept fp32 master weights in ZeRO-1 instead.

    --precision   parameters/compute   optimizer master weights   rounding of the update
    fp32          fp32                 fp32                       -
    bf16-mixed    bf16                 fp32 (1/dp each w/ ZeRO-1) fp32 master, copy -> bf16
    bf16-sr       bf16                 the bf16 weights           stochastic (software; hardware on trn1)
    bf16          bf16                 the bf16 weights           round-to-nearest-even

Adam's moments stay fp32 in every mode.
"""

from __future__ import annotations

import torch

PRECISIONS = ("fp32", "bf16-mixed", "bf16-sr", "bf16")


def param_dtype(precision: str) -> torch.dtype:
    return torch.float32 if precision == "fp32" else torch.bfloat16


def master_dtype(precision: str) -> torch.dtype:
    return torch.float32 if precision in ("fp32", "bf16-mixed") else torch.bfloat16


def stochastic_round_to_bf16(x: torch.Tensor, generator=None) -> torch.Tensor:
    """Round fp32 -> bf16 up or down at random, unbiased.

    A bf16 is the top 16 bits of an fp32. Adding a uniform random integer in
    [0, 2^16) to the low 16 bits and then truncating them carries into the
    kept bits with probability (low bits) / 2^16: exactly the distance to the
    next bf16 value. Works for negative numbers too (sign-magnitude format).
    """
    x = x.float().contiguous()
    bits = x.view(torch.int32)
    noise = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, device=x.device, generator=generator)
    rounded = (bits + noise) & -65536          # -65536 == 0xFFFF0000: clear the low 16 bits
    out = rounded.view(torch.float32).to(torch.bfloat16)    # exact: low bits are zero
    # a NaN with a full mantissa would carry into the sign bit: keep NaN a NaN
    return torch.where(torch.isnan(x), x.to(torch.bfloat16), out)


def round_update(x: torch.Tensor, dtype: torch.dtype, precision: str, software_sr: bool,
                 generator=None) -> torch.Tensor:
    """Store the fp32 result of an optimizer step in the master dtype."""
    if dtype == torch.float32:
        return x
    if precision == "bf16-sr" and software_sr:
        return stochastic_round_to_bf16(x, generator)
    # round-to-nearest-even; on trn1 with NEURON_RT_STOCHASTIC_ROUNDING_EN=1 the
    # hardware rounds this very cast stochastically instead
    return x.to(dtype)
