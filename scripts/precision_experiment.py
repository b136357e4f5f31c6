"""The precision experiment: does pure bf16 with round-to-nearest stall while
stochastic rounding keeps up with fp32? (docs/precision.md has the results.)

Trains the `small` preset on the built-in corpus once per --precision, same
seed and steps, then prints a table of the losses and draws the curves:

    python scripts/precision_experiment.py --steps 40                 # ~15-20 min on 2 busy CPU cores
    python scripts/precision_experiment.py --steps 300 --out-root runs/precision-cuda -- --device cuda
    python scripts/precision_experiment.py --steps 300 --out-root runs/precision-cuda-lowlr \\
        -- --device cuda --lr 3e-4 --min-lr 3e-5                      # small updates: where rounding bites
    python scripts/precision_experiment.py --report-only --out-root runs/precision-cuda \\
        --out-root runs/precision-cuda-lowlr --out-root runs/precision --plot docs/precision_loss.png

Each run is exactly

    python train.py --preset small --precision P --out-dir ROOT/P --steps S --no-progress \\
        --resume never --overwrite [anything after --]

(--resume never --overwrite so that a rerun starts over instead of resuming).
Nothing here is a test: it takes minutes and asserts nothing. The table and
the picture (with matplotlib installed) are made from the runs' metrics.jsonl;
from their final checkpoints, two diagnostics: the share of weights still at
their initial value, and the share of AdamW updates (from the fp32 run's
state) that round-to-nearest bf16 would drop.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRECISIONS = ("fp32", "bf16", "bf16-sr", "bf16-mixed")
# a mode is a --precision, or one of these: a precision with more flags
VARIANTS = {"bf16-sr-m16": ["--precision", "bf16-sr", "--moments", "bf16"]}   # HLAT's pure bf16: bf16 moments too


def run(precision: str, steps: int, out_dir: str, extra: list[str]) -> float:
    """One training run; returns its wall time in seconds."""
    flags = VARIANTS.get(precision, ["--precision", precision])
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--preset", "small", *flags,
           "--out-dir", out_dir, "--steps", str(steps), "--no-progress", "--resume", "never", "--overwrite",
           *extra]
    print("$ python " + " ".join([os.path.relpath(cmd[1], ROOT)] + cmd[2:]), flush=True)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT)
    return time.perf_counter() - t0


def read_run(out_dir: str) -> dict:
    """{'loss': {step: loss}, 'val': {step: val_loss}, 'config': ..., 'tokens_per_s': median}."""
    loss, val, tps = {}, {}, []
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            if "loss" in r:
                loss[r["step"]] = r["loss"]
                if r.get("tokens_per_s"):
                    tps.append(r["tokens_per_s"])
            if "val_loss" in r:
                val[r["step"]] = r["val_loss"]
    cfg_path = os.path.join(out_dir, "config.json")
    config = json.load(open(cfg_path)) if os.path.isfile(cfg_path) else {}
    tps.sort()
    return {"loss": loss, "val": val, "config": config, "tokens_per_s": tps[len(tps) // 2] if tps else None}


def smoothed(loss: dict, step: int, window: int) -> float:
    """Mean train loss over the `window` steps ending at `step` (fewer at the start)."""
    vals = [loss[s] for s in range(step - window + 1, step + 1) if s in loss]
    return sum(vals) / len(vals) if vals else math.nan


def report_steps(runs: dict, rows: int = 6) -> list[int]:
    """The steps that have a val_loss in every run (eval_every and the last
    step), or, when those are fewer than `rows`, also evenly spaced train steps."""
    evals = train = None
    for r in runs.values():
        evals = set(r["val"]) if evals is None else evals & set(r["val"])
        train = set(r["loss"]) if train is None else train & set(r["loss"])
    steps = set(evals or [])
    last = max(train or [0])
    if len(steps) < rows and last:
        steps |= {s for s in (round(last * (i + 1) / rows) for i in range(rows)) if s in train}
    return sorted(steps)


def val_text(r: dict, step: int) -> str:
    return f"{r['val'][step]:8.4f}" if step in r["val"] else f"{'-':>8}"


def table(root: str, runs: dict, window: int) -> str:
    names = list(runs)
    cfg = next(iter(runs.values()))["config"].get("train", {})
    lines = [f"{root}: lr {cfg.get('lr')} -> {cfg.get('min_lr')}, {cfg.get('steps')} steps, "
             f"batch {cfg.get('batch_size')} x {cfg.get('seq_len')}, device {cfg.get('device')}",
             f"train = mean train loss over the last {window} steps; val = held-out loss "
             f"({cfg.get('eval_batches')} batches)", ""]
    head = f"{'step':>5} | " + " | ".join(f"{n:^17}" for n in names)
    lines += [head, f"{'':>5} | " + " | ".join(f"{'train':>8} {'val':>8}" for _ in names), "-" * len(head)]
    for s in report_steps(runs):
        cells = [f"{smoothed(runs[n]['loss'], s, window):8.4f} {val_text(runs[n], s)}" for n in names]
        lines.append(f"{s:>5} | " + " | ".join(cells))
    evals = [s for s in report_steps(runs) if all(s in r["val"] for r in runs.values())]
    if "fp32" in runs and evals:
        last = evals[-1]
        ref = runs["fp32"]["val"][last]
        lines.append("")
        lines.append(f"val loss at step {last} minus fp32's: " + ", ".join(
            f"{n} {runs[n]['val'][last] - ref:+.4f}" for n in names if n != "fp32"))
    tps = ", ".join(f"{n} {runs[n]['tokens_per_s']:,.0f}" for n in names if runs[n]["tokens_per_s"])
    lines.append(f"median tokens/s: {tps}")
    return "\n".join(lines)


def rounding_report(run_dir: str) -> str:
    """Which Adam updates would round-to-nearest bf16 drop? From a run's final
    checkpoint (fp32 master weights and moments): the AdamW update each element
    would get, at the peak and at the final learning rate, against half the
    bf16 spacing at that weight. An update below half a spacing leaves a bf16
    weight unchanged under round-to-nearest (and moves it with probability
    |update| / spacing under stochastic rounding)."""
    import torch
    sys.path.insert(0, ROOT)
    from nanohlat.run import checkpoint
    path = checkpoint.latest(run_dir)
    if path is None:
        return f"(no checkpoint in {run_dir}: no rounding report)"
    shards = checkpoint.ShardSet(path)
    manifest = shards.manifest
    t = manifest["config"]["train"]
    k = manifest["schedule"]["optimizer_step"]
    bc1, bc2 = 1 - t["beta1"] ** k, 1 - t["beta2"] ** k
    names = sorted(next(iter(shards.shards.values()))["meta"])
    rows = {"matrices": [], "norm gains": []}
    for name in names:
        w = shards.full(name, "optim", "master")
        m, v = shards.full(name, "optim", "exp_avg"), shards.full(name, "optim", "exp_avg_sq")
        adam = (m / bc1) / ((v / bc2).sqrt() + t["adam_eps"])
        decay = t["weight_decay"] * w if w.ndim >= 2 else torch.zeros_like(w)
        half = torch.ldexp(torch.ones_like(w), torch.frexp(w.abs()).exponent - 8) / 2  # half a bf16 spacing
        live = w != 0          # padded vocabulary rows stay exactly zero
        rows["matrices" if w.ndim >= 2 else "norm gains"].append((adam[live], decay[live], half[live], w[live]))
    lines = [f"AdamW updates vs bf16 spacing, from {path} (fp32 state after {k} steps):",
             "share of elements whose update is under half a bf16 spacing, i.e. that a "
             "round-to-nearest bf16 weight would not take:",
             f"{'':<12} {'at lr ' + format(t['lr'], 'g'):>14} {'at lr ' + format(t['min_lr'], 'g'):>14} "
             f"{'decay alone':>12} {'median |w|':>11}"]
    for kind, parts in rows.items():
        if not parts:
            continue
        adam, decay, half, w = (torch.cat([p[i].reshape(-1) for p in parts]) for i in range(4))
        cells = [f"{((lr * (adam + decay)).abs() < half).float().mean().item():>14.1%}" for lr in (t["lr"], t["min_lr"])]
        wd = f"{((t['lr'] * decay).abs() < half).float().mean().item():>12.1%}" if kind == "matrices" else f"{'-':>12}"
        lines.append(f"{kind:<12} {cells[0]} {cells[1]} {wd} {w.abs().median().item():>11.3g}")
    return "\n".join(lines)


def frozen_report(root: str, precisions) -> str:
    """Share of weights still exactly at their initial value at the end of each
    run (from its final checkpoint): the direct sign of updates being rounded away."""
    import torch
    sys.path.insert(0, ROOT)
    from nanohlat.run import checkpoint
    from nanohlat import recipe
    from nanohlat.model import full_init
    from nanohlat.precision import param_dtype
    lines = [f"share of weights still exactly at their initial value after the last step ({root}):",
             f"{'':<12} {'norm gains':>11} {'matrices':>10}"]
    for prec in precisions:
        path = checkpoint.latest(os.path.join(root, prec))
        if path is None:
            continue
        shards = checkpoint.ShardSet(path)
        cfg = shards.manifest["config"]
        model_cfg, seed = recipe.model_from_dict(cfg["model"]), cfg["train"]["seed"]
        same = {1: [0, 0], 2: [0, 0]}
        for name in sorted(next(iter(shards.shards.values()))["meta"]):
            w = shards.full(name)
            init = full_init(name, w.shape, model_cfg, seed).to(param_dtype(cfg["train"]["precision"])).float()
            live = init != 0 if name in ("embed.weight", "head.weight") else torch.ones_like(w, dtype=torch.bool)
            same[min(w.ndim, 2)][0] += int(((w == init) & live).sum())
            same[min(w.ndim, 2)][1] += int(live.sum())
        lines.append(f"{prec:<12} {same[1][0] / same[1][1]:>11.1%} {same[2][0] / same[2][1]:>10.1%}")
    return "\n".join(lines)


def plot(experiments: list[tuple[str, dict]], window: int, path: str) -> None:
    """One row per experiment: smoothed train loss (val loss as dots), and the
    difference of each run's smoothed train loss to fp32's."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    colors = {"fp32": "black", "bf16": "tab:red", "bf16-sr": "tab:blue", "bf16-mixed": "tab:green",
              "bf16-sr-m16": "tab:purple"}
    fig, axes = plt.subplots(len(experiments), 2, figsize=(12, 4.2 * len(experiments)), squeeze=False)
    for row, (root, runs) in zip(axes, experiments):
        cfg = next(iter(runs.values()))["config"].get("train", {})
        title = (f"{os.path.basename(root.rstrip('/'))}: lr {cfg.get('lr')} -> {cfg.get('min_lr')}, "
                 f"{cfg.get('steps')} steps, {cfg.get('device')}")
        ref = runs.get("fp32")
        for name, r in runs.items():
            steps = sorted(r["loss"])
            sm = [smoothed(r["loss"], s, window) for s in steps]
            c = colors.get(name)
            row[0].plot(steps, sm, label=name, color=c, lw=1.4)
            vs = sorted(r["val"])
            row[0].plot(vs, [r["val"][s] for s in vs], "o", color=c, ms=4)
            if ref is not None and name != "fp32":
                common = [s for s in steps if s in ref["loss"]]
                row[1].plot(common, [smoothed(r["loss"], s, window) - smoothed(ref["loss"], s, window)
                                     for s in common], label=name, color=c, lw=1.4)
        lows = [smoothed(r["loss"], s, window) for r in runs.values() for s in r["loss"]]
        lows += [v for r in runs.values() for v in r["val"].values()]
        lo = min(lows)
        row[0].set_ylim(lo - 0.1, lo + 3.0)      # the tail, where the runs differ
        row[0].set(title=f"{title}\ntrain loss ({window}-step mean), val loss (dots)", xlabel="step", ylabel="loss")
        row[1].axhline(0.0, color="black", lw=0.8)
        row[1].set(title=f"{title}\ntrain loss ({window}-step mean) minus fp32's", xlabel="step",
                   ylabel="loss difference")
        row[0].legend()
        row[1].legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="arguments after -- go to every train.py run (e.g. -- --device cuda --lr 3e-4)")
    p.add_argument("--steps", type=int, default=40, help="training steps per run (default 40: CPU-sized)")
    p.add_argument("--precisions", default=",".join(PRECISIONS),
                   help="comma-separated (default: all four; also " + ", ".join(VARIANTS) + ")")
    p.add_argument("--out-root", action="append", default=None,
                   help="runs go to OUT_ROOT/<precision> (default runs/precision); with --report-only it "
                        "may be given several times, one picture row each")
    p.add_argument("--report-only", action="store_true", help="do not train, only read the runs and report")
    p.add_argument("--window", type=int, default=10, help="steps in the train-loss moving mean (default 10)")
    p.add_argument("--plot", default=os.path.join(ROOT, "docs", "precision_loss.png"),
                   help="picture to write ('' for none; needs matplotlib)")
    args = p.parse_args(argv)
    roots = args.out_root or [os.path.join(ROOT, "runs", "precision")]
    precisions = [s for s in args.precisions.split(",") if s]
    if not args.report_only:
        if len(roots) != 1:
            p.error("give one --out-root when training (several only with --report-only)")
        for prec in precisions:
            secs = run(prec, args.steps, os.path.join(roots[0], prec), extra)
            print(f"{prec}: {secs:.0f} s ({secs / args.steps:.2f} s/step including eval and checkpoint)\n",
                  flush=True)
    experiments = []
    for root in roots:
        runs = {prec: read_run(os.path.join(root, prec)) for prec in precisions
                if os.path.isfile(os.path.join(root, prec, "metrics.jsonl"))}
        if not runs:
            print(f"no runs found under {root}", file=sys.stderr)
            return 1
        print(table(root, runs, args.window) + "\n")
        if any(os.path.isdir(os.path.join(root, prec, "checkpoints")) for prec in runs):
            print(frozen_report(root, list(runs)) + "\n")
        if "fp32" in runs and os.path.isdir(os.path.join(root, "fp32", "checkpoints")):
            print(rounding_report(os.path.join(root, "fp32")) + "\n")
        experiments.append((root, runs))
    if args.plot:
        try:
            plot(experiments, args.window, args.plot)
        except ImportError:
            print("(matplotlib is not installed: no picture; pip install matplotlib)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
