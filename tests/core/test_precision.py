"""Number formats (nanohlat/precision.py): stochastic rounding to bf16 is
unbiased, round-to-nearest is not, and that is what lets pure-bf16 training
keep small updates.

Statistical tolerances. A stochastic rounding of x, which lies between the
bf16 neighbours lo < x < hi = lo + ulp, is lo or hi: a Bernoulli draw with
p = (x - lo) / ulp, so E[SR(x)] = x exactly and one draw has standard
deviation ulp * sqrt(p (1 - p)). The mean of N independent draws therefore
has standard error SE = ulp * sqrt(p (1 - p) / N), and we accept |mean - x|
< 5 SE (a false alarm has probability ~6e-7 per value; the generators are
seeded anyway, so a run is repeatable). Round-to-nearest is deterministic:
its error for such an x is min(p, 1 - p) * ulp, which we choose to be
dozens of SEs so the two cannot be confused.
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from nanohlat import comm, config, optim
from nanohlat import recipe
from nanohlat import device as devicelib
from nanohlat import mesh as meshlib
from nanohlat.model import Transformer, init_weights
from nanohlat import shard_spec
from nanohlat.precision import (full_index, master_dtype, mix64, name_key, param_dtype, round_update, rounding_noise,
                                step_key, stochastic_round_to_bf16)

N_DRAWS = 20_000


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """Spacing of bf16 values around |x| (normal numbers): 2^(exponent - 7)."""
    return torch.ldexp(torch.ones_like(x), torch.frexp(x.abs()).exponent - 8)


def between_neighbours(p: float, lo: float) -> float:
    """The fp32 value a fraction p of the way from bf16 `lo` to the next bf16 up (in magnitude)."""
    lo_t = torch.tensor(lo, dtype=torch.float32)
    assert lo_t.to(torch.bfloat16).float() == lo_t, "lo must be a bf16 value"
    x = (lo_t + math.copysign(p, lo) * bf16_ulp(lo_t)).item()
    return x


# (fraction of the way to the next bf16, the lower neighbour): magnitudes from
# an Adam-sized 3e-3 to 1e4, both signs, p near 0, 1/2 and 1
CASES = [(0.25, 1.0), (0.5, 1.0), (0.9, 1.0), (0.1, 0.5), (0.3, -1.0), (0.7, -2.0),
         (0.02, 0.0029296875), (0.6, -0.0029296875), (0.45, 9984.0), (0.97, -9984.0)]


def test_stochastic_rounding_is_unbiased_and_round_to_nearest_is_not():
    g = torch.Generator().manual_seed(0)
    x = torch.tensor([between_neighbours(p, lo) for p, lo in CASES], dtype=torch.float32)
    draws = stochastic_round_to_bf16(x.expand(N_DRAWS, -1), generator=g)     # (N, cases)
    assert draws.dtype == torch.bfloat16
    lo = torch.tensor([lo for _, lo in CASES], dtype=torch.float64)
    ulp = bf16_ulp(lo.float()).double()
    hi = lo + torch.sign(lo) * ulp
    # every draw is one of the two neighbours, never anything else
    d = draws.double()
    assert ((d == lo) | (d == hi)).all()
    p = (x.double() - lo).abs() / ulp           # the exact fraction of the fp32 value we rounded
    assert torch.allclose(p, torch.tensor([p for p, _ in CASES], dtype=torch.float64), atol=1e-3)
    se = ulp * torch.sqrt(p * (1 - p) / N_DRAWS)
    sr_err = (d.mean(0) - x.double()).abs()
    rne_err = (x.to(torch.bfloat16).double() - x.double()).abs()
    assert (sr_err < 5 * se).all(), f"SR mean off by {(sr_err / se).tolist()} standard errors"
    assert torch.allclose(rne_err, torch.minimum(p, 1 - p) * ulp)
    assert (rne_err > 20 * se).all(), "round-to-nearest should be visibly biased for these values"


def test_stochastic_rounding_with_the_hashed_noise_is_unbiased():
    """The optimizer's noise (a hash of seed, step, parameter and element) in
    place of the generator: N steps of the same elements, same 5-SE bound."""
    x = torch.tensor([between_neighbours(p, lo) for p, lo in CASES], dtype=torch.float32)
    steps = torch.arange(1, N_DRAWS + 1, dtype=torch.int64)
    keys = mix64(step_key(0, steps) ^ name_key("layers.0.attn.wq.weight"))          # (N,)
    noise = rounding_noise(keys[:, None], torch.arange(len(CASES), dtype=torch.int64)[None, :])
    assert noise.min() >= 0 and noise.max() < 1 << 16
    d = stochastic_round_to_bf16(x.expand(N_DRAWS, -1), noise=noise).double()
    lo = torch.tensor([lo for _, lo in CASES], dtype=torch.float64)
    ulp = bf16_ulp(lo.float()).double()
    p = (x.double() - lo).abs() / ulp
    se = ulp * torch.sqrt(p * (1 - p) / N_DRAWS)
    assert ((d.mean(0) - x.double()).abs() < 5 * se).all()


def test_mix64_is_splitmix64_with_wrapping_int64():
    """The int64 tensor version equals SplitMix64 written on Python's exact integers."""
    def reference(z):
        z &= (1 << 64) - 1
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
        z ^= z >> 31
        return z - (1 << 64) if z >= 1 << 63 else z
    values = [0, 1, -1, 12345, -(1 << 63), (1 << 63) - 1, 0x9E3779B97F4A7C15 - (1 << 64)]
    got = mix64(torch.tensor(values, dtype=torch.int64)).tolist()
    assert got == [reference(v) for v in values]


