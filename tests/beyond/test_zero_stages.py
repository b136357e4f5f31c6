"""ZeRO stages beside each other (zero1.py, zero2.py, zero3.py): the --zero flag and its old spelling --zero1."""

from __future__ import annotations

import json
import os
import re

import pytest

from nanohlat import recipe
from nanohlat.config import UserError

TINY = ["--preset", "tiny"]


def test_zero1_is_the_older_spelling_of_zero_1():
    assert recipe.parse_args(TINY + ["--zero1"])[1].zero == 1
    assert recipe.parse_args(TINY + ["--zero", "1"])[1].zero == 1
    assert recipe.parse_args(TINY)[1].zero == 0
    assert recipe.parse_args(["--preset", "hlat-70b"])[1].zero == 1


@pytest.mark.parametrize("argv, words", [(["--zero", "4"], "not a ZeRO stage"),
                                         (["--zero", "-1"], "not a ZeRO stage"),
                                         (["--zero1", "--zero", "0"], "older spelling"),
                                         (["--zero", "3", "--pp", "2"], "not supported: a pipeline stage"),
                                         (["--zero", "3", "--compile"], "not supported: ZeRO-3 empties"),
                                         (["--zero", "2", "--schedule", "interleaved", "--virtual-stages", "2"],
                                          "not supported: ZeRO-2 reduce-scatters a bucket"),
                                         (["--zero", "2", "--schedule", "zb-h1"],
                                          "zb-h1 is not supported: ZeRO-2 reduce-scatters a bucket"),
                                         (["--zero", "3", "--schedule", "zb-h1"],
                                          "zb-h1 is not supported: ZeRO-3 reduce-scatters a bucket")])
def test_bad_zero_flags_are_refused_in_one_line(argv, words):
    with pytest.raises(UserError, match=words) as e:
        recipe.parse_args(TINY + argv)
    assert "\n" not in str(e.value)


