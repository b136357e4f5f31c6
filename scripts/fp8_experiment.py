"""The FP8 experiments of docs/precision.md: training in each recipe against bf16, one large activation,
and what the emulation costs on the CPU. Nothing here is a test: it measures and prints.

    python scripts/fp8_experiment.py cast 0.3 500 1e6 1e-3      # values in E4M3 and E5M2, unscaled and scaled
    python scripts/fp8_experiment.py outlier                    # one large activation, every recipe (seconds)
    python scripts/fp8_experiment.py speed                      # an FP8 linear's step against fp32 (a minute)
    python scripts/fp8_experiment.py train --steps 30           # the issue's shape, bf16-mixed and each recipe
    python scripts/fp8_experiment.py train --report-only        # the table again, from the runs' metrics

`train` runs, for R in none and each recipe (none: the same run without --fp8),

    python train.py --preset tiny --d-model 128 --ffn-dim 384 --steps S --precision bf16-mixed --fp8 R \\
        --out-dir ROOT/R --no-progress --resume never --overwrite [anything after --]

and tabulates the first and last loss, the held-out loss (the run's last evaluation: its own forward,
in FP8 where it trained in FP8), its difference from the run without --fp8, whether every step was
finite and whether the loss fell. (Its tokens/s are left out: on a shared machine they measure the
neighbours; `speed` times the linear in interleaved rounds instead.)

`outlier`: x (256 x 512, N(0, 1)) with one element 10^3, 10^4 or 10^5 (a "massive activation", Sun et
al. 2024), cast as each recipe casts a linear's input for the forward (fp8_scaling.cast); the share of
x's elements flushed to zero, and the relative error of x W^T (W 512 x 512, N(0, 0.02), cast as the
recipe casts a weight) against fp64 in the 255 rows without the outlier.

`speed`: a linear of the `small` preset's MLP (256 x 688; 16 x 256 tokens), forward + backward, fp32
and each recipe (torch threads: 1 and all), the median of rounds interleaved so that a noisy machine
slows them alike: emulated FP8 costs time on the CPU (it computes the same fp32 matmul, and casts).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from nanohlat import tensor_parallel as tpl  # noqa: E402
from nanohlat.beyond import fp8, fp8_scaling  # noqa: E402
from nanohlat.comm import Group  # noqa: E402

RECIPES = fp8_scaling.RECIPES
SHAPE = ["--preset", "tiny", "--d-model", "128", "--ffn-dim", "384", "--precision", "bf16-mixed"]


def show_casts(values: list[float]) -> None:
    """Each value cast to E4M3 and E5M2 with scale 1, and scaled so that the largest |value| lands on the
    format's largest (what it then stands for: q / s)."""
    x = torch.tensor(values)
    print(f"{'value':>10s} | {'E4M3':>10s} {'E4M3 scaled':>12s} | {'E5M2':>10s} {'E5M2 scaled':>12s}")
    cols = []
    for fmt in (fp8_scaling.E4M3, fp8_scaling.E5M2):
        s = fp8_scaling.amax_scale(x.abs().max(), fmt)
        cols += [fp8_scaling.saturating_cast(x, 1.0, fmt).float(), fp8_scaling.saturating_cast(x, s, fmt).float() / s]
    for i, v in enumerate(values):
        print(f"{v:10.4g} | {cols[0][i]:10.4g} {cols[1][i]:12.4g} | {cols[2][i]:10.4g} {cols[3][i]:12.4g}")


def outlier() -> None:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(256, 512, generator=g)
    w = torch.randn(512, 512, generator=g) * 0.02
    rest = torch.arange(256) != 17   # the rows without the outlier
    print(f"{'outlier':>8s} {'recipe':11s} {'flushed to zero':>16s} {'rel. error of x W^T, other rows':>32s}")
    for big in (1e3, 1e4, 1e5):
        x = base.clone()
        x[17, 100] = big
        exact = x.double() @ w.double().t()
        for recipe in ("tensorwise", "rowwise", "blockwise", "mx"):
            rule = fp8.RULES.get(recipe, "amax")
            cx = fp8_scaling.cast(x, fp8_scaling.Axis(256), fp8_scaling.Axis(512),
                                  fp8_scaling.block_sizes(recipe, "x"), rule, fp8_scaling.E4M3, count=True)
            cw = fp8_scaling.cast(w, fp8_scaling.Axis(512), fp8_scaling.Axis(512),
                                  fp8_scaling.block_sizes(recipe, "w"), rule, fp8_scaling.E4M3)
            y = fp8_scaling.mm(cx, cw, transpose_b=True)
            err = float((y.double() - exact)[rest].norm() / exact[rest].norm())
            print(f"{big:8.0e} {recipe:11s} {int(cx.flushed) / x.numel():>15.3%} {err:>32.4f}")