@pytest.mark.parametrize("shape, tp_dim", [((12, 8), 0), ((12, 8), 1), ((6, 4, 8), 1), ((16,), 0)])
@pytest.mark.parametrize("tp", [2, 4])
def test_noise_names_an_element_by_its_place_in_the_full_parameter(shape, tp_dim, tp):
    """A tp shard's noise is the full parameter's noise, sliced like the shard:
    the rounding of an element does not depend on the layout or the rank."""
    key = mix64(step_key(1234, torch.tensor(7)) ^ name_key("w"))
    n = math.prod(shape)
    full_noise = rounding_noise(key, torch.arange(n)).view(shape)
    for rank in range(tp):
        local_shape = shard_spec.shard(full_noise, tp_dim, rank, tp).shape
        local = torch.arange(math.prod(local_shape))
        mine = rounding_noise(key, full_index(local, local_shape, tp_dim, rank, tp)).view(local_shape)
        assert torch.equal(mine, shard_spec.shard(full_noise, tp_dim, rank, tp))
    other_step = rounding_noise(mix64(step_key(1234, torch.tensor(8)) ^ name_key("w")), torch.arange(n))
    other_name = rounding_noise(mix64(step_key(1234, torch.tensor(7)) ^ name_key("v")), torch.arange(n))
    assert (other_step != full_noise.view(-1)).float().mean() > 0.99
    assert (other_name != full_noise.view(-1)).float().mean() > 0.99


def test_stochastic_rounding_of_bf16_values_is_exact():
    g = torch.Generator().manual_seed(1)
    values = (torch.randn(10_000, generator=g) * torch.logspace(-8, 8, 10_000)).to(torch.bfloat16).float()
    special = torch.tensor([0.0, -0.0, 1.0, -1.0, 2.0 ** -126, -(2.0 ** 100), float("inf"), float("-inf")])
    values = torch.cat([values, special])
    for _ in range(5):
        out = stochastic_round_to_bf16(values, generator=g)
        assert torch.equal(out.float(), values)
        assert torch.equal(torch.signbit(out.float()), torch.signbit(values))   # -0.0 stays -0.0


def test_stochastic_rounding_keeps_nan():
    # torch's own NaNs (quiet, payload 0) stay NaN; other payloads: the next test
    x = torch.tensor([float("nan"), -float("nan")])
    assert torch.isnan(stochastic_round_to_bf16(x)).all()


def test_stochastic_rounding_keeps_every_nan_payload():
    x = torch.tensor([0x7FFF8000, 0x7FFFFFFF, -0x8000], dtype=torch.int32).view(torch.float32)
    assert torch.isnan(x).all()
    out = stochastic_round_to_bf16(x.expand(1000, -1), generator=torch.Generator().manual_seed(0))
    assert torch.isnan(out).all()


