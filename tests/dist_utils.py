"""The one way the tests start gloo workers: `spawn_workers`.

Spawning processes (and importing torch in each) costs seconds, so a test
hands one worker group as much work as it can: `run_layouts` trains a list of
runs that share a world size in one group; each run builds its own mesh and
process groups inside the same default group.
"""

from __future__ import annotations

import os
import sys
import traceback

import torch.multiprocessing as mp

from nanohlat.run.launch import free_port, start_method

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

__all__ = ["free_port", "spawn_workers", "run_layouts", "fixed_threads", "assert_same_weights"]

# The tests that fix a CPU thread count (workers, tutorial commands with
# --threads 1) use this one, 1 unless the environment says otherwise. Results
# must not depend on it beyond the tolerances the tests state, so .ci/run runs
# the layout-equivalence and tutorial tests once more with another count.
THREADS_ENV = "NANOHLAT_TEST_THREADS"


def fixed_threads() -> int:
    """CPU threads per process for the tests that fix them: $NANOHLAT_TEST_THREADS, else 1."""
    value = os.environ.get(THREADS_ENV, "1")
    if not (value.isdigit() and int(value) >= 1):
        raise ValueError(f"{THREADS_ENV}={value!r}: give a whole number of threads, at least 1 (or unset it for 1)")
    return int(value)


def _entry(rank: int, fn, world: int, port: int, args: tuple, err_dir: str, env: dict) -> None:
    sys.path.insert(0, ROOT)
    os.environ.clear()   # a forkserver worker starts with the server's environment: use ours (launch.start_method)
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    try:
        fn(rank, world, *args)
    except BaseException:
        with open(os.path.join(err_dir, f"rank{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        raise


def spawn_workers(fn, world: int, args: tuple, err_dir: str) -> None:
    """Run fn(rank, world, *args) in `world` new processes that can join one
    gloo group through env:// (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE are
    set; fn, or the train() it calls, creates the group). fn must be a module-level
    function. Raises AssertionError with the first failing rank's traceback."""
    os.makedirs(err_dir, exist_ok=True)
    try:
        mp.start_processes(_entry, args=(fn, world, free_port(), args, err_dir, dict(os.environ)), nprocs=world,
                           join=True, start_method=start_method())
    except Exception as e:
        msgs = [open(os.path.join(err_dir, n)).read() for n in sorted(os.listdir(err_dir))]
        raise AssertionError("worker failed:\n" + "\n".join(msgs[:1])) from e


def _train(rank: int, world: int, runs: list[list[str]], setup=None) -> None:
    import train
    from nanohlat import recipe
    from nanohlat.run import preflight
    if setup is not None:   # a test's instrumentation, installed in each worker
        setup(rank)
    for argv in runs:
        model_cfg, tcfg = recipe.parse_args(argv + ["--no-progress", "--threads", str(fixed_threads())])
        train.train(*preflight.inputs(model_cfg, tcfg, world, rank))


def run_layouts(world: int, runs: list[list[str]], err_dir: str, setup=None) -> None:
    """Train every argv in `runs` with `world` gloo workers; raise with the first rank's traceback.
    `setup(rank)`, a module-level function, runs first in each worker (e.g. to patch something)."""
    spawn_workers(_train, world, (runs, setup), err_dir)


# The consolidated weights of a layout against one process's, per tensor: at most
# 0.5% of its elements (or 3, if more) differ by more than 1e-6, none by more than
# 1e-4. tests/core/test_layouts_equal_one_process.py's docstring says why two numbers, and measured them.
WEIGHT_TOL, WEIGHT_MAX, OUTLIER_SHARE, OUTLIERS_MIN = 1e-6, 1e-4, 5e-3, 3


def assert_same_weights(out_dir, ref_weights: dict) -> None:
    """The run in out_dir, loaded as every command loads it, holds ref_weights."""
    from nanohlat import device
    from nanohlat.serving.generate import load_model   # the loader of every command
    model, _ = load_model(str(out_dir), device.get_device("cpu"))
    for name, p in model.named_parameters():
        diff = (p - ref_weights[name]).abs()
        assert diff.max().item() < WEIGHT_MAX, f"{name} differs by {diff.max().item()}"
        outliers = int((diff > WEIGHT_TOL).sum())
        assert outliers <= max(OUTLIERS_MIN, OUTLIER_SHARE * diff.numel()), \
            f"{name}: {outliers} of {diff.numel()} elements differ by more than {WEIGHT_TOL}"
