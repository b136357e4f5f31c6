"""Every layout trains exactly like one process (docs/design.md section 5).

Same per-step losses, same grad norms, same consolidated weights after the
last step, for tensor, sequence, pipeline (AFAB, 1F1B, interleaved and ZB-H1,
several micro-batch counts) and data parallelism with and without ZeRO-1, alone and combined; and
with more tp ranks than kv heads (replicated kv heads), whose checkpoints
load into layouts without replicas and back.

Tolerance: the layouts add the same numbers in a different order (a dot
product split over tp ranks, gradients summed over dp ranks, micro-batches
accumulated one by one), so results differ by fp32 round-off: ~1e-7 relative
per operation, grown through 4 layers and 4 optimizer steps. Measured: losses
(~6) differ by <= 5e-7; we allow 2e-5. Grad norms (~1.7) agree to 1e-6
relative at step 1 and to 1e-4 later (see the weights paragraph for why).

Weights need two numbers. Almost every element agrees to ~1e-7. But Adam's
update is g / (sqrt(v) + eps): for the rare element whose gradient is itself
round-off-sized (near 1e-8), or a sum that cancels to far less than its
terms, a relative change of that gradient moves the update by a visible
fraction of lr (3e-3). Even one process with 4 micro-batches instead of 1
differs from itself that way in 2 of 250k elements, by 1.1e-5; tp 4 with 2
kv heads in 1 element of a 64-element norm gain, by 1.2e-6 (its step-2
gradient, -3.4e-6, came out 2e-3 relative apart). How many such elements a
layout has depends on the CPU's kernels, which choose the summation order: on
an AVX2 CPU every layout stayed within 0.1% of a tensor's elements (or one
element); on an AVX-512 CPU (16-wide sums) tp 2 x pp 2 x dp 2 had 12 of
11,264 elements of one MLP weight (0.11%) and tp 4 with 2 kv heads 2 of
1,024 elements of wv. So we require, per tensor: at most 0.5% of its
elements, or 3 elements if that is more (in a 64-element tensor one element
is already 1.6%), differ by more than 1e-6, and none by more than 1e-4 (3%
of one step). A real bug (a missing all-reduce, a wrong shard, a mis-scaled
loss) moves most elements of a tensor by ~lr and the first loss by >1e-2.
"""

from __future__ import annotations

import json

import pytest

from conftest import read_metrics
from dist_utils import assert_same_weights, run_layouts

LOSS_TOL = 2e-5   # (the weights' numbers: dist_utils.assert_same_weights)
BASE = ["--preset", "tiny", "--steps", "4", "--eval-every", "0", "--batch-size", "8", "--seq-len", "32",
        "--warmup-steps", "2"]


def _flags(cache_dir, out_dir, extra):
    return BASE + ["--cache-dir", cache_dir, "--out-dir", str(out_dir)] + extra