def test_same_generator_state_gives_the_same_rounding():
    x = torch.rand(1000) * 10 - 5
    a = stochastic_round_to_bf16(x, generator=torch.Generator().manual_seed(7))
    b = stochastic_round_to_bf16(x, generator=torch.Generator().manual_seed(7))
    c = stochastic_round_to_bf16(x, generator=torch.Generator().manual_seed(8))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_small_updates_vanish_with_round_to_nearest_and_survive_with_stochastic_rounding():
    """w = 1.0 in bf16, += 1e-4 a thousand times (each sum formed in fp32, then
    stored in bf16). bf16's spacing just above 1.0 is 2^-7 ~ 0.0078, so each
    1e-4 is far below half a spacing: round-to-nearest returns 1.0 every time.
    SR moves up one spacing with probability 1e-4 / 2^-7 ~ 1.3% per step, so
    E[w] follows the fp32 sum. One chain ends at 1.1 +- sd, with sd ~
    sqrt(1000 * 2^-7 * 1e-4) ~ 0.028; the mean of CHAINS chains has standard
    error sd / sqrt(CHAINS) and must be within 5 of those of the fp32 sum."""
    chains, steps, delta = 1000, 1000, 1e-4
    g = torch.Generator().manual_seed(2)
    rne = torch.ones(chains, dtype=torch.bfloat16)
    sr = torch.ones(chains, dtype=torch.bfloat16)
    exact = torch.ones((), dtype=torch.float32)
    for _ in range(steps):
        rne = (rne.float() + delta).to(torch.bfloat16)
        sr = stochastic_round_to_bf16(sr.float() + delta, generator=g)
        exact = exact + delta
    assert (rne == 1.0).all()
    sd = math.sqrt(steps * 2.0 ** -7 * delta)
    mean = sr.double().mean().item()
    assert abs(mean - exact.item()) < 5 * sd / math.sqrt(chains), (mean, exact.item())
    assert abs(exact.item() - 1.1) < 1e-4
    assert sr.double().std().item() < 2 * sd       # spread as predicted, not a runaway


def test_round_update_dispatch():
    x = torch.full((4096,), 1.0 + 2.0 ** -9)     # a quarter of the way from 1.0 to the next bf16
    assert round_update(x, torch.float32, "fp32") is x
    assert (round_update(x, torch.bfloat16, "bf16") == 1.0).all()             # nearest
    noise = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    sr = round_update(x, torch.bfloat16, "bf16-sr", noise)
    assert 0.15 < (sr > 1.0).float().mean().item() < 0.35                     # ~1/4 round up
    # what the cast receives is already a bf16 value, so trn1's hardware rounding cannot change it
    assert torch.equal(sr.float().to(torch.bfloat16), sr) and torch.equal(stochastic_round_to_bf16(x, noise=noise), sr)
    assert [param_dtype(p) for p in ("fp32", "bf16-mixed", "bf16-sr", "bf16")] == [torch.float32] + [torch.bfloat16] * 3
    assert [master_dtype(p) for p in ("fp32", "bf16-mixed", "bf16-sr", "bf16")] == \
        [torch.float32, torch.float32, torch.bfloat16, torch.bfloat16]


@pytest.mark.parametrize("precision", ["bf16", "bf16-sr", "bf16-mixed"])
def test_optimizer_keeps_small_updates_only_with_sr_or_fp32_master(precision):
    """The wiring in FlatAdamW: RMSNorm gains start at 1.0 and Adam moves them by
    about lr per step. At lr 5e-4 that is under half a bf16 spacing (2^-9 below
    1.0, 2^-8 above), so pure bf16 with round-to-nearest never moves them; SR
    moves some each step; bf16-mixed moves its fp32 master every step."""
    model_cfg, tcfg = recipe.parse_args(["--preset", "tiny", "--precision", precision, "--lr", "5e-4",
                                         "--n-layers", "2"])
    model = Transformer(model_cfg)
    init_weights(model, tcfg.seed)
    model.to(dtype=param_dtype(precision))
    opt = optim.FlatAdamW(model, meshlib.Mesh(1, 1, 1, ledger=comm.CommLedger()), tcfg,
                          devicelib.get_device("cpu"))
    batch = torch.randint(0, model_cfg.vocab_size, (2, tcfg.seq_len + 1), generator=torch.Generator().manual_seed(3))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)          # tiny tensors: one thread is faster, and steady on a busy machine
    try:
        for _ in range(3):
            opt.zero_grad()
            model(batch[:, :-1], batch[:, 1:]).mean().backward()
            opt.step(tcfg.lr)
    finally:
        torch.set_num_threads(threads)
    gains = torch.cat([p.detach().float().view(-1) for n, p in model.named_parameters() if p.ndim == 1])
    master = torch.cat([g.master.float() for g in opt.groups if not g.decay])   # the 1-D (norm) group(s)
    moved = (gains != 1.0).float().mean().item()
    if precision == "bf16":
        assert moved == 0.0 and (master == 1.0).all()
    elif precision == "bf16-sr":
        assert 0.05 < moved < 1.0
    else:
        assert (master != 1.0).float().mean().item() > 0.95      # fp32 master: every gain moved


