"""A mixture of experts at cp 2 against one process, by the gradient norm (issue 63's "to explain").

The issue: the moe preset at cp 2 with --moe-aux-coef 0 logged grad norms up to 3.4e-5 relative
from one process's by step 5 (1.8e-5 without --moe-bias-rate, 4e-6 at the default coefficient),
while the losses agreed to 1e-7, above the lab's 1e-5, and nothing tested grad norms there.

What it is (measured on the moe preset, 5 steps, --warmup-steps 2, one thread; the probe recorded
every rank's routing choices, router probabilities, inputs, gradients and weights at each step):

  * no routing tie broken differently: in 20 (layer, step) pairs of 256 tokens each, not one token
    chose other experts at cp 2 than in one process (router probabilities within 2.7e-6);
  * no difference in what cp 2 computes: from the same weights and optimizer state (one process's
    step-3 checkpoint, resumed both ways) cp 2's step-4 gradients equal one process's to 1.7e-7 of
    their norm (the worst parameter 2.7e-7), its grad norm and loss to every logged digit, as at
    step 1 (2.1e-7, the grad norm 3.9e-10);
  * but AdamW amplifies round-off: its update m / (sqrt(v) + eps) is, at step 1, g / (|g| + 1e-8)
    per element, so where an element's gradient is near eps (a few dozen per matrix) a round-off
    difference of 1e-10 moves the update by up to 1.4e-3 of lr. After step 1 the two runs' weights
    differ by up to 8.6e-5 of their tensor's largest element (layers.3.attn.wo) for gradients that
    differed by 2.1e-7; every later step computes on slightly different weights. The dense tiny
    preset drifts alike (2.4e-4 after step 1). The grad norm shows it where the model is sensitive:
    at step 4 the moe preset's gradient spikes (norm 2.25 against 1.1-1.4 at the other steps, the
    embedding's squared norm 2.3 against 0.4), and the embedding's and layer 0's attention
    gradients differ by 1.4e-5, the grad norm by 5.8e-6 (ulysses; allgather 4.4e-6, ring 9.5e-7;
    with --moe-bias-rate 1e-3 3.7e-6). A coefficient of 0 leaves the router trained by the language
    model's gradient alone, which the trajectory makes more sensitive; it is the trajectory, not
    the layout, that differs.

So the bound that holds is per step: from the same weights, cp 2's step is one process's up to fp32
round-off. This test checks it (`SAME_STEP`: the grad norm and loss of the first resumed step within
1e-6 relative; measured equal), and bounds the drift of a run from scratch at `DRIFT` per step, a
check against gross errors only (measured <= 5.8e-6 here, 3.4e-5 on the issue's machine). The
negative control: each cp rank's router sums over its own tokens alone (test_moe.py's planted bug)
moves the resumed step's grad norm by 5.5e-3, its loss by 8e-8 only (at --moe-aux-coef 0 the router
losses barely reach the loss): a check of losses alone would pass it.
"""

from __future__ import annotations

import pytest

from conftest import read_metrics
from dist_utils import run_layouts

SAME_STEP = 1e-6   # one step from the same weights: round-off (measured: equal to the logged digits)
DRIFT = 1e-4       # five steps from the same start: AdamW's amplified round-off (measured <= 3.4e-5)

CASES = {"aux0_ulysses": (["--moe-aux-coef", 0], ["--cp-attention", "ulysses"]),
         "aux0_bias_allgather": (["--moe-aux-coef", 0, "--moe-bias-rate", 1e-3], ["--cp-attention", "allgather"])}


def _flags(cache_dir, out, *extra):
    return ["--preset", "moe", "--steps", "5", "--warmup-steps", "2", "--device", "cpu", "--cache-dir", cache_dir,
            "--out-dir", str(out), "--eval-every", "0", *[str(e) for e in extra]]


def _rows(out) -> dict:
    return {m["step"]: m for m in read_metrics(str(out))}


def _rel(a, b) -> float:
    return abs(a - b) / abs(b)


def _quiet_peak(rank: int) -> None:
    from nanohlat.tools import metrics
    metrics.measure_cpu_peak = lambda *args, **kwargs: 1e12   # (the MFU's CPU rate: seconds, not under test)


@pytest.mark.slow
def test_moe_at_cp2_takes_one_processs_step_from_the_same_weights(cache_dir, tmp_path, monkeypatch):
    import train
    from nanohlat.run import preflight
    from nanohlat import recipe
    from nanohlat.tools import metrics
    monkeypatch.setattr(metrics, "measure_cpu_peak", lambda *args, **kwargs: 1e12)
    runs = []
    for name, (model, layout) in CASES.items():   # one process: 5 steps, the step-3 checkpoint kept
        one = tmp_path / f"{name}_one"
        model_cfg, tcfg = recipe.parse_args(_flags(cache_dir, one, *model, "--save-every", 3, "--keep-last", 0,
                                                   "--no-progress", "--threads", 1))
        train.train(*preflight.inputs(model_cfg, tcfg))
        step3 = one / "checkpoints" / "step_00000003"
        runs += [_flags(cache_dir, tmp_path / f"{name}_cp2", *model, "--cp", 2, *layout),
                 _flags(cache_dir, tmp_path / f"{name}_cp2_from3", *model, "--cp", 2, *layout, "--resume", step3)]
    run_layouts(2, runs, str(tmp_path / "err"), setup=_quiet_peak)
    for name in CASES:
        one, cp2, from3 = (_rows(tmp_path / f"{name}{s}") for s in ("_one", "_cp2", "_cp2_from3"))
        assert sorted(from3) == [4, 5] and sorted(cp2) == sorted(one) == [1, 2, 3, 4, 5]
        # the bound: from the same weights, the same step up to round-off
        for key in ("grad_norm", "loss"):
            assert _rel(from3[4][key], one[4][key]) <= SAME_STEP, (name, key, from3[4][key], one[4][key])
            assert _rel(cp2[1][key], one[1][key]) <= SAME_STEP, (name, key, cp2[1][key], one[1][key])
        # from scratch the weights drift apart (the module docstring): bounded, per step
        drift = max(_rel(cp2[s]["grad_norm"], one[s]["grad_norm"]) for s in one)
        assert drift <= DRIFT, (name, drift)
        assert max(_rel(cp2[s]["loss"], one[s]["loss"]) for s in one) <= SAME_STEP, name
