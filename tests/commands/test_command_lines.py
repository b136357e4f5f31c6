"""The command lines a user types: train.py (one process, --nproc, torchrun), sample.py, and their errors.

The full 3D layout through the launcher (`--nproc 8 --tp 2 --pp 2 --dp 2 --zero1
--sequence-parallel`) is tutorial chapter 6's runnable block (tests/repo/test_tutorial.py
checks what it prints); its equality with one process, to 2e-5, is
tests/core/test_layouts_equal_one_process.py's `tp2_pp2_dp2_zero1_sp`."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, read_metrics
from nanohlat.config import UserError

TINY = ["--preset", "tiny", "--steps", "5", "--eval-every", "0", "--no-progress"]


def run(args, cwd=ROOT, check=True, timeout=240):
    p = subprocess.run([sys.executable] + args, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"{args} exited {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return p


def losses(out_dir):
    return [m["loss"] for m in read_metrics(str(out_dir))]


@pytest.fixture(scope="module")
def one_process(cache_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("one")
    run(["train.py", *TINY, "--cache-dir", cache_dir, "--out-dir", str(out)])
    return out


# -- bad input: one line, exit code 2, nothing written ---------------------

@pytest.mark.parametrize("args, message", [
    (["--preset", "huge"], "unknown preset 'huge'; choose one of tiny, default"),
    (["--data", "/no/such/file.txt"], "/no/such/file.txt"),
    (["--seq-len", "4096"], "--seq-len 4096 is above the model maximum 64"),
    (["--steps", "0"], "--steps must be positive, got 0"),
    (["--batch-size", "-1"], "--batch-size must be positive, got -1"),
    (["--precision", "fp8"], "--precision 'fp8' is not one of"),
    (["--nproc", "2", "--tp", "3"], "--tp 3"),
    (["--schedule", "interleaved"], "the interleaved schedule needs --virtual-stages >= 2"),
    (["--nproc", "2", "--pp", "2", "--schedule", "interleaved", "--virtual-stages", "4", "--microbatches", "2"],
     "--pp x --virtual-stages = 8 chunks of equal size (--n-layers 4)"),
    (["--nproc", "2", "--pp", "2", "--schedule", "zb-h1", "--microbatches", "1"],
     "--schedule zb-h1 needs --microbatches >= --pp (got 1 < 2)"),
    (["--schedule", "zb-h1", "--compile"], "--schedule zb-h1 with --compile is not supported"),
    (["--schedule", "zb-h1", "--virtual-stages", "2"], "only it uses them"),
])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(args, message, tmp_path, capsys, cache_dir):
    import train
    out = tmp_path / "run"
    code = train.main(["--preset", "tiny", "--cache-dir", cache_dir, "--out-dir", str(out)] + args)
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.startswith("error: ") and "\n" not in err and message in err, err
    assert not out.exists()


def test_empty_data_folder_is_refused(tmp_path, capsys):
    import train
    (tmp_path / "empty").mkdir()
    code = train.main(["--preset", "tiny", "--data", str(tmp_path / "empty"), "--out-dir", str(tmp_path / "o")])
    assert code == 2 and "error: " in capsys.readouterr().err


def test_errors_exit_2_without_traceback_as_a_process(tmp_path):
    p = run(["train.py", "--preset", "nope", "--out-dir", str(tmp_path / "o")], check=False)
    assert p.returncode == 2 and "Traceback" not in p.stderr and p.stderr.count("\n") == 1
    p = run(["sample.py", "--out-dir", str(tmp_path / "missing")], check=False)
    assert p.returncode == 2 and "no complete checkpoint" in p.stderr and "Traceback" not in p.stderr


# -- one end for every command: system/cli.py:command -----------------------

STUB_MESSAGE = "exercise 4b: column- and row-parallel linear layers, see tutorial.md section 4"


@pytest.mark.parametrize("raised, code", [
    (UserError("--steps must be positive, got 0"), 2),
    (OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/full/disk/metrics.jsonl"), 2),
    (KeyboardInterrupt(), 130),
    (NotImplementedError(STUB_MESSAGE), 2),
], ids=["bad input", "OSError", "Ctrl-C", "exercise stub"])
def test_the_one_error_tail_ends_a_command_with_one_line(raised, code, capsys):
    from nanohlat.system import cli
    from nanohlat.system.files import os_error_message

    @cli.command
    def main(argv):
        raise raised
    assert main([]) == code
    out, err = capsys.readouterr()
    if isinstance(raised, UserError):
        want = f"error: {raised}"
    elif isinstance(raised, OSError):
        want = f"error: {os_error_message(raised)}"
        assert "/full/disk/metrics.jsonl" in want and "No space left on device" in want
    elif isinstance(raised, KeyboardInterrupt):
        want = "interrupted"
    else:
        want = f"error: {cli.not_done(raised)}"
        assert "exercise 4b is not done yet" in want
    assert err == want + "\n" and not out, err


def test_the_one_error_tail_passes_exit_codes_through_and_keeps_a_crash_traceback():
    from nanohlat.system import cli
    assert cli.command(lambda: 143)() == 143          # stopped by SIGTERM, saved: the command's own code
    assert cli.command(lambda: 0)() == 0

    @cli.command
    def crash():
        raise RuntimeError("a bug")                    # not bad input: the traceback stays
    with pytest.raises(RuntimeError, match="a bug"):
        crash()


def test_every_command_ends_through_the_one_error_tail():
    """train.py (its pre-flight), sample.py, eval.py and every `python -m` command's
    main is system/cli.py:command around it: none writes an error tail of its own."""
    import eval as eval_py
    import sample
    from nanohlat.bench import bench
    from nanohlat.classroom import kit
    from nanohlat.run import preflight
    from nanohlat.serving import hf, server
    from nanohlat.system import cli
    from nanohlat.classroom import compile_lessons
    from nanohlat.figures import __main__ as figures
    mains = {"figures/__main__.py": figures.main, "run/preflight.py (train.py)": preflight.main, "sample.py": sample.main, "eval.py": eval_py.main,
             "bench/bench.py": bench.main, "serving/server.py": server.main, "serving/hf.py": hf.main,
             "classroom/kit.py": kit.main, "classroom/compile_lessons.py": compile_lessons.main}
    try:
        from nanohlat.serving import harness
        mains["serving/harness.py"] = harness.main
    except ImportError:   # lm_eval is optional
        pass
    tail = cli.command(lambda: 0).__code__
    bare = [name for name, main in mains.items() if main.__code__ is not tail or not hasattr(main, "__wrapped__")]
    assert not bare, f"these commands' main is not wrapped by system/cli.py:command: {', '.join(bare)}"


# -- a run: loss falls, metrics.jsonl, sample.py ----------------------------

def test_short_run_lowers_loss_and_writes_metrics(one_process):
    records = read_metrics(str(one_process))
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    for r in records:
        assert {"step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "mfu"} <= set(r)
    assert records[-1]["loss"] < records[0]["loss"] - 0.1
    assert records[-1]["tokens"] == 5 * 8 * 32
    cfg = json.load(open(one_process / "config.json"))
    assert cfg["model"]["n_layers"] == 4 and cfg["train"]["steps"] == 5


def test_sample_streams_text_from_the_run(one_process):
    p = run(["sample.py", "--out-dir", str(one_process), "--prompt", "import os\n", "--max-new-tokens", "20"])
    assert p.stdout.startswith("import os\n") and len(p.stdout) > len("import os\n")


# -- the launchers: same losses as one process ------------------------------

@pytest.mark.slow
def test_nproc_2_tensor_parallel_equals_one_process(one_process, cache_dir, tmp_path):
    out = tmp_path / "tp2"
    p = run(["train.py", *TINY, "--cache-dir", cache_dir, "--out-dir", str(out), "--nproc", "2", "--tp", "2"])
    assert losses(out) == pytest.approx(losses(one_process), abs=2e-5)
    # the comm ledger of the first step is printed once, beside the prediction from the model shape
    rows = [line.split() for line in p.stdout.splitlines() if line.startswith("  tp.")]
    assert rows and all(r[-1] == "same" for r in rows), p.stdout


INTERLEAVED = ["--preset", "tiny", "--n-layers", "8", "--microbatches", "8", "--steps", "3", "--eval-every", "3",
               "--eval-batches", "1", "--no-progress"]


def val_losses(out_dir):
    with open(out_dir / "metrics.jsonl") as f:
        return [r["val_loss"] for r in map(json.loads, f) if "val_loss" in r]


@pytest.mark.slow
def test_interleaved_pp4_v2_with_timeline_equals_one_process(cache_dir, tmp_path):
    """The issue's command: 8 layers in 8 chunks, stage s holding layers s and s+4;
    the losses of one process (evaluation's forward_only chain too), the ideal
    bubble 0.16 and, on every stage, the chunk activations in flight that the
    schedule's formula says."""
    one, four = tmp_path / "one", tmp_path / "pp4"
    run(["train.py", *INTERLEAVED, "--cache-dir", cache_dir, "--out-dir", str(one)])
    p = run(["train.py", *INTERLEAVED, "--cache-dir", cache_dir, "--out-dir", str(four), "--nproc", "4", "--pp", "4",
             "--schedule", "interleaved", "--virtual-stages", "2", "--timeline"])
    assert losses(four) == pytest.approx(losses(one), abs=2e-5)
    assert len(val_losses(four)) == 1 and val_losses(four) == pytest.approx(val_losses(one), abs=2e-5)
    # rank 0's exchanges (boundary 0|1 and the wrap 3|0), as the comm ledger counted them: the plan's prediction
    rows = [line.split() for line in p.stdout.splitlines() if line.startswith("  pp.")]
    assert rows and all(r[-1] == "same" for r in rows), p.stdout
    assert "   0   0   0   0  0-0,4-4  +embedding" in p.stdout
    text = (four / "timeline.txt").read_text()
    assert "bubble: ideal 0.16 = formula (p-1)/(v*m+p-1) = 0.16" in text
    # 2(p-1-s) + (v-1)p + 1 = 11 9 7 5: ideal (the order) and measured (the runner's dict of kept activations)
    assert "= 11 9 7 5; ideal 11 9 7 5; measured 11 9 7 5" in text
    assert json.load(open(four / "summary.json"))["peak_in_flight"] == 11


@pytest.mark.slow
def test_zb_h1_pp4_with_timeline_equals_one_process(cache_dir, tmp_path):
    """The issue's command with --schedule zb-h1: one process's losses (its
    split backward computes the same gradients), the ideal bubble 0.11 and p =
    4 micro-batches in flight on every stage, from F to W, as the formula says."""
    zb = ["--schedule", "zb-h1"]
    one, four = tmp_path / "one", tmp_path / "pp4"
    run(["train.py", *INTERLEAVED, *zb, "--cache-dir", cache_dir, "--out-dir", str(one)])
    run(["train.py", *INTERLEAVED, *zb, "--cache-dir", cache_dir, "--out-dir", str(four), "--nproc", "4", "--pp", "4",
         "--timeline"])
    assert losses(four) == pytest.approx(losses(one), abs=2e-5)
    assert len(val_losses(four)) == 1 and val_losses(four) == pytest.approx(val_losses(one), abs=2e-5)
    text = (four / "timeline.txt").read_text()
    assert "bubble: ideal 0.11 = formula (p-1)/(3m+p-1) = 0.11" in text
    assert "formula min(p, m) = 4 4 4 4; ideal 4 4 4 4; measured 4 4 4 4" in text
    assert "stage 3 | .. .. .. F0 B0 F1 B1" in text and text.count(" W7") == 4


@pytest.mark.slow
def test_torchrun_equals_one_process(one_process, cache_dir, tmp_path):
    out = tmp_path / "torchrun"
    run(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "train.py", *TINY,
         "--cache-dir", cache_dir, "--out-dir", str(out), "--tp", "2"])
    assert losses(out) == pytest.approx(losses(one_process), abs=2e-5)


@pytest.mark.slow
def test_pipeline_1f1b_with_timeline_equals_one_process(one_process, cache_dir, tmp_path):
    out = tmp_path / "pp2"
    p = run(["train.py", *TINY, "--cache-dir", cache_dir, "--out-dir", str(out), "--nproc", "2", "--pp", "2",
             "--schedule", "1f1b", "--microbatches", "4", "--timeline"])
    assert losses(out) == pytest.approx(losses(one_process), abs=2e-5)
    text = (out / "timeline.txt").read_text()
    # 1F1B on 2 stages: stage 0 warms up with pp-1 = 1 forward, then alternates
    assert "stage 0 | F0 F1 .. B0 F2 B1 F3 B2 .. B3" in text
    assert "stage 1 | .. F0 B0 F1 B1 F2 B2 F3 B3 .." in text
    assert "formula (p-1)/(m+p-1) = 0.20" in text and "timeline" not in p.stderr
    assert json.load(open(out / "summary.json"))["peak_in_flight"] == 2      # 1F1B: at most pp
    pytest.importorskip("matplotlib")
    assert (out / "timeline.png").stat().st_size > 1000