def test_bf16_micro_batch_gradients_accumulate_in_fp32():
    """64 micro-batches with --precision bf16-mixed: the gradient the optimizer
    sees equals the fp32 sum of the 64 per-micro-batch (bf16) gradients to
    <= 1e-6 relative. Autograd's own accumulation into the bf16 `p.grad`
    (what the optimizer used to read) is off by ~1e-2: each of the 63 additions
    rounds the running sum to bf16's 8 bits."""
    model_cfg, tcfg = recipe.parse_args(["--preset", "tiny", "--precision", "bf16-mixed", "--n-layers", "1",
                                         "--microbatches", "64"])
    mb, T = 64, 8
    batch = torch.randint(0, model_cfg.vocab_size, (mb, 1, T + 1), generator=torch.Generator().manual_seed(4))

    def build():
        model = Transformer(model_cfg)
        init_weights(model, tcfg.seed)
        return model.to(dtype=torch.bfloat16)

    plain, hooked = build(), build()
    opt = optim.FlatAdamW(hooked, meshlib.Mesh(1, 1, 1, ledger=comm.CommLedger()), tcfg, devicelib.get_device("cpu"))
    names = [n for n, _ in plain.named_parameters()]
    exact = {n: torch.zeros(p.shape, dtype=torch.float64) for n, p in plain.named_parameters()}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        opt.zero_grad()
        for i in range(mb):
            # one micro-batch alone: its bf16 gradient, summed exactly (fp64) over micro-batches
            plain.zero_grad(set_to_none=True)
            plain(batch[i, :, :-1], batch[i, :, 1:]).mean().div(mb).backward()
            for n, p in plain.named_parameters():
                exact[n] += p.grad.double()
            hooked(batch[i, :, :-1], batch[i, :, 1:]).mean().div(mb).backward()   # accumulates via the hooks
        # autograd's bf16 accumulation, for comparison
        plain.zero_grad(set_to_none=True)
        for i in range(mb):
            plain(batch[i, :, :-1], batch[i, :, 1:]).mean().div(mb).backward()
    finally:
        torch.set_num_threads(threads)
    assert all(p.grad is None for p in hooked.parameters())     # the bf16 gradients were freed
    got = {n: g.grad[off:off + p.numel()].double() for g in opt.groups
           for n, p, off in zip(g.names, g.params, g.offsets)}
    ref = torch.cat([exact[n].view(-1) for n in names])
    flat = torch.cat([got[n] for n in names])
    bf16_sum = torch.cat([p.grad.double().view(-1) for p in plain.parameters()])

    def rel(x):
        return ((x - ref).norm() / ref.norm()).item()
    assert rel(flat) <= 1e-6, rel(flat)
    assert rel(bf16_sum) > 1e-3, rel(bf16_sum)      # the test can tell the two apart


