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

    --precision   parameters/compute   optimizer master weights      rounding of the update
    fp32          fp32                 the parameters themselves     -
    bf16-mixed    bf16                 a separate fp32 copy          fp32 master, copy -> bf16
    bf16-sr       bf16                 the parameters themselves     stochastic (software, counter-based)
    bf16          bf16                 the parameters themselves     round-to-nearest-even

The model's parameters live in one flat buffer per optimizer group
(optim.FlatGroup: each parameter is a view of it; on XLA the step gathers it
from the parameters and scatters it back, inside the graph). Where the master dtype is
the parameter dtype, the master weights ARE that buffer (this dp rank's 1/dp
slice of it with ZeRO-1): no second copy, the update is written straight into
the parameters. Only bf16-mixed keeps a separate fp32 master (4 more bytes per
parameter, 1/dp with ZeRO-1). Gradients always accumulate in fp32
(data_parallel.accumulate_hook). Adam's moments are fp32, or with
`--moments bf16` (bf16-sr only: what HLAT's pure-bf16 stack did) bf16, updated
in fp32 and stored with stochastic rounding like the weights (2 + 2 bytes
instead of 4 + 4 per parameter).

The update's rounding is always this file's counter-based software rounding,
on trn1 too: its result is already a bf16 value when it is cast, so the
hardware's stochastic rounding (xla.set_neuron_rounding) cannot change it, and
replicas stay identical however each NeuronCore's random bits fall.

Stochastic rounding noise: one rule for every holder of an element
------------------------------------------------------------------
With plain data parallelism every dp rank holds a replica of every element,
tp ranks hold replicas of the RMSNorm gains, and under ZeRO-1 one dp rank
rounds an element that all others then receive. Replicas stay bitwise
identical only if every holder rounds an element with the same noise. So the
noise is a function of *what* is rounded, never of *who* rounds it:

    noise(element) = hash(seed, optimizer step, parameter name,
                          the element's flat index in the FULL parameter) mod 2^16

"Full" means unsharded over tp: a tp rank computes its elements' indices in
the whole tensor from its shard's position (`full_index`), so the noise is
also the same in every layout. The hash is counter-based (SplitMix64's
integer mixing on int64 tensors: no generator state to carry, no
torch.Generator, which torch_xla does not have), and its 16 bits are as good
as uniform, so the rounding stays unbiased.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch

PRECISIONS = ("fp32", "bf16-mixed", "bf16-sr", "bf16")


def param_dtype(precision: str) -> torch.dtype:
    return torch.float32 if precision == "fp32" else torch.bfloat16


def master_dtype(precision: str) -> torch.dtype:
    return torch.float32 if precision in ("fp32", "bf16-mixed") else torch.bfloat16


def moment_dtype(moments: str) -> torch.dtype:
    """Adam's two moments: fp32, or bf16 with stochastic rounding (--moments)."""
    return torch.bfloat16 if moments == "bf16" else torch.float32


def stochastic_round_to_bf16(x: torch.Tensor, generator=None,
                             noise: torch.Tensor | None = None) -> torch.Tensor:
    """Round fp32 -> bf16 up or down at random, unbiased: each value goes to one of
    its two bf16 neighbours, the farther one the less likely, so that on average it
    is the value itself (tutorial chapter 7 says how, and why it matters).
    `noise`: the random integers in [0, 2^16) to use (int32, x's shape; the
    optimizer's `round_into_master` passes `rounding_noise`), else drawn from
    `generator`. NaN stays NaN.
    """
    # exercise 7a: begin
    # A bf16 is the top 16 bits of an fp32. Adding a uniform random integer in
    # [0, 2^16) to the low 16 bits and then truncating them carries into the
    # kept bits with probability (low bits) / 2^16: exactly the distance to the
    # next bf16 value. Works for negative numbers too (sign-magnitude format).
    x = x.float().contiguous()
    bits = x.view(torch.int32)
    if noise is None:
        noise = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, device=x.device, generator=generator)
    rounded = (bits + noise) & -65536          # -65536 == 0xFFFF0000: clear the low 16 bits
    out = rounded.view(torch.float32).to(torch.bfloat16)    # exact: low bits are zero
    # a NaN with a full mantissa would carry into the sign bit: keep NaN a NaN
    return torch.where(torch.isnan(x), x.to(torch.bfloat16), out)
    # exercise 7a: end


def round_update(x: torch.Tensor, dtype: torch.dtype, precision: str,
                 noise: torch.Tensor | None = None) -> torch.Tensor:
    """Store the fp32 result of an optimizer step in `dtype` (the master's, or the moments')."""
    if dtype == torch.float32:
        return x
    if precision == "bf16-sr":
        return stochastic_round_to_bf16(x, noise=noise)
    return x.to(dtype)          # round-to-nearest-even


# -- the noise: SplitMix64 (Steele, Lea, Flood 2014) on int64 tensors ---------
# int64 multiplication wraps around modulo 2^64 in torch and XLA alike. The
# mixer needs logical right shifts, and `>>` of a negative int64 differs
# (torch copies the sign bit; torch_xla 2.9 gave 0 for -1 >> 30), so _shr
# shifts only non-negative numbers and puts the sign bit back by hand.

def _s64(c: int) -> int:
    """A 64-bit constant as the signed int64 torch stores."""
    return c - (1 << 64) if c >= 1 << 63 else c


_GAMMA = _s64(0x9E3779B97F4A7C15)
_M1, _M2 = _s64(0xBF58476D1CE4E5B9), _s64(0x94D049BB133111EB)


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical shift right of int64 bit patterns by 1 <= s <= 63."""
    low63 = (x & ((1 << 63) - 1)) >> s                 # the 63 low bits, shifted: no sign involved
    return low63 | ((x < 0).to(torch.int64) << (63 - s))   # the sign bit lands at bit 63 - s


def mix64(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser: every output bit depends on every input bit."""
    x = (x ^ _shr(x, 30)) * _M1
    x = (x ^ _shr(x, 27)) * _M2
    return x ^ _shr(x, 31)


def name_key(name: str) -> int:
    """A stable 64-bit key for a parameter name (Python's hash() changes per process)."""
    return _s64(int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little"))


def step_key(seed: int, step: torch.Tensor) -> torch.Tensor:
    """The key of one optimizer step (`step`: an int64 device tensor; no host sync, no recompile)."""
    return mix64(mix64(torch.full_like(step, _s64(seed % (1 << 64)))) + step * _GAMMA)


def rounding_noise(param_key: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Uniform integers in [0, 2^16) for the elements at `index` (int64, full-parameter
    flat indices) of the parameter whose per-step key is `param_key`
    (= mix64(step_key ^ name_key)). The top 16 bits of the mix are kept."""
    return _shr(mix64(param_key + index * _GAMMA), 48).to(torch.int32)


def full_index(local: torch.Tensor, shape, tp_dim, chunk: int, chunks: int) -> torch.Tensor:
    """Flat indices into the full parameter of the elements at flat indices
    `local` of this rank's shard (shape `shape`), which is chunk number `chunk`
    of `chunks` contiguous chunks along `tp_dim` (shard_spec.shard)."""
    if tp_dim is None or chunks == 1:
        return local
    block = math.prod(shape[tp_dim:])          # one chunk's elements per index of the leading dims
    return (local // block) * (block * chunks) + chunk * block + local % block


# -- a flat shard, parameter by parameter: what the noise and checkpoints need --

@dataclass(frozen=True)
class Piece:
    """One parameter's part of a rank's (shard of a) flat buffer.

    [start, stop) indexes the shard; [local_start, local_stop) the same
    elements in this rank's tp-local parameter, flattened. The rest names
    those elements in the FULL parameter (full_index): the parameter's
    tp-local `shape`, its `tp_dim`, and which of `chunks` chunks along it
    this rank holds. Checkpoints store the optimizer state by these pieces too."""
    name: str
    name_key: int
    start: int
    stop: int
    local_start: int
    local_stop: int
    shape: tuple
    tp_dim: int | None
    chunk: int
    chunks: int


def shard_pieces(names, params, offsets, start: int, stop: int, tp_rank: int, tp: int) -> list[Piece]:
    """The Pieces of the parameters (at flat `offsets`) that overlap the shard [start, stop)."""
    pieces = []
    for name, p, off in zip(names, params, offsets):
        lo, hi = max(off, start), min(off + p.numel(), stop)
        if lo >= hi:
            continue
        chunks = 1 if p.shard.dim is None else p.shard.parts   # (shard_spec.ShardSpec)
        # which chunk this rank holds: over tp, its tp rank's; a parameter cut over another group of ranks
        # (a mixture's experts, spread over expert parallelism's ranks, whole on every tp rank) says its part
        chunk = p.shard.part if p.shard.group != "tp" else tp_rank * chunks // tp
        pieces.append(Piece(name, name_key(name), lo - start, hi - start, lo - off, hi - off, tuple(p.shape),
                            p.shard.dim, chunk, chunks))   # tp ranks sharing a chunk hold copies
    return pieces


def round_into_master(master: torch.Tensor, w: torch.Tensor, pieces: list[Piece], precision: str,
                      seed: int, step: torch.Tensor, salt: int = 0) -> None:
    """Store an optimizer step's fp32 result `w` in the bf16 `master` (same shard);
    also the bf16 moments (--moments bf16), each with its own `salt`.

    bf16-sr rounds each element with its own noise, a function of (seed,
    optimizer `step`, parameter, the element's index in the full parameter)
    and not of the rank (module docstring), so every holder of an element
    rounds it alike. One piece at a time: small int64 temporaries."""
    if precision != "bf16-sr":
        master.copy_(round_update(w, master.dtype, precision))
        return
    key = step_key(seed, step) if not salt else mix64(step_key(seed, step) ^ salt)
    for p in pieces:
        local = torch.arange(p.local_start, p.local_stop, dtype=torch.int64, device=w.device)
        index = full_index(local, p.shape, p.tp_dim, p.chunk, p.chunks)   # each element's in the full tensor
        noise = rounding_noise(mix64(key ^ p.name_key), index)
        master[p.start:p.stop].copy_(stochastic_round_to_bf16(w[p.start:p.stop], noise=noise))
