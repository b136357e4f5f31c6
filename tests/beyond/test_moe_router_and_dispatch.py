"""A mixture of experts' parts (nanohlat/beyond/moe.py), in one process: the router's losses against
independent formulas, its gradient, dropless dispatch (sorted and grouped) against the plain
per-expert loop, capacity mode's drop rule, the moe preset's init, the router losses' place in
the backward, and what a mixture refuses."""

from __future__ import annotations

import math
import time

import pytest
import torch
import torch.nn.functional as F

from nanohlat.beyond import moe
from nanohlat import recipe
from nanohlat.config import UserError
from nanohlat.model import full_init, init_weights
from nanohlat.run.build import decoder
from moe_utils import MOE_CFG, _experts, _routing_case


def test_balance_and_z_losses_equal_an_independent_formula():
    """Per sequence, in plain Python floats: f_e = share of the T*k choices that
    picked e, P_e = mean probability of e; balance = E * sum f_e P_e; z = mean of
    logsumexp(logits)^2. route() must agree, sequence by sequence."""
    B, T, C, E, k = 3, 5, 8, 4, 2
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(B, T, C, generator=g, dtype=torch.float64), torch.randn(E, C, generator=g, dtype=torch.float64)
    experts, weights, balance, z = moe.route(x, w, k)
    for b in range(B):
        counts, prob_sums, z_sum = [0] * E, [0.0] * E, 0.0
        for t in range(T):
            logits = [sum(float(x[b, t, c]) * float(w[e, c]) for c in range(C)) for e in range(E)]
            m = max(logits)
            exps = [math.exp(v - m) for v in logits]
            probs = [v / sum(exps) for v in exps]
            top = sorted(range(E), key=lambda e: -probs[e])[:k]
            assert experts[b, t].tolist() == top
            for j, e in enumerate(top):   # Mixtral: renormalised over the chosen k
                assert abs(float(weights[b, t, j]) - probs[e] / sum(probs[i] for i in top)) < 1e-12
                counts[e] += 1
            prob_sums = [s + p for s, p in zip(prob_sums, probs)]
            z_sum += (m + math.log(sum(exps))) ** 2
        want = E * sum((counts[e] / (T * k)) * (prob_sums[e] / T) for e in range(E))
        assert abs(float(balance[b]) - want) < 1e-12, (b, float(balance[b]), want)
        assert abs(float(z[b]) - z_sum / T) < 1e-12
    # the balance loss is 1 when routing is uniform, more when it is not
    assert float(moe.route(torch.zeros(1, 4, C, dtype=torch.float64), w * 0, 1)[2]) == pytest.approx(1.0)


def test_router_gradient_passes_gradcheck_in_fp64():
    """The renormalised weights, balance and z-loss against finite differences
    (top-k's choice is locally constant: a random case has no near-ties)."""
    x, w = _routing_case(N=12, C=6, E=5)
    x, w = x.view(2, 6, 6).requires_grad_(), w.requires_grad_()

    def f(x, w):
        _, weights, balance, z = moe.route(x, w, 2)
        return weights, balance, z

    assert torch.autograd.gradcheck(f, (x, w), eps=1e-6, atol=1e-8)


def test_dropless_dispatch_equals_the_per_expert_loop_and_its_gradients():
    x, w = _routing_case()
    experts, weights, _, _ = moe.route(x.unsqueeze(0), w, 2)
    experts, weights = experts[0], weights[0]
    params = [p.requires_grad_() for p in _experts()]
    x.requires_grad_()
    y_sorted = moe.dispatch_sorted(x, experts, weights, *params)
    grads_sorted = torch.autograd.grad(y_sorted.pow(2).sum(), [x, *params])
    y_loop = moe.dispatch_loop(x, experts, weights, *params)
    grads_loop = torch.autograd.grad(y_loop.pow(2).sum(), [x, *params])
    assert torch.allclose(y_sorted, y_loop, rtol=0, atol=1e-13)
    for a, b in zip(grads_sorted, grads_loop):
        assert torch.allclose(a, b, rtol=0, atol=1e-12)
    # and by hand for one token: the weighted sum of its two experts' SwiGLUs
    gate, up, down = (p.detach() for p in params)
    t = 7
    want = sum(weights[t, j] * moe.swiglu(x[t:t + 1].detach(), gate[e], up[e], down[e])[0]
               for j, e in enumerate(experts[t].tolist()))
    assert torch.allclose(y_sorted[t].detach(), want, rtol=0, atol=1e-13)


