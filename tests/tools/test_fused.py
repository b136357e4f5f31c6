"""tools/fused.py's rotary embedding is model.apply_rotary bit for bit, forward and backward, and an
eager run (build.py) uses it where the step is not compiled."""

from __future__ import annotations

import pytest
import torch

from nanohlat import model as M
from nanohlat.tools import fused


def rotated_and_grad(rotate, x, cos, sin, g):
    """(y, dx) of rotate(x, cos, sin) against the upstream gradient g, x a transposed view as in
    Attention.forward (B, T, H, D) -> (B, H, T, D)."""
    x = x.detach().requires_grad_()
    y = rotate(x.transpose(1, 2), cos, sin)
    y.backward(g)
    return y.detach(), x.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("B,T,H,D", [(2, 12, 3, 16), (8, 32, 8, 8), (1, 5, 2, 2)])
def test_rotary_is_apply_rotary_bit_for_bit(B, T, H, D, dtype):
    g = torch.Generator().manual_seed(B * 1000 + T * 10 + D)
    x = (torch.randn(B, T, H, D, generator=g) * 3).to(dtype)
    up = torch.randn(B, H, T, D, generator=g).to(dtype)
    cos, sin = M.rotary_tables(D, T + 3, 1e4)
    want = rotated_and_grad(M.apply_rotary, x, cos[:T], sin[:T], up)
    got = rotated_and_grad(fused.rotate, x, cos[:T], sin[:T], up)
    assert got[0].dtype == want[0].dtype == dtype
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    # serving's per-row positions: tables of shape (B, 1, T, D)
    pos = torch.randint(0, T + 3, (B, T), generator=g)
    tables = cos[pos].unsqueeze(1), sin[pos].unsqueeze(1)
    want = rotated_and_grad(M.apply_rotary, x, *tables, up)
    got = rotated_and_grad(fused.rotate, x, *tables, up)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_rotary_backward_is_the_derivative():
    """The hand-written backward is the forward's derivative (finite differences, fp64)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 7, 8, dtype=torch.float64, generator=g, requires_grad=True)
    cos, sin = (t[:7].double() for t in M.rotary_tables(8, 7, 1e4))
    assert torch.autograd.gradcheck(lambda x: fused.Rotary.apply(x, cos, sin), (x,))


def test_rotary_keeps_no_activation():
    """What it saves for backward is the two tables, as apply_rotary: the memory plan is unchanged."""
    x = torch.randn(2, 4, 6, 8, requires_grad=True)
    cos, sin = M.rotary_tables(8, 6, 1e4)
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        fused.rotate(x, cos, sin)
    assert sorted(t.shape for t in kept) == [cos.shape, sin.shape]


@pytest.mark.parametrize("compile", [False, True])
def test_an_eager_run_rotates_by_the_fused_function(compile):
    from nanohlat import comm, mesh as meshlib, recipe
    from nanohlat.device import get_device
    from nanohlat.run.build import build
    cfg, tcfg = recipe.parse_args(["--preset", "tiny", "--n-layers", "2"] + (["--compile"] if compile else []))
    model, _, _ = build(cfg, tcfg, meshlib.Mesh(1, 1, 1, ledger=comm.CommLedger()), get_device("cpu"))
    want = M.apply_rotary if compile else fused.rotate
    assert [b.attn.rotate for b in model.layers.values()] == [want] * 2
