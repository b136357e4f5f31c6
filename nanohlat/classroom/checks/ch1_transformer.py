"""Chapter 1, the transformer: RMSNorm (1a), rotary embeddings (1b), the KV cache (1c).

1a against the formula in float64, on fp32 and on bf16 input (normalised in
fp32: within 1.5 bf16 steps), and on a near-zero vector that only eps keeps
small, its input left as it was; 1b against the rotation written as complex multiplication, and the
property it is for (a dot product depends only on the distance); 1c against
the model run on the whole sequence without a cache, fed in a prefill, a
chunk and single tokens, with multi-head and grouped-query attention, and on
rows at different positions (a batch of prompts of different lengths).
"""

from __future__ import annotations

import torch

from nanohlat.classroom.checks.grading import Kept, case, compare, untouched


def bf16_steps(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """|got - want| in bf16 steps: units of the spacing of bf16 numbers at |want|."""
    mag = want.double().abs().clamp_min(2.0 ** -126)
    step = torch.exp2(torch.floor(torch.log2(mag)) - 7)        # 7 stored mantissa bits
    return (got.double() - want.double()).abs() / step


def check_rmsnorm() -> str | None:
    from nanohlat.model import RMSNorm
    g = torch.Generator().manual_seed(11)
    D = 256
    cases = [("fp32 input", torch.float32),
             # a bf16 input must still be normalised in fp32: the exact result, rounded twice (the normalised
             # x to bf16, then its product with the bf16 weight), is at most 1.5 bf16 steps off; a mean of
             # squares and rsqrt computed in bf16 lands up to 2-3 steps off
             ("bf16 input, within 1.5 bf16 steps of the exact result", torch.bfloat16)]
    for name, dtype in cases:
        case(name)
        norm = RMSNorm(D, 1e-5, False).to(dtype)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(D, generator=g))
        x = (torch.randn(8, 16, D, generator=g) * 3 + 0.5).to(dtype)
        x[0, 0] = 1e-4   # a tiny vector: only eps keeps it finite (and small)
        x64 = x.double()
        want = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight.double()
        given = Kept(x)
        y = norm(x)
        if y.dtype != dtype:
            return f"{name}: RMSNorm returned {y.dtype}; the output keeps the input's dtype ({dtype})"
        v = compare(f"{name}: the near-zero vector x = 1e-4 (only eps keeps it small)", y[0, 0], want[0, 0],
                    rtol=1e-2, atol=1e-5)
        if v:
            return v
        if dtype == torch.float32:
            v = compare(f"{name}: RMSNorm output", y, want, rtol=1e-5, atol=1e-5)
        else:
            steps = bf16_steps(y, want)
            if not steps.max() <= 1.5:
                idx = [int(i) for i in (steps == steps.max()).nonzero()[0]]
                return (f"{name}: RMSNorm output is {steps.max().item():.2f} bf16 steps off the exact result at "
                        f"index {idx} (got {y[tuple(idx)].item():.6g}, exact {want[tuple(idx)].item():.6g}); "
                        f"{int((steps > 1.5).sum())} of {steps.numel()} elements are more than 1.5 steps off: "
                        f"normalise in fp32, round once at the end")
        v = v or untouched(f"{name}: RMSNorm", "its input x", given,
                           "x is the residual stream, which the block reads again to add the attention's output "
                           "to (x + attn(attn_norm(x))); x.float() of an fp32 x is x itself, so h *= ... writes "
                           "into x: write h = h * ...")
        if v:
            return v
    return None