def test_dropless_sorted_dispatch_against_the_loop_speed(capsys):
    """Measured, not asserted (a shared CPU's timings are noise): the sorted
    dispatch and the plain loop on a 4096-token, 8-expert, top-2 case, fp32
    forward + backward. The figures print with -s; equality is asserted."""
    N, C, E, Fd = 4096, 64, 8, 128
    x, w = _routing_case(N=N, C=C, E=E, dtype=torch.float32)
    experts, weights, _, _ = moe.route(x.unsqueeze(0), w, 2)
    experts, weights = experts[0], weights[0]
    params = [p.requires_grad_() for p in _experts(E, C, Fd, dtype=torch.float32)]
    times = {}
    for name, fn in (("sorted", moe.dispatch_sorted), ("loop", moe.dispatch_loop)):
        best = math.inf
        for _ in range(5):
            start = time.perf_counter()
            fn(x, experts, weights, *params).sum().backward()
            best = min(best, time.perf_counter() - start)
        times[name] = best
    y1, y2 = moe.dispatch_sorted(x, experts, weights, *params), moe.dispatch_loop(x, experts, weights, *params)
    assert torch.allclose(y1, y2, rtol=1e-5, atol=1e-6)
    with capsys.disabled():
        print(f"\ndispatch fwd+bwd, {N} tokens, E {E}, top-2: sorted {times['sorted'] * 1e3:.1f} ms, "
              f"loop {times['loop'] * 1e3:.1f} ms (best of 5)")


def _drop_rule(experts, E, C):
    """The docstring's rule, by hand: choices served rank by rank, token by token;
    an expert keeps its first C. Returns keep[t][j]."""
    N, k = experts.shape
    taken, keep = [0] * E, [[False] * k for _ in range(N)]
    for j in range(k):
        for t in range(N):
            e = int(experts[t, j])
            if taken[e] < C:
                taken[e], keep[t][j] = taken[e] + 1, True
    return keep


@pytest.mark.parametrize("factor", [0.5, 1.0, 1.25])
def test_capacity_mode_drops_exactly_what_the_rule_says(factor):
    x, w = _routing_case(N=40, E=4)
    w[0] += 0.8    # a router that favours expert 0, so that some choices are dropped
    experts, weights, _, _ = moe.route(x.unsqueeze(0), w, 2)
    experts, weights = experts[0], weights[0]
    params = _experts()
    E, C = 4, moe.capacity(40, 2, 4, factor)
    assert C == math.ceil(factor * 40 * 2 / 4)
    keep = torch.tensor(_drop_rule(experts, E, C))
    y, dropped = moe.dispatch_capacity(x, experts, weights, *params, factor)
    # the rule's survivors, computed by the loop with the dropped choices' weights at zero
    want = moe.dispatch_loop(x, experts, weights * keep, *params)
    assert torch.allclose(y, want, rtol=0, atol=1e-13)
    assert float(dropped) == pytest.approx(1 - keep.float().mean().item(), abs=1e-12)
    if factor < 1:
        assert float(dropped) > 0


def test_capacity_mode_with_room_for_every_token_equals_dropless():
    x, w = _routing_case(N=32)
    experts, weights, _, _ = moe.route(x.unsqueeze(0), w, 2)
    y, dropped = moe.dispatch_capacity(x, experts[0], weights[0], *_experts(), factor=4.0)   # C = N * k
    assert float(dropped) == 0
    assert torch.allclose(y, moe.dispatch_sorted(x, experts[0], weights[0], *_experts()), rtol=0, atol=1e-13)


