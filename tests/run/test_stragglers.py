"""Stragglers named (run/stragglers.py): a rank slowed on purpose is named, with its coordinates, and
only it, only while it is slow.

One run of 4 gloo workers (dp 2 x pp 2), its steps in three windows of --straggler-every 3 steps:
steps 1-3 (step 1 warms up and is not timed), 4-6, in which rank 3 (dp 1, pp 1) sleeps 0.3 s before
each step (run/faults.py's `slow`, a test-only fault: NANOHLAT_FAULTS, not a flag), and 7-9. The log
and summary.json name rank 3 for steps 4-6 and nothing else: the windows before and after are runs
with no straggler, and the other ranks, which wait for rank 3 in their collectives, are not named.
--straggler-factor 3 leaves room for the noise of 4 processes sharing 2 cores (own times of ~20-60
ms; the slowed rank's is ~300 ms more). The run's shards are held to the plan's bytes per rank too.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

from dist_utils import run_layouts

LOG_ENV = "TEST_STRAGGLER_LOG"


def _log_to_file(rank: int) -> None:
    """In each worker: rank 0's stderr (where the straggler lines go) into a file the test reads."""
    if rank == 0:
        sys.stderr = open(os.environ[LOG_ENV], "w", buffering=1)


@pytest.mark.slow
def test_a_slowed_rank_is_named_with_its_coordinates_and_no_other(cache_dir, tmp_path, monkeypatch):
    out, log = tmp_path / "run", tmp_path / "rank0.err"
    monkeypatch.setenv("NANOHLAT_FAULTS", "slow:rank=3:seconds=0.3:from=4:until=6")
    monkeypatch.setenv(LOG_ENV, str(log))
    argv = ["--preset", "tiny", "--steps", "9", "--eval-every", "0", "--dp", "2", "--pp", "2", "--microbatches", "2",
            "--straggler-every", "3", "--straggler-factor", "3", "--cache-dir", cache_dir, "--out-dir", str(out)]
    run_layouts(4, [argv], str(tmp_path / "err"), setup=_log_to_file)
    lines = [line for line in log.read_text().splitlines() if "straggler" in line]
    assert len(lines) == 1, lines
    assert lines[0].startswith("warning: straggler: rank 3 (dp 1, pp 1, tp 0) took ") and "in steps 4-6" in lines[0]
    found = json.load(open(out / "summary.json"))["stragglers"]
    assert [(f["rank"], f["dp"], f["pp"], f["tp"], f["steps"]) for f in found] == [(3, 1, 1, 0, [4, 6])], found
    assert found[0]["ratio"] > 3 and found[0]["own_s"] > 0.25
    # the plan's bytes of each rank's shard (dp rank 0's write; the file adds its metadata)
    from nanohlat import plan, recipe
    model, tcfg = recipe.parse_args(argv)
    for rank in range(4):
        size = os.path.getsize(out / "checkpoints" / "step_00000009" / f"shard_{rank:05d}.pt")
        assert 0 <= size - plan.rank_bytes(model, tcfg, 4, rank) <= 64 * 1024, (rank, size)
