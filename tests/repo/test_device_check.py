"""scripts/device_check.py, the CPU side of it: no GPU is lent to CI, so what runs here is its
refusal without CUDA and the logic that makes its one table, on made-up figures (and on the
bench's own formatting, so a change of the bench's lines cannot leave its parser behind)."""

import importlib.util
import os

import pytest
import torch

from conftest import ROOT
from nanohlat.bench import ratios

SCRIPT = os.path.join(ROOT, "scripts", "device_check.py")


def load():
    spec = importlib.util.spec_from_file_location("device_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_without_cuda_it_refuses_in_one_line(capsys):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: the script would run")
    assert load().main([]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("error: scripts/device_check.py checks nanohlat "
                                                                  "on a CUDA device, and torch sees none here")


def test_the_table_from_made_up_figures():
    dc = load()
    assert dc.compare_losses([6.0, 5.5], [6.0, 5.5003], 1e-4) == (pytest.approx(0.0003 / 5.5003), True)
    worst, ok = dc.compare_losses([6.0, 5.6], [6.0, 5.5], 1e-4)
    assert not ok and worst == pytest.approx(0.1 / 5.5)
    assert dc.compare_losses([6.0], [6.0, 5.5], 1e-4)[1] is False          # a run cut short never passes
    assert dc.compare_losses([6.0], [], 1e-4)[1] is False                  # nor one without a CPU reference
    assert dc.plan_ratio(105, 100) == (1.05, True)
    assert dc.plan_ratio(99, 100)[1] is False and dc.plan_ratio(120, 100)[1] is False   # under, or too far over
    assert dc.plan_ratio(100, None) == (None, False)
    text = dc.table([dict(check="losses", case="dense eager", measured="3.1e-06 rel. vs cpu (10 steps)",
                          limit="<= 0.0001", verdict="PASS"),
                     dict(check="bench", case="1b bf16 vs hf-llama", verdict="skipped: out of time")])
    lines = text.splitlines()
    assert lines[0].split() == ["check", "case", "measured", "limit", "verdict"]
    assert lines[1].split()[-1] == "PASS" and lines[2].endswith("skipped: out of time")
    assert len({line.index(" dense") if " dense" in line else line.index(" case") for line in lines[:2]}) == 1


def test_it_reads_the_benchs_own_lines():
    """parse_bench on what bench.report and bench.ratio_line print (made-up step times)."""
    dc = load()
    times = {"nanohlat": [0.10, 0.11, 0.10, 0.12], "hf-llama": [0.11, 0.11, 0.12, 0.12]}
    fwd = {"nanohlat": [0.08] * 4, "hf-llama": [0.09] * 4}
    first = {"nanohlat": 1.0, "hf-llama": 1.0}
    out = "\n".join([ratios.report(times, fwd, first, {}, {}, 2048, 6e9, 989e12, {"nanohlat": "hf-llama"}),
                     ratios.load_line((0.5, 1.0), 16, None), ratios.ratio_line(times, "nanohlat", "hf-llama")])
    got = dc.parse_bench(out)
    assert got["rounds"] == 4 and got["ratio"] == pytest.approx(1.0, abs=0.11)
    assert got["mfu_nanohlat"] > got["mfu_hf-llama"] > 0
