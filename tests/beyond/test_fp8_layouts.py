"""--fp8 in every layout trains like one process's FP8 run (beyond/fp8.py: blocks as one process has them).

tp 2 with sequence parallelism, pp 2, dp 2 with ZeRO-1 and ZeRO-3, cp 2, and expert parallelism (ep 2,
the moe preset), each under tensorwise and blockwise, against one process whose micro-batches are each
rank's (4 sequences of 32 tokens: one 128-token tile). tiny's --ffn-dim 128 keeps every reduction
within the block rules (d_model 64: one block, as if zero-padded); under tp each rank's 64 of the
ffn and 32 of the heads lie inside one 128-block of one process, and under cp each rank's zigzag
chunks of 8 tokens inside one 128-token tile: those blocks straddle the cut, and their amax is
taken over the ranks (fp8_scaling.block_amax), as are the tensor-wise scales of cut tensors.

What "equal" can mean, derived. Layouts add the same fp32 numbers in other orders (tp's partial sums,
--cp's weight gradient over tokens), a difference of fp32 round-off, ~1e-7 relative (the high-precision
layout tests: tests/core/test_layouts_equal_one_process.py). FP8 amplifies it: an element within
round-off of a rounding boundary of the FP8 grid rounds the other way in the other layout, a change of a
whole FP8 step (2^-3 of the element in E4M3, 2^-2 in E5M2), and the backward carries it through every
layer below; so two correct runs agree as far as one FP8 run agrees with itself moved by round-off. This
test measures that: one process trained again with every initial weight moved by one fp32 ulp (a random
sign each: `_perturbed`), the noise floor. Measured (tiny, tensorwise): step-1 gradients move by up to 4.9%
of their norm in layer 0, 3e-5 at the head; tp 2's own differences stay at or below the floor's (4.1%
and 2.7e-5), parameter by parameter. So a layout passes when: its step-1 loss equals one process's to
LOSS_TOL (2e-5, the high-precision tests': a forward flips few elements; measured <= 5e-7), each later
loss within 4x the floor's difference at that step plus LOSS_TOL, and each parameter's step-1 gradient
(read from the step-1 checkpoint: Adam's first moment is (1 - beta1) g with --grad-clip 0) within 4x the
floor's difference for that parameter, or 1e-5 of its norm (round-off) where the floor is below it.
(pp, dp, ZeRO and ep split no reduction of a cast tensor: they came out bitwise equal, and cp to 3e-7.)
Each dense run's first-step comm ledger equals the plan's prediction to the byte (plan/fp8_costs.py: the amax
gathers), and so does delayed scaling's at tp 2 (its history's gather a step).

The negative control: tp 2 with each shard's own amax (the reduction over tp switched off,
`_shard_amax`): its step-1 loss moves by 2e-4 (10x LOSS_TOL), its gradients by 7-12% in every layer,
800x the floor at the head: the checks above fail on it, as the test requires.
"""

from __future__ import annotations

import pytest
import torch

from conftest import read_metrics
from dist_utils import run_layouts
from plan_utils import assert_run_matches_plan

LOSS_TOL = 2e-5   # the step-1 loss (module docstring)
FLOOR_FACTOR = 4  # later losses, step-1 gradients: within this many times the noise floor
ROUND_OFF = 1e-5  # a gradient's difference relative to its norm that is round-off whatever the floor
BASE = ["--steps", "2", "--eval-every", "0", "--batch-size", "8", "--seq-len", "32", "--warmup-steps", "2",
        "--grad-clip", "0", "--save-every", "1", "--keep-last", "0"]
MODELS = {"dense": ["--preset", "tiny", "--ffn-dim", "128"], "moe": ["--preset", "moe"]}
ONE = ["--microbatches", "2"]   # one process: each micro-batch one rank's of the layouts below
LAYOUTS = {"tp2_sp": ("dense", ["--tp", "2", "--sequence-parallel", "--microbatches", "2"]),
           "pp2": ("dense", ["--pp", "2", "--microbatches", "2"]),
           "dp2_zero1": ("dense", ["--dp", "2", "--zero", "1"]),
           "dp2_zero3": ("dense", ["--dp", "2", "--zero", "3"]),
           "cp2": ("dense", ["--cp", "2", "--microbatches", "2"]),
           "ep2": ("moe", ["--dp", "2", "--ep", "2"])}
RECIPES = ("tensorwise", "blockwise")


def _argv(model, recipe, out, cache_dir, extra=()):
    return MODELS[model] + BASE + ["--fp8", recipe, "--cache-dir", cache_dir, "--out-dir", str(out), *extra]


def _perturbed(init):
    """init_weights, then every weight moved by one fp32 ulp up or down (a fixed random sign each)."""
    def init_weights(model, seed):
        init(model, seed)
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1 + 2.0 ** -23 * (torch.randint(0, 2, p.shape, generator=g) * 2 - 1))
    return init_weights


