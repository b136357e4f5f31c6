"""An FP8 run's checkpoints: a resume is exact (delayed scaling's amax history included), and the
checkpoint samples, evaluates and exports to Hugging Face like any other (its weights are the master
weights; the FP8 linears' history is state beside them, which a high-precision reader leaves aside).

The history is what makes delayed scaling resumable: a scale of step n comes from the amaxes of the
steps before it. Without it a resumed run would cast step 3 with the scale 1 of a fresh start; the
negative control (the history not loaded) shows its losses move."""

from __future__ import annotations

import json
import os

import pytest
import torch

from conftest import read_metrics

STEPS, N = 4, 2


def _flags(cache_dir, out, *extra):
    return ["--preset", "tiny", "--ffn-dim", "128", "--steps", str(STEPS), "--eval-every", "0", "--warmup-steps", "2",
            "--precision", "bf16-mixed", "--fp8", "delayed", "--fp8-history", "4", "--cache-dir", cache_dir,
            "--out-dir", str(out), "--no-progress", "--threads", "1", *map(str, extra)]


def _train(argv):
    import train
    from nanohlat import recipe
    from nanohlat.run import preflight
    model_cfg, tcfg = recipe.parse_args(argv)
    return train.train(*preflight.inputs(model_cfg, tcfg))


def _losses(out) -> dict:
    return {m["step"]: m["loss"] for m in read_metrics(str(out))}


@pytest.fixture(scope="module")
def runs(cache_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8ckpt")
    _train(_flags(cache_dir, root / "full"))
    _train(_flags(cache_dir, root / "resumed", "--stop-after", N))
    _train(_flags(cache_dir, root / "resumed"))
    return root


@pytest.mark.slow
def test_delayed_scaling_resumes_bit_for_bit(runs, cache_dir, tmp_path, monkeypatch):
    assert _losses(runs / "resumed") == _losses(runs / "full")
    assert sorted(_losses(runs / "full")) == list(range(1, STEPS + 1))
    from nanohlat.run.checkpoint.reshard import ShardSet
    shards = ShardSet(str(runs / "resumed" / "checkpoints" / f"step_{N:08d}"))
    history = shards.full("layers.0.attn.wq.fp8_history")
    assert history.shape == (3, 4) and (history[:, :N] > 0).all() and (history[:, N:] == 0).all()
    # the negative control: the same resume without the history (and its scales) loaded
    from nanohlat.run.checkpoint import reshard
    real = reshard.state_buffers
    monkeypatch.setattr(reshard, "state_buffers", lambda model: {n: b for n, b in real(model).items()
                                                                 if ".fp8_" not in n})
    _train(_flags(cache_dir, tmp_path / "lost", "--stop-after", N))
    _train(_flags(cache_dir, tmp_path / "lost"))
    lost, full = _losses(tmp_path / "lost"), _losses(runs / "full")
    assert all(lost[s] == full[s] for s in range(1, N + 1)) and lost[N + 1] != full[N + 1], (lost, full)


@pytest.mark.slow
def test_an_fp8_checkpoint_samples_evaluates_and_exports_like_any_other(runs, cache_dir, tmp_path, capsys):
    import sample
    from nanohlat import device
    from nanohlat.serving.hf import main as hf_main
    from nanohlat.run.checkpoint.reshard import ShardSet
    from nanohlat.run.data import prepare_data
    from nanohlat.serving import evaluate
    from nanohlat.serving.generate import load_model
    run = str(runs / "full")
    assert sample.main(["--out-dir", run, "--max-new-tokens", "4", "--prompt", "def ", "--device", "cpu"]) == 0
    model, _ = load_model(run, device.get_device("cpu"))   # (eval.py's load): the master weights, no FP8 linears
    shards = ShardSet(os.path.join(run, "checkpoints", f"step_{STEPS:08d}"))
    for name, p in model.named_parameters():
        assert torch.equal(p.float(), shards.full(name)), name
    ds = prepare_data("", "", 512, cache_dir, log=lambda *a: None)
    assert 0 < evaluate.heldout_metrics(model, ds, 32, batch_size=2, max_batches=1)["val_loss"] < 10
    assert hf_main(["export", run, str(tmp_path / "hf")]) == 0
    with open(tmp_path / "hf" / "config.json") as f:
        assert json.load(f)["num_hidden_layers"] == 4
    capsys.readouterr()
