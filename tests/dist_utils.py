"""Run train.train() for several layouts inside one set of N spawned gloo workers.

Spawning processes (and importing torch in each) costs seconds, so a test
hands one worker group a list of runs that share a world size; each run
builds its own mesh and process groups inside the same default group.
"""

from __future__ import annotations

import os
import socket
import sys
import traceback

import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, runs: list[list[str]], err_dir: str, setup=None) -> None:
    sys.path.insert(0, ROOT)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    import train
    from nanohlat import config
    try:
        if setup is not None:   # a test's instrumentation, installed in each worker
            setup(rank)
        for argv in runs:
            model_cfg, tcfg = config.parse_args(argv + ["--no-progress", "--threads", "1"])
            train.train(model_cfg, tcfg, rank, world, rank, world)
    except BaseException:
        with open(os.path.join(err_dir, f"rank{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        raise


def run_layouts(world: int, runs: list[list[str]], err_dir: str, setup=None) -> None:
    """Train every argv in `runs` with `world` gloo workers; raise with the first rank's traceback.
    `setup(rank)`, a module-level function, runs first in each worker (e.g. to patch something)."""
    os.makedirs(err_dir, exist_ok=True)
    try:
        mp.start_processes(_worker, args=(world, _free_port(), runs, err_dir, setup), nprocs=world,
                           join=True, start_method="spawn")
    except Exception as e:
        msgs = [open(os.path.join(err_dir, n)).read() for n in sorted(os.listdir(err_dir))]
        raise AssertionError("worker failed:\n" + "\n".join(msgs[:1])) from e
