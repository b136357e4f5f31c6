"""run/cpu_memory.py: on glibc, what a step frees stays in the process, so the next step takes no
page faults for it; elsewhere it does nothing and says so; train.py's CPU processes set it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT
from nanohlat.run import cpu_memory

# A step's pattern, cut down: four 16 MB tensors made (every page touched) and freed, four
# times, in a fresh process, counting the minor page faults of each round; then again after
# keep_freed_memory. 16 MB is past glibc's first mmap threshold (128 KB) and 64 MB freed at
# once past its trim threshold (twice the largest block freed), as the default preset's are.
ROUNDS = """
import json, resource, sys, torch
from nanohlat.run import cpu_memory

def faults():
    out = []
    for _ in range(4):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        kept = [torch.ones(4 << 20) for _ in range(4)]
        del kept
        out.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return out

first = faults()
kept = cpu_memory.keep_freed_memory()
print(json.dumps({"first": first, "kept": kept, "then": faults()}))
"""
PAGES = 4 * (16 << 20) // 4096   # the pages a round touches (4 KB pages)


@pytest.mark.skipif(not cpu_memory.glibc() or sys.platform != "linux", reason="glibc's malloc only")
def test_a_step_after_the_first_faults_no_page():
    out = subprocess.run([sys.executable, "-c", ROUNDS], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["kept"] is True
    # glibc as it comes gives the memory back every round: the kernel hands each page out again
    if max(got["first"][1:]) < PAGES // 2:
        pytest.skip(f"this C library keeps the memory already ({got['first']} faults a round): nothing to show")
    assert min(got["first"][1:]) > PAGES // 2, got
    # kept: the rounds after the first reuse the same pages
    assert max(got["then"][1:]) < PAGES // 100, got


def test_elsewhere_it_does_nothing_and_says_so(monkeypatch):
    def no_glibc(name):
        raise ValueError(f"unrecognized configuration name {name}")   # what os.confstr raises off glibc
    monkeypatch.setattr(cpu_memory.os, "confstr", no_glibc)
    assert cpu_memory.glibc() is False
    assert cpu_memory.keep_freed_memory() is False


def test_a_cpu_process_of_train_py_keeps_it(monkeypatch):
    import torch
    from nanohlat import recipe
    from nanohlat.run import preflight
    calls = []
    monkeypatch.setattr(cpu_memory, "keep_freed_memory", lambda: calls.append("kept") or True)
    with torch.random.fork_rng():   # (join seeds torch's generators: this test's process keeps its own)
        preflight.join(recipe.TrainConfig(device="cpu", threads=torch.get_num_threads()))
    assert calls == ["kept"]
