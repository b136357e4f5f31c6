"""Hostile flags and sizes (docs/robustness.md; the shared helpers: hostile.py): every flag
against its meaning, in train.py, sample.py, eval.py and the other commands; sizes checked before
anything is allocated; every size answered at once, by arithmetic; a mixture's capacity factor
bounded and its buffer counted; messages that point the right way."""

from __future__ import annotations

import os

import pytest

from hostile import TINY, ckpt, main_in_process, one_line_error, run_py, train_here, _edit_manifest


# ---------------------------------------------------------------------------
# Every flag against its meaning (config.py, sample.py, eval.py)
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("args, message", [
    (["--lr", "nan"], "--lr must be a finite number > 0, got nan"),
    (["--lr", "inf"], "--lr must be a finite number > 0, got inf"),
    (["--min-lr", "nan"], "--min-lr must be a finite number in [0, --lr]"),
    (["--beta1", "1.5"], "--beta1 must be a finite number in [0, 1), got 1.5"),
    (["--beta2", "1"], "--beta2 must be a finite number in [0, 1)"),
    (["--grad-clip", "-1"], "--grad-clip must be a finite number >= 0 (0 = no clipping)"),
    (["--warmup-steps", "-10"], "--warmup-steps must be >= 0, got -10"),
    (["--bucket-mb", "0"], "--bucket-mb must be a finite number > 0"),
    (["--adam-eps", "0"], "--adam-eps must be a finite number > 0"),
    (["--weight-decay", "nan"], "--weight-decay must be a finite number >= 0"),
    (["--vocab-multiple", "0"], "--vocab-multiple must be positive, got 0"),
    (["--eval-every", "5", "--eval-batches", "0"], "--eval-batches 0 with evaluation on"),
    (["--rendezvous-timeout", "0"], "--rendezvous-timeout must be a finite number > 0"),
    (["--norm-eps", "nan"], "--norm-eps must be a finite number > 0"),
    (["--n-heads", "0"], "--n-heads must be positive, got 0"),
    (["--n-kv-heads", "0"], "--n-kv-heads must be positive, got 0"),
    (["--seed", str(2**64)], "--seed must be in [0, 2**63)"),
    (["--threads", "100000"], "--threads 100000 is more than 1024"),
    (["--resume", ""], "--resume is empty; give auto"),
    # in range, but what they would cause is refused (preflight.check_values)
    (["--bucket-mb", "1e-30"], "--bucket-mb 1e-30 cuts a rank's ~250,432 gradients into 250,432 buckets"),
    (["--collective-timeout", "1e300"], "--collective-timeout 1e+300 is outside [1, 604800] seconds"),
    (["--collective-timeout", "1e-9"], "--collective-timeout 1e-09 is outside [1, 604800] seconds"),
    (["--rendezvous-timeout", "1e300"], "--rendezvous-timeout 1e+300 is outside [1, 604800] seconds"),
])
def test_flags_out_of_range_exit_2_before_anything(args, message, tmp_path, capsys, cache_dir):
    out = tmp_path / "run"
    code, err = main_in_process(TINY + ["--cache-dir", cache_dir, "--out-dir", str(out)] + args, capsys)
    assert code == 2
    one_line_error(err, message)
    assert not out.exists()          # before training: nothing written, so `--resume never` is never blocked


