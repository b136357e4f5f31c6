"""Hostile input, round six (issue 63; docs/robustness.md): every flag checked whether or not its
feature is on, every float flag in a finite, sane range, and a manifest called damaged only when it
is. (Start-up signals: test_interrupt_startup.py; the benches' refusals: commands/test_bench_refusals.py;
the layout matrix's paths: repo/test_layout_matrix_compare.py; a mixture at cp 2 by the grad norm:
beyond/test_moe_cp_grad_norm.py.)
"""

from __future__ import annotations

import json
import math
import os

import pytest

from hostile import one_line_error

TINY = ["--preset", "tiny", "--steps", "2", "--eval-every", "0", "--no-progress", "--threads", "1"]


def train_main(argv, capsys) -> tuple[int, str]:
    import train
    code = train.main([str(a) for a in argv])
    return code, capsys.readouterr().err


# ---------------------------------------------------------------------------
# A flag of a feature the run does not use; every float flag in a finite, sane range
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("args, message", [
    # a dense model took each of these unchecked (and saved --moe-bias-rate nan in its manifest)
    (["--moe-bias-rate", "1e-3"], "--moe-bias-rate 0.001 needs --moe-experts (a dense model, --moe-experts 0, has "
                                  "no router or experts for it); give --moe-experts too, or drop --moe-bias-rate"),
    (["--moe-top-k", "0"], "--moe-top-k 0 needs --moe-experts"),
    (["--moe-aux-coef=-1"], "--moe-aux-coef must be a finite number >= 0, got -1.0"),
    (["--moe-capacity-factor=-2"], "--moe-capacity-factor must be a finite number >= 0, got -2.0"),
    (["--moe-bias-rate", "nan"], "--moe-bias-rate must be a finite number >= 0, got nan"),
    (["--moe-bias-rate", "inf"], "--moe-bias-rate must be a finite number >= 0, got inf"),
    (["--moe-every", "2"], "--moe-every 2 needs --moe-experts"),
    (["--cp-attention", "ring"], "--cp-attention ring needs --cp N (N >= 2)"),
    (["--no-sp-regather"], "--no-sp-regather needs --sequence-parallel"),
    (["--search"], "--search needs --plan (it ranks the layouts in the plan; without --plan train.py trains)"),
    # magnitudes that overflow the arithmetic (1e308, 1e40: "cannot be converted to type float without
    # overflow" in moe.py; 1e39: every expert bias NaN after step 1, exit 0)
    (["--preset", "moe", "--moe-aux-coef", "1e308"], "--moe-aux-coef 1e+308 is above 1e+06 (a router loss's weight"),
    (["--preset", "moe", "--moe-z-coef", "1e40"], "--moe-z-coef 1e+40 is above 1e+06"),
    (["--preset", "moe", "--moe-bias-rate", "1e39"], "--moe-bias-rate 1e+39 is above 1 (a bias's move per step"),
    (["--lr", "1e39"], "--lr 1e+39 is above 3.4e+38 (fp32's largest number"),
    (["--weight-decay", "1e308"], "--weight-decay 1e+308 is above 3.4e+38"),
    (["--grad-clip", "1e308"], "--grad-clip 1e+308 is above 3.4e+38"),
    (["--adam-eps", "1e308"], "--adam-eps 1e+308 is above 1 (eps guards Adam's division"),
    (["--norm-eps", "1e308"], "--norm-eps 1e+308 is above 1"),        # trained, the loss stuck at ln V
    (["--bucket-mb", "1e308"], "--bucket-mb 1e+308 is above 1e+09"),   # (an OverflowError in pre-flight)
])
def test_a_flag_out_of_its_feature_or_range_is_refused_before_anything(args, message, tmp_path, capsys):
    out = tmp_path / "out"
    code, err = train_main(TINY + ["--out-dir", out] + args, capsys)
    assert code == 2
    one_line_error(err, message)
    assert not out.exists()


@pytest.mark.parametrize("args", [
    ["--moe-top-k", "2", "--moe-bias-rate", "0", "--cp-attention", "allgather", "--sp-regather"],   # the defaults
    ["--preset", "moe", "--moe-bias-rate", "1e-3", "--moe-aux-coef", "0"],
    ["--preset", "moe", "--moe-aux-coef", "1e6", "--moe-bias-rate", "1"],                            # the largest
    ["--cp", "2", "--cp-attention", "ring"], ["--tp", "2", "--sequence-parallel", "--no-sp-regather"],
])
def test_a_feature_flag_at_its_default_or_with_its_feature_passes(args):
    from nanohlat import recipe
    recipe.parse_args(args)


def test_every_preset_still_parses():
    from nanohlat import recipe
    for name in recipe.PRESETS:
        recipe.parse_args(["--preset", name])


def test_every_float_flag_has_a_largest_value_or_needs_none():
    """Each float field of the recipe is bounded above (recipe.HIGHEST, or validate's own bound), or is
    one whose any finite value computes: --rope-theta (1e308 trains), --min-lr (at most --lr), the
    timeouts (at most a week: preflight.check_values)."""
    import dataclasses
    from nanohlat import recipe
    floats = {f.name for cls in (recipe.ModelConfig, recipe.TrainConfig) for f in dataclasses.fields(cls)
              if type(f.default) is float}
    bounded_elsewhere = {"rope_theta", "min_lr", "beta1", "beta2", "moe_capacity_factor", "rendezvous_timeout",
                         "collective_timeout"}
    assert floats == set(recipe.HIGHEST) | bounded_elsewhere


