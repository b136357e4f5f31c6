"""How long a checkpoint stops training, with and without --async-save (docs/design.md 9).

    python scripts/async_save_bench.py [--preset tiny] [--steps 20] [--every 2] [--rounds 5] [--threads 1] [train.py flags]

Trains the same run in this process three ways, in interleaved rounds (the
order turned each round): saving every 2 steps synchronously, the same with
--async-save, and saving only at the end (the baseline). For each it reads
summary.json's "checkpoints": the seconds each periodic save stopped the
steps (a synchronous save: all of it; a background one: the snapshot, the
wait for the one before, the hand-over), and times the whole run. It prints
the medians over the rounds with their spread (min-max), the ratio of the
stalls, what a save cost the run's wall time (its time less the baseline's,
per save), and checks that the three runs logged the same losses, bit for bit.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(argv: list[str], out: str) -> tuple[float, dict, list[float]]:
    import train
    t0 = time.perf_counter()
    with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
        code = train.main(argv + ["--out-dir", out, "--resume", "never", "--overwrite"])
    wall = time.perf_counter() - t0
    assert code == 0, f"train.py {' '.join(argv)} exited {code}"
    with open(os.path.join(out, "summary.json")) as f:
        saves = json.load(f)["checkpoints"]
    with open(os.path.join(out, "metrics.jsonl")) as f:
        losses = [r["loss"] for r in map(json.loads, f) if "loss" in r]
    return wall, saves, losses


def spread(xs: list[float], unit: float = 1e3) -> str:
    return f"{statistics.median(xs) * unit:.1f} ({min(xs) * unit:.1f}-{max(xs) * unit:.1f})"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--every", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    args, extra = p.parse_known_args()   # (the rest: train.py's flags, e.g. a larger --d-model)
    base = ["--preset", args.preset, "--steps", str(args.steps), "--eval-every", "0", "--no-progress",
            "--threads", str(args.threads), "--keep-last", "2", *extra]
    ways = {"sync": ["--save-every", str(args.every)], "async": ["--save-every", str(args.every), "--async-save"],
            "end only": []}
    stalls = {"sync": [], "async": []}
    walls = {w: [] for w in ways}
    root = tempfile.mkdtemp(prefix="async-bench-")
    reference = None
    for r in range(args.rounds):
        order = list(ways) if r % 2 == 0 else list(reversed(ways))
        for way in order:
            wall, saves, losses = run(base + ways[way], os.path.join(root, way.replace(" ", "_")))
            walls[way].append(wall)
            reference = reference or losses
            assert losses == reference, f"{way}: the losses differ from the first run's"
            if way == "sync":
                stalls["sync"] += saves["sync_stall_s"][:-1]   # the periodic saves (the last is the run's end)
            elif way == "async":
                stalls["async"] += saves["stall_s"]
    n = (args.steps - 1) // args.every   # periodic saves a run (the last step's is the run's end)
    print(f"{' '.join([args.preset, *extra])}, {args.steps} steps, a save every {args.every} ({n} periodic + the last), "
          f"{args.threads} thread(s), {args.rounds} interleaved rounds; ms, median (min-max)")
    print(f"  stall per periodic save: sync {spread(stalls['sync'])}, --async-save {spread(stalls['async'])}; "
          f"ratio sync / async {statistics.median(stalls['sync']) / statistics.median(stalls['async']):.1f}x")
    base_wall = statistics.median(walls["end only"])
    for way in ("sync", "async"):
        per = [(w - base_wall) / n for w in walls[way]]
        print(f"  {way}: run {spread(walls[way], 1)} s; wall time a periodic save added to the run "
              f"(its run less the median end-only run, / {n}): {spread(per)} ms")
    print(f"  end-only run {spread(walls['end only'], 1)} s; losses of all {3 * args.rounds} runs: the same, bit for bit")
    shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
