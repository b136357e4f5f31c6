"""Every runnable command block of tutorial.md runs and succeeds.

A block is runnable when it is fenced as bash and its first line is
`# runnable`. Each block runs with bash -e in a fresh directory that links to
the repository's scripts and package, so its `runs/` outputs go to a
temporary place and the blocks cannot drift from the code they describe.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT

BLOCK = re.compile(r"```bash\n# runnable\n(.*?)```", re.S)


def runnable_blocks() -> list[str]:
    with open(os.path.join(ROOT, "tutorial.md")) as f:
        return BLOCK.findall(f.read())


def test_the_tutorial_has_runnable_blocks():
    assert len(runnable_blocks()) >= 8


@pytest.mark.parametrize("index", range(len(runnable_blocks())))
def test_tutorial_block_runs(index, tmp_path):
    block = runnable_blocks()[index]
    for name in ("train.py", "sample.py", "eval.py", "nanohlat", "tests", "scripts", "pyproject.toml"):
        os.symlink(os.path.join(ROOT, name), tmp_path / name)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    os.symlink(sys.executable, bin_dir / "python")          # `python` in the block = this interpreter
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    p = subprocess.run(["bash", "-e", "-c", block], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, f"block {index} failed:\n{block}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