def _shard_amax(rank: int) -> None:
    """The negative control, in each worker: every block's amax over this rank's shard only."""
    from nanohlat.beyond import fp8_scaling
    fp8_scaling.Axis.straddles = lambda self, block: False


def _run_here(argv):
    import train
    from nanohlat import recipe
    from nanohlat.run import preflight
    from nanohlat.tools import metrics
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(metrics, "measure_cpu_peak", lambda *a, **k: 1e12)   # (the MFU's rate: seconds, not tested)
        model_cfg, tcfg = recipe.parse_args(argv + ["--no-progress", "--threads", "1"])
        train.train(*preflight.inputs(model_cfg, tcfg))


def _result(out) -> tuple[list, dict]:
    """(losses by step, each parameter's step-1 gradient, whole) of the run in `out`."""
    from nanohlat.run.checkpoint.reshard import ShardSet
    shards = ShardSet(str(out / "checkpoints" / "step_00000001"))
    names = {n for sh in shards.shards.values() for n in sh["optim"]}
    beta1 = 0.9   # (every preset's: Adam's first moment after step 1 is (1 - beta1) g)
    grads = {n: shards.full(n, "optim", "exp_avg") / (1 - beta1) for n in names}
    return [m["loss"] for m in read_metrics(str(out))], grads


def _rel(a, b) -> float:
    return float((a - b).norm() / b.norm())


def differences(got, ref, floor) -> list[str]:
    """What in run `got` is further from `ref` than the module docstring allows (floor: the perturbed run)."""
    (losses, grads), (ref_losses, ref_grads), (floor_losses, floor_grads) = got, ref, floor
    out = []
    if abs(losses[0] - ref_losses[0]) > LOSS_TOL:
        out.append(f"step-1 loss {losses[0]} vs {ref_losses[0]}")
    for step, (a, b, c) in enumerate(zip(losses[1:], ref_losses[1:], floor_losses[1:]), start=2):
        if abs(a - b) > FLOOR_FACTOR * abs(c - b) + LOSS_TOL:
            out.append(f"step-{step} loss {a} vs {b} (floor {c})")
    for name, g in ref_grads.items():
        bound = max(FLOOR_FACTOR * _rel(floor_grads[name], g), ROUND_OFF)
        if _rel(grads[name], g) > bound:
            out.append(f"{name}: step-1 gradient {_rel(grads[name], g):.2e} of its norm off, bound {bound:.2e}")
    return out


@pytest.fixture(scope="module")
def one_process(cache_dir, tmp_path_factory):
    """Each recipe and model in one process, and again moved by round-off (the noise floor)."""
    from nanohlat.run import build
    out = {}
    for recipe in RECIPES:
        for model in MODELS:
            for kind in ("ref", "floor"):
                where = tmp_path_factory.mktemp(f"{recipe}_{model}_{kind}")
                with pytest.MonkeyPatch.context() as mp:
                    if kind == "floor":
                        mp.setattr(build, "init_weights", _perturbed(build.init_weights))
                    _run_here(_argv(model, recipe, where, cache_dir, ONE))
                out[recipe, model, kind] = _result(where)
    return out


@pytest.mark.slow
def test_every_layout_trains_like_one_process_under_fp8_and_the_shard_only_amax_does_not(
        one_process, cache_dir, tmp_path):
    runs = {(recipe, name): tmp_path / f"{recipe}_{name}" for recipe in RECIPES for name in LAYOUTS}
    delayed = tmp_path / "delayed_tp2_sp"   # (for the plan: delayed scaling's history gathers over tp and dp)
    argvs = {out: _argv(LAYOUTS[name][0], recipe, out, cache_dir, LAYOUTS[name][1]) for (recipe, name), out in runs.items()}
    argvs[delayed] = _argv("dense", "delayed", delayed, cache_dir, LAYOUTS["tp2_sp"][1])
    run_layouts(2, list(argvs.values()), str(tmp_path / "err"))
    for (recipe, name), out in runs.items():
        model = LAYOUTS[name][0]
        found = differences(_result(out), one_process[recipe, model, "ref"], one_process[recipe, model, "floor"])
        assert not found, f"{recipe} {name}: " + "; ".join(found)
        if model == "dense":   # and the plan counted every amax gather to the byte (plan/fp8_costs.py; ep2's all-to-alls
            assert_run_matches_plan(out, argvs[out], 2)   # follow its routing, which the plan takes as balanced)
    assert_run_matches_plan(delayed, argvs[delayed], 2)
    # the negative control: tp 2, each shard's own amax
    control = tmp_path / "control"
    run_layouts(2, [_argv("dense", "tensorwise", control, cache_dir, ["--tp", "2", "--microbatches", "2"])],
                str(tmp_path / "err_control"), setup=_shard_amax)
    found = differences(_result(control), one_process["tensorwise", "dense", "ref"],
                        one_process["tensorwise", "dense", "floor"])
    assert found[0].startswith("step-1 loss"), found
    assert len([f for f in found if "gradient" in f]) > 30, found   # nearly all of tiny's 39 parameters
