"""A run of HLAT's recipe builds and trains from the core alone (issue 57, docs/design.md 1).

What HLAT did not train with lives in nanohlat/beyond/ and is applied from outside the core, each
extension imported by run/build.py (and the plan, the timeline) only where its flag is handled. So a
run whose flags ask for nothing beyond HLAT's recipe (tp with or without sequence parallelism, pp under
AFAB or 1F1B, dp with ZeRO 0 or 1, any precision, activation checkpointing, the CPU's fast AdamW)
never loads a module of nanohlat/beyond/. Here each worker makes `nanohlat.beyond` unimportable before
it imports train.py, trains such layouts, and checks at the end that no module of beyond/ was loaded;
the same layouts trained with beyond/ importable give the same losses and grad norms, bit for bit.
The workers are two gloo processes (one group for every layout, as dist_utils.run_layouts); about 25 s
on 2 cores.
"""

from __future__ import annotations

import importlib.abc
import sys

import pytest

from conftest import read_metrics
from dist_utils import fixed_threads, run_layouts, spawn_workers

BASE = ["--preset", "tiny", "--steps", "3", "--eval-every", "0", "--batch-size", "8", "--seq-len", "32",
        "--warmup-steps", "1", "--device", "cpu"]
LAYOUTS = {   # two processes each: the must-haves of the issue, and a checkpoint in each
    "tp2_sp": ["--tp", "2", "--sequence-parallel", "--activation-checkpointing", "selective"],
    "pp2_1f1b": ["--pp", "2", "--schedule", "1f1b", "--microbatches", "2"],
    "pp2_afab": ["--pp", "2", "--schedule", "afab", "--microbatches", "2", "--activation-checkpointing", "full"],
    "dp2_zero1": ["--dp", "2", "--zero", "1"],
    "dp2_bf16_sr": ["--dp", "2", "--precision", "bf16-sr"],
}


class _NoBeyond(importlib.abc.MetaPathFinder):
    """An import finder that refuses every module of nanohlat/beyond/."""

    def find_spec(self, name, path=None, target=None):
        if name == "nanohlat.beyond" or name.startswith("nanohlat.beyond."):
            raise ImportError(f"{name}: nanohlat/beyond/ is unimportable in this test")
        return None


def _beyond_loaded() -> list[str]:
    return sorted(m for m in sys.modules if m == "nanohlat.beyond" or m.startswith("nanohlat.beyond."))


def _train_without_beyond(rank: int, world: int, runs: list[list[str]]) -> None:
    """dist_utils._train with nanohlat/beyond/ unimportable from before train.py is imported."""
    assert not _beyond_loaded(), _beyond_loaded()   # (what the worker inherited: nothing of it)
    sys.meta_path.insert(0, _NoBeyond())
    import train
    from nanohlat import recipe
    from nanohlat.run import preflight
    for argv in runs:
        model_cfg, tcfg = recipe.parse_args(argv + ["--no-progress", "--threads", str(fixed_threads())])
        train.train(*preflight.inputs(model_cfg, tcfg, world, rank))
    assert not _beyond_loaded(), _beyond_loaded()


def _runs(cache_dir, root) -> list[list[str]]:
    return [BASE + flags + ["--cache-dir", cache_dir, "--out-dir", str(root / name), "--save-every", "2"]
            for name, flags in LAYOUTS.items()]


@pytest.fixture(scope="module")
def both(cache_dir, tmp_path_factory):
    """Every layout trained twice: beyond/ unimportable, then importable."""
    alone, usual = tmp_path_factory.mktemp("alone"), tmp_path_factory.mktemp("usual")
    spawn_workers(_train_without_beyond, 2, (_runs(cache_dir, alone),), str(alone / "errors"))
    run_layouts(2, _runs(cache_dir, usual), str(usual / "errors"))
    return alone, usual


@pytest.mark.parametrize("name", LAYOUTS)
def test_a_layout_of_hlats_recipe_trains_without_beyond_bit_for_bit(name, both):
    alone, usual = (read_metrics(str(root / name)) for root in both)
    assert [m["step"] for m in alone] == [1, 2, 3]
    assert [(m["loss"], m["grad_norm"]) for m in alone] == [(m["loss"], m["grad_norm"]) for m in usual]


def test_a_blocked_beyond_is_really_unimportable():
    """The negative control: the finder the workers install does refuse beyond/ (a layout that needs it
    would fail there: a run with --zero 2 imports zero2.py)."""
    finder = _NoBeyond()
    sys.meta_path.insert(0, finder)
    saved = {m: sys.modules.pop(m) for m in _beyond_loaded()}
    try:
        with pytest.raises(ImportError, match="unimportable"):
            import nanohlat.beyond.zero2  # noqa: F401
    finally:
        sys.meta_path.remove(finder)
        sys.modules.update(saved)


def test_the_recipe_and_the_tools_answer_as_the_extensions_do():
    """What lets a dense run skip beyond/ must not drift from it: the recipe's names for --schedule's
    and --cp-attention's values are the extensions' own, and tools/orders.py (the core's AFAB and 1F1B,
    beyond/schedules.py's only for its own schedules) gives every schedule's stage ops, dependencies,
    timetable and layers as beyond/schedules.py does."""
    from nanohlat.beyond import context_parallel, schedules
    from nanohlat.recipe.configs import CP_ATTENTIONS, SCHEDULES
    from nanohlat.tools import orders
    assert SCHEDULES == schedules.SCHEDULES and CP_ATTENTIONS == context_parallel.ALGORITHMS
    for schedule, pp, m, v in [("afab", 2, 3, 1), ("1f1b", 4, 8, 1), ("interleaved", 2, 4, 2), ("zb-h1", 4, 8, 1)]:
        assert orders.timetable(schedule, pp, m, v) == schedules.timetable(schedule, pp, m, v)
        for stage in range(pp):
            ops = orders.stage_ops(schedule, pp, m, stage, v)
            assert ops == schedules.stage_ops(schedule, pp, m, stage, v)
            assert [orders.depends_on(schedule, op, stage, pp, v) for op in ops] == \
                [schedules.depends_on(op, stage, pp, v) for op in ops]
            for chunk in range(v):
                assert orders.chunk_layers(8, pp, stage, chunk, v) == schedules.chunk_layers(8, pp, stage, chunk, v)
