"""The fast AdamW path (tools/fast_adamw.py:FastFlatAdamW, what build.py gives the CPU) computes
FlatAdamW's numbers: through torch's fused kernel not bit for bit, so both are held to a bound
derived here, against AdamW computed in fp64 from the same fp32 state.

`fused_bound`, per element, u = 2^-24 (fp32's unit round-off), first order in u: each fp32
operation rounds once, relative error <= u; expm1 and the fp32 -> fp64 -> fp32 constants <= 1 ulp.
With M = |m| + (1 - b1)|g| (no cancellation: >= |m'|), U = (lr / bc1) M / den* (>= |update|):

  m' = b1 m + (1 - b1) g   FlatAdamW's lerp: the weight's rounding, g - m, the product, the sum:
                           <= u (1 + 2 (1 - b1)) |m| + 4 u (1 - b1) |g|  <= 4 u M  (b1 >= 0.5);
                           the kernel's lerp is the same formula (its coefficient the same fp32)
  v' = b2 v + (1 - b2) g^2 FlatAdamW's lerp of g^2: <= u (4 (1-b2) g^2 + 3 (1-b2) v + v') <= 8 u v'
                           (b2 >= 0.5); the kernel's b2 v + ((1 - b2) g) g: <= 6 u v'
  den = sqrt(v' / bc2)+eps sqrt halves v's error (4 u) + its rounding; sqrt(bc2) from an fp32 expm1
                           (FlatAdamW: 3 u) or fp64 (the kernel: u); the division; the sum: <= 10 u
  lr / bc1                 FlatAdamW fp32 (lr, expm1, division: 6 u), the kernel fp64 rounded (2 u)
  update                   two more roundings: |update - update*| <= (4 + 6 + 10 + 2) u U = 22 u U
  w' = w (1 - lr wd) - update   the factor (2 u), the product, the difference:
                           <= 4 u |w| + 23 u U

`fused_bound` rounds each constant up by one u for the terms of second order. The check is not
vacuous: an lr off by 1e-4 (relative) is caught (`test_the_bound_catches_a_wrong_update`).
"""

import pytest
import torch

from nanohlat import comm, optim
from nanohlat import device as devicelib
from nanohlat import mesh as meshlib
from nanohlat.model import init_weights
from nanohlat.run.build import decoder
from nanohlat import recipe
from nanohlat.tools import fast_adamw

U = 2.0 ** -24
pytestmark = pytest.mark.skipif(not fast_adamw.fused_adamw("cpu"), reason="torch has no fused CPU AdamW here")


def exact_step(w, m, v, g, n, lr, tcfg, decay):
    """AdamW in fp64 from fp32 state (g already clipped): (w', m', v', U) of the module docstring."""
    w, m, v, g = (t.double() for t in (w, m, v, g))
    b1, b2, eps, wd = tcfg.beta1, tcfg.beta2, tcfg.adam_eps, tcfg.weight_decay if decay else 0.0
    m1, v1 = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
    bc1, bc2 = 1 - b1 ** n, 1 - b2 ** n
    den = (v1 / bc2).sqrt() + eps
    big_u = lr / bc1 * (m.abs() + (1 - b1) * g.abs()) / den
    return w * (1 - lr * wd) - lr / bc1 * m1 / den, m1, v1, big_u


def fused_bound(w, m, g, v1, big_u, tcfg):
    """Per element: the bounds on |w' - w'*|, |m' - m'*|, |v' - v'*| (module docstring)."""
    M = m.double().abs() + (1 - tcfg.beta1) * g.double().abs()
    return U * (5 * w.double().abs() + 24 * big_u), 5 * U * M, 9 * U * v1


def pair(args, fused_too=True):
    """(FlatAdamW, FastFlatAdamW) on two copies of one model; the fast one's grad norm in the
    textbook's chunks, so both clip by the same bits."""
    model_cfg, tcfg = recipe.parse_args(["--preset", "tiny", "--n-layers", "2"] + args)
    mesh, dev = meshlib.Mesh(1, 1, 1, ledger=comm.CommLedger()), devicelib.get_device("cpu")
    opts = []
    for cls in (optim.FlatAdamW, fast_adamw.FastFlatAdamW):
        model = decoder(model_cfg)
        init_weights(model, tcfg.seed)
        opts.append(cls(model, mesh, tcfg, dev))
    opts[1].chunk = optim.NORM_CHUNK
    assert opts[1].fused
    return opts, tcfg


def set_state(opts, n, gen, grad_scale):
    """The same random state in both: weights kept, m and v (zero at n = 1), gradients; step n next."""
    for groups in zip(*(o.groups for o in opts)):
        size = groups[0].grad.numel()
        m = torch.randn(size, generator=gen) * grad_scale if n > 1 else torch.zeros(size)
        v = torch.rand(size, generator=gen) * grad_scale ** 2 if n > 1 else torch.zeros(size)
        g = torch.randn(size, generator=gen) * grad_scale
        g[::7] = -9 * m[::7]            # some elements where b1 m + (1 - b1) g cancels (b1 0.9, to round-off)
        for grp in groups:
            grp.exp_avg.copy_(m)
            grp.exp_avg_sq.copy_(v)
            grp.grad.copy_(g)
    for o in opts:
        o.step_count.fill_(n - 1)


