"""scripts/layout_matrix.py's paths (issue 63): `--compare` never writes over the table it compares
with, every path is checked before the first run (~25 minutes for the whole matrix), Ctrl-C is one
line, and a relative --cache-dir is the current folder's. The runs themselves are replaced by a
stand-in (`fake_train`): what is tested is what the script does with paths, in milliseconds.
"""

from __future__ import annotations

import json
import os

import pytest

from test_layout_matrix import _script


def fake_train(calls, loss=1.0):
    def train(name, nproc, flags, tmp, cache):
        calls.append((name, cache))
        return {"name": name, "nproc": nproc, "flags": flags, "seconds": 0.0, "loss": [loss] * 5,
                "grad_norm": [0.5] * 5}
    return train


@pytest.fixture
def m(monkeypatch):
    module = _script()
    monkeypatch.setattr(module, "machine", lambda: {"torch": "x", "python": "y", "cpu": "z"})
    return module


def one_line(err: str, *needles) -> None:
    err = err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    for n in needles:
        assert n in err, (n, err)


def test_compare_with_the_default_out_leaves_the_baseline_and_compares_with_it(m, monkeypatch, tmp_path, capsys):
    """`--compare runs/layout_matrix.json` (the docstring's usage) wrote the new table over the baseline,
    then compared the table with itself: "bit for bit the same", exit 0, the baseline gone."""
    baseline = tmp_path / "layout_matrix.json"
    monkeypatch.setattr(m, "DEFAULT_OUT", str(baseline))
    calls = []
    monkeypatch.setattr(m, "train", fake_train(calls, loss=1.0))
    assert m.main(["--only", "tp2", "--compare", str(baseline)]) == 2      # no baseline yet: refused, no run
    one_line(capsys.readouterr().err, f"--compare {str(baseline)!r} cannot be read")
    assert calls == []
    assert m.main(["--only", "tp2"]) == 0                                   # the baseline
    before = baseline.read_bytes()
    monkeypatch.setattr(m, "train", fake_train(calls, loss=2.0))            # a change that moves every loss
    capsys.readouterr()
    assert m.main(["--only", "tp2", "--compare", str(baseline)]) == 1
    out = capsys.readouterr().out
    new = tmp_path / "layout_matrix.new.json"
    assert baseline.read_bytes() == before and new.is_file()
    assert f"wrote {new} (the baseline {baseline} is left as it was)" in out
    assert f"against {baseline}: 2 run(s) differ: one, tp2" in out
    assert json.loads(new.read_text())["runs"]["tp2"]["loss"] == [2.0] * 5


def test_an_out_that_is_the_baseline_is_refused_before_any_run(m, monkeypatch, tmp_path, capsys):
    calls = []
    monkeypatch.setattr(m, "train", fake_train(calls))
    baseline = tmp_path / "base.json"
    assert m.main(["--only", "tp2", "--out", str(baseline)]) == 0
    before = baseline.read_bytes()
    os.symlink(baseline, tmp_path / "link.json")
    calls.clear()
    for out in (baseline, tmp_path / "link.json", tmp_path / "." / "base.json"):
        assert m.main(["--only", "tp2", "--out", str(out), "--compare", str(baseline)]) == 2
        one_line(capsys.readouterr().err, f"--out {str(out)!r} is the --compare baseline: the new table would "
                                          f"replace the one it is compared with; give another --out")
    assert calls == [] and baseline.read_bytes() == before


@pytest.mark.parametrize("case", ["out a folder", "out under a file", "out a FIFO", "compare not JSON",
                                  "compare no table", "cache a file", "unknown layout", "bad flag"])
def test_every_path_is_checked_before_the_first_run(case, m, monkeypatch, tmp_path, capsys):
    """They were checked after every run (~25 minutes for the whole matrix), then a FileNotFoundError or an
    uncaught UserError."""
    calls = []
    monkeypatch.setattr(m, "train", fake_train(calls))
    (tmp_path / "dir").mkdir()
    (tmp_path / "file").write_text("x")
    (tmp_path / "bad.json").write_text("{")
    (tmp_path / "list.json").write_text("[1]")
    os.mkfifo(tmp_path / "fifo")
    argv, message = {
        "out a folder": (["--out", str(tmp_path / "dir")], "is a folder"),
        "out under a file": (["--out", str(tmp_path / "file" / "x.json")], "is not a folder; choose another --out"),
        "out a FIFO": (["--out", str(tmp_path / "fifo")], "is a FIFO (named pipe), not a regular file"),
        "compare not JSON": (["--compare", str(tmp_path / "bad.json")], "cannot be read as a layout matrix JSON"),
        "compare no table": (["--compare", str(tmp_path / "list.json")], "is JSON but not a layout matrix table"),
        "cache a file": (["--cache-dir", str(tmp_path / "file")], "is not a folder"),
        "unknown layout": (["--only", "tp3"], "unknown layout(s) tp3; the names are: one_m4, tp2"),
        "bad flag": (["--only"], "argument --only: expected one argument"),
    }[case]
    try:
        code = m.main((["--only", "tp2"] if "--only" not in argv else []) + argv)
    except SystemExit as e:   # (the parser's refusal)
        code = e.code
    assert code == 2
    one_line(capsys.readouterr().err, message)
    assert calls == []


def test_ctrl_c_is_one_line_and_130(m, monkeypatch, tmp_path, capsys):
    def interrupted(*a):
        raise KeyboardInterrupt
    monkeypatch.setattr(m, "train", interrupted)
    assert m.main(["--only", "tp2", "--out", str(tmp_path / "t.json")]) == 130
    assert capsys.readouterr().err.strip() == "interrupted"
    assert not (tmp_path / "t.json").exists()


def test_a_relative_cache_dir_is_the_current_folders(m, monkeypatch, tmp_path):
    """The runs start in the repository's root: `--cache-dir relcache` built the cache there."""
    calls = []
    monkeypatch.setattr(m, "train", fake_train(calls))
    monkeypatch.chdir(tmp_path)
    assert m.main(["--only", "tp2", "--out", "t.json", "--cache-dir", "relcache"]) == 0
    assert {tuple(c) for _, c in calls} == {("--cache-dir", str(tmp_path / "relcache"))}
    assert (tmp_path / "t.json").is_file()
