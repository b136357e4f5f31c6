"""Checkpoints: a resumed run is the same run, any checkpoint loads into any
layout, and no crash or bad file ever loads silently (issue 9).

What "the same run" means here. One process in fp32 on the CPU is
deterministic, and so is a fixed layout over gloo (same ranks, same order of
additions), so an interrupted-and-resumed run must log *bit-identical*
losses: any drift means some state (optimizer step count, Adam moments, the
lr schedule, the data position, an RNG) was not restored. A checkpoint loaded
into a *different* layout adds the same numbers in another order, so it
agrees to fp32 round-off only (the tolerance of test_layouts_equal_one_process.py).

How crashes are made deterministic, without a test-only user flag:
  * in-process: `saving._atomic_write` (nanohlat/run/checkpoint/saving.py:
    every file a save writes goes through it) is replaced by one that raises at a chosen write of a chosen
    save, after writing half a shard or before writing the manifest or the
    `latest` pointer. Nothing in save() or train() catches or cleans up, so
    the files on disk are exactly those a crash at that instant leaves;
  * across processes: the test runs `train.main` with its launcher's workers
    running `_fault_worker`, which plants a real `os.kill(SIGKILL)` in one
    rank at one point (half-way through writing its shard of step 4, or at
    the optimizer step of step 2), on the first start only.

Expensive runs are shared: one process runs in-process (~1 s each), the
tp=2 x pp=2 x dp=2 + ZeRO-1 runs and their resharded continuations run in one
set of 8 gloo workers, and only the two launcher tests start workers of their own.
"""

from __future__ import annotations

import errno
import io
import json
import os
import shutil
import signal
import sys
import time

import pytest
import torch

from conftest import read_metrics
from dist_utils import run_layouts

LOSS_TOL = 2e-5    # another layout: fp32 round-off, as in test_layouts_equal_one_process.py
STEPS, N = 6, 3    # runs of 2N steps, interrupted after step N
BASE = ["--preset", "tiny", "--steps", str(STEPS), "--eval-every", "0", "--batch-size", "8", "--seq-len", "32",
        "--warmup-steps", "2", "--no-progress", "--threads", "1"]
LAYOUT8 = ["--tp", "2", "--pp", "2", "--dp", "2", "--zero1", "--sequence-parallel", "--microbatches", "2"]
RESHARD8 = {"pp4_dp2_zero1": ["--pp", "4", "--dp", "2", "--zero1"],    # tp 2 -> 1, pp 2 -> 4
            "tp4_dp2": ["--tp", "4", "--dp", "2"]}                       # tp 2 -> 4, pp 2 -> 1, no ZeRO


def flags(cache_dir, out_dir, *extra):
    return BASE + ["--cache-dir", cache_dir, "--out-dir", str(out_dir)] + [str(e) for e in extra]


def ckpt(out_dir, step: int) -> str:
    return os.path.join(str(out_dir), "checkpoints", f"step_{step:08d}")


def train_here(argv):
    """One process, in this process (no torch.distributed)."""
    import train
    from nanohlat import recipe
    from nanohlat.run import preflight
    model_cfg, tcfg = recipe.parse_args(argv)
    return train.train(*preflight.inputs(model_cfg, tcfg))


def losses(out_dir) -> dict:
    return {m["step"]: m["loss"] for m in read_metrics(str(out_dir))}


def assert_bit_identical(got_dir, ref_dir):
    got, ref = losses(got_dir), losses(ref_dir)
    assert sorted(got) == list(range(1, STEPS + 1)), sorted(got)
    assert got == ref     # exact float equality: the resumed run *is* the run


def assert_close_after(got_dir, ref_dir, start: int):
    got, ref = losses(got_dir), losses(ref_dir)
    assert sorted(got) == list(range(start + 1, STEPS + 1)), sorted(got)
    for s in got:
        assert abs(got[s] - ref[s]) < LOSS_TOL, (s, got[s], ref[s])


# ---------------------------------------------------------------------------
# Shared runs
# ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def one(cache_dir, tmp_path_factory):
    """One process: 2N steps straight, and the same run stopped after N, then started again."""
    root = tmp_path_factory.mktemp("one")
    train_here(flags(cache_dir, root / "full", "--save-every", 2, "--keep-last", 2))
    train_here(flags(cache_dir, root / "resumed", "--stop-after", N))
    train_here(flags(cache_dir, root / "resumed"))
    return root