@pytest.mark.parametrize("n, grad_scale, clip", [(1, 1e-3, 0.0), (2, 1e-2, 0.0), (1000, 1e-2, 0.0),
                                                 (3, 1e-4, 1.0), (7, 1.0, 0.5)])
def test_fast_adamw_gives_flat_adamws_numbers_within_the_derived_bound(n, grad_scale, clip):
    """Both FlatAdamW's blocked textbook lines and the fused kernel land within `fused_bound` of AdamW in
    fp64, every group (decayed and not), the first step and late ones, clipping active (the last case)
    and not. The kernel runs once per group."""
    opts, tcfg = pair(["--lr", "3e-3", "--weight-decay", "0.1", "--grad-clip", str(clip)])
    set_state(opts, n, torch.Generator().manual_seed(n), grad_scale)
    before = [(g.master.clone(), g.exp_avg.clone(), g.exp_avg_sq.clone(), g.grad.clone(), g.decay)
              for g in opts[0].groups]
    calls = []
    real = torch._fused_adamw_
    torch._fused_adamw_ = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        norms = [o.step(tcfg.lr)[0] for o in opts]
    finally:
        torch._fused_adamw_ = real
    assert len(calls) == len(opts[1].groups)
    assert torch.equal(norms[0], norms[1])
    scale = torch.clamp(tcfg.grad_clip / (norms[0] + 1e-6), max=1.0) if tcfg.grad_clip > 0 else None
    assert (scale is not None and scale.item() < 1.0) == (clip == 0.5)          # clipping active or not
    differ = False
    for (w, m, v, g, decay), flat, fast in zip(before, *(o.groups for o in opts)):
        g = g * scale if scale is not None else g                                 # FlatAdamW's own multiply
        w1, m1, v1, big_u = exact_step(w, m, v, g, n, tcfg.lr, tcfg, decay and tcfg.weight_decay != 0)
        bw, bm, bv = fused_bound(w, m, g, v1, big_u, tcfg)
        for grp in (flat, fast):
            assert ((grp.master.double() - w1).abs() <= bw).all()
            assert ((grp.exp_avg.double() - m1).abs() <= bm).all()
            assert ((grp.exp_avg_sq.double() - v1).abs() <= bv).all()
        moved = (flat.master.double() - w).abs().max()
        assert moved > 100 * bw.max()                                             # a step, not round-off
        differ = differ or not torch.equal(fast.master, flat.master)
    assert differ       # not the same bits: the bound is what holds them together


def test_the_bound_catches_a_wrong_update():
    """An lr 1e-4 off (relative) moves the weights outside the bound: it is not vacuous."""
    opts, tcfg = pair(["--lr", "3e-3", "--weight-decay", "0.1"])
    set_state(opts, 5, torch.Generator().manual_seed(5), 1e-2)
    g = opts[1].groups[0]
    w, m, v, grad = g.master.clone(), g.exp_avg.clone(), g.exp_avg_sq.clone(), g.grad.clone()
    opts[1].step(tcfg.lr * (1 + 1e-4))
    w1, _, v1, big_u = exact_step(w, m, v, grad, 5, tcfg.lr, tcfg, g.decay)
    bw = fused_bound(w, m, grad, v1, big_u, tcfg)[0]
    assert ((g.master.double() - w1).abs() > bw).any()


def test_a_skipped_step_and_every_layout_keep_exact_bits():
    """What stays bit for bit: a non-finite step changes nothing (as FlatAdamW's), and an element's
    update does not depend on where in a buffer it sits (a shard's tail is mid-buffer in another
    layout): the buffer split at an odd place gives the full buffer's bits."""
    opts, tcfg = pair(["--lr", "3e-3"])
    set_state(opts, 3, torch.Generator().manual_seed(3), 1e-2)
    for o in opts:
        o.groups[0].grad[5] = float("inf")
    kept = [[(g.master.clone(), g.exp_avg.clone(), g.exp_avg_sq.clone()) for g in o.groups] for o in opts]
    for o, saved in zip(opts, kept):
        norm, finite = o.step(tcfg.lr)
        assert not finite.item()
        assert all(torch.equal(a, b) for g, s in zip(o.groups, saved) for a, b in zip((g.master, g.exp_avg, g.exp_avg_sq), s))
    fast = opts[1]
    fast.now = (tcfg.lr, True)
    fast.step_number.fill_(3)
    gen = torch.Generator().manual_seed(1)
    w, m, v, g = (torch.randn(1003, generator=gen) * s for s in (1e-1, 1e-2, 1e-2, 1e-2))
    v = v.abs()
    c = {"clip": torch.ones(())}
    whole = [t.clone() for t in (g, m, v, w)]
    fast._adamw(*whole, c, True)
    parts = [t.clone() for t in (g, m, v, w)]
    for sl in (slice(0, 37), slice(37, 1003)):                     # 37 and 966: neither a multiple of 16
        fast._adamw(*(t[sl] for t in parts), c, True)
    assert all(torch.equal(a, b) for a, b in zip(whole[1:], parts[1:]))
