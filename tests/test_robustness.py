"""Nothing lost, nothing hung: what nanohlat promises for each hostile input or
event (the table in docs/robustness.md), one test per promise.

Every case ends in one of three ways, and the tests check which: exit 0 by
design, exit 2 with one line starting "error: " and no traceback, or a
documented signal exit (143 after SIGTERM, 130 after Ctrl-C) with a
checkpoint saved. Runs are the tiny preset for a few steps, in this process
where possible; the few tests that need a real second process start one.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from conftest import ROOT, read_metrics

TINY = ["--preset", "tiny", "--steps", "4", "--eval-every", "0", "--no-progress", "--threads", "1"]


def one_line_error(err: str, *needles: str) -> None:
    err = err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    for n in needles:
        assert n in err, (n, err)


def main_in_process(argv, capsys) -> tuple[int, str]:
    import train
    code = train.main(argv)
    return code, capsys.readouterr().err


def run_py(args, check=True, timeout=240, **kw):
    p = subprocess.run([sys.executable] + args, cwd=ROOT, capture_output=True, text=True, timeout=timeout, **kw)
    if check and p.returncode != 0:
        raise AssertionError(f"{args} exited {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return p


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
])
def test_flags_out_of_range_exit_2_before_anything(args, message, tmp_path, capsys, cache_dir):
    out = tmp_path / "run"
    code, err = main_in_process(TINY + ["--cache-dir", cache_dir, "--out-dir", str(out)] + args, capsys)
    assert code == 2
    one_line_error(err, message)
    assert not out.exists()          # before training: nothing written, so `--resume never` is never blocked


def test_lr_nan_as_a_process_exits_2_before_training(tmp_path, cache_dir):
    p = run_py(["train.py", *TINY, "--cache-dir", cache_dir, "--out-dir", str(tmp_path / "o"), "--lr", "nan"],
               check=False)
    assert p.returncode == 2
    one_line_error(p.stderr, "--lr")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("args, message", [
    (["--top-k", "-5"], "--top-k must be >= 0, got -5"),
    (["--temperature", "nan"], "--temperature must be a finite number >= 0"),
    (["--temperature", "-1"], "--temperature must be a finite number >= 0"),
    (["--num-samples", "0"], "--num-samples must be >= 1, got 0"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
])
def test_sample_flags_out_of_range(args, message, tmp_path, capsys):
    import sample
    assert sample.main(["--out-dir", str(tmp_path / "nothing")] + args) == 2
    one_line_error(capsys.readouterr().err, message)


def test_binary_prompt_and_task_files_are_one_line(tmp_path, capsys):
    import eval as eval_py
    import sample
    binary = tmp_path / "blob.bin"
    binary.write_bytes(bytes(range(256)) * 4)
    assert sample.main(["--out-dir", str(tmp_path), "--prompt-file", str(binary)]) == 2
    one_line_error(capsys.readouterr().err, "is not UTF-8 text", str(binary))
    assert eval_py.main(["--out-dir", str(tmp_path), "--task", str(binary)]) == 2
    one_line_error(capsys.readouterr().err, "is not UTF-8 text", str(binary))