@pytest.fixture(scope="module")
def eight(cache_dir, tmp_path_factory):
    """tp=2 x pp=2 x dp=2 + ZeRO-1 (8 gloo workers): 2N steps straight; stopped
    after N; the stopped run's checkpoint continued in two other 8-rank layouts;
    then the stopped run started again."""
    root = tmp_path_factory.mktemp("eight")
    at_n = ckpt(root / "resumed", N)
    runs = [flags(cache_dir, root / "full", *LAYOUT8),
            flags(cache_dir, root / "resumed", *LAYOUT8, "--stop-after", N)]
    runs += [flags(cache_dir, root / name, *extra, "--resume", at_n) for name, extra in RESHARD8.items()]
    runs += [flags(cache_dir, root / "resumed", *LAYOUT8)]
    run_layouts(8, runs, str(root / "errors"))
    return root


# ---------------------------------------------------------------------------
# Resume is exact
# ---------------------------------------------------------------------------

def test_one_process_resume_is_bit_identical(one):
    assert_bit_identical(one / "resumed", one / "full")
    manifest = json.load(open(os.path.join(ckpt(one / "resumed", N), "manifest.json")))
    assert manifest["step"] == N and manifest["tokens"] == N * 8 * 32
    assert manifest["schedule"]["optimizer_step"] == N and manifest["data"]["next_step"] == N
    assert manifest["layout"] == {"tp": 1, "pp": 1, "dp": 1, "cp": 1,
                                  "zero": 0, "zero1": False, "world": 1, "virtual_stages": 1}


def test_the_manifest_names_only_the_generator_a_shard_holds(one, cache_dir, tmp_path):
    """The manifest's "rng" describes what each shard's "rng" holds: the torch CPU
    generator, no stochastic-rounding one (there is none). A checkpoint saved while
    it still named one resumes as exactly: the description is never read."""
    from nanohlat.run.checkpoint import manifest as manifest_lib
    path = ckpt(one / "resumed", N)
    manifest = json.load(open(os.path.join(path, "manifest.json")))
    shard = torch.load(os.path.join(path, "shard_00000.pt"), weights_only=True)
    assert manifest["rng"] == manifest_lib.RNG and "torch CPU generator" in manifest["rng"]
    assert "stochastic-rounding generator" not in manifest["rng"] and sorted(shard["rng"]) == ["torch_cpu"]
    old = tmp_path / "old"
    train_here(flags(cache_dir, old, "--stop-after", N))
    mpath = os.path.join(ckpt(old, N), "manifest.json")
    saved = json.load(open(mpath))
    saved["rng"] = "per rank, in its shard (torch CPU generator, stochastic-rounding generator)"   # as saved before
    with open(mpath, "w") as f:
        json.dump(saved, f)
    train_here(flags(cache_dir, old))
    assert_bit_identical(old, one / "full")


def test_keep_last_and_latest_pointer(one):
    """--save-every 2 --keep-last 2 over 6 steps: steps 4 and 6 remain, `latest` names 6."""
    root = one / "full" / "checkpoints"
    assert sorted(n for n in os.listdir(root) if not n.startswith(".")) == \
        ["latest", "step_00000004", "step_00000006"]
    assert (root / "latest").read_text() == "step_00000006"


def test_bf16_stochastic_rounding_resume_is_bit_identical(cache_dir, tmp_path):
    """Pure bf16 with software stochastic rounding: the SR generator's state is restored too."""
    sr = ["--precision", "bf16-sr"]
    train_here(flags(cache_dir, tmp_path / "full", *sr))
    train_here(flags(cache_dir, tmp_path / "resumed", *sr, "--stop-after", N))
    train_here(flags(cache_dir, tmp_path / "resumed", *sr))
    assert_bit_identical(tmp_path / "resumed", tmp_path / "full")


def test_tp2_pp2_dp2_zero1_resume_is_bit_identical(eight):
    assert_bit_identical(eight / "resumed", eight / "full")
    shards = sorted(n for n in os.listdir(ckpt(eight / "resumed", N)) if n.endswith(".pt"))
    assert shards == [f"shard_{r:05d}.pt" for r in range(8)]     # one per rank


# ---------------------------------------------------------------------------
# Resharding: any checkpoint into any layout
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(RESHARD8))
def test_8_rank_checkpoint_continues_in_another_layout(eight, name):
    assert_close_after(eight / name, eight / "full", N)


def test_8_rank_checkpoint_continues_in_one_process(eight, cache_dir, tmp_path):
    train_here(flags(cache_dir, tmp_path, "--resume", ckpt(eight / "resumed", N)))
    assert_close_after(tmp_path, eight / "full", N)