@pytest.mark.parametrize("args, message", [
    (["--top-k", "-5"], "--top-k must be >= 0, got -5"),
    (["--temperature", "nan"], "--temperature must be a finite number >= 0"),
    (["--temperature", "-1"], "--temperature must be a finite number >= 0"),
    (["--num-samples", "0"], "--num-samples must be >= 1, got 0"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--seed", str(2**64)], "--seed must be in [0, 2**63)"),
])
def test_sample_flags_out_of_range(args, message, tmp_path, capsys):
    import sample
    assert sample.main(["--out-dir", str(tmp_path / "nothing")] + args) == 2
    one_line_error(capsys.readouterr().err, message)


def test_speculative_decoding_flags_out_of_range(capsys):
    from nanohlat.serving import server as serving
    for args, message in ((["--temperature", "nan"], "--temperature must be a finite number >= 0"),
                          (["--temperature", "-1"], "--temperature must be a finite number >= 0"),
                          (["--seed", "-1"], "--seed must be in [0, 2**63)"),
                          (["--threads", "-1"], "--threads must be at least 1")):
        assert serving.main(["--target", "none", "--draft", "none"] + args) == 2
        one_line_error(capsys.readouterr().err, message)


@pytest.mark.parametrize("command, args, message", [
    ("train", ["--zero", "1.5"], "argument --zero: invalid int value: '1.5'"),
    ("train", ["--collective-timeout", "abc"], "argument --collective-timeout: invalid float value: 'abc'"),
    ("train", ["--check-replicas", "1.5"], "argument --check-replicas: invalid int value: '1.5'"),
    ("train", ["--warmup-steps", "1e3"], "argument --warmup-steps: invalid int value: '1e3'"),
    ("train", ["--lr", "-1e-3"], "argument --lr: expected one argument (a value that starts with '-' is written "
                                 "--lr=-1e-3)"),
    ("train", ["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    ("sample", ["--top-k", "x"], "argument --top-k: invalid int value: 'x'"),
    ("eval", ["--shots", "1.5"], "argument --shots: invalid int value: '1.5'"),
    ("serving", ["--k", "z"], "argument --k: invalid int value: 'z'"),
    ("hf", ["export"], "the following arguments are required: RUN_OR_CKPT, HF_DIR"),
    ("bench", ["--warmup", "q"], "argument --warmup: invalid int value: 'q'"),
    ("classroom", ["check", "99z"], "unknown exercise 99z"),
    ("classroom", ["bogus"], "argument cmd: invalid choice: 'bogus'"),
])
def test_a_bad_command_line_is_one_error_line_and_exit_2(command, args, message, capsys):
    """argparse printed the whole usage (34 lines for train.py) before the line that matters;
    the classroom's unknown exercise exited 1 (a failed check's code)."""
    import importlib
    main = {"train": "train", "sample": "sample", "eval": "eval", "serving": "nanohlat.serving.server",
            "hf": "nanohlat.serving.hf", "bench": "nanohlat.bench.bench", "classroom": "nanohlat.classroom.kit"}
    with pytest.raises(SystemExit) as e:
        importlib.import_module(main[command]).main(args)
    assert e.value.code == 2
    one_line_error(capsys.readouterr().err, message)


def test_a_bad_flag_points_to_the_commands_help():
    p = run_py(["train.py", "--zero", "1.5"], check=False)
    assert p.returncode == 2
    one_line_error(p.stderr, "error: argument --zero: invalid int value: '1.5' (python train.py --help lists the flags)")
    p = run_py(["-m", "nanohlat.classroom", "check", "99z"], check=False)
    assert p.returncode == 2
    one_line_error(p.stderr, "unknown exercise 99z")


def test_a_tiny_temperature_samples_the_largest_logit():
    """logits / 1e-40 overflowed to inf (softmax: nan, and a crash); shifted by the
    row's largest logit first, the scaled logits stay <= 0."""
    import torch
    from nanohlat.serving import generate
    logits = torch.tensor([[1.0, 3.0, 2.0, float("-inf")]])
    assert torch.equal(generate.probabilities(logits, 1e-40), torch.tensor([[0.0, 1.0, 0.0, 0.0]]))
    assert torch.allclose(generate.probabilities(logits, 1.0), torch.softmax(logits, -1))


@pytest.mark.parametrize("where, message", [
    ("folder", "is a folder; give a file path"),
    ("under_a_file", "is a file, not a folder"),
])
def test_eval_json_that_cannot_be_written_is_refused_before_evaluating(where, message, tmp_path, capsys):
    import eval as eval_py
    (tmp_path / "folder").mkdir()
    (tmp_path / "afile").write_text("x")
    target = {"folder": tmp_path / "folder", "under_a_file": tmp_path / "afile" / "eval.json"}[where]
    # --out-dir holds no run: the path is refused before any checkpoint is even looked for
    assert eval_py.main(["--out-dir", str(tmp_path / "norun"), "--json", str(target)]) == 2
    one_line_error(capsys.readouterr().err, message)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "folder"]


def test_prompt_and_task_files_that_are_not_regular_files_are_refused(tmp_path, capsys):
    """A FIFO would block and /dev/zero never ends: refused before reading; a folder is named as one."""
    import eval as eval_py
    import sample
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert sample.main(["--out-dir", str(tmp_path), "--prompt-file", str(fifo)]) == 2
    one_line_error(capsys.readouterr().err, "is not a regular file")
    for task in (fifo, tmp_path):
        assert eval_py.main(["--out-dir", str(tmp_path), "--task", str(task)]) == 2
        one_line_error(capsys.readouterr().err, "is not a regular file", str(task))


def test_a_task_with_an_empty_choice_is_refused(tmp_path, capsys):
    """An empty continuation scores log-likelihood 0 and would always win (or, with an
    empty context too, crash the scorer)."""
    import eval as eval_py
    task = tmp_path / "t.jsonl"
    task.write_text('{"context": "", "choices": ["", "b"], "label": 1}\n')
    assert eval_py.main(["--out-dir", str(tmp_path), "--task", str(task)]) == 2
    one_line_error(capsys.readouterr().err, "t.jsonl:1", "a choice is empty")


def test_a_failed_atomic_write_leaves_the_old_file_and_no_partial(tmp_path):
    """files.atomic_write (checkpoints, the data cache, eval.json): a write that
    fails part-way keeps the old file whole and removes its `.partial`."""
    import errno
    from nanohlat.system.files import atomic_write
    target = tmp_path / "eval.json"
    target.write_text("old")

    def full(f):
        f.write(b"half")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(target))
    with pytest.raises(OSError):
        atomic_write(str(target), full)
    assert target.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["eval.json"]


def test_binary_prompt_and_task_files_are_one_line(tmp_path, capsys):
    import eval as eval_py
    import sample
    binary = tmp_path / "blob.bin"
    binary.write_bytes(bytes(range(256)) * 4)
    assert sample.main(["--out-dir", str(tmp_path), "--prompt-file", str(binary)]) == 2
    one_line_error(capsys.readouterr().err, "is not UTF-8 text", str(binary))
    assert eval_py.main(["--out-dir", str(tmp_path), "--task", str(binary)]) == 2
    one_line_error(capsys.readouterr().err, "is not UTF-8 text", str(binary))


# ---------------------------------------------------------------------------
# Sizes checked before allocation (preflight.check_memory)
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("args, why", [
    # the rotary tables: (2^24 positions x head dim 2048) x 2, 256 GiB in fp32
    (["--max-seq-len", "16777216", "--d-model", "4096", "--n-heads", "2", "--n-kv-heads", "2"],
     "--max-seq-len 16,777,216"),
    (["--d-model", "65536", "--n-heads", "4", "--n-kv-heads", "4"], "GiB"),   # weights and optimizer
])
def test_a_model_that_cannot_fit_is_refused_before_allocating(tmp_path, capsys, args, why):
    """One line with the estimate and this machine's memory, exit 2, nothing written
    (and no allocation: a 2^24-position rotary table of head dim 2048 would take 256 GiB)."""
    code, err = main_in_process([*TINY, "--device", "cpu", "--out-dir", str(tmp_path / "run"), *args], capsys)
    assert code == 2
    one_line_error(err, "this model does not fit: it needs about", "this machine has", why)
    assert not (tmp_path / "run").exists()


def test_memory_check_counts_every_local_rank(monkeypatch):
    """--nproc N on the CPU: N ranks share the RAM; what fits once may not fit N times."""
    from nanohlat import config
    from nanohlat import recipe
    from nanohlat.run import preflight
    from nanohlat import plan
    model_cfg, tcfg = recipe.parse_args([*TINY, "--device", "cpu", "--nproc", "4", "--dp", "4"])
    per_rank = plan.peak_memory_per_rank(model_cfg, tcfg, 4) + preflight.rotary_bytes(model_cfg)
    monkeypatch.setattr(os, "sysconf", lambda name: {"SC_PAGE_SIZE": 1}.get(name, 2 * per_rank))
    preflight.check_memory(model_cfg, tcfg, 4, 1, spawns=False)        # one local rank: fits
    with pytest.raises(config.UserError, match=r"\(4 ranks of"):
        preflight.check_memory(model_cfg, tcfg, 4, 4, spawns=True)      # four: does not


def test_a_full_disk_at_the_start_names_the_lock_and_leaves_nothing(tmp_path, cache_dir, capsys, monkeypatch):
    """The disk is full when the run lock records its PID: one line naming run.lock,
    exit 2, and the out-dir it created is gone (no 0-byte run.lock left behind)."""
    import errno
    from nanohlat.run import runlock

    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(runlock.os, "pwrite", full)
    out = tmp_path / "run"
    code, err = main_in_process([*TINY, "--cache-dir", cache_dir, "--out-dir", str(out)], capsys)
    assert code == 2
    one_line_error(err, str(out / "run.lock"), "No space left on device", "--out-dir")
    assert not out.exists()


# ---------------------------------------------------------------------------
# Every size answered at once: arithmetic, never counting (issue 50)
# ---------------------------------------------------------------------------

BIG = "9" * 21   # 999999999999999999999 ranks: divisors() once counted up to it
BIG_COMMAS = f"{int(BIG):,}"
ODD = "16777215"   # 2^24 - 1 = 3^2 x 5 x 7 x 13 x 17 x 241 ranks: the largest odd world nanohlat takes


@pytest.mark.parametrize("args, message", [
    (["--plan", "--preset", "hlat-7b", "--nproc", BIG],
     f"--nproc {BIG_COMMAS} is more than 2^24 = 16,777,216, the largest size nanohlat takes"),
    (["--preset", "tiny", "--nproc", BIG], f"--nproc {BIG_COMMAS} is more than 2^24"),
    (["--preset", "tiny", "--n-heads", BIG], f"--n-heads {BIG_COMMAS} is more than 2^24"),
    (["--preset", "tiny", "--batch-size", "16777217"], "--batch-size 16,777,217 is more than 2^24"),
    (["--preset", "tiny", "--cp", "2", "--nproc", ODD],
     f"--tp 1 x --pp 1 x --cp 2 = 2 does not divide the world size {ODD}; choose tp*pp*cp among 1, 3, 5, 7, 9, "
     f"13, 15, 17, 21, 35, ... or {ODD} (96 in all)"),
    (["--preset", "tiny", "--tp", "2", "--nproc", ODD], f"--tp 2 x --pp 1 = 2 does not divide the world size {ODD}"),
    (["--preset", "tiny", "--steps", BIG], f"--steps {BIG} is more than 2^53"),
    (["--preset", "moe", "--n-layers", "16777216"], "this model does not fit"),   # (its sparse layers: counted)
])
def test_every_size_is_answered_at_once(args, message, tmp_path, capsys):
    """A --nproc of 21 digits (and training at --cp 2 or --tp 2 with 10^12 + 1 ranks, a MoE of
    10^12 layers) once never answered: divisors and the sparse layers were counted one by one. Now
    every size is at most 2^24 (recipe.MAX_SIZE), whose divisors take 4,096 tries, and any other
    count at most 2^53; the largest world and layer count allowed answer at once too."""
    import time
    start = time.perf_counter()
    code, err = main_in_process(args + ["--out-dir", str(tmp_path / "run")], capsys)
    assert time.perf_counter() - start < 5
    assert code == 2
    one_line_error(err, message)


def test_a_launchers_world_beyond_the_largest_and_a_search_over_the_largest_answer_at_once(tmp_path, capsys,
                                                                                         monkeypatch):
    import time
    start = time.perf_counter()
    code, _ = main_in_process(["--plan", "--search", "--preset", "tiny", "--nproc", "16777216"], capsys)
    assert code == 0 and time.perf_counter() - start < 5
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", BIG)
    start = time.perf_counter()
    code, err = main_in_process(["--preset", "tiny", "--out-dir", str(tmp_path / "run")], capsys)
    assert code == 2 and time.perf_counter() - start < 5
    one_line_error(err, f"a world of {BIG_COMMAS} ranks is more than 2^24 = 16,777,216, the largest world")


def test_divisors_are_tried_up_to_the_square_root():
    """recipe.divisors against counting every number (to 2,000 and at random below 10^6), and at
    the sizes' bound: primes, squares, 2^24 itself, each in well under a millisecond's worth of tries."""
    import random
    from nanohlat.recipe import MAX_SIZE, choices, divisors
    rng = random.Random(0)
    for n in list(range(1, 2000)) + [rng.randrange(1, 10**6) for _ in range(50)]:
        assert divisors(n) == [d for d in range(1, n + 1) if n % d == 0], n
    for n in (MAX_SIZE, MAX_SIZE - 1, 16777213, 4093 ** 2, 4096 ** 2 - 1):   # (16777213 and 4093: primes)
        d = divisors(n)
        assert d[0] == 1 and d[-1] == n and all(n % x == 0 for x in d) and d == sorted(set(d))
    assert divisors(16777213) == [1, 16777213] and divisors(4093 ** 2) == [1, 4093, 4093 ** 2]
    assert choices(divisors(MAX_SIZE)) == "1, 2, 4, 8, 16, 32, 64, 128, 256, 512, ... or 16777216 (25 in all)"


# ---------------------------------------------------------------------------
# A mixture's capacity factor: bounded, and its buffer counted (issue 50)
# ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def moe_run(tmp_path_factory):
    """A 1-step run of the moe preset (dropless), for sample.py and eval.py to read."""
    out = tmp_path_factory.mktemp("moe") / "run"
    cache = out.parent / "cache"     # (its tokenizer: a resume needs the same)
    assert train_here(["--preset", "moe", "--steps", "1", "--eval-every", "0", "--no-progress", "--threads", "1",
                       "--batch-size", "4", "--cache-dir", str(cache), "--out-dir", str(out)]) is not None
    return out


@pytest.mark.parametrize("factor", ["1e30", "1e6"])
def test_a_capacity_factor_beyond_every_token_is_refused_in_every_command(factor, moe_run, tmp_path, capsys):
    """--moe-capacity-factor 1e30 was an OverflowError, 1e6 a 131 GB buffer the memory pre-flight did not
    count: above --moe-experts / --moe-top-k (2 here) each expert already takes every token, so the
    factor is refused there, by train.py and (through a checkpoint's manifest) sample.py and eval.py."""
    import shutil
    import eval as evalpy
    import sample
    want = f"--moe-capacity-factor {float(factor):g} is above --moe-experts / --moe-top-k = 2: at 2 each expert"
    code, err = main_in_process(["--preset", "moe", "--moe-capacity-factor", factor, "--out-dir", str(tmp_path / "x")],
                                capsys)
    assert code == 2
    one_line_error(err, want, "give at most 2, or 0 (dropless)")
    copy = tmp_path / "run"
    shutil.copytree(moe_run, copy)
    mpath = _edit_manifest(copy, 1, lambda m: m["config"]["model"].update(moe_capacity_factor=float(factor)))
    for main in (lambda: sample.main(["--out-dir", str(copy), "--max-new-tokens", "2"]),
                 lambda: evalpy.main(["--out-dir", str(copy), "--examples", "4", "--max-batches", "1"])):
        assert main() == 2
        one_line_error(capsys.readouterr().err, f"checkpoint manifest {mpath} is damaged", want)


def test_the_memory_preflight_counts_the_capacity_buffer():
    import dataclasses
    from nanohlat import recipe
    from nanohlat.plan.memory import moe_layer_bytes
    model, _ = recipe.parse_args(["--preset", "moe", "--moe-experts", "64", "--moe-top-k", "1"])
    N, d = 4096, model.d_model
    dropless = moe_layer_bytes(model, N, 1, 4)
    at_most = moe_layer_bytes(dataclasses.replace(model, moe_capacity_factor=64.0), N, 1, 4)
    # 64 queues of every token: 64 x the experts' rows, the dispatch buffer (64 N + 1 rows), the keep mask
    assert at_most - dropless == 4 * (4 * model.ffn_dim * 63 * N + (64 * N + 1) * d) + N


# ---------------------------------------------------------------------------
# Messages that point the right way (issue 50, item 8)
# ---------------------------------------------------------------------------

def test_a_cp_layout_is_refused_for_its_world_before_its_sequence(tmp_path, capsys):
    """--cp 3 --nproc 2 was refused for --seq-len (not a multiple of 6) before the world size."""
    code, err = main_in_process(["--preset", "tiny", "--cp", "3", "--nproc", "2", "--out-dir", str(tmp_path)], capsys)
    assert code == 2
    one_line_error(err, "--tp 1 x --pp 1 x --cp 3 = 3 does not divide the world size 2; choose tp*pp*cp among 1 or 2")


def test_a_search_says_why_the_presets_own_layout_is_not_valid(capsys):
    """--plan --search --preset moe --nproc 6 said "not valid for 6 ranks" and nothing more."""
    import train
    assert train.main(["--plan", "--search", "--preset", "moe", "--nproc", "6"]) == 0
    out = capsys.readouterr().out
    assert out.rstrip().endswith("the preset's own layout is not valid for 6 ranks: --batch-size 8 must split into "
                                 "dp 6 x microbatches 1 equal micro-batches; use a multiple of 6"), out[-2000:]
    assert "(no layout the search tries splits this model and batch over 6 ranks)" in out


def test_a_damaged_moe_experts_in_a_manifest_is_named_as_damage(moe_run, tmp_path, capsys):
    """The manifest's config.model says 8 experts, its shards hold 4: reported as a shape mismatch
    ("the model being loaded has ..."), as if another model were being loaded; it is the manifest."""
    import shutil
    import eval as evalpy
    import sample
    copy = tmp_path / "run"
    shutil.copytree(moe_run, copy)
    mpath = _edit_manifest(copy, 1, lambda m: m["config"]["model"].update(moe_experts=8))
    for main in (lambda: sample.main(["--out-dir", str(copy), "--max-new-tokens", "2"]),
                 lambda: evalpy.main(["--out-dir", str(copy), "--examples", "4", "--max-batches", "1"])):
        assert main() == 2
        one_line_error(capsys.readouterr().err, f"checkpoint manifest {mpath} is damaged (its config.model makes "
                       f"'layers.0.mlp.router.weight' [8, 64], its shards hold [4, 64])")


def test_a_resume_that_changes_the_routing_says_so(moe_run, tmp_path, capsys):
    """Changing --moe-top-k, --moe-capacity-factor or --moe-aux-coef on resume was accepted silently:
    allowed (the weights fit: no shape changes), and announced in one note."""
    import shutil
    copy = tmp_path / "run"
    shutil.copytree(moe_run, copy)
    code, err = main_in_process(["--preset", "moe", "--steps", "2", "--eval-every", "0", "--no-progress", "--threads",
                                 "1", "--batch-size", "4", "--cache-dir", str(moe_run.parent / "cache"), "--out-dir",
                                 str(copy), "--moe-top-k", "1", "--moe-capacity-factor", "1.5"], capsys)
    assert code == 0, err
    notes = [line for line in err.splitlines() if line.startswith("note: resuming")]
    assert notes == [f"note: resuming {ckpt(copy, 1)} with --moe-top-k 1 (it trained with 2), --moe-capacity-factor "
                     f"1.5 (it trained with 0.0): the same weights, another model from here on"], err