def check_rotary() -> str | None:
    from nanohlat.model import apply_rotary, rotary_tables
    D, T, theta = 16, 12, 10000.0
    cos, sin = rotary_tables(D, T, theta)
    g = torch.Generator().manual_seed(12)
    x = torch.randn(2, 3, T, D, generator=g, dtype=torch.float64)
    y = apply_rotary(x, cos, sin)
    # oracle: pair (x_i, x_{i+D/2}) is the complex number x_i + i x_{i+D/2}, turned by t * theta^(-2i/D)
    freqs = theta ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    angle = torch.arange(T, dtype=torch.float64)[:, None] * freqs[None, :]     # (T, D/2)
    z = torch.complex(x[..., :D // 2], x[..., D // 2:]) * torch.polar(torch.ones_like(angle), angle)
    want = torch.cat([z.real, z.imag], dim=-1)
    case("x (2, 3, 12, 16) at positions 0..11")
    v = compare("x (2, 3, 12, 16) at positions 0..11: apply_rotary(x, *rotary_tables(16, 12, 1e4))", y, want)
    if v:
        return v
    # the property the tutorial promises: <rot(q, m), rot(k, n)> depends on m - n only
    case("relative positions")
    q, k = torch.randn(D, generator=g, dtype=torch.float64), torch.randn(D, generator=g, dtype=torch.float64)
    rq = apply_rotary(q.expand(1, 1, T, D), cos, sin)[0, 0]
    rk = apply_rotary(k.expand(1, 1, T, D), cos, sin)[0, 0]
    return compare("relative positions: <rot(q, 5), rot(k, 2)> vs <rot(q, 9), rot(k, 6)> (same distance)",
                   rq[5] @ rk[2], rq[9] @ rk[6])


def check_kv_cache() -> str | None:
    from nanohlat.recipe import ModelConfig
    from nanohlat.model import Transformer, init_weights
    from nanohlat.serving import generate as gen
    for n_kv in (4, 2):   # multi-head, then grouped-query attention
        cfg = ModelConfig(n_layers=2, d_model=32, n_heads=4, n_kv_heads=n_kv, ffn_dim=48, vocab_size=50,
                          max_seq_len=16)
        model = Transformer(cfg)
        init_weights(model, seed=13)
        tokens = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(13))
        with torch.no_grad():
            want = model(tokens)                               # no cache: the whole sequence at once
            cache = gen.new_cache(model, 2, 12)
            # prefill 5 tokens, then a chunk of 3 (it must not see its own future), then one at a time
            pieces = [(0, 5), (5, 8)] + [(p, p + 1) for p in range(8, 12)]
            for a, b in pieces:
                name = case(f"positions {a}..{b - 1} fed with the KV cache holding 0..{a - 1} (n_kv_heads {n_kv})")
                got = gen.cached_forward(model, cache, tokens[:, a:b], torch.arange(a, b).expand(2, b - a))
                v = compare(f"{name}: logits", got, want[:, a:b], rtol=1e-4, atol=1e-5)
                if v:
                    return v
            # rows at different positions (a batch of prompts of different lengths): row 1's prompt is 3
            # tokens, right-padded to row 0's 5; its decoding overwrites the padding's cache columns, which
            # it must never see before
            name = case(f"ragged rows: row 0 at positions 5.., row 1 at 3.. over its padding (n_kv_heads {n_kv})")
            cache = gen.new_cache(model, 2, 12)
            pad = torch.randint(0, cfg.vocab_size, (2,), generator=torch.Generator().manual_seed(14))
            prompt = torch.stack([tokens[0, :5], torch.cat([tokens[1, :3], pad])])
            got = gen.cached_forward(model, cache, prompt, torch.arange(5).expand(2, 5))
            v = (compare(f"{name}: row 0's prompt logits", got[0], want[0, :5], rtol=1e-4, atol=1e-5)
                 or compare(f"{name}: row 1's prompt logits", got[1, :3], want[1, :3], rtol=1e-4, atol=1e-5))
            for j in range(4):
                if v:
                    return v
                pos = torch.tensor([[5 + j], [3 + j]])
                got = gen.cached_forward(model, cache, torch.stack([tokens[0, 5 + j:6 + j], tokens[1, 3 + j:4 + j]]), pos)
                v = compare(f"{name}: logits of row 0 at {5 + j} and row 1 at {3 + j}", got[:, 0],
                            torch.stack([want[0, 5 + j], want[1, 3 + j]]), rtol=1e-4, atol=1e-5)
            if v:
                return v
    return None
