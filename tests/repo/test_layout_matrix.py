"""scripts/layout_matrix.py --sample: the CI sample of the layout matrix.

One layout each of the kinds a refactor of the core is most likely to break
(tp 2 with SP, pp 2 zb-h1, dp 2 ZeRO-2 and ZeRO-3, cp 2 ring, MoE at ep 2, MoE
at pp 2 interleaved), each trained by `python train.py` for 5 steps, with its
one-process reference (9 runs); the command exits 1 if a layout's loss is
further than the tests' fp32 tolerance (1e-5 relative per step, the script's
docstring) from its reference's. Measured: 2 min 50 s for this file on 2 cores
shared with two other test suites (70 s of CPU).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT

SCRIPT = os.path.join(ROOT, "scripts", "layout_matrix.py")


def _script():
    spec = importlib.util.spec_from_file_location("layout_matrix", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_sample_is_fp32_layouts_of_the_matrix_with_one_process_references():
    m = _script()
    runs, refs = m.plan(m.SAMPLE)
    assert len(m.SAMPLE) >= 6 and set(refs) == set(m.SAMPLE)
    assert all(m.tolerance(flags) == m.TOLERANCE["fp32"] for _, _, flags in runs)
    assert all(refs[n].startswith("one") and n not in m.UNCHECKED for n in m.SAMPLE)
    assert len(m.LAYOUTS) >= 40 and len({n for n, _, _ in m.LAYOUTS}) == len(m.LAYOUTS)
    assert all(1 <= nproc <= 4 for _, nproc, _ in m.LAYOUTS)


@pytest.mark.slow
def test_the_layout_matrix_sample_trains_like_one_process(cache_dir, tmp_path):
    m = _script()
    out = tmp_path / "sample.json"
    p = subprocess.run([sys.executable, SCRIPT, "--sample", "--out", str(out), "--cache-dir", cache_dir],
                       cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, f"exit {p.returncode}\n{p.stdout[-4000:]}\n{p.stderr[-3000:]}"
    for name in m.SAMPLE:   # each sampled layout has its row in the table, with a number
        assert re.search(rf"^{name} +\d +\d\.\d\de[+-]\d\d ", p.stdout, re.M), (name, p.stdout[-4000:])
    table = json.loads(out.read_text())
    digest = re.search(r"^table digest: ([0-9a-f]{64})$", p.stdout, re.M).group(1)
    assert table["digest"] == digest
    assert all(len(r["loss"]) == len(r["grad_norm"]) == m.STEPS for r in table["runs"].values())