def _linear_step(layer, x, gy):
    x = x.detach().requires_grad_()
    layer.weight.grad = None
    layer(x).backward(gy)


def speed(rounds: int = 7) -> None:
    one = Group("tp", [0], 0)
    g = torch.Generator().manual_seed(0)
    x, gy = torch.randn(16, 256, 256, generator=g), torch.randn(16, 256, 688, generator=g)
    base = tpl.ColumnParallelLinear(256, 688, one)
    with torch.no_grad():
        base.weight.normal_(0, 0.02, generator=g)
    layers = {"fp32": base}
    for recipe in RECIPES:
        run = fp8.Fp8Run(recipe)
        layers[recipe] = fp8.Fp8ColumnParallelLinear(base, run, one, recipe)
        run.layers = [layers[recipe]]
    for threads in (1, torch.get_num_threads()):
        torch.set_num_threads(threads)
        times = {k: [] for k in layers}
        for _ in range(rounds):
            for name, layer in layers.items():   # interleaved: each round times every variant once
                _linear_step(layer, x, gy)
                start = time.perf_counter()
                _linear_step(layer, x, gy)
                times[name].append(time.perf_counter() - start)
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"threads {threads}: forward + backward of a 256 -> 688 linear on 4,096 tokens, median of {rounds} "
              f"interleaved rounds (spread min-max)")
        for name, ts in times.items():
            print(f"  {name:11s} {med[name] * 1e3:8.1f} ms ({min(ts) * 1e3:.1f}-{max(ts) * 1e3:.1f})  "
                  f"x{med[name] / med['fp32']:.2f} fp32's time")


def train(steps: int, out_root: str, extra: list[str], report_only: bool) -> None:
    rows = []
    for recipe in ("none",) + RECIPES:
        out = os.path.join(out_root, recipe)
        if not report_only:
            cmd = [sys.executable, "train.py", *SHAPE, "--fp8", recipe, "--steps", str(steps), "--out-dir", out,
                   "--no-progress", "--resume", "never", "--overwrite", *extra]
            subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        with open(os.path.join(out, "metrics.jsonl")) as f:
            records = [json.loads(line) for line in f]
        losses = [r for r in records if "loss" in r]
        val = [r["val_loss"] for r in records if "val_loss" in r]
        finite = all(r["loss"] == r["loss"] and abs(r["loss"]) != float("inf") for r in losses)
        falling = losses[-1]["loss"] < losses[0]["loss"]
        rows.append((recipe, losses[0]["loss"], losses[-1]["loss"], val[-1], finite, falling))
    base = rows[0][3]
    print(f"{'--fp8':11s} {'loss 1':>7s} {'loss ' + str(len(losses)):>8s} {'held-out':>9s} {'vs none':>8s} "
          f"{'all finite':>10s} {'falling':>8s}")
    for recipe, first, last, val, finite, falling in rows:
        print(f"{recipe:11s} {first:7.4f} {last:8.4f} {val:9.4f} {(val - base) / base:+8.2%} {str(finite):>10s} "
              f"{str(falling):>8s}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=("cast", "outlier", "speed", "train"))
    p.add_argument("values", nargs="*", type=float, help="cast: the values to cast")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--out-root", default="runs/fp8")
    p.add_argument("--report-only", action="store_true")
    args, extra = p.parse_known_args()
    extra = [a for a in extra if a != "--"]
    if args.what == "cast":
        show_casts(args.values or [0.3, 500.0, 1e6, 1e-3])
    elif args.what == "outlier":
        outlier()
    elif args.what == "speed":
        speed()
    else:
        train(args.steps, args.out_root, extra, args.report_only)


if __name__ == "__main__":
    main()