def test_sample_py_loads_an_8_rank_run(eight, capsys):
    """`python sample.py --out-dir DIR` on the tp=2 x pp=2 x dp=2 + ZeRO-1 run (its main(), here)."""
    sample = pytest.importorskip("sample", reason="sample.py not written yet (its loader is tested below)")
    assert sample.main(["--out-dir", str(eight / "full"), "--max-new-tokens", "8", "--prompt", "def "]) == 0
    assert capsys.readouterr().out.startswith("def ")


def test_the_inference_load_equals_the_training_weights(eight, one):
    """The 8-rank run's final weights, stitched into one model, are the one-process run's (round-off)."""
    from nanohlat import device
    cpu = device.get_device("cpu")
    from nanohlat.serving.generate import load_model   # the loader of every command
    got, manifest = load_model(str(eight / "full"), cpu)
    ref, _ = load_model(str(one / "full"), cpu)
    assert manifest["layout"] == {"tp": 2, "pp": 2, "dp": 2, "cp": 1,
                                  "zero": 1, "zero1": True, "world": 8, "virtual_stages": 1}
    ref_params = dict(ref.named_parameters())
    for name, p in got.named_parameters():
        assert (p - ref_params[name]).abs().max().item() < 1e-4, name


# ---------------------------------------------------------------------------
# Crashes while saving leave the previous checkpoint usable
# ---------------------------------------------------------------------------

class Crash(Exception):
    """Stands for the process dying: nothing in save() or train() catches it."""


