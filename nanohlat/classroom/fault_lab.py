"""The fault lab: kill a real run again and again, and hold what it lost to Young and Daly's formula.

    python -m nanohlat.classroom fault OUT [--kills N] [--gap G] [--seed S] [--fault SPEC ...] [-- train.py flags]

It trains twice from scratch into OUT: `OUT/reference` without a fault, and
`OUT/faulted` with N kills planted (run/faults.py: NANOHLAT_FAULTS), each a
kill -9 of a rank drawn at random at a step drawn at random: the gaps between
kills are drawn from an exponential distribution of mean G steps, rounded up to whole steps (failures
that come at random, as Young's model has them), with the seed S, so that a
lab repeats exactly. The faulted run has --max-restarts enough for all of
them: the launcher restarts the job after each kill from the newest complete
checkpoint by itself (preflight.worker), and its record says what each cost
(run/restarts.py). `--fault` adds another fault after the kills (a hang, a
slow rank, a full disk during a save: run/faults.py's kinds).

What it compares, per kill: the steps recomputed (the steps trained since the
newest complete checkpoint, done again) against the formula's expectation.
Young's model (plan/failures.py) loses half an interval per failure on
average, tau / 2 = k / 2 steps with --save-every k, for a failure at a
random instant. The lab kills at the end of a step (once its work is done,
before its save), which is half a step later on average: (k + 1) / 2 steps.
Its tolerance is three standard errors of the mean of N kills: a kill's loss
is spread evenly over 1..k, whose standard deviation is sqrt((k^2 - 1) / 12).
It prints the seconds lost beside them: the redone steps at the reference
run's pace, and the rest, restarting (the launcher, new workers, loading the
checkpoint), which the interval does not change and the formula leaves out.
And the final loss of the faulted run must equal the reference's, bit for bit.

Exit code 0 when both hold, 1 when either does not, 2 for bad input.
"""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys

from nanohlat.config import UserError


def kill_plan(kills: int, gap: float, seed: int, world: int) -> list[tuple[int, int]]:
    """(rank, step) of each kill: the steps first, sums of exponential gaps of mean `gap` (at least one step
    apart, so each restarted attempt gets past the kill before it), the same for any world; then the ranks."""
    rng, step, steps = random.Random(seed), 0, []
    for _ in range(kills):
        step += max(1, math.ceil(rng.expovariate(1 / gap)))
        steps.append(step)
    return [(rng.randrange(world), s) for s in steps]


def expected(k: int, kills: int) -> tuple[float, float]:
    """(steps recomputed a kill is expected to cost, the tolerance of the mean of `kills`): (k + 1) / 2 for a
    kill at the end of a step, three standard errors of a loss spread evenly over 1..k (module docstring)."""
    return (k + 1) / 2, 3 * math.sqrt((k * k - 1) / 12) / math.sqrt(kills)


def _records(out: str) -> list[dict]:
    path = os.path.join(out, "metrics.jsonl")
    with open(path, encoding="utf-8") as f:
        return [r for r in map(json.loads, f) if isinstance(r, dict)]


def _train(root: str, argv: list[str], out: str, env: dict) -> None:
    """train.py of `root` with `argv` into `out`, from scratch, quietly; UserError with its last line if it fails."""
    cmd = [sys.executable, os.path.join(root, "train.py"), *argv, "--out-dir", out, "--resume", "never",
           "--overwrite", "--no-progress"]
    done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise UserError(f"the fault lab's run into {out} failed (exit {done.returncode}): {last}")


