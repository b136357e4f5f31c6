"""FlatAdamW (optim.py) is AdamW: over its flat buffers it computes what the
textbook per-parameter AdamW (optim.py:reference_adamw_step) computes, with
clipping by the global grad norm and decoupled weight decay.

Tolerance. One process, fp32 everywhere, and both optimizers get the very
same gradients each step (the reference model's), so they differ only by
fp32 round-off: FlatAdamW writes AdamW in place (m.lerp_ rather than
b1 m + (1 - b1) g, sqrt(v) / sqrt(bc2) rather than sqrt(v / bc2), the bias
corrections as -expm1(n log b) in fp32 rather than 1 - b^n in fp64): a few
ulps (~1e-7 relative) of an update of ~lr per element. After 6 steps at
lr 1e-2 the weights agree to 1.2e-7 (measured: one ulp of a norm gain near
1.0); atol 1e-6 + rtol 1e-5 leaves a margin and still catches a real slip (a
missed bias correction, a clip applied twice, decay on the norm gains: each
moves some weight by ~1e-3 in a step).
"""

from __future__ import annotations

import pytest
import torch

from nanohlat import comm, optim
from nanohlat import recipe
from nanohlat import device as devicelib
from nanohlat import mesh as meshlib
from nanohlat.model import Transformer, init_weights


def test_flat_adamw_matches_the_per_parameter_reference():
    model_cfg, tcfg = recipe.parse_args(["--preset", "tiny", "--precision", "fp32", "--n-layers", "2",
                                         "--lr", "1e-2", "--grad-clip", "0.05", "--weight-decay", "0.1"])
    flat_model, ref_model = Transformer(model_cfg), Transformer(model_cfg)
    init_weights(flat_model, tcfg.seed)
    init_weights(ref_model, tcfg.seed)
    opt = optim.FlatAdamW(flat_model, meshlib.Mesh(1, 1, 1, ledger=comm.CommLedger()), tcfg,
                          devicelib.get_device("cpu"))
    params = [p for _, p in ref_model.named_parameters()]
    initial = [p.detach().clone() for p in params]
    state: dict = {}
    gen = torch.Generator().manual_seed(0)
    for step in range(6):
        batch = torch.randint(0, model_cfg.vocab_size, (2, tcfg.seq_len + 1), generator=gen)
        lr = optim.cosine_lr(step, tcfg.lr, tcfg.min_lr, 2, 6)
        ref_model.zero_grad()
        ref_model(batch[:, :-1], batch[:, 1:]).mean().backward()
        grads = [p.grad for p in params]
        # FlatAdamW gets exactly the same gradients, through its hooks: the gradient of sum(p * g) is g
        opt.zero_grad()
        sum((p * g).sum() for p, g in zip(flat_model.parameters(), grads)).backward()
        norm, finite = opt.step(lr)
        ref_norm = optim.reference_adamw_step(params, grads, state, lr, tcfg)
        assert finite.item() and norm.item() > 2 * tcfg.grad_clip    # clipping is active every step
        assert norm.item() == pytest.approx(ref_norm.item(), rel=1e-6)
    for (name, p), q in zip(flat_model.named_parameters(), params):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6, msg=name)
    assert int(opt.step_count) == state["step"] == 6
    assert max((p - q).abs().max().item() for p, q in zip(params, initial)) > 1e-2   # and the weights moved
