"""Training state changes only in the step (issue 57, docs/design.md 1): run/session.py resumes,
logs, evaluates, votes to stop and saves, and changes no parameter, buffer or optimizer state.

The one piece of training state that once moved in the session's logging path is a mixture's expert
bias (--moe-bias-rate), which now moves in the optimizer's step hook (moe_figures.Figures.move_biases,
registered by run/build.py). So train.py's own loop, run with a session that does nothing at all (no
logging, evaluation, checkpoints or stop vote: `_Bare`), must leave every parameter, buffer and
optimizer state exactly as a run with the real session does, biases included; and the biases must
have moved (without --moe-bias-rate the model has none, and the states agree as well). One process,
the moe preset, 4 steps: a few seconds.
"""

from __future__ import annotations

import pytest
import torch

import train
from nanohlat import recipe
from nanohlat.run import preflight, session as sessionlib


class _Bare:
    """Session's interface, doing nothing: the loop's own steps and nothing around them."""

    def __init__(self, model_cfg, tcfg, mesh, dev, model, runner, opt, ds, resume_from):
        self.start_step, self.model, self.opt = 0, model, opt

    def end_step(self, step, loss, norm, finite, lr) -> bool:
        return False

    def close(self) -> dict:
        return {}


def _trained(cache_dir, out, session_class, monkeypatch, *extra) -> tuple:
    """Train the moe preset with `session_class` in train.py's place; its model and optimizer after."""
    kept = []

    class Keeping(session_class):
        def __init__(self, *args):
            super().__init__(*args)
            kept.append((args[4], args[6]))   # (model, opt)

    monkeypatch.setattr(train, "Session", Keeping)
    model_cfg, tcfg = recipe.parse_args(["--preset", "moe", "--steps", "4", "--device", "cpu", "--threads", "1",
                                         "--cache-dir", cache_dir, "--out-dir", str(out), "--no-progress",
                                         "--eval-every", "2", "--save-every", "2", *extra])
    train.train(*preflight.inputs(model_cfg, tcfg))
    return kept[0]


def _state(model, opt) -> dict:
    out = {f"param {n}": p.detach().clone() for n, p in model.named_parameters()}
    out |= {f"buffer {n}": b.detach().clone() for n, b in model.named_buffers()}
    for i, g in enumerate(opt.groups):
        out |= {f"group {i} master": g.master.clone(), f"group {i} m": g.exp_avg.clone(),
                f"group {i} v": g.exp_avg_sq.clone()}
    return out | {"step_count": opt.step_count.clone()}


@pytest.mark.parametrize("rate", ["1e-2", "0"])
def test_a_run_without_its_session_changes_the_same_state(rate, cache_dir, tmp_path, monkeypatch):
    real = _state(*_trained(cache_dir, tmp_path / "real", sessionlib.Session, monkeypatch, "--moe-bias-rate", rate))
    bare = _state(*_trained(cache_dir, tmp_path / "bare", _Bare, monkeypatch, "--moe-bias-rate", rate))
    assert real.keys() == bare.keys()
    for name in real:
        assert torch.equal(real[name], bare[name]), name
    biases = [v for k, v in real.items() if k.endswith("expert_bias")]
    if rate == "0":   # the negative control: no bias to move, and the states still agree
        assert not biases
    else:             # the biases moved (in the step: the bare run moved them too)
        assert biases and all(b.abs().max() > 0 for b in biases)