@pytest.fixture(scope="module")
def reference(cache_dir, tmp_path_factory):
    """One process, no parallelism: the ground truth."""
    import train
    from nanohlat import device
    from nanohlat import recipe
    from nanohlat.run import preflight
    out = tmp_path_factory.mktemp("ref")
    model_cfg, tcfg = recipe.parse_args(_flags(cache_dir, out, ["--no-progress"]))
    train.train(*preflight.inputs(model_cfg, tcfg))
    from nanohlat.serving.generate import load_model   # the loader of every command
    model, _ = load_model(str(out), device.get_device("cpu"))
    return read_metrics(str(out)), {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_same_as_reference(reference, out_dir, first_step: int = 1):
    """Losses and grad norms of steps first_step.. and the final weights equal the reference's."""
    ref_metrics, ref_weights = reference[:2]
    ref_metrics = [m for m in ref_metrics if m["step"] >= first_step]
    got = read_metrics(str(out_dir))
    assert [m["step"] for m in got] == [m["step"] for m in ref_metrics]
    for a, b in zip(got, ref_metrics):
        assert abs(a["loss"] - b["loss"]) < LOSS_TOL, (a["step"], a["loss"], b["loss"])
        # step 1 starts from identical weights: only summation order differs, and
        # the per-parameter gradients of the layouts agree to ~1e-9. The norm's own
        # reduction adds nothing visible to that (optim.sum_of_squares accumulates
        # in fp64; a plain fp32 reduction alone would be off by ~1e-5), so 1e-6
        # holds. Later steps inherit the rare Adam-amplified weight differences
        # described above, which the gradient norm (unlike the loss) feels: 1e-4
        rel = 1e-6 if a["step"] == 1 else 1e-4
        assert abs(a["grad_norm"] - b["grad_norm"]) < rel * b["grad_norm"], (a, b)
    assert_same_weights(out_dir, ref_weights)


WORLD2 = {
    "tp2": ["--tp", "2"],
    "tp2_sp": ["--tp", "2", "--sequence-parallel"],
    "tp2_sp_selective_ckpt": ["--tp", "2", "--sequence-parallel", "--activation-checkpointing", "selective"],
    "pp2_1f1b_full_ckpt": ["--pp", "2", "--microbatches", "2", "--activation-checkpointing", "full"],
    "dp2": ["--dp", "2"],
    "dp2_zero1": ["--dp", "2", "--zero1", "--bucket-mb", "0.01"],
    **{f"pp2_{s}_m{m}": ["--pp", "2", "--schedule", s, "--microbatches", str(m)]
       for s in ("afab", "1f1b") for m in (1, 2, 4)},
    # interleaved: stage 0 holds layers 0 and 2, stage 1 layers 1 and 3
    "pp2_interleaved_m2": ["--pp", "2", "--schedule", "interleaved", "--virtual-stages", "2", "--microbatches", "2"],
}
WORLD4 = {
    "tp4": ["--tp", "4"],
    "tp2_pp2_sp": ["--tp", "2", "--pp", "2", "--sequence-parallel", "--microbatches", "2"],
    "tp2_dp2_zero1": ["--tp", "2", "--dp", "2", "--zero1"],
    "tp2_pp2_interleaved_sp": ["--tp", "2", "--pp", "2", "--schedule", "interleaved", "--virtual-stages", "2",
                               "--sequence-parallel", "--microbatches", "2"],
    **{f"pp4_{s}_m{m}": ["--pp", "4", "--schedule", s, "--microbatches", str(m)]
       for s in ("afab", "1f1b") for m in (1, 4, 8)},
    # zb-h1: the split backward under tp x pp with SP (regather: the gather again in W), and
    # dp x pp with ZeRO-1 and overlapped reduction (buckets filled by B's norms and W's linears)
    "tp2_pp2_zb_h1_sp": ["--tp", "2", "--pp", "2", "--schedule", "zb-h1", "--sequence-parallel",
                         "--microbatches", "2"],
    "dp2_pp2_zb_h1_zero1": ["--dp", "2", "--pp", "2", "--zero1", "--schedule", "zb-h1", "--microbatches", "4",
                            "--bucket-mb", "0.01", "--save-every", "2"],
}
WORLD8 = {"tp2_pp2_dp2_zero1_sp": ["--tp", "2", "--pp", "2", "--dp", "2", "--zero1", "--sequence-parallel",
                                   "--microbatches", "2"]}


# Interleaved checkpoints (2 kv heads, against reference_kv2): dp 2 x pp 2 with
# ZeRO-1 saves at step 2 and continues with 1F1B (world 2) and in one process
# (test below); interleaved continues one process's step-2 checkpoint.
INTERLEAVED_RUNS = {
    "dp2_pp2_interleaved_zero1": ["--n-kv-heads", "2", "--dp", "2", "--pp", "2", "--zero1", "--schedule", "interleaved",
                                  "--virtual-stages", "2", "--microbatches", "2", "--save-every", "2"],
}


# More tp ranks than kv heads: tiny with 2 kv heads at tp 4 (each kv head held
# by 2 ranks), against one process with 2 kv heads. Checkpoints saved at step 2
# continue in other layouts: tp 1 -> tp 4 (replicas), tp 4 -> tp 2 (none) and
# tp 4 -> tp 1 (test below).
KV2 = ["--n-kv-heads", "2"]


def _ckpt(out_dir, step: int) -> str:
    return str(out_dir / "checkpoints" / f"step_{step:08d}")


@pytest.fixture(scope="module")
def reference_kv2(cache_dir, tmp_path_factory):
    import train
    from nanohlat import device
    from nanohlat import recipe
    from nanohlat.run import preflight
    out = tmp_path_factory.mktemp("ref_kv2")
    model_cfg, tcfg = recipe.parse_args(_flags(cache_dir, out, KV2 + ["--no-progress", "--save-every", "2"]))
    train.train(*preflight.inputs(model_cfg, tcfg))
    from nanohlat.serving.generate import load_model   # the loader of every command
    model, _ = load_model(str(out), device.get_device("cpu"))
    return read_metrics(str(out)), {n: p.detach().clone() for n, p in model.named_parameters()}, out


@pytest.fixture(scope="module")
def layout_runs(cache_dir, tmp_path_factory, reference_kv2):
    """Train every layout once (one worker group per world size); name -> out dir.
    World 4 first: the world-2 group continues one of its checkpoints."""
    root = tmp_path_factory.mktemp("layouts")
    world4 = WORLD4 | {"tp4_kv2_sp": KV2 + ["--tp", "4", "--sequence-parallel", "--save-every", "2"],
                       "tp4_kv2_m4": KV2 + ["--tp", "4", "--microbatches", "4"],
                       **INTERLEAVED_RUNS,
                       "tp4_kv2_sp_from_tp1": KV2 + ["--tp", "4", "--sequence-parallel",
                                                     "--resume", _ckpt(reference_kv2[2], 2)],
                       "dp2_pp2_interleaved_from_tp1": KV2 + ["--pp", "2", "--dp", "2", "--schedule", "interleaved",
                                                          "--virtual-stages", "2", "--microbatches", "2",
                                                          "--resume", _ckpt(reference_kv2[2], 2)]}
    world2 = WORLD2 | {"tp2_kv2_from_tp4": KV2 + ["--tp", "2", "--resume", _ckpt(root / "tp4_kv2_sp", 2)],
                       "pp2_1f1b_from_interleaved": KV2 + ["--pp", "2", "--microbatches", "2", "--resume",
                                                          _ckpt(root / "dp2_pp2_interleaved_zero1", 2)],
                       "pp2_1f1b_from_zb_h1": ["--pp", "2", "--microbatches", "2", "--resume",
                                               _ckpt(root / "dp2_pp2_zb_h1_zero1", 2)]}
    outs = {}
    for world, layouts in ((4, world4), (2, world2), (8, WORLD8)):
        runs = []
        for name, extra in layouts.items():
            outs[name] = root / name
            runs.append(_flags(cache_dir, outs[name], extra))
        run_layouts(world, runs, str(root / f"errors{world}"))
    return outs


@pytest.mark.parametrize("name", list(WORLD2) + list(WORLD4) + list(WORLD8))
def test_layout_matches_one_process(name, layout_runs, reference):
    assert_same_as_reference(reference, layout_runs[name])


def test_interleaved_with_dp2_zero1_trains_like_one_process_and_its_checkpoints_move(layout_runs, reference_kv2,
                                                                                  cache_dir, tmp_path):
    """dp 2 x pp 2 interleaved with ZeRO-1 gives one process's losses and
    weights; its step-2 checkpoint continues with 1F1B and in one process,
    and one process's continues interleaved: each like one process from step 3."""
    import train
    from nanohlat import recipe
    from nanohlat.run import preflight
    assert_same_as_reference(reference_kv2, layout_runs["dp2_pp2_interleaved_zero1"])
    ckpt = _ckpt(layout_runs["dp2_pp2_interleaved_zero1"], 2)
    assert json.load(open(f"{ckpt}/manifest.json"))["layout"]["virtual_stages"] == 2
    train.train(*preflight.inputs(*recipe.parse_args(_flags(cache_dir, tmp_path, KV2 + ["--no-progress",
                                                                                         "--resume", ckpt]))))
    for out in (layout_runs["pp2_1f1b_from_interleaved"], tmp_path, layout_runs["dp2_pp2_interleaved_from_tp1"]):
        assert_same_as_reference(reference_kv2, out, first_step=3)


def test_zb_h1_checkpoint_continues_with_1f1b(layout_runs, reference):
    """dp 2 x pp 2 zb-h1's step-2 checkpoint, continued by pp 2 1F1B: one process's steps 3 and 4."""
    assert_same_as_reference(reference, layout_runs["pp2_1f1b_from_zb_h1"], first_step=3)


def test_zb_h1_holds_p_micro_batches_from_forward_to_weight_gradients(layout_runs):
    """pp 2, m 4: every stage keeps p = 2 micro-batches from F to W (summary.json: rank 0)."""
    from nanohlat.tools.timeline import in_flight_formula
    summary = json.load(open(layout_runs["dp2_pp2_zb_h1_zero1"] / "summary.json"))
    assert summary["peak_in_flight"] == in_flight_formula("zb-h1", 2, 4, 0)[0] == 2


@pytest.mark.parametrize("pp, schedule, m", [(2, "afab", 4), (2, "1f1b", 4), (4, "afab", 8), (4, "1f1b", 8),
                                             (4, "1f1b", 1)])
def test_in_flight_micro_batches_afab_holds_all_1f1b_at_most_pp(pp, schedule, m, layout_runs):
    """Stage 0 (rank 0) keeps every micro-batch's activations under AFAB and at most pp under 1F1B."""
    summary = json.load(open(layout_runs[f"pp{pp}_{schedule}_m{m}"] / "summary.json"))
    assert summary["peak_in_flight"] == (m if schedule == "afab" else min(pp, m))


def test_zero1_optimizer_state_is_one_dp_th_plus_padding(layout_runs):
    """tiny: 249,856 matrix + 576 norm parameters; 2 fp32 moments = 8 bytes each (in fp32 the
    master weights are the parameters themselves: precision.py)."""
    full = json.load(open(layout_runs["dp2"] / "summary.json"))["optimizer_bytes"]
    sharded = json.load(open(layout_runs["dp2_zero1"] / "summary.json"))["optimizer_bytes"]
    assert full == 8 * (249_856 + 576)
    assert sharded == 8 * (249_856 // 2 + 576 // 2)        # both even: no padding at dp=2
    assert sharded * 2 == full


def test_replicated_kv_heads_train_like_one_process(layout_runs, reference_kv2, cache_dir):
    """tp 4 with 2 kv heads and sequence parallel: the losses, grad norms and
    weights of one process; the replicas' gradient all-reduce moves the bytes
    the plan predicts; the checkpoint holds each kv head once (ranks 0 and 2)."""
    import torch
    from nanohlat import recipe
    from nanohlat import plan
    from nanohlat.mesh import Mesh
    out = layout_runs["tp4_kv2_sp"]
    assert_same_as_reference(reference_kv2, out)
    model_cfg, tcfg = recipe.parse_args(_flags(cache_dir, out, KV2 + ["--tp", "4", "--sequence-parallel"]))
    measured = json.load(open(out / "summary.json"))["comm_bytes"]
    assert measured["kv.all_reduce"] == 4 * 2 * 8 * 64 * 4    # layers x (wk, wv) x head_dim x d_model x fp32
    assert measured == plan.comm_bytes_per_step(model_cfg, tcfg, Mesh(4, 1, 1, 0))
    holders = {}
    for r in range(4):
        shard = torch.load(f"{_ckpt(out, 2)}/shard_{r:05d}.pt", weights_only=True)
        for name in shard["model"]:
            holders.setdefault(name, []).append(r)
    assert holders["layers.0.attn.wk.weight"] == [0, 2] and holders["layers.0.attn.wq.weight"] == [0, 1, 2, 3]
    assert holders["layers.0.attn_norm.weight"] == [0]


def test_kv_replicas_sum_their_gradients_once_per_step_whatever_the_micro_batches(layout_runs, reference_kv2):
    """The kv copies' gradients are summed on the fp32 buffer once per step (optim.py:
    FlatAdamW.reduce_gradients), not once per micro-batch: 4 micro-batches make the calls
    and bytes of 1, and still train like one process."""
    out = layout_runs["tp4_kv2_m4"]
    assert_same_as_reference(reference_kv2, out)
    m4 = json.load(open(out / "summary.json"))
    m1 = json.load(open(layout_runs["tp4_kv2_sp"] / "summary.json"))
    assert m4["comm_calls"]["kv.all_reduce"] == m1["comm_calls"]["kv.all_reduce"] == 1
    assert m4["comm_bytes"]["kv.all_reduce"] == m1["comm_bytes"]["kv.all_reduce"]


@pytest.mark.parametrize("name", ["tp4_kv2_sp_from_tp1", "tp2_kv2_from_tp4", "tp1_from_tp4"])
def test_replicated_kv_checkpoints_continue_in_other_layouts(name, layout_runs, reference_kv2, cache_dir, tmp_path):
    """A step-2 checkpoint of one process continues at tp 4 with replicas, and
    one of tp 4 continues at tp 2 (one kv head per rank) and in one process."""
    if name == "tp1_from_tp4":
        import train
        from nanohlat import recipe
        from nanohlat.run import preflight
        argv = _flags(cache_dir, tmp_path, KV2 + ["--no-progress", "--resume", _ckpt(layout_runs["tp4_kv2_sp"], 2)])
        train.train(*preflight.inputs(*recipe.parse_args(argv)))
        out = tmp_path
    else:
        out = layout_runs[name]
    assert_same_as_reference(reference_kv2, out, first_step=3)


def test_interleaved_holds_its_warm_up_plus_one_chunk_activations(layout_runs):
    """pp 2, v 2, m 2: stage 0's warm-up is 2(p-1) + (v-1)p = 4 forwards, all of
    its v*m = 4 chunk activations: summary.json's peak_in_flight (rank 0)."""
    from nanohlat.tools.timeline import in_flight_formula
    summary = json.load(open(layout_runs["pp2_interleaved_m2"] / "summary.json"))
    assert summary["peak_in_flight"] == in_flight_formula("interleaved", 2, 2, 0, 2)[0] == 4