def test_moe_initialisation_is_deterministic_and_layout_independent():
    """As the dense model's (test_model.py): each parameter depends on (seed, name)
    only; the experts' down matrices get the output projections' smaller std."""
    import dataclasses
    cfg = dataclasses.replace(MOE_CFG, moe_shared_experts=1, moe_every=2)
    a, b = decoder(cfg), decoder(cfg, layers=range(2, 4), first=False)
    init_weights(a, 7), init_weights(b, 7)
    full = dict(a.named_parameters())
    for n, p in b.named_parameters():
        assert torch.equal(p, full[n]), n
    for n, p in full.items():
        assert torch.equal(full_init(n, p.shard.full_shape, cfg, 7), p.detach()), n
    assert isinstance(a.layers["1"].mlp, moe.MoE) and not isinstance(a.layers["0"].mlp, moe.MoE)
    down, gate = full["layers.1.mlp.down.weight"], full["layers.1.mlp.gate.weight"]
    assert down.shape == (4, 64, 128) and gate.shape == (4, 128, 64)
    assert down.std() < gate.std() / 2
    assert sum(p.numel() for p in a.parameters()) == cfg.num_params()
    assert sum(p.numel() for p in decoder(MOE_CFG).parameters()) == MOE_CFG.num_params()


def test_the_router_losses_join_the_backward_where_they_are_made_and_not_the_loss():
    """moe.RouterLoss: a training forward returns the language model's loss alone, the held-out
    forward's bit for bit; its backward adds each sequence's router losses (summed over the sparse
    layers, with their coefficients) at the weight given (`router_scale`): every parameter's gradient
    is that of lm.sum() + scale * router.sum() written out by hand, on a model that attaches none.
    The step's figures count every routing choice, and their moe_router_loss is the router losses'
    mean over sequences."""
    from nanohlat.mesh import Mesh
    torch.manual_seed(0)
    scale, tokens = 0.25, torch.randint(0, MOE_CFG.vocab_size, (2, 16))
    model, ref = decoder(MOE_CFG, router_scale=scale), decoder(MOE_CFG)
    init_weights(model, 1)
    init_weights(ref, 1)

    def router(m):   # (B,): each sequence's router losses, summed over the layers
        return sum(MOE_CFG.moe_aux_coef * b.mlp.losses[0] + MOE_CFG.moe_z_coef * b.mlp.losses[1]
                   for b in m.layers.values())
    with torch.no_grad():
        held_out = model(tokens, tokens)
    figures = model.step_figures
    assert figures.total is None                                          # no gradients: nothing counted
    trained = model(tokens, tokens)
    assert torch.equal(trained, held_out)                                 # the loss is the language model's
    assert figures.total[:, :4].sum(1).tolist() == [2 * 16 * 2] * 4     # every token's 2 choices counted
    trained.sum().backward()
    lm = ref(tokens, tokens)
    (lm.sum() + scale * router(ref).sum()).backward()
    wanted = dict(ref.named_parameters())
    for n, p in model.named_parameters():
        assert torch.allclose(p.grad, wanted[n].grad, rtol=1e-5, atol=1e-8), n
    assert not torch.allclose(wanted["layers.0.mlp.router.weight"].grad,
                              torch.autograd.grad(ref(tokens, tokens).sum(), wanted["layers.0.mlp.router.weight"])[0],
                              rtol=1e-3, atol=0)                          # (the router losses do move the router)
    logged = model.step_figures.metrics(Mesh(1, 1, 1).build_groups(None), "cpu")
    assert logged["moe_router_loss"] == pytest.approx(float(router(model).mean().detach()), rel=1e-6)


@pytest.mark.parametrize("flags, named", [(["--moe-top-k", "5"], "--moe-top-k 5")])
def test_moe_refuses_what_it_does_not_support_in_one_line(flags, named):
    with pytest.raises(UserError) as e:
        recipe.parse_args(["--preset", "moe"] + flags)
    assert named in str(e.value) and "\n" not in str(e.value)