@pytest.mark.xla
@pytest.mark.skipif(importlib.util.find_spec("torch_xla") is None, reason="needs torch_xla")
def test_the_noise_and_the_rounding_are_the_same_on_xla_as_on_the_cpu():
    """An XLA rank and a CPU rank holding the same element draw the same noise:
    int64 wrap-around and the logical shifts agree (torch_xla's `>>` of a
    negative int64 does not match torch's, which precision._shr avoids)."""
    import torch_xla.core.xla_model as xm
    dev = xm.xla_device()
    idx = full_index(torch.arange(100, 300), (8, 50), 1, 1, 2)
    key = mix64(step_key(1234, torch.tensor(5)) ^ name_key("w"))
    key_x = mix64(step_key(1234, torch.tensor(5, device=dev)) ^ name_key("w"))
    noise, noise_x = rounding_noise(key, idx), rounding_noise(key_x, idx.to(dev))
    assert torch.equal(noise, noise_x.cpu())
    x = torch.randn(200, generator=torch.Generator().manual_seed(5))
    assert torch.equal(stochastic_round_to_bf16(x, noise=noise),
                       stochastic_round_to_bf16(x.to(dev), noise=noise_x).cpu())


@pytest.mark.parametrize("precision, moments", [("fp32", "fp32"), ("bf16-mixed", "fp32"), ("bf16", "fp32"),
                                                ("bf16-sr", "fp32"), ("bf16-sr", "bf16")])
def test_master_weights_are_the_parameters_unless_bf16_mixed(precision, moments):
    """HLAT's memory: where the master dtype is the parameters' own, the optimizer keeps no
    second copy: every parameter is a view of its group's flat buffer, and the master is that
    buffer, so a step writes straight into the weights. bf16-mixed alone keeps fp32 master
    weights beside the bf16 parameters. --moments bf16 stores the moments in 2 bytes."""
    model_cfg, tcfg = recipe.parse_args(["--preset", "tiny", "--precision", precision, "--moments", moments,
                                         "--n-layers", "2"])
    model = Transformer(model_cfg)
    init_weights(model, tcfg.seed)
    model.to(dtype=param_dtype(precision))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = optim.FlatAdamW(model, meshlib.Mesh(1, 1, 1, ledger=comm.CommLedger()), tcfg, devicelib.get_device("cpu"))
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())     # packing changed no value
    for g in opt.groups:
        base = g.flat.untyped_storage().data_ptr()
        assert all(p.untyped_storage().data_ptr() == base for p in g.params)        # views of the flat buffer
        assert (g.master.untyped_storage().data_ptr() == base) == (precision != "bf16-mixed") == g.master_is_params
        assert g.exp_avg.dtype == g.exp_avg_sq.dtype == (torch.bfloat16 if moments == "bf16" else torch.float32)
    batch = torch.randint(0, model_cfg.vocab_size, (2, tcfg.seq_len + 1), generator=torch.Generator().manual_seed(3))
    opt.zero_grad()
    model(batch[:, :-1], batch[:, 1:]).mean().backward()
    opt.step(tcfg.lr)
    moved = sum(not torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert moved == len(before)                               # the step reached every parameter
    assert all((g.exp_avg_sq.float() > 0).any() for g in opt.groups)


def test_bf16_moments_need_stochastic_rounding():
    with pytest.raises(config.UserError, match="--moments bf16 .* needs --precision bf16-sr"):
        recipe.parse_args(["--preset", "tiny", "--precision", "bf16-mixed", "--moments", "bf16"])
    assert recipe.parse_args(["--preset", "hlat-7b"])[1].moments == "bf16"      # HLAT's pure bf16


def test_bf16_moments_round_alike_in_every_holder_and_stay_unbiased():
    """The moments' noise is the master's rule with a salt: a function of the element, not of
    the rank, and independent of the weights' noise (salts 1, 2 vs 0)."""
    from nanohlat.precision import Piece, round_into_master
    w = torch.full((4096,), 1.0 + 2.0 ** -9)
    piece = [Piece("x", name_key("x"), 0, 4096, 0, 4096, (4096,), None, 0, 1)]
    out = {salt: torch.empty(4096, dtype=torch.bfloat16) for salt in (0, 1, 2)}
    for salt, o in out.items():
        round_into_master(o, w, piece, "bf16-sr", 1337, torch.tensor(5), salt)
    again = torch.empty(4096, dtype=torch.bfloat16)
    round_into_master(again, w, piece, "bf16-sr", 1337, torch.tensor(5), 1)
    assert torch.equal(again, out[1])                                   # same element, same bits
    assert not torch.equal(out[0], out[1]) and not torch.equal(out[1], out[2])   # independent noise
    for o in out.values():
        assert 0.15 < (o > 1.0).float().mean().item() < 0.35            # ~1/4 round up: unbiased