def test_zero3_on_xla_is_refused_in_one_line_exit_2(tmp_path, capsys):
    import train
    code = train.main(TINY + ["--nproc", "2", "--dp", "2", "--zero", "3", "--device", "xla",
                              "--out-dir", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and "--zero 3 is not supported on xla" in err, err


# ---------------------------------------------------------------------------
# Two ranks, dp 2: every ZeRO stage, overlapped and not; checkpoints across stages
# ---------------------------------------------------------------------------

BASE = ["--preset", "tiny", "--steps", "5", "--eval-every", "0", "--batch-size", "8", "--seq-len", "32",
        "--warmup-steps", "2", "--microbatches", "2", "--bucket-mb", "0.05", "--check-replicas", "1"]
STAGES = {f"z{z}_{o}": ["--dp", "2", "--zero", str(z), f"--{o}-grad-reduce"]
          for z in (0, 1, 2, 3) for o in ("overlap", "no-overlap")}
# ZeRO-3 with full activation checkpointing: a layer's backward recomputes its forward, the layer gathered
STAGES["z3_full_overlap"] = ["--dp", "2", "--zero", "3", "--activation-checkpointing", "full"]
# pure bf16 with stochastic rounding and bf16 moments (the rounding noise must not see the overlap)
BF16 = {f"z2_bf16sr_{o}": ["--dp", "2", "--zero", "2", "--precision", "bf16-sr", "--moments", "bf16",
                           f"--{o}-grad-reduce"] for o in ("overlap", "no-overlap")}
BF16["z3_bf16sr_overlap"] = ["--dp", "2", "--zero", "3", "--precision", "bf16-sr", "--moments", "bf16"]
# a ZeRO-2 checkpoint (step 2) continued with ZeRO-0 at dp 2, and ZeRO-0's continued with ZeRO-2; ZeRO-3's
# continued with ZeRO-0, ZeRO-1's with ZeRO-3
RESUMED = {"z0_from_z2": ["--dp", "2", "--zero", "0"], "z2_from_z0": ["--dp", "2", "--zero", "2"],
           "z0_from_z3": ["--dp", "2", "--zero", "0"], "z3_from_z1": ["--dp", "2", "--zero", "3"]}
LOSS_TOL = 2e-5     # fp32 round-off through 5 steps (tests/core/test_layouts_equal_one_process.py's tolerance)


def _flags(cache_dir, out_dir, extra):
    return BASE + ["--cache-dir", cache_dir, "--out-dir", str(out_dir)] + extra


def _ckpt(out_dir, step: int) -> str:
    return str(out_dir / "checkpoints" / f"step_{step:08d}")


def log_collectives(rank: int) -> None:
    """In each worker: note in $ZERO_TEST_LOG/rank{rank}.txt each run's start ('run'), each
    collective a hook started in the backward ('start'), each phase 1 of a step ('phase1') and,
    after each micro-batch's backward, the elements ZeRO-2 still stages ('staged0': none) and
    the ZeRO-3 flat buffers still whole ('whole0': none); at each step's start, how many of the
    last step's reduced gradients are still alive ('kept0': none), unless they are the flat buffers'."""
    import weakref

    import train
    from nanohlat import comm, optim, pipeline
    from nanohlat.beyond import zero2, zero3
    path = os.path.join(os.environ["ZERO_TEST_LOG"], f"rank{rank}.txt")

    def noting(fn, what):
        def wrapper(*args, **kwargs):
            with open(path, "a") as f:
                f.write(what + "\n")
            return fn(*args, **kwargs)
        return wrapper
    train.train = noting(train.train, "run")
    # after each micro-batch's backward: the ZeRO-2 staging still held (each group's Staging, as the optimizer
    # makes them)
    states = []
    track = zero2.ZeroTwoDP.track
    zero2.ZeroTwoDP.track = lambda self, g: states.append(track(self, g)) or states[-1]
    backward = pipeline.PipelineRunner._backward

    def backward_then_note(self, i, *chunk):
        out = backward(self, i, *chunk)
        with open(path, "a") as f:
            held = sum(t.numel() for s in states for t in s.staged.values())
            held += sum(out.numel() + piece.numel() for s in states for _, out, piece in s.flight.values())
            whole = sum(s.flat.untyped_storage().nbytes() > 0 for s in states if isinstance(s, zero3.Shard))
            f.write(f"staged{held}\nwhole{whole}\n")
        return out
    pipeline.PipelineRunner._backward = backward_then_note
    reduced, reduce, run = [], optim.FlatAdamW.reduce_gradients, pipeline.PipelineRunner.run

    def reduce_and_note(self):
        grads = reduce(self)
        buffers = {g.grad.untyped_storage().data_ptr() for g in self.groups}
        reduced[:] = [weakref.ref(t) for t in grads if t.untyped_storage().data_ptr() not in buffers]
        return grads

    def run_and_note(self, *args, **kwargs):
        with open(path, "a") as f:
            f.write(f"kept{sum(r() is not None for r in reduced)}\n")
        return run(self, *args, **kwargs)
    pipeline.PipelineRunner.run = run_and_note
    comm.start_all_reduce = noting(comm.start_all_reduce, "start")
    comm.start_reduce_scatter = noting(comm.start_reduce_scatter, "start")
    optim.FlatAdamW.reduce_gradients = noting(reduce_and_note, "phase1")


@pytest.fixture(scope="module")
def stage_runs(cache_dir, tmp_path_factory):
    """Every run of STAGES (then RESUMED) in one group of 2 gloo workers; name -> (argv, out dir),
    and "log" -> rank 0's log_collectives, one list of events per run."""
    from dist_utils import run_layouts
    root = tmp_path_factory.mktemp("zero")
    runs = {name: _flags(cache_dir, root / name, extra + (["--save-every", "2"] if "_overlap" in name else []))
            for name, extra in (STAGES | BF16).items()}
    runs |= {name: _flags(cache_dir, root / name, extra + ["--resume", _ckpt(root / f"{name[-2:]}_overlap", 2)])
             for name, extra in RESUMED.items()}
    os.environ["ZERO_TEST_LOG"] = str(root)
    try:
        run_layouts(2, list(runs.values()), str(root / "errors"), setup=log_collectives)
    finally:
        del os.environ["ZERO_TEST_LOG"]
    with open(root / "rank0.txt") as f:
        per_run = f.read().split("run\n")[1:]
    return {name: (argv, root / name) for name, argv in runs.items()} | {
        "log": dict(zip(runs, (r.split() for r in per_run), strict=True))}


def test_overlap_starts_every_bucket_in_the_backward(stage_runs):
    """With overlap, every bucket's dp collective starts in the backward, before phase 1 (once
    per step, or per micro-batch with ZeRO-2: the ledger's calls, less the loss's all-reduce);
    without overlap, none does (ZeRO-2 then reduce-scatters in the backward, synchronously)."""
    log = stage_runs["log"]
    for name in STAGES:
        steps = " ".join(e for e in log[name] if not e.startswith(("staged", "whole"))).split("phase1")[:-1]
        assert len(steps) == 5, name
        started = [s.split().count("start") for s in steps]
        calls = _summary(stage_runs[name][1])["comm_calls"]
        buckets = calls["dp.all_reduce"] - 1 if name[:2] == "z0" else calls["dp.reduce_scatter"]
        buckets = buckets if "_overlap" in name else 0
        assert started == [buckets] * 5, (name, started)


def test_zero2_keeps_no_full_gradient_buffer_between_micro_batches(stage_runs):
    """After every micro-batch's backward every ZeRO-2 bucket has been reduce-scattered and its
    staging freed, in flight (overlap) or not: what stays is the 1/dp shard (grad_bytes, below)."""
    for name in ("z2_overlap", "z2_no-overlap", "z2_bf16sr_overlap", "z3_overlap", "z3_no-overlap"):
        staged = [e for e in stage_runs["log"][name] if e.startswith("staged")]
        assert staged == ["staged0"] * 10, (name, staged)      # 5 steps x 2 micro-batches


def test_a_steps_reduced_gradients_are_freed_before_the_next_step(stage_runs):
    """ZeRO-1's reduce-scatter makes each step a new fp32 shard of the gradients (1/dp of them):
    train.py frees it after the update, so the next step's forward and backward do not carry it."""
    for name in ("z1_overlap", "z1_no-overlap"):
        kept = [e for e in stage_runs["log"][name] if e.startswith("kept")]
        assert kept == ["kept0"] * 5, (name, kept)


def test_zero3_frees_every_layer_after_its_backward(stage_runs):
    """After every micro-batch's backward no ZeRO-3 flat buffer holds storage (each unit freed once
    its last gradient was in); between steps each rank keeps its shard (param_bytes, below)."""
    for name in ("z3_overlap", "z3_no-overlap", "z3_full_overlap"):
        whole = [e for e in stage_runs["log"][name] if e.startswith("whole")]
        assert whole == ["whole0"] * 10, (name, whole)


def _metrics(out_dir):
    from conftest import read_metrics
    return [(m["step"], m["loss"], m["grad_norm"]) for m in read_metrics(str(out_dir))]


def _summary(out_dir):
    with open(out_dir / "summary.json") as f:
        return json.load(f)


def test_every_zero_stage_trains_like_plain_data_parallelism(stage_runs):
    ref = _metrics(stage_runs["z0_no-overlap"][1])
    assert [s for s, _, _ in ref] == [1, 2, 3, 4, 5]
    for name in STAGES:
        for (s, loss, norm), (_, ref_loss, ref_norm) in zip(_metrics(stage_runs[name][1]), ref, strict=True):
            assert abs(loss - ref_loss) < LOSS_TOL, (name, s, loss, ref_loss)
            assert abs(norm - ref_norm) < 1e-4 * ref_norm, (name, s, norm, ref_norm)


@pytest.mark.parametrize("zero", ["z0", "z1", "z2", "z2_bf16sr", "z3"])
def test_overlapped_reduction_is_bitwise_the_same_and_moves_the_same_bytes(stage_runs, zero):
    """--overlap-grad-reduce only moves when each bucket's collective starts: the same
    losses and norms to the last bit, the same final weights, the same comm ledger."""
    import torch
    on, off = stage_runs[f"{zero}_overlap"][1], stage_runs[f"{zero}_no-overlap"][1]
    assert _metrics(on) == _metrics(off)
    a, b = _summary(on), _summary(off)
    # (not the process's peak memory, nor "checkpoints": the overlapped run also saved every 2 steps, and
    # what it records is each save's stall in seconds)
    timed = ("peak_memory", "checkpoints")
    assert {k: v for k, v in a.items() if k not in timed} == {k: v for k, v in b.items() if k not in timed}
    for rank in range(2):   # the weights and the optimizer state (ZeRO: each rank's shard of it)
        a = torch.load(f"{_ckpt(on, 5)}/shard_{rank:05d}.pt", weights_only=True)
        b = torch.load(f"{_ckpt(off, 5)}/shard_{rank:05d}.pt", weights_only=True)
        assert _same(a["model"], b["model"]) and _same(a["optim"], b["optim"]) and (rank or a["optim"])


def test_zero3_rounds_bf16_stochastically_as_zero2_does(stage_runs):
    """Pure bf16, stochastically rounded weights and moments: ZeRO-3's shards get the same noise as
    ZeRO-2's (it follows the element, not the layout: precision.py), so the losses agree to
    round-off (the grad norms too: the groups' squares are summed in another order)."""
    got, ref = _metrics(stage_runs["z3_bf16sr_overlap"][1]), _metrics(stage_runs["z2_bf16sr_overlap"][1])
    for (s, loss, norm), (_, ref_loss, ref_norm) in zip(got, ref, strict=True):
        assert abs(loss - ref_loss) < LOSS_TOL and abs(norm - ref_norm) < 1e-4 * ref_norm, (s, loss, ref_loss)


def _same(a, b) -> bool:
    """Bitwise equality of nested dicts / lists of tensors and numbers."""
    import torch
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def test_zero2_and_3_keep_half_the_bytes_and_the_plan_predicts_every_byte(stage_runs):
    from plan_utils import assert_run_matches_plan
    for name in ("z0_overlap", "z1_overlap", "z2_overlap", "z2_no-overlap", "z2_bf16sr_overlap", "z3_overlap",
                 "z3_no-overlap", "z3_bf16sr_overlap", "z3_full_overlap"):
        argv, out = stage_runs[name]
        assert_run_matches_plan(out, argv, 2)
    z0, z1, z2, z3 = (_summary(stage_runs[f"z{z}_overlap"][1]) for z in (0, 1, 2, 3))
    assert z2["grad_bytes"] <= 0.55 * z0["grad_bytes"] and z2["grad_bytes"] == 4 * (249_856 + 576) // 2
    # ZeRO-3 keeps the shard of the parameters too (and of the gradients and the optimizer state)
    assert z3["param_bytes"] <= 0.55 * z0["param_bytes"] and z3["param_bytes"] == 4 * (249_856 + 576) // 2
    assert (z3["grad_bytes"], z3["optimizer_bytes"]) == (z2["grad_bytes"], z2["optimizer_bytes"])
    assert z2["param_bytes"] == z1["param_bytes"] == z0["param_bytes"]
    # ZeRO-3 all-gathers the parameters twice per micro-batch instead of once after the step; with fp32
    # parameters and one micro-batch that is 1.5x plain data parallelism's bytes (tutorial chapter 3)
    assert z3["comm_wire_bytes"]["dp.all_gather"] == 2 * 2 * z1["comm_wire_bytes"]["dp.all_gather"]
    assert z3["comm_wire_bytes"]["dp.reduce_scatter"] == z2["comm_wire_bytes"]["dp.reduce_scatter"]
    assert z1["grad_bytes"] == z0["grad_bytes"]            # ZeRO-1 keeps the whole gradient buffer
    assert z2["optimizer_bytes"] == z1["optimizer_bytes"] == z0["optimizer_bytes"] // 2
    # ZeRO-2 reduce-scatters every micro-batch (2 here): twice ZeRO-1's gradient bytes on the wire
    assert z2["comm_wire_bytes"]["dp.reduce_scatter"] == 2 * z1["comm_wire_bytes"]["dp.reduce_scatter"]


@pytest.mark.parametrize("name", list(RESUMED))
def test_checkpoints_continue_in_another_zero_stage(stage_runs, name):
    """Steps 3-5 after a checkpoint of step 2 saved by another stage: the uninterrupted run's."""
    got, ref = _metrics(stage_runs[name][1]), _metrics(stage_runs["z0_no-overlap"][1])[2:]
    assert [s for s, _, _ in got] == [3, 4, 5]
    for (s, loss, _), (_, ref_loss, _) in zip(got, ref, strict=True):
        assert abs(loss - ref_loss) < LOSS_TOL, (name, s, loss, ref_loss)


@pytest.mark.parametrize("zero", ["z2", "z3"])
def test_a_zero2_or_3_checkpoint_continues_in_one_process(stage_runs, cache_dir, tmp_path, zero):
    import train
    from nanohlat.run import preflight
    resume = _ckpt(stage_runs[f"{zero}_overlap"][1], 2)
    layout = json.load(open(f"{resume}/manifest.json"))["layout"]
    assert (layout["zero"], layout["zero1"]) == (int(zero[1]), True)      # the stage it was saved by
    model_cfg, tcfg = recipe.parse_args(_flags(cache_dir, tmp_path / "one", ["--no-progress", "--resume", resume]))
    train.train(*preflight.inputs(model_cfg, tcfg))
    ref = _metrics(stage_runs["z0_no-overlap"][1])[2:]
    for (s, loss, _), (_, ref_loss, _) in zip(_metrics(tmp_path / "one"), ref, strict=True):
        assert abs(loss - ref_loss) < LOSS_TOL, (s, loss, ref_loss)


# ---------------------------------------------------------------------------
# Four ranks: ZeRO-2 beside tensor + sequence parallelism and beside pipeline parallelism
# ---------------------------------------------------------------------------

WORLD4 = {"tp2_dp2_sp_z2": ["--tp", "2", "--dp", "2", "--sequence-parallel", "--zero", "2"],
          "tp2_dp2_sp_z3": ["--tp", "2", "--dp", "2", "--sequence-parallel", "--zero", "3"],
          "pp2_dp2_z2": ["--pp", "2", "--dp", "2", "--zero", "2"]}


@pytest.fixture(scope="module")
def reference(cache_dir, tmp_path_factory):
    """One process, the same flags otherwise: (argv, out dir)."""
    import train
    from nanohlat.run import preflight
    out = tmp_path_factory.mktemp("zero_ref")
    argv = _flags(cache_dir, out, ["--no-progress"])
    train.train(*preflight.inputs(*recipe.parse_args(argv)))
    return argv, out


@pytest.fixture(scope="module")
def four_rank_runs(cache_dir, tmp_path_factory, stage_runs):
    """WORLD4's runs, and tp 2 x dp 2 ZeRO-2 continuing the dp 2 ZeRO-2 checkpoint of step 2."""
    from dist_utils import run_layouts
    root = tmp_path_factory.mktemp("zero4")
    runs = {name: _flags(cache_dir, root / name, extra) for name, extra in WORLD4.items()}
    runs["tp2_dp2_z2_from_dp2"] = _flags(cache_dir, root / "tp2_dp2_z2_from_dp2",
                                         ["--tp", "2", "--dp", "2", "--zero", "2", "--resume",
                                          _ckpt(stage_runs["z2_overlap"][1], 2)])
    run_layouts(4, list(runs.values()), str(root / "errors"))
    return {name: (argv, root / name) for name, argv in runs.items()}


@pytest.mark.parametrize("name", list(WORLD4))
def test_zero2_3_with_tensor_sequence_or_pipeline_parallelism_trains_like_one_process(four_rank_runs, reference,
                                                                                     name):
    """Losses and grad norms of one process (fp32 round-off), replicas checked every step
    (--check-replicas 1), and the comm ledger and kept bytes of the plan: ZeRO-2's and 3's tp
    sums of the SP norm gains run on the 1/dp shard (ZeRO-3: one per layer, and the final norm's)."""
    from plan_utils import assert_run_matches_plan
    argv, out = four_rank_runs[name]
    for (s, loss, norm), (_, ref_loss, ref_norm) in zip(_metrics(out), _metrics(reference[1]), strict=True):
        assert abs(loss - ref_loss) < LOSS_TOL, (name, s, loss, ref_loss)
        assert abs(norm - ref_norm) < 1e-4 * ref_norm, (name, s, norm, ref_norm)
    assert_run_matches_plan(out, argv, 4)


def test_a_zero2_checkpoint_continues_in_another_layout(four_rank_runs, reference):
    got, ref = _metrics(four_rank_runs["tp2_dp2_z2_from_dp2"][1]), _metrics(reference[1])[2:]
    assert [s for s, _, _ in got] == [3, 4, 5]
    for (s, loss, _), (_, ref_loss, _) in zip(got, ref, strict=True):
        assert abs(loss - ref_loss) < LOSS_TOL, (s, loss, ref_loss)


def test_eval_and_sample_read_a_zero3_checkpoint_as_the_zero0_one(stage_runs):
    """A ZeRO-3 checkpoint holds whole weights (export all-gathers the shards): loaded for
    inference (generate.load_model, the one-process load) it is ZeRO-0's model, to round-off."""
    import torch
    from nanohlat.device import get_device
    from nanohlat.serving.generate import load_model   # the loader of every command
    z3, _ = load_model(_ckpt(stage_runs["z3_overlap"][1], 5), get_device("cpu"))
    z0, _ = load_model(_ckpt(stage_runs["z0_overlap"][1], 5), get_device("cpu"))
    ref = dict(z0.named_parameters())
    for name, p in z3.named_parameters():
        assert torch.allclose(p, ref[name], rtol=0, atol=1e-5), name
    tokens = torch.arange(32).view(2, 16)
    assert torch.allclose(z3(tokens), z0(tokens), rtol=0, atol=1e-4)


# a row of --timeline's dp collectives: what it is, the collective, bytes, when issued, where
TIMELINE_ROW = re.compile(r"^  (bucket \d+|params \d+|loss|grad norm|\w+ \?)\s+(dp\.\w+)\s+([\d,]+)\s+([\d.]+)\s+"
                          r"(in [FBW]\d+|after the backward)")


def timeline_rows(text: str) -> list[tuple[str, str, int, float, str]]:
    """(what, collective, bytes, issued, where) of each dp collective a timeline.txt lists, in its order."""
    return [(w, op, int(b.replace(",", "")), float(t), at)
            for w, op, b, t, at in (m.groups() for m in map(TIMELINE_ROW.match, text.splitlines()) if m)]


def bucket_bytes(rows) -> dict:
    """{bucket number: its bytes} of the gradient buckets among `rows` (each bucket once per step here)."""
    return {w: b for w, _, b, _, _ in rows if w.startswith("bucket")}


def test_the_timeline_names_every_dp_collective_and_numbers_buckets_by_identity(cache_dir, tmp_path):
    """--timeline at dp 2 lists every collective of the last step on the dp group, named: each
    gradient bucket's, the loss's all-reduce, ZeRO-1's grad-norm all-reduce and all-gathers of
    the parameters; each the ledger's calls and bytes of a step (the first: the same traffic).
    With overlap the buckets are issued in the last backward, before it ends; without, all after
    it, the loss first. A bucket has the same number (and bytes) in both, though the order of
    issue differs: numbering rows by that order (the planted mistake) fails the same check. It
    times and changes nothing: the same losses, norms and weights bitwise and the same comm
    ledger as without --timeline."""
    import torch
    from dist_utils import run_layouts
    runs = {name: _flags(cache_dir, tmp_path / name, ["--dp", "2", "--steps", "3", "--save-every", "3",
                                                      "--check-replicas", "0"] + extra)
            for name, extra in (("on", ["--timeline"]), ("off", ["--timeline", "--no-overlap-grad-reduce"]),
                                ("plain", []), ("z1_on", ["--zero", "1", "--timeline"]),
                                ("z1_off", ["--zero", "1", "--timeline", "--no-overlap-grad-reduce"]))}
    run_layouts(2, list(runs.values()), str(tmp_path / "errors"))
    ledger = {name: {k: v for k, v in _summary(tmp_path / name).items() if k.startswith("comm_")} for name in runs}
    assert ledger["on"] == ledger["plain"] == ledger["off"] and ledger["on"]["comm_calls"]
    assert ledger["z1_on"] == ledger["z1_off"]
    assert _metrics(tmp_path / "on") == _metrics(tmp_path / "plain") == _metrics(tmp_path / "off")
    for rank in range(2):
        a, b = (torch.load(f"{_ckpt(tmp_path / n, 3)}/shard_{rank:05d}.pt", weights_only=True)
                for n in ("on", "plain"))
        assert _same(a["model"], b["model"]) and _same(a["optim"], b["optim"])
    rows = {}
    for name in ("on", "off", "z1_on", "z1_off"):
        text = (tmp_path / name / "timeline.txt").read_text()
        end = float(re.search(r"its backward ended at ([\d.]+) ms", text).group(1))
        rows[name] = r = timeline_rows(text)
        # every dp collective of a step, named: the ledger's calls and bytes, key by key
        for key, calls in ledger[name]["comm_calls"].items():
            if key.startswith("dp."):
                assert sum(op == key for _, op, _, _, _ in r) == calls, (key, text)
                assert sum(b for _, op, b, _, _ in r if op == key) == ledger[name]["comm_bytes"][key], (key, text)
        assert len(r) == sum(c for k, c in ledger[name]["comm_calls"].items() if k.startswith("dp.")), text
        assert not [w for w, *_ in r if "?" in w], text                          # each one named
        loss = [row for row in r if row[0] == "loss"]
        assert len(loss) == 1 and loss[0][1:3] == ("dp.all_reduce", 4) and loss[0][4] == "after the backward", text
        buckets = [row for row in r if row[0].startswith("bucket")]
        assert len(buckets) > 2 and len(bucket_bytes(buckets)) == len(buckets), text
        if name.startswith("z1"):
            assert [(w, op, b) for w, op, b, _, _ in r if w == "grad norm"] == [("grad norm", "dp.all_reduce", 4)]
            gathers = {w.replace("params", "bucket"): b for w, op, b, _, _ in r if op == "dp.all_gather"}
            assert gathers == bucket_bytes(r), text     # bucket k's new weights: as many bytes as its fp32 grads
        during = [row for row in buckets if row[4].startswith("in B") and row[3] <= end]
        if name.endswith("on"):
            assert len(during) == len(buckets) and all(row[4] == "in B1" for row in during), text
            assert f"{len(buckets)} issued during the backward, 0 after it" in text
        else:
            assert not during and r[0][0] == "loss", text     # the loss's all-reduce, then phase 1
            assert f"0 issued during the backward, {len(buckets)} after it" in text
        assert "blocked in the loss's all-reduce" in text and "ms outside them (the host's own work)" in text
        assert re.search(r"^  bucket 0: buffer 0 (\[0, |columns \[0, )", text, re.M), text
    for on, off in (("on", "off"), ("z1_on", "z1_off")):
        assert bucket_bytes(rows[on]) == bucket_bytes(rows[off]), (rows[on], rows[off])
        # the negative control: numbered by the order of issue, the same buckets get other numbers
        by_issue = {name: {n: b for n, (_, _, b, _, _) in enumerate(x for x in rows[name] if x[0].startswith("bucket"))}
                    for name in (on, off)}
        assert by_issue[on] != by_issue[off], by_issue


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_a_bucket_is_named_by_its_place_in_the_buffers_not_by_when_it_goes(zero):
    """CommTrace.name, in one process: every bucket of every flat gradient buffer, told in reverse
    order, gets the number of its place (buffer order, then bucket order), by its view of the
    buffer (plain dp) or the (buffer, k) its caller says (ZeRO); a copy of a bucket, which says
    nothing, is 'bucket ?' (named by where it lies, not by how many came before it); ZeRO's
    all-gathers of a kept shard's columns are 'params k'."""
    import torch
    from nanohlat import comm, device as devicelib, mesh as meshlib
    from nanohlat.model import Transformer, init_weights
    from nanohlat.run import build
    from nanohlat.tools.comm_trace import CommTrace
    model_cfg, tcfg = recipe.parse_args(TINY + ["--n-layers", "2", "--zero", str(zero), "--bucket-mb", "0.05"])
    model = Transformer(model_cfg)
    init_weights(model, tcfg.seed)
    opt = build.optimizer(model, meshlib.Mesh(1, 1, 1, ledger=comm.CommLedger()), tcfg, devicelib.get_device("cpu"))
    trace = CommTrace(None, opt)
    want, n = [], 0
    for g in opt.groups:
        for k, ranges in enumerate(g.dp.buckets(g.padded)):
            (lo, hi), what = ranges[0], (None if zero == 0 else (g.grad, k))
            want.append((f"bucket {n}", g.grad[lo:hi], what, lo, hi, g))
            n += 1
    assert n > len(opt.groups) >= 2
    for label, view, what, lo, hi, g in reversed(want):
        assert trace.name("dp.all_reduce", view, what) == label
        assert trace.name("dp.all_reduce", view.clone(), None) == "bucket ?"     # a copy: no place
        if zero:
            shard = g.dp_state.param_shard if g.dp_state.param_shard is not None else g.master
            assert trace.name("dp.all_gather", shard[lo:hi], None) == label.replace("bucket", "params")
    assert trace.name("dp.all_reduce", torch.zeros(()), "loss") == "loss"
