"""--fp8-stats N (beyond/fp8_stats.py): what FP8 does to each linear's numbers, logged every N steps, and
the run's worst linears; and the outlier the statistics are for (scripts/fp8_experiment.py outlier).

The logged figures are checked against what they say: the amax of a weight at step 2 is the largest
|element| of that weight after step 1 (the step-1 checkpoint), its scale the fp32 448 / amax of the
tensor-wise recipe, the fractions are fractions, and a flushed count is the elements that were nonzero
and are zero once cast, counted independently here on a tensor with one large element."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import read_metrics
from nanohlat.beyond import fp8, fp8_scaling


def _train(argv):
    import train
    from nanohlat import recipe
    from nanohlat.run import preflight
    model_cfg, tcfg = recipe.parse_args(argv)
    return train.train(*preflight.inputs(model_cfg, tcfg))


@pytest.mark.slow
def test_fp8_stats_are_logged_every_n_steps_and_mean_what_they_say(cache_dir, tmp_path, capsys):
    out = tmp_path / "run"
    _train(["--preset", "tiny", "--ffn-dim", "128", "--steps", "2", "--eval-every", "0", "--fp8", "tensorwise",
            "--fp8-stats", "2", "--save-every", "1", "--keep-last", "0", "--cache-dir", cache_dir,
            "--out-dir", str(out), "--no-progress", "--threads", "1"])
    rows = read_metrics(str(out))
    assert "fp8" not in rows[0] and "fp8" in rows[1]
    figures = rows[1]["fp8"]
    assert len(figures) == 4 * 7 and set(figures["layers.2.mlp.down"]) == {"x", "w", "dy"}
    for name, per in figures.items():
        for role, f in per.items():
            assert 0 <= f["saturated"] <= 1 and 0 <= f["flushed"] <= 1 and f["amax"] > 0, (name, role, f)
    from nanohlat.run.checkpoint.reshard import ShardSet
    w = ShardSet(str(out / "checkpoints" / "step_00000001")).full("layers.0.attn.wq.weight")
    logged = figures["layers.0.attn.wq"]["w"]
    assert logged["amax"] == w.abs().max().item()
    scale = fp8_scaling.amax_scale(w.abs().max(), fp8_scaling.E4M3)
    assert logged["scale"] == pytest.approx(scale.item(), rel=1e-6)   # (logged as 1 / the fp32 reciprocal)
    with open(out / "summary.json") as f:
        worst = json.load(f)["fp8_worst"]
    assert set(worst) == {"flushed", "saturated"}
    assert "fp8: the worst linears, flushed: " in capsys.readouterr().out


def test_one_large_activation_flushes_a_tensor_wise_cast_and_only_its_block_otherwise():
    """The outlier experiment in small: x ~ N(0, 1) with one element 1e5. One scale for the tensor puts
    the other elements at 448 / 1e5 of their size: those below half E4M3's smallest subnormal (2^-10) are
    flushed, about P(|z| < 2^-10 x 1e5 / 448) = 17%; per row, per 128-tile or per 32-block only the
    outlier's own row, tile or block loses its small elements (at most 512, 128 or 32 of 131,072)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 512, generator=g)
    x[17, 100] = 1e5
    threshold = 2.0 ** -10 * 1e5 / 448                       # |x| below this flushes under the tensor-wise scale
    expected = int((x.abs() < threshold).sum())              # counted here, independently of the cast
    counts = {}
    for recipe in ("tensorwise", "rowwise", "blockwise", "mx"):
        c = fp8_scaling.cast(x, fp8_scaling.Axis(256), fp8_scaling.Axis(512), fp8_scaling.block_sizes(recipe, "x"),
                             fp8.RULES.get(recipe, "amax"), fp8_scaling.E4M3, count=True)
        counts[recipe] = int(c.flushed)
        assert counts[recipe] == int(((c.q.float() == 0) & (x != 0)).sum())
    assert abs(counts["tensorwise"] - expected) <= 0.01 * expected and counts["tensorwise"] > 0.15 * x.numel()
    assert counts["rowwise"] <= 512 and counts["blockwise"] <= 128 and counts["mx"] <= 32, counts