# ---------------------------------------------------------------------------
# A manifest is called damaged only when it is
# ---------------------------------------------------------------------------

def _edit(run, step, edit) -> str:
    path = os.path.join(str(run), "checkpoints", f"step_{step:08d}", "manifest.json")
    with open(path) as f:
        m = json.load(f)
    edit(m)
    with open(path, "w") as f:
        json.dump(m, f)   # (bare NaN, as an older nanohlat wrote it)
    return path


@pytest.fixture(scope="module")
def dense_run(tmp_path_factory, cache_dir):
    import train
    out = tmp_path_factory.mktemp("dense") / "run"
    assert train.main(TINY + ["--cache-dir", cache_dir, "--out-dir", str(out)]) == 0
    return out


def test_a_dense_checkpoint_saved_with_moe_bias_rate_nan_is_read_with_a_note(dense_run, tmp_path, cache_dir,
                                                                              capsys):
    """An older nanohlat took `--moe-bias-rate nan` for a dense model and saved it: eval.py, sample.py,
    the export and --resume called the checkpoint "damaged (config.model.moe_bias_rate is nan)" and the
    run could not be used. A dense model never reads its mixture fields: each reader notes the value,
    sets it aside and goes on (exit 0)."""
    import shutil
    import eval as evalpy
    import sample
    from nanohlat.serving import hf
    run = tmp_path / "run"
    shutil.copytree(dense_run, run)
    mpath = _edit(run, 2, lambda m: m["config"]["model"].update(moe_bias_rate=float("nan"), moe_top_k=0))
    note = (f"note: checkpoint manifest {mpath} records --moe-bias-rate nan, which train.py refuses now (an older "
            f"nanohlat took it unchecked); a dense model has no experts and never uses it, so it is set aside")
    from nanohlat.run.checkpoint import manifest
    capsys.readouterr()
    for main in (lambda: evalpy.main(["--out-dir", str(run), "--examples", "4", "--max-batches", "1"]),
                 lambda: sample.main(["--out-dir", str(run), "--max-new-tokens", "2"]),
                 lambda: hf.main(["export", str(run), str(tmp_path / "hf")]),
                 lambda: __import__("train").main(TINY + ["--steps", "3", "--cache-dir", cache_dir,
                                                          "--out-dir", str(run)])):
        manifest._noted.clear()   # (once per process: each command here is a process of its own)
        assert main() == 0
        err = capsys.readouterr().err
        assert note in err and "damaged" not in err, err
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    assert "resumed" not in err or "--moe-top-k" not in err   # (no "resuming with --moe-top-k 2 (it trained with 0)")


def test_damage_is_still_called_damage(dense_run, tmp_path, capsys):
    """A string where a number belongs is no older version's value: damaged, as before."""
    import shutil
    import eval as evalpy
    run = tmp_path / "run"
    shutil.copytree(dense_run, run)
    mpath = _edit(run, 2, lambda m: m["config"]["model"].update(moe_bias_rate="abc"))
    assert evalpy.main(["--out-dir", str(run), "--examples", "4", "--max-batches", "1"]) == 2
    one_line_error(capsys.readouterr().err, f"checkpoint manifest {mpath} is damaged (config.model.moe_bias_rate "
                                            f"is 'abc')")


def test_expert_biases_an_older_bias_rate_overflowed_are_named_as_such(tmp_path, cache_dir, monkeypatch, capsys):
    """`--preset moe --moe-bias-rate 1e39` (an older nanohlat took it) made every expert bias NaN after
    step 1, exited 0, and eval.py and sample.py used the model. Trained here as that version did (the
    bound lifted), the checkpoint is refused by every reader and by a resume, in one line saying why."""
    import eval as evalpy
    import train
    from nanohlat import recipe
    monkeypatch.setitem(recipe.HIGHEST, "moe_bias_rate", (math.inf, ""))
    run = tmp_path / "run"
    assert train.main(["--preset", "moe", "--moe-bias-rate", "1e39", "--steps", "1", "--batch-size", "4",
                       "--eval-every", "0", "--no-progress", "--threads", "1", "--cache-dir", cache_dir,
                       "--out-dir", str(run)]) == 0
    monkeypatch.undo()
    capsys.readouterr()
    want = "has non-finite expert biases (NaN or inf) in layers.0.mlp.expert_bias: its run moved them by a " \
           "--moe-bias-rate so large that they overflowed (train.py refuses one above 1 now)"
    assert evalpy.main(["--out-dir", str(run), "--examples", "4", "--max-batches", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "records --moe-bias-rate 1e+39, which train.py refuses now" in err[0]   # the note, then the line
    one_line_error(err[-1], want)
    code, err = train_main(["--preset", "moe", "--moe-bias-rate", "1e-3", "--steps", "2", "--batch-size", "4",
                            "--eval-every", "0", "--no-progress", "--threads", "1", "--cache-dir", cache_dir,
                            "--out-dir", run], capsys)
    assert code == 2
    one_line_error(err.strip().splitlines()[-1], want)
