"""Balancing a mixture of experts without an auxiliary loss (--moe-bias-rate, DeepSeek-V3):
a bias per expert that chooses the top k but never weighs them, moved after each step by the
load of the whole global batch, so every layout moves it alike; saved and resumed exactly."""

from __future__ import annotations

import pytest
import torch

from conftest import read_metrics
from dist_utils import run_layouts
from nanohlat.beyond import moe
from nanohlat.run import checkpoint
from moe_utils import _flags, _train_here


def test_the_bias_chooses_the_experts_but_never_weighs_them():
    """route() with a bias: each token's k experts are those of the highest p + bias (from plain
    Python), their weights its own p renormalised over them, as without a bias; the balance and z
    losses follow the choice, and a zero bias is no bias. update_bias moves each expert by the
    rate towards its share, not at all on a skipped step; the bias stays fp32 in a bf16 model."""
    B, T, C, E, k = 2, 16, 8, 4, 2
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(B, T, C, generator=g, dtype=torch.float64), torch.randn(E, C, generator=g, dtype=torch.float64)
    plain = moe.route(x, w, k)
    for a, b in zip(moe.route(x, w, k, bias=torch.zeros(E, dtype=torch.float64)), plain):
        assert torch.equal(a, b)
    bias = torch.tensor([0.15, -0.2, 0.0, 0.1], dtype=torch.float64)
    experts, weights, _, _ = moe.route(x, w, k, bias=bias)
    probs = (x @ w.t()).softmax(-1)
    for b in range(B):
        for t in range(T):
            p = probs[b, t].tolist()
            top = sorted(range(E), key=lambda e: -(p[e] + float(bias[e])))[:k]
            assert experts[b, t].tolist() == top
            for j, e in enumerate(top):   # the router's own probabilities, not p + bias
                assert abs(float(weights[b, t, j]) - p[e] / sum(p[i] for i in top)) < 1e-12
    changed = (experts.sort(-1).values != plain[0].sort(-1).values).any(-1)
    assert 0 < int(changed.sum()) < B * T, "the bias should move some tokens, not all"

    load = torch.tensor([5.0, 1.0, 3.0, 3.0])   # mean 3: expert 0 over, 1 under, 2 and 3 at their share
    b = torch.zeros(E)
    moe.update_bias(b, load, 0.5)
    assert b.tolist() == [-0.5, 0.5, 0.0, 0.0]
    moe.update_bias(b, load, 0.5, finite=torch.tensor(False))
    assert b.tolist() == [-0.5, 0.5, 0.0, 0.0]
    block = moe.MoE(C, 12, E, k, bias_rate=1e-3).to(torch.bfloat16)
    assert block.expert_bias.dtype == torch.float32 and "expert_bias" in block.state_dict()
    plain = moe.MoE(C, 12, E, k)                               # without --moe-bias-rate: no state
    assert plain.expert_bias is None and "expert_bias" not in plain.state_dict()


def _biases(ckpt: str) -> dict:
    shards = checkpoint.ShardSet(ckpt)
    names = [f"layers.{i}.mlp.expert_bias" for i in range(4)]
    return {n: shards.full(n) for n in names}


@pytest.mark.slow
def test_bias_balancing_at_dp_2_and_ep_2_equals_one_process_and_resumes_exactly(cache_dir, tmp_path):
    """The moe preset with --moe-bias-rate 1e-2 and no balance loss, 6 steps: at dp 2 and at ep 2
    (each rank routes half the batch; the load of the whole batch moves the bias) the losses are one
    process's to fp32 round-off and the saved biases equal bit for bit, at step 3 and step 6; resumed
    from step 3, one process repeats steps 4-6 exactly, biases included. Export to Mixtral refuses it."""
    def flags(name, *extra):
        return _flags(cache_dir, tmp_path / name, "--steps", 6, "--save-every", 3, "--moe-bias-rate", "1e-2",
                      "--moe-aux-coef", 0, *extra)

    def ckpt(name, step):
        return str(tmp_path / name / "checkpoints" / f"step_{step:08d}")
    _train_here(flags("one"))
    run_layouts(2, [flags("dp2", "--dp", 2), flags("ep2", "--ep", 2)], str(tmp_path / "err"))
    _train_here(flags("resumed", "--resume", ckpt("one", 3)))
    ref = {m["step"]: m for m in read_metrics(str(tmp_path / "one"))}
    for name in ("dp2", "ep2"):
        for m in read_metrics(str(tmp_path / name)):
            r = ref[m["step"]]
            assert abs(m["loss"] - r["loss"]) <= 1e-5 * r["loss"], (name, m, r)
            assert m["moe_load_max"] == r["moe_load_max"] and m["moe_load_cv"] == r["moe_load_cv"], (name, m, r)
    resumed = read_metrics(str(tmp_path / "resumed"))
    assert [m["step"] for m in resumed] == [4, 5, 6]
    assert all(m["loss"] == ref[m["step"]]["loss"] for m in resumed), (resumed, ref)
    for step in (3, 6):
        want = _biases(ckpt("one", step))
        assert all(float(b.abs().sum()) > 0 for b in want.values()), want   # the bias moved
        for name in ("dp2", "ep2") + (("resumed",) if step == 6 else ()):
            got = _biases(ckpt(name, step))
            assert all(torch.equal(got[n], want[n]) for n in want), (name, step, got, want)
    # Mixtral's router has no bias: export refuses these weights in one line and writes nothing
    from nanohlat.serving import hf
    assert hf.main(["export", ckpt("one", 6), str(tmp_path / "hf")]) == 2
    assert not (tmp_path / "hf").exists() or not any((tmp_path / "hf").iterdir())