def crash_on_write(real, step: int, nth: int, half: bool):
    """An _atomic_write that dies at the nth file (0: shard, 1: the tokenizer's copy, 2: manifest, 3: `latest`)
    of the save of `step`, after writing half of it (half=True) or before writing."""
    seen = []

    def write(path, fn):
        if f".tmp_step_{step:08d}" in path or seen:
            seen.append(path)
            if len(seen) - 1 == nth:
                if half:
                    buf = io.BytesIO()
                    fn(buf)
                    with open(path + ".partial", "wb") as f:
                        f.write(buf.getvalue()[:len(buf.getvalue()) // 2])
                raise Crash(path)
        return real(path, fn)
    return write


@pytest.mark.parametrize("point", ["half_a_shard", "before_manifest", "before_latest"])
def test_crash_while_saving_leaves_a_resumable_run(point, one, cache_dir, tmp_path, monkeypatch):
    """Crash while saving step 4 (--save-every 2), then start again: the run resumes
    from step 2 (or from step 4 if only the `latest` pointer was missing), and its
    losses are the uninterrupted run's, bit for bit."""
    from nanohlat.run import checkpoint
    from nanohlat.run.checkpoint import saving
    nth, half = {"half_a_shard": (0, True), "before_manifest": (2, False), "before_latest": (3, False)}[point]
    argv = flags(cache_dir, tmp_path, "--save-every", 2, "--keep-last", 2)
    with monkeypatch.context() as m:
        m.setattr(saving, "_atomic_write", crash_on_write(saving._atomic_write, 4, nth, half))
        with pytest.raises(Crash):
            train_here(argv)
    expect = 4 if point == "before_latest" else 2
    assert checkpoint.latest(str(tmp_path)) == ckpt(tmp_path, expect)
    if point == "half_a_shard":
        assert os.path.isfile(os.path.join(tmp_path, "checkpoints", ".tmp_step_00000004", "shard_00000.pt.partial"))
    summary = train_here(argv)
    assert len(summary["losses"]) == STEPS - expect
    assert_bit_identical(tmp_path, one / "full")
    assert not [n for n in os.listdir(tmp_path / "checkpoints") if n.startswith(".")]   # debris cleared


def test_going_back_to_an_older_checkpoint_keeps_the_newer_ones_aside(one, cache_dir, tmp_path, capsys):
    """--resume PATH to step 3 of a finished run, in the same out-dir: the next save
    (step 4) becomes the run's head; step 6, from the abandoned future, is moved
    (with the metrics that led to it) into checkpoints/abandoned_*/, not deleted."""
    shutil.copytree(one / "resumed", tmp_path / "run")
    train_here(flags(cache_dir, tmp_path / "run", "--resume", ckpt(tmp_path / "run", N), "--stop-after", 4))
    from nanohlat.run import checkpoint
    assert [os.path.basename(p) for p in checkpoint.list_checkpoints(str(tmp_path / "run"))] == \
        ["step_00000003", "step_00000004"]
    assert sorted(losses(tmp_path / "run")) == [1, 2, 3, 4]
    aside = [n for n in os.listdir(tmp_path / "run" / "checkpoints") if n.startswith("abandoned_")]
    assert len(aside) == 1
    kept = tmp_path / "run" / "checkpoints" / aside[0]
    assert sorted(os.listdir(kept)) == ["metrics.jsonl", "step_00000006"]
    assert sorted(losses(kept)) == list(range(1, STEPS + 1))          # the abandoned line's records, whole
    checkpoint.ShardSet(str(kept / "step_00000006"))                   # and its checkpoint, still valid
    assert "newer checkpoint(s) step_00000006 and their metrics are kept in" in capsys.readouterr().err


# ---------------------------------------------------------------------------
# Launcher: a dead worker stops the job (or restarts it) promptly
# ---------------------------------------------------------------------------

def _fault_worker(*args, **kwargs):
    """preflight.worker with one SIGKILL (or a full disk, or a crash) planted, in rank fault["rank"], first start only.
    Runs in each worker process that `launch.spawn` starts; the fault comes from
    the test through the environment (the only way into a spawned worker that
    does not touch train.py's flags)."""
    from nanohlat.run import launch, preflight
    from nanohlat.run.checkpoint import saving
    from nanohlat import optim
    fault = json.loads(os.environ["TEST_CHECKPOINT_FAULT"])

    def die():
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    if int(os.environ["RANK"]) == fault["rank"] and launch.restart_count() == 0:
        if fault["at"] == "save":        # half-way through writing this rank's shard of a save
            real = saving._atomic_write

            def write(path, fn):
                if f".tmp_step_{fault['step']:08d}" in path:
                    buf = io.BytesIO()
                    fn(buf)
                    with open(path + ".partial", "wb") as f:
                        f.write(buf.getvalue()[:len(buf.getvalue()) // 2])
                        f.flush()
                    die()
                return real(path, fn)
            saving._atomic_write = write
        elif fault["at"] == "full disk":     # the disk fills while this rank writes its shard of a save
            real = saving._atomic_write

            def write(path, fn):
                if f".tmp_step_{fault['step']:08d}" in path and "shard_" in path:
                    return real(path, lambda f: fn(_FullDisk(f, 100)))
                return real(path, fn)
            saving._atomic_write = write
        elif fault["at"] == "crash":         # a bug: an unexpected exception at the first optimizer step
            def reduce_gradients(self):
                raise ZeroDivisionError("planted by the test")
            optim.FlatAdamW.reduce_gradients = reduce_gradients
        else:                            # at the optimizer step of step fault["step"] (1-based): its first phase
            real_reduce, calls = optim.FlatAdamW.reduce_gradients, []

            def reduce_gradients(self):
                calls.append(1)
                if len(calls) == fault["step"]:
                    die()
                return real_reduce(self)
            optim.FlatAdamW.reduce_gradients = reduce_gradients
    return preflight.worker(*args, **kwargs)


def run_main_with_fault(fault: dict, argv: list[str], monkeypatch) -> tuple[int, float]:
    """train.main(argv) in this process, its launcher's workers running
    _fault_worker (preflight.main hands the module-level `preflight.worker` to launch.spawn)."""
    import train
    from nanohlat.run import preflight
    monkeypatch.setenv("TEST_CHECKPOINT_FAULT", json.dumps(fault))
    monkeypatch.setattr(preflight, "worker", _fault_worker)
    t0 = time.time()
    return train.main(argv), time.time() - t0


@pytest.mark.slow
def test_worker_killed_while_saving_is_restarted_and_finishes(one, cache_dir, tmp_path, monkeypatch, capfd):
    """--nproc 2 --tp 2 --max-restarts 1: rank 1 is SIGKILLed half-way through writing
    its shard of step 4. The launcher restarts both workers, they resume from step 2
    (the half-written step 4 is ignored), and the run finishes with the losses of the
    uninterrupted run (one process; tp=2 adds in another order: round-off)."""
    argv = flags(cache_dir, tmp_path, "--nproc", 2, "--tp", 2, "--save-every", 2, "--max-restarts", 1)
    code, _ = run_main_with_fault({"rank": 1, "at": "save", "step": 4}, argv, monkeypatch)
    out, err = capfd.readouterr()
    assert code == 0, out[-2000:] + err[-3000:]
    assert f"resumed from {ckpt(tmp_path, 2)} at step 2" in out
    assert_close_after(tmp_path, one / "full", 0)
    from nanohlat.run import checkpoint
    assert checkpoint.latest(str(tmp_path)) == ckpt(tmp_path, STEPS)


@pytest.mark.slow
def test_dead_worker_stops_the_job_and_is_named(cache_dir, tmp_path, monkeypatch, capfd):
    """Without restarts, rank 1 SIGKILLed at step 2 ends the whole job promptly
    (rank 0 is left waiting in a collective: no hang) with an error naming rank 1."""
    argv = flags(cache_dir, tmp_path, "--nproc", 2, "--dp", 2)
    code, seconds = run_main_with_fault({"rank": 1, "at": "step", "step": 2}, argv, monkeypatch)
    err = capfd.readouterr().err
    assert code == 1
    assert "error: rank 1 failed with exit code -9 (signal SIGKILL)" in err, err[-3000:]
    assert seconds < 60


# ---------------------------------------------------------------------------
# NaN / inf steps
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("zero", ["0", "3"])
def test_a_nan_step_is_skipped_with_a_warning(cache_dir, tmp_path, monkeypatch, capsys, zero):
    """NaN gradients injected into step 3 only: warning, the update is skipped (the
    weights and Adam moments saved after step 3 equal those after step 2, and so
    does the optimizer's step count), and the run goes on. ZeRO-3 too, whose kept
    shard is the weights (zero3.py; one process: the shard is all of it)."""
    from nanohlat import optim, pipeline
    real_run, calls = pipeline.PipelineRunner.run, []

    def run(self, *args, **kwargs):
        loss = real_run(self, *args, **kwargs)
        calls.append(1)
        if len(calls) == 3:
            loss = loss * float("nan")
        return loss

    real_reduce = optim.FlatAdamW.reduce_gradients

    def reduce_gradients(self):   # the optimizer step's first phase
        if len(calls) == 3:   # the gradients live in the optimizer's fp32 buffers
            for g in self.groups:
                g.grad.fill_(float("nan"))
        return real_reduce(self)
    monkeypatch.setattr(pipeline.PipelineRunner, "run", run)
    monkeypatch.setattr(optim.FlatAdamW, "reduce_gradients", reduce_gradients)
    train_here(flags(cache_dir, tmp_path, "--steps", 5, "--save-every", 1, "--keep-last", 0, "--max-bad-steps", 2,
                     "--zero", zero))
    assert "warning: step 3 had a non-finite loss or gradient; the update was skipped" in capsys.readouterr().err
    shard = {s: torch.load(os.path.join(ckpt(tmp_path, s), "shard_00000.pt"), weights_only=True) for s in (2, 3, 4)}
    for name, w in shard[2]["model"].items():
        assert torch.equal(w, shard[3]["model"][name]), name
        assert torch.equal(shard[2]["optim"][name]["exp_avg"], shard[3]["optim"][name]["exp_avg"]), name
    assert not torch.equal(shard[3]["model"]["embed.weight"], shard[4]["model"]["embed.weight"])
    step_count = {s: json.load(open(os.path.join(ckpt(tmp_path, s), "manifest.json")))["schedule"]["optimizer_step"]
                  for s in (2, 3, 4)}
    assert step_count == {2: 2, 3: 2, 4: 3}      # Adam's bias correction does not count the skipped step
    assert sorted(losses(tmp_path)) == [1, 2, 3, 4, 5]


def test_non_finite_steps_in_a_row_stop_the_run(cache_dir, tmp_path, capsys):
    """An absurd --lr blows the weights up after step 1; every later gradient is
    NaN. --max-bad-steps 2 stops the run at step 3 with one clear line, exit 2."""
    import train
    argv = flags(cache_dir, tmp_path, "--lr", "1e30", "--min-lr", 0, "--warmup-steps", 1, "--max-bad-steps", 2)
    assert train.main(argv) == 2
    err = capsys.readouterr().err
    assert "warning: step 2 had a non-finite loss or gradient" in err
    assert "error: 2 steps in a row had a non-finite loss or gradient (by step 3)" in err
    assert sorted(losses(tmp_path)) == [1, 2, 3]


def test_a_run_stopped_by_max_bad_steps_saves_its_last_good_step_and_resumes_from_it(one, cache_dir, tmp_path,
                                                                                       capsys, monkeypatch):
    """Steps 4 and 5 non-finite (their losses NaN), --max-bad-steps 2: the run stops itself at
    step 5, exit 2, and first saves what it holds, the weights and Adam state of step 3 (the
    two updates were skipped), as step 3's checkpoint: the one a run that saved at step 3
    wrote (one/resumed: --stop-after 3), manifest and shards. It exited 2 without saving, its
    line pointing at a checkpoint "saved before the trouble" that did not exist. --resume auto
    continues from it with the losses of that run, bit for bit (and of the run never stopped)."""
    import train
    from nanohlat import pipeline
    from nanohlat.run import checkpoint
    real_run, calls = pipeline.PipelineRunner.run, []

    def run(self, *args, **kwargs):
        loss = real_run(self, *args, **kwargs)
        calls.append(1)
        return loss * float("nan") if len(calls) in (4, 5) else loss
    monkeypatch.setattr(pipeline.PipelineRunner, "run", run)
    out = tmp_path / "run"
    assert train.main(flags(cache_dir, out, "--max-bad-steps", 2)) == 2
    err = capsys.readouterr().err
    assert "error: 2 steps in a row had a non-finite loss or gradient (by step 5); stopping at --max-bad-steps 2" \
        in err and err.count("error:") == 1, err
    assert f"the weights are those of step 3, the last good one: saved in {ckpt(out, 3)}. " in err, err
    assert "--resume auto continues from there" in err
    assert [os.path.basename(p) for p in checkpoint.list_checkpoints(str(out))] == ["step_00000003"]
    mine, theirs = (checkpoint.read_manifest(ckpt(d, N)) for d in (out, one / "resumed"))
    for key in ("step", "tokens", "schedule", "layout"):
        assert mine[key] == theirs[key], key
    shards = [torch.load(os.path.join(ckpt(d, N), "shard_00000.pt"), weights_only=True) for d in (out, one / "resumed")]

    def same(a, b) -> bool:
        if isinstance(a, dict):
            return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
        return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
    for section in ("model", "optim", "rng"):
        assert same(shards[0][section], shards[1][section]), section
    monkeypatch.undo()
    assert train.main(flags(cache_dir, out, "--resume", "auto")) == 0
    assert losses(out) == losses(one / "resumed") == losses(one / "full")


def test_resume_auto_never_starts_from_scratch_over_a_runs_metrics(cache_dir, tmp_path, capsys):
    """An out-dir with metrics.jsonl records and no complete checkpoint (a run that saved nothing):
    --resume auto started from scratch and replaced them. Refused now, naming them; --resume never
    --overwrite starts again."""
    import train
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 6.2}\n{"step": 2, "loss": 6.1}\n')
    assert train.main(flags(cache_dir, out, "--resume", "auto")) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"error: --out-dir {out} holds a run's metrics.jsonl (2 records) but no complete checkpoint "
                   f"to continue from: --resume auto would start from scratch and replace them; --resume never "
                   f"--overwrite starts again, or choose another --out-dir"), err
    assert (out / "metrics.jsonl").read_text().count("\n") == 2
    assert train.main(flags(cache_dir, out, "--resume", "never", "--overwrite", "--steps", 1)) == 0


def test_nan_checks_are_off_while_neuron_extracts_graphs(cache_dir, tmp_path, monkeypatch):
    """neuron_parallel_compile runs the script on zero-valued tensors: no stopping then."""
    monkeypatch.setenv("NEURON_EXTRACT_GRAPHS_ONLY", "1")
    summary = train_here(flags(cache_dir, tmp_path, "--lr", "1e30", "--min-lr", 0, "--warmup-steps", 1,
                               "--max-bad-steps", 2))
    assert summary["step"] == STEPS


# ---------------------------------------------------------------------------
# --resume never / --overwrite
# ---------------------------------------------------------------------------

def test_resume_never_refuses_an_existing_run_and_overwrite_replaces_it(one, cache_dir, tmp_path, capsys):
    import train
    from nanohlat.run import checkpoint
    run = tmp_path / "run"
    shutil.copytree(one / "full", run)
    assert train.main(flags(cache_dir, run, "--resume", "never", "--steps", 2)) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --out-dir") and "--overwrite" in err and err.count("\n") == 1
    assert checkpoint.latest(str(run)) == ckpt(run, STEPS)          # untouched
    assert train.main(flags(cache_dir, run, "--resume", "never", "--overwrite", "--steps", 2)) == 0
    assert [os.path.basename(p) for p in checkpoint.list_checkpoints(str(run))] == ["step_00000002"]
    assert sorted(losses(run)) == [1, 2]


# ---------------------------------------------------------------------------
# Corrupt, partial or mismatched checkpoints: one clear line, never a load
# ---------------------------------------------------------------------------

def _break(path: str, how: str) -> str:
    """Damage the checkpoint at `path`; returns the file the error must name."""
    shard3, manifest = os.path.join(path, "shard_00003.pt"), os.path.join(path, "manifest.json")
    if how == "missing shard":
        os.remove(shard3)
    elif how == "truncated shard":
        with open(shard3, "r+b") as f:
            f.truncate(os.path.getsize(shard3) // 2)
    elif how == "corrupt shard":                       # same size, flipped bytes
        with open(shard3, "r+b") as f:
            f.seek(os.path.getsize(shard3) // 2)
            b = f.read(16)
            f.seek(-16, 1)
            f.write(bytes(x ^ 0xFF for x in b))
    elif how == "truncated manifest":
        with open(manifest, "r+b") as f:
            f.truncate(os.path.getsize(manifest) // 2)
        return manifest
    elif how == "shard dropped from the manifest":     # consistent files, but a tensor chunk is nowhere
        m = json.load(open(manifest))
        del m["files"]["shard_00001.pt"]
        os.remove(os.path.join(path, "shard_00001.pt"))
        json.dump(m, open(manifest, "w"))
        return path
    return shard3


@pytest.mark.parametrize("how", ["missing shard", "truncated shard", "corrupt shard", "truncated manifest",
                                 "shard dropped from the manifest"])
def test_damaged_checkpoint_is_a_clear_error(eight, tmp_path, how):
    from nanohlat import device
    from nanohlat.config import UserError
    path = str(tmp_path / "step")
    shutil.copytree(ckpt(eight / "full", STEPS), path)
    named = _break(path, how)
    with pytest.raises(UserError) as e:
        from nanohlat.serving.generate import load_model   # the loader of every command
        load_model(path, device.get_device("cpu"))
    assert named in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("how, extra", [("corrupt shard", []),                  # found by the loader (one process)
                                        ("corrupt shard", ["--nproc", "2"]),     # by main, before workers start
                                        ("truncated shard", ["--nproc", "2"])])
def test_damaged_checkpoint_stops_train_py_with_one_line(how, extra, eight, cache_dir, tmp_path, capsys):
    """--resume auto on a run whose newest checkpoint is damaged: one line, exit 2, nothing loaded."""
    import train
    run = tmp_path / "run"
    shutil.copytree(ckpt(eight / "full", STEPS), ckpt(run, STEPS))
    named = _break(ckpt(run, STEPS), how)
    assert train.main(flags(cache_dir, run, "--steps", 8, *extra)) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and named in err and err.count("\n") == 1, err


def test_checkpoint_of_another_model_shape_is_refused(one, cache_dir, tmp_path, capsys):
    import train
    from nanohlat.run import checkpoint
    from nanohlat.config import UserError
    run = tmp_path / "run"
    shutil.copytree(one / "full", run)
    assert train.main(flags(cache_dir, run, "--steps", 8, "--d-model", 32, "--n-heads", 4, "--n-kv-heads", 4)) == 2
    err = capsys.readouterr().err
    assert "different model shape (d_model 64 vs 32" in err and "manifest.json" in err and err.count("\n") == 1
    # the library call refuses too (train() under a launcher does not go through main's check)
    from nanohlat import device
    from nanohlat import recipe
    from nanohlat.model import Transformer
    from nanohlat.mesh import Mesh
    from nanohlat.optim import FlatAdamW
    model_cfg, tcfg = recipe.parse_args(flags(cache_dir, run, "--n-layers", 2))
    model = Transformer(model_cfg)
    with pytest.raises(UserError, match="different model shape"):
        checkpoint.load(ckpt(run, STEPS), model, FlatAdamW(model, Mesh(1, 1, 1), tcfg, device.get_device("cpu")),
                        Mesh(1, 1, 1), device.get_device("cpu"))


# ---------------------------------------------------------------------------
# A full disk during a save
# ---------------------------------------------------------------------------

class _FullDisk:
    """A file whose disk fills after `room` bytes: write raises ENOSPC, as the OS does."""

    def __init__(self, f, room: int):
        self.f, self.room = f, room

    def write(self, b):
        if len(b) > self.room:
            raise OSError(errno.ENOSPC, "No space left on device", getattr(self.f, "name", None))
        self.room -= len(b)
        return self.f.write(b)

    def __getattr__(self, name):
        return getattr(self.f, name)


def _fill_disk_at(monkeypatch, step: int, file: str = "shard_"):
    """saving._atomic_write: the disk fills half-way through `file` of step `step`'s save."""
    from nanohlat.run.checkpoint import saving
    real = saving._atomic_write

    def write(path, fn):
        if f".tmp_step_{step:08d}" in path and os.path.basename(path).startswith(file):
            return real(path, lambda f: fn(_FullDisk(f, 100)))
        return real(path, fn)
    monkeypatch.setattr(saving, "_atomic_write", write)


@pytest.mark.parametrize("file", ["shard_", "manifest"])
def test_full_disk_during_save_is_one_line_and_resume_is_exact(one, cache_dir, tmp_path, monkeypatch, capfd, file):
    """The disk fills while step 4's shard (torch.save wraps the ENOSPC in a RuntimeError)
    or its manifest is written: exit 2, one line naming the file and the space it needs,
    no `.tmp_step_*` left, step 2 intact; `--resume auto` then continues exactly."""
    import train
    _fill_disk_at(monkeypatch, 4, file)
    code = train.main(flags(cache_dir, tmp_path, "--save-every", 2))
    err = capfd.readouterr().err.strip().splitlines()
    assert code == 2, err
    assert len(err) == 1 and err[0].startswith("error: cannot write checkpoint file "), err
    assert "No space left on device" in err[0] and "--out-dir" in err[0] and "Traceback" not in err[0]
    if file == "shard_":
        assert "shard_00000.pt" in err[0] and " MB" in err[0], err
    root = tmp_path / "checkpoints"
    assert sorted(os.listdir(root)) == ["latest", "step_00000002"], os.listdir(root)
    monkeypatch.undo()
    assert train.main(flags(cache_dir, tmp_path, "--save-every", 2, "--resume", "auto")) == 0
    assert_bit_identical(tmp_path, one / "full")


def test_a_runtime_error_that_is_not_io_is_not_disguised():
    """Only torch.save's wrapped I/O errors become a disk-full line; another RuntimeError stays itself."""
    from nanohlat.run.checkpoint import io_errors
    with pytest.raises(RuntimeError, match="something else"):
        io_errors.io_error(RuntimeError("something else"), "/x/shard.pt", 10)
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:603] . unexpected pos 64 vs 0")
    except RuntimeError as e:
        line = str(io_errors.io_error(e, "/x/shard.pt", 3 * 2**20))
    assert "'/x/shard.pt'" in line and "No space left on device" in line and "\n" not in line


@pytest.mark.slow
def test_full_disk_in_one_rank_is_named_by_the_launcher(one, cache_dir, tmp_path, monkeypatch, capfd):
    """--nproc 2 --dp 2: rank 1's disk fills while it writes its shard of step 4. Both
    ranks leave the save (rank 0 is not left waiting), the launcher prints rank 1's
    cause in one line and exits 2, no `.tmp_step_*` is left, and --resume auto goes
    on from step 2."""
    argv = flags(cache_dir, tmp_path, "--nproc", 2, "--dp", 2, "--save-every", 2)
    code, seconds = run_main_with_fault({"rank": 1, "at": "full disk", "step": 4}, argv, monkeypatch)
    err = capfd.readouterr().err
    assert code == 2, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert any(line.startswith("error: rank 1: cannot write checkpoint file ") and "shard_00001.pt" in line
               and "No space left on device" in line for line in lines), err[-3000:]
    assert "Traceback" not in err and "exit code" not in err, err[-3000:]
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["latest", "step_00000002"]
    monkeypatch.undo()
    import train
    assert train.main(flags(cache_dir, tmp_path, "--nproc", 2, "--dp", 2, "--save-every", 2)) == 0
    assert "resumed from" in capfd.readouterr().out
    assert_close_after(tmp_path, one / "full", 0)


@pytest.mark.slow
def test_a_crashing_rank_is_named_with_its_cause(cache_dir, tmp_path, monkeypatch, capfd):
    """An unexpected exception in rank 1: the launcher says `error: rank 1: <type>: <message>`, exit 1."""
    argv = flags(cache_dir, tmp_path, "--nproc", 2, "--dp", 2)
    code, _ = run_main_with_fault({"rank": 1, "at": "crash", "step": 1}, argv, monkeypatch)
    err = capfd.readouterr().err
    assert code == 1, err[-3000:]
    assert "error: rank 1: ZeroDivisionError: planted by the test" in err, err[-3000:]