def run(out: str, kills: int, gap: float, seed: int, extra: list[str], argv: list[str], root: str) -> int:
    """The lab (module docstring). Returns the exit code."""
    from nanohlat import recipe
    from nanohlat.run import faults
    from nanohlat.system import flags
    if kills < 1 or not 0 < gap < 1e6:
        raise UserError(f"--kills must be at least 1 and --gap a number of steps > 0, got {kills} and {gap:g}")
    _, tcfg = recipe.parse_args(argv, flags.Parser)   # (bad flags: one line here, before anything runs)
    k, world = tcfg.save_every, tcfg.nproc
    if k < 1:
        raise UserError("give train.py's --save-every N (N >= 1): the lab measures the work lost between checkpoints")
    plan = kill_plan(kills, gap, seed, world)
    steps = plan[-1][1] + k   # the run goes a checkpoint past the last kill
    spec = [f"kill:rank={r}:step={s}:attempt={i}" for i, (r, s) in enumerate(plan)]
    for j, item in enumerate(extra):   # --fault: after the kills, unless it names its attempt
        spec.append(item if "attempt=" in item or item.startswith("slow") else f"{item}:attempt={kills + j}")
    faults.parse(";".join(spec))   # (a malformed --fault: one line here)
    argv = [*argv, "--steps", str(steps)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    env.pop(faults.ENV, None)
    print(f"fault lab: {kills} kill(s) of a random rank at random steps (gaps from an exponential of mean {gap:g} "
          f"steps rounded up to whole steps, seed {seed}), --save-every {k}, {world} process(es), {steps} steps; "
          f"runs in {out}", flush=True)
    out = os.path.abspath(out)   # (train.py runs in the repository's root)
    ref_dir, bad_dir = os.path.join(out, "reference"), os.path.join(out, "faulted")
    _train(root, argv, ref_dir, env)
    restarts = kills + sum(1 for e in extra if not e.startswith("slow"))
    _train(root, [*argv, "--max-restarts", str(restarts)], bad_dir, dict(env, **{faults.ENV: ";".join(spec)}))
    return report(plan, k, steps, _records(ref_dir), _records(bad_dir))


def step_seconds(records: list[dict]) -> float:
    """A run's median seconds a step, from its metrics.jsonl records (tokens a step / tokens_per_s)."""
    steps = sorted((r["step"], r["tokens"], r["tokens_per_s"]) for r in records
                   if "loss" in r and r.get("tokens_per_s"))
    if not steps:
        return float("nan")
    per_step = steps[0][1] // steps[0][0]
    rates = sorted(per_step / tps for _, _, tps in steps)
    return rates[len(rates) // 2]


def report(plan: list[tuple[int, int]], k: int, steps: int, ref: list[dict], bad: list[dict]) -> int:
    """The lab's table and verdict from the two runs' metrics.jsonl records. Returns the exit code."""
    starts = {r["restart"]: r for r in bad if "restart" in r}
    lost = {r["recovered"]: r["seconds_lost"] for r in bad if "recovered" in r}
    rows, recomputed = [], []
    print("  kill  rank  at step  resumed from  steps recomputed  seconds lost")
    for i, (rank, step) in enumerate(plan, 1):
        r = starts.get(i)
        if r is None:
            print(f"  {i:4d}  {rank:4d}  {step:7d}  (no restart recorded)")
            continue
        recomputed.append(r["steps_recomputed"])
        rows.append(lost.get(i))
        print(f"  {i:4d}  {rank:4d}  {step:7d}  {r['step']:12d}  {r['steps_recomputed']:16d}  "
              + (f"{lost[i]:12.1f}" if i in lost else f"{'?':>12}"))
    for i in sorted(set(starts) - set(range(1, len(plan) + 1))):
        print(f"  restart {i} (a --fault): resumed from step {starts[i]['step']}, "
              f"{starts[i]['steps_recomputed']} steps recomputed")
    mean, tol = expected(k, len(plan))
    got = sum(recomputed) / len(recomputed) if recomputed else float("nan")
    within = len(recomputed) == len(plan) and abs(got - mean) <= tol
    print(f"  steps recomputed: {sum(recomputed)} in all, {got:.2f} per kill; Young/Daly: half an interval, "
          f"{k}/2 = {k / 2:g} steps, + 1/2 (a kill at a step's end, after its work) = {mean:.2f} per kill, "
          f"within +-{tol:.2f} (3 standard errors of {len(plan)} kills): {'yes' if within else 'NO'}")
    pace = step_seconds(ref)
    seconds = sum(x for x in rows if x is not None)
    print(f"  seconds lost: {seconds:.1f} in all, {seconds / max(1, len(rows)):.1f} per kill: redoing "
          f"{sum(recomputed)} steps at the uninterrupted run's pace ({pace * 1e3:.0f} ms a step, its median) "
          f"~{sum(recomputed) * pace:.1f} s, the rest restarting (the launcher, the workers, loading the checkpoint), "
          f"the same at any interval")
    final_ref = [r["loss"] for r in ref if "loss" in r and r["step"] == steps]
    final_bad = [r["loss"] for r in bad if "loss" in r and r["step"] == steps]
    same = bool(final_ref and final_bad and final_ref[-1] == final_bad[-1])
    print(f"  final loss: {final_ref[-1] if final_ref else float('nan'):.6f} uninterrupted, "
          f"{final_bad[-1] if final_bad else float('nan'):.6f} with the {len(plan)} kill(s): "
          + ("the same, bit for bit" if same else "DIFFERENT"))
    return 0 if within and same else 1
