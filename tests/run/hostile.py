"""Nothing lost, nothing hung: the helpers and fixtures shared by the tests that hold nanohlat
to its promise for each hostile input or event (the table in docs/robustness.md), one test
per promise:

  test_hostile_flags_and_sizes.py           every flag against its meaning; sizes checked before
                                            allocating, and answered at once; messages that point the right way
  test_hostile_out_dirs_and_full_disks.py   one run per out-dir; out-dirs that are not runs; full disks
  test_hostile_files.py                     checkpoints, data caches, manifests, configs and metrics
                                            that are damaged, moved or not what they claim; non-finite numbers
  test_signals_and_launchers.py             concurrent runs, SIGTERM, Ctrl-C, kill -9, rendezvous, the
                                            launcher's lines

Every case ends in one of three ways, and the tests check which: exit 0 by
design, exit 2 with one line starting "error: " and no traceback, or a
documented signal exit (143 after SIGTERM, 130 after Ctrl-C) with a
checkpoint saved. Runs are the tiny preset for a few steps, in this process
where possible; the few tests that need a real second process start one.
"""

from __future__ import annotations

import json
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
# Shared: a finished tiny run (checkpoints at steps 2 and 4) and a small corpus
# ---------------------------------------------------------------------------

def train_here(argv):
    import train
    from nanohlat import recipe
    from nanohlat.run import preflight
    model_cfg, tcfg = recipe.parse_args(argv)
    return train.train(*preflight.inputs(model_cfg, tcfg))


def flags(cache_dir, out_dir, *extra):
    return TINY + ["--cache-dir", cache_dir, "--out-dir", str(out_dir)] + [str(e) for e in extra]


def ckpt(out_dir, step: int) -> str:
    return os.path.join(str(out_dir), "checkpoints", f"step_{step:08d}")


def losses(out_dir) -> dict:
    return {m["step"]: m["loss"] for m in read_metrics(str(out_dir))}


@pytest.fixture(scope="module")
def base(cache_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("base") / "run"
    train_here(flags(cache_dir, out, "--save-every", 2))
    return out


@pytest.fixture
def run_copy(base, tmp_path):
    import shutil
    shutil.copytree(base, tmp_path / "run")
    return tmp_path / "run"


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory):
    """A folder of a few Python files (json's sources): a tokenizer trains on it in a second."""
    import shutil
    import sysconfig
    folder = tmp_path_factory.mktemp("corpus")
    src = os.path.join(sysconfig.get_paths()["stdlib"], "json")
    for name in sorted(os.listdir(src)):
        if name.endswith(".py"):
            shutil.copyfile(os.path.join(src, name), folder / name)
    return folder


def saved_step(out) -> int:
    from nanohlat.run import checkpoint
    return checkpoint.step_of(checkpoint.latest(str(out)))


def _edit_manifest(run_dir, step: int, edit) -> str:
    path = os.path.join(ckpt(run_dir, step), "manifest.json")
    with open(path) as f:
        m = json.load(f)
    edit(m)
    with open(path, "w") as f:
        json.dump(m, f)
    return path


def _export(args) -> int:
    """`python -m nanohlat.hf ARGS`'s exit code (main returns it; a bad flag exits from the parser)."""
    from nanohlat.serving import hf
    try:
        return hf.main(args)
    except SystemExit as e:
        return e.code
