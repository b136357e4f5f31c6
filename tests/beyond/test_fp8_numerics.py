"""nanohlat's FP8 linear (beyond/fp8.py) against independent implementations, on the same CPU inputs.

tensorwise and rowwise against torchao's Float8Linear with the matching recipe (torchao's
"tensorwise": E5M2 gradients; its "rowwise": E4M3 gradients, power-of-two scales, so nanohlat's rowwise
runs with --fp8-grad-format e4m3 here): the forward output and the two gradients, dx and dW (the three
matmuls), are bitwise equal in bf16, and in fp32 for tensorwise. torchao's rowwise in fp32 returns its
matmuls through bf16 (its addmm_float8_unwrapped: torch._scaled_mm has no fp32 output with row scales),
so there the bound is exact too: torchao's result is nanohlat's rounded to bf16, bit for bit. Both
dequantise as torch._scaled_mm's CPU kernel does (q * (1/s) in fp32, one fp32 matmul), so equality,
not closeness, is what the tests ask. torchao is a test dependency (pyproject's `test` extra); where it
cannot be imported (the torch 2.9 lane) these tests skip with one line.

delayed, blockwise and mx against references written here from the published definitions, in fp64:
Transformer Engine's DelayedScaling (a history of amaxes, the max over it, a margin; the scale of
step n from the amaxes of steps before n), DeepSeek-V3 section 3.3 (1 x 128 tiles of activations and
gradients, 128 x 128 blocks of weights, scale = 448 / the block's amax, an fp32 number), the OCP
Microscaling Formats (MX) v1.0 specification (32 elements along the reduction share an E8M0 scale
2^(floor(log2 amax) - emax_elem)); each rounding to the FP8 grid is this file's own (`to_grid`: round
half to even on the format's grid of normals and subnormals, saturating), not torch's cast. The
operand x s is formed in fp32 (the operand's dtype, as every implementation does). The bound, derived:
the reference sums exact products in fp64; nanohlat dequantises each operand with the fp32 reciprocal
of its scale (relative error <= u = 2^-24 per operand, none for a power of two) and sums K products in
fp32 (<= K u of the sum of |products|: Higham's gamma_K), so |nanohlat - reference| <= (K + 2) u
sum_k |a_k b_k|, plus half an ulp of the output dtype.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from nanohlat import tensor_parallel as tpl
from nanohlat.beyond import fp8, fp8_scaling
from nanohlat.comm import Group

ONE = Group("tp", [0], 0)


def _torchao():
    try:
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        return Float8LinearConfig, convert_to_float8_training
    except Exception as e:   # noqa: BLE001 - an older torch (the 2.9 lane) may fail to load it in many ways
        pytest.skip(f"torchao's Float8Linear cannot be imported here ({e.__class__.__name__}): pip install torchao")


def _nanohlat_linear(weight: torch.Tensor, recipe: str, grad_format: str):
    lin = tpl.ColumnParallelLinear(weight.shape[1], weight.shape[0], ONE).to(weight.dtype)
    with torch.no_grad():
        lin.weight.copy_(weight)
    return fp8.Fp8ColumnParallelLinear(lin, fp8.Fp8Run(recipe, grad_format), ONE, "l")


def _run(module, weight, x, gy):
    x = x.clone().requires_grad_()
    y = module(x)
    y.backward(gy)
    return y.detach(), x.grad, weight.grad


def _inputs(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(256, 128, generator=g) * 0.02).to(dtype)
    x = (torch.randn(4, 64, 128, generator=g) * 3).to(dtype)
    x[0, 3, 7] = 200.0   # an outlier: tensor-wise scales feel it, row-wise ones only in its row
    gy = (torch.randn(4, 64, 256, generator=g) * 1e-3).to(dtype)
    return w, x, gy


@pytest.mark.parametrize("recipe, grad_format", [("tensorwise", "e5m2"), ("rowwise", "e4m3")])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_tensorwise_and_rowwise_equal_torchaos_float8linear(recipe, grad_format, dtype):
    Float8LinearConfig, convert = _torchao()
    w, x, gy = _inputs(dtype)
    ours = _nanohlat_linear(w, recipe, grad_format)
    ref = nn.Sequential(nn.Linear(128, 256, bias=False).to(dtype))
    with torch.no_grad():
        ref[0].weight.copy_(w)
    ref = convert(ref, config=Float8LinearConfig.from_recipe_name(recipe))
    got = _run(ours, ours.weight, x, gy)
    want = _run(ref, ref[0].weight, x, gy)
    for name, a, b in zip(("y", "dx", "dW"), got, want):
        if recipe == "rowwise" and dtype == torch.float32:
            a = a.bfloat16().float()   # (torchao's rowwise fp32 path: through bf16, module docstring)
        assert a.dtype == b.dtype and torch.equal(a, b), (name, (a.float() - b.float()).abs().max())
    # and FP8 did something: the products are not the high-precision ones
    assert not torch.equal(got[0], torch.nn.functional.linear(x, w))


# ---------------------------------------------------------------------------
# References from the published definitions, in fp64
# ---------------------------------------------------------------------------

GRID = {torch.float8_e4m3fn: (3, -6, 448.0), torch.float8_e5m2: (2, -14, 57344.0)}   # mantissa bits, emin, largest


def to_grid(v: torch.Tensor, fmt) -> torch.Tensor:
    """v (fp64) rounded to the nearest value of the FP8 format (ties to even), saturating: the quantum of a
    number of exponent e is 2^(max(e, emin) - mantissa bits) (below 2^emin: the subnormals' spacing)."""
    m, emin, largest = GRID[fmt]
    v = v.double()
    e = torch.floor(torch.log2(v.abs().clamp(min=2.0 ** -200)))
    quantum = torch.exp2(torch.clamp(e, min=emin) - m)
    return (torch.round(v / quantum) * quantum).clamp(-largest, largest)


def reference_matmul(a, b, scale_a, scale_b, fmt_a, fmt_b):
    """sum_k (grid(a s_a) / s_a)(grid(b s_b) / s_b) in fp64: a (M, K), b (K, N), each scale per element
    (fp32 numbers); a s is formed in fp32, as the operand is."""
    qa = to_grid((a.float() * scale_a.float()).double(), fmt_a) / scale_a.double()
    qb = to_grid((b.float() * scale_b.float()).double(), fmt_b) / scale_b.double()
    return qa @ qb, qa.abs() @ qb.abs()


def assert_within_bound(got, ref, size_sum, K, dtype):
    """|got - ref| <= (K + 2) u sum|a b| + half an ulp of `dtype` at |ref| (module docstring)."""
    u = 2.0 ** -24
    half_ulp = ref.abs() * (2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -24)
    bound = (K + 2) * u * size_sum + half_ulp
    excess = (got.double() - ref).abs() - bound
    assert excess.max() <= 0, f"off by {(got.double() - ref).abs().max():.3g}, bound {bound.max():.3g}"


def block_scales(t: torch.Tensor, rows: int, cols: int, fmt, rule: str) -> torch.Tensor:
    """The per-element scale of t (2-D) in blocks rows x cols (DeepSeek-V3: 448 / amax rounded to fp32;
    OCP MX: 1 / 2^(floor(log2 amax) - emax_elem)), computed in fp64 from each block's amax."""
    R, C = t.shape
    out = torch.empty(R, C, dtype=torch.float64)
    largest = GRID[fmt][2]
    emax = {torch.float8_e4m3fn: 8, torch.float8_e5m2: 15}[fmt]
    for i in range(0, R, rows):
        for j in range(0, C, cols):
            amax = t[i:i + rows, j:j + cols].double().abs().max().item()
            if rule == "deepseek":
                s = float(torch.tensor(largest / max(amax, 1e-12), dtype=torch.float64).float())
            else:   # OCP MX: math.frexp gives amax = m 2^e with m in [0.5, 1): floor(log2 amax) = e - 1
                s = 1.0 if amax == 0 else 2.0 ** -(math.frexp(amax)[1] - 1 - emax)
            out[i:i + rows, j:j + cols] = s
    return out


@pytest.mark.parametrize("recipe", ["blockwise", "mx"])
@pytest.mark.parametrize("grad_format", ["e5m2", "e4m3"])
def test_blockwise_and_mx_equal_their_published_definitions(recipe, grad_format):
    w, x, gy = _inputs(torch.float32, seed=1)
    w, x, gy = w[:, :], x, gy
    ours = _nanohlat_linear(w, recipe, grad_format)
    y, dx, dw = _run(ours, ours.weight, x, gy)
    E4, G = torch.float8_e4m3fn, fp8_scaling.FORMATS[grad_format]
    rule = "deepseek" if recipe == "blockwise" else "mx"
    tile = 128 if recipe == "blockwise" else 32
    wrows = 128 if recipe == "blockwise" else 1   # a weight's blocks: 128 x 128 (DeepSeek-V3), 1 x 32 (MX)
    x2, g2 = x.reshape(-1, 128), gy.reshape(-1, 256)
    # forward: x (tokens, in) tiles along in; W (out, in) blocks along in
    ref, size = reference_matmul(x2, w.t(), block_scales(x2, 1, tile, E4, rule),
                                 block_scales(w, wrows, tile, E4, rule).t(), E4, E4)
    assert_within_bound(y.reshape(-1, 256), ref, size, 128, torch.float32)
    # input gradient: dY (tokens, out) tiles along out; W blocks along out
    ref, size = reference_matmul(g2, w, block_scales(g2, 1, tile, G, rule),
                                 block_scales(w.t(), wrows, tile, E4, rule).t(), G, E4)
    assert_within_bound(dx.reshape(-1, 128), ref, size, 256, torch.float32)
    # weight gradient: dY^T (out, tokens) and x (tokens, in), both tiled along the tokens
    ref, size = reference_matmul(g2.t(), x2, block_scales(g2.t(), 1, tile, G, rule),
                                 block_scales(x2.t(), 1, tile, E4, rule).t(), G, E4)
    assert_within_bound(dw, ref, size, 256, torch.float32)


def test_delayed_scaling_equals_transformer_engines_definition():
    """Five steps of one linear under --fp8 delayed (history 3, margin 1): each step's casts use the
    scales of the amax history of the steps before it (step 1: scale 1), as Transformer Engine defines
    them: s = (largest / max over the history) / 2^margin, fp32; the history moves on in the step hook."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(64, 128, generator=g) * 0.02
    lin = tpl.ColumnParallelLinear(128, 64, ONE)
    with torch.no_grad():
        lin.weight.copy_(w)
    run = fp8.Fp8Run("delayed", "e5m2", history=3, margin=1)
    ours = fp8.Fp8ColumnParallelLinear(lin, run, ONE, "l")
    run.layers = [ours]
    history = {r: [] for r in ("x", "w", "dy")}
    largest = {"x": 448.0, "w": 448.0, "dy": 57344.0}
    fmt = {"x": torch.float8_e4m3fn, "w": torch.float8_e4m3fn, "dy": torch.float8_e5m2}
    for step in range(5):
        x = torch.randn(2, 32, 128, generator=g) * (1 + 3 * step)   # growing: later steps saturate
        gy = torch.randn(2, 32, 64, generator=g) * 1e-3
        scales = {r: (1.0 if not history[r] else
                      float(torch.tensor(largest[r] / max(history[r][-3:]) / 2.0, dtype=torch.float64).float()))
                  for r in history}
        ours.weight.grad = None
        y, dx, dw = _run(ours, ours.weight, x, gy)
        each = {r: torch.tensor(scales[r], dtype=torch.float64) for r in history}
        x2, g2 = x.reshape(-1, 128), gy.reshape(-1, 64)
        for got, (a, b, sa, sb, fa, fb, K) in (
                (y.reshape(-1, 64), (x2, w.t(), "x", "w", fmt["x"], fmt["w"], 128)),
                (dx.reshape(-1, 128), (g2, w, "dy", "w", fmt["dy"], fmt["w"], 64)),
                (dw, (g2.t(), x2, "dy", "x", fmt["dy"], fmt["x"], 64))):
            ref, size = reference_matmul(a, b, each[sa].expand(a.shape), each[sb].expand(b.shape), fa, fb)
            assert_within_bound(got, ref, size, K, torch.float32)
        for r, t in (("x", x), ("w", w), ("dy", gy)):
            history[r].append(t.abs().max().item())
        fp8.end_step(run, ())
        assert torch.equal(ours.fp8_scale, torch.tensor(
            [largest[r] / max(history[r][-3:]) / 2.0 for r in ("x", "w", "dy")], dtype=torch.float32)), step


def test_saturating_cast_clamps_where_torchs_cast_does_not():
    x = torch.tensor([1e6, -1e6, 500.0, 448.0, float("nan")])
    for fmt in (torch.float8_e4m3fn, torch.float8_e5m2):
        q = fp8_scaling.saturating_cast(x, 1.0, fmt).float()
        big = fp8_scaling.LARGEST[fmt]
        assert q[0] == big and q[1] == -big and torch.isnan(q[4])
    assert torch.isinf(torch.tensor([1e6]).to(torch.float8_e5m2).float()).all()   # (torch's own: inf)


def test_the_grid_reference_agrees_with_torchs_cast_inside_the_range():
    """The oracle's rounding and torch's cast agree on every value they both define (inside the range):
    so a difference in the tests above is the scaling's, not the rounding's."""
    g = torch.Generator().manual_seed(0)
    v = torch.cat([torch.randn(20000, generator=g) * s for s in (1e-3, 1, 100)] + [torch.linspace(-448, 448, 5001)])
    # Inside the range only: past 448 torch 2.9's cast gives nan (from 464 up) and torch 2.13's saturates.
    e4 = v.clamp(-448, 448)
    assert torch.equal(to_grid(e4.double(), torch.float8_e4m3fn).float(), e4.to(torch.float8_e4m3fn).float())
    v = v.clamp(-57344, 57344)
    assert torch.equal(to_grid(v.double(), torch.float8_e5m2).float(), v.to(torch.float8_e5m2).float())