def test_dropless_moe_on_xla_is_refused_in_one_line(capsys):
    import train
    assert train.main(["--preset", "moe", "--device", "xla"]) == 2
    err = capsys.readouterr().err.strip()
    assert "dropless" in err and "--moe-capacity-factor" in err and len(err.splitlines()) == 1
    assert train.main(["--preset", "moe", "--device", "xla", "--moe-capacity-factor", "1", "--nproc", "2",
                       "--ep", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--ep 2 is not supported on xla" in err and len(err.splitlines()) == 1


@pytest.mark.skipif(not hasattr(F, "grouped_mm"), reason="F.grouped_mm is torch >= 2.10's")
def test_the_compiled_grouped_matmul_is_torchs_bit_for_bit_aligned_or_not():
    """--compile's grouped matmul (torch.ops.nanohlat.grouped_mm, an op Dynamo holds whole) gives
    F.grouped_mm's output and gradients bit for bit, an empty slice included, and so does the CPU's
    kernel on operands 4 bytes off a 16-byte boundary (where Dynamo cannot look: moe.grouped)."""
    g = torch.Generator().manual_seed(7)
    E, C, Fd = 4, 64, 32
    ends = torch.tensor([100, 100, 400, 512], dtype=torch.int32)   # expert 1: no row
    a = torch.randn(512, C, generator=g).requires_grad_()
    w = torch.randn(E, Fd, C, generator=g).requires_grad_()
    upstream = torch.randn(512, Fd, generator=g)
    outs = []
    for mm in (moe.grouped_mm, torch.ops.nanohlat.grouped_mm):
        y = mm(a, w.transpose(1, 2), ends)
        outs.append((y, *torch.autograd.grad((y * upstream).sum(), (a, w))))
    for got, want in zip(*outs):
        assert torch.equal(got, want)
    assert outs[0][2][1].abs().sum() == 0 and outs[0][2][0].abs().sum() > 0   # the empty slice's gradient: zeros
    def shifted(t):   # the same values 4 bytes past a 16-byte boundary
        return torch.cat([torch.zeros(1), t.detach().reshape(-1)])[1:].view(t.shape)
    a4, w4 = shifted(a), shifted(w)
    assert a4.data_ptr() % 16 == 4 and w4.data_ptr() % 16 == 4
    assert torch.equal(moe.grouped_mm(a4, w4.transpose(1, 2), ends), outs[0][0])


def test_grouped_dispatch_equals_the_loop_in_fp32_with_an_empty_expert():
    """dispatch_sorted where its slices are small and fp32 (moe.swiglu_slices: one F.grouped_mm per
    projection) against the plain loop: output and every gradient to fp32 round-off, an expert with
    no token included (its gradient zeros, not missing); where torch has no grouped matmul, one
    matmul per slice."""
    g = torch.Generator().manual_seed(4)
    N, C, E, Fd, k = 64, 16, 8, 8, 2
    x = torch.randn(N, C, generator=g).requires_grad_()
    experts = torch.stack([torch.randperm(E - 1, generator=g)[:k] for _ in range(N)])   # expert 7: no token
    weights = (torch.rand(N, k, generator=g) + 0.1).requires_grad_()
    params = [(p.float() * 0.5).requires_grad_() for p in _experts(E, C, Fd, seed=3)]
    assert moe.grouped(x, *params, rows=N * k / E) == hasattr(F, "grouped_mm")   # the path under test
    upstream = torch.randn(N, C, generator=g)
    got = moe.dispatch_sorted(x, experts, weights, *params)
    want = moe.dispatch_loop(x, experts, weights, *params)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    grads = torch.autograd.grad((got * upstream).sum(), [x, weights, *params])
    wanted = torch.autograd.grad((want * upstream).sum(), [x, weights, *params])
    for a, b in zip(grads, wanted):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5)
    assert grads[2][E - 1].abs().sum() == 0 and grads[2][0].abs().sum() > 0
