"""Evaluate nanohlat checkpoints: held-out loss / perplexity / bits per byte, and
multiple-choice tasks scored by log-likelihood (nanohlat/serving/evaluate.py).

    python eval.py                                     # out/'s latest checkpoint, built-in task
    python eval.py --out-dir runs/x --task builtin my_task.jsonl --shots 3
    python eval.py --out-dir runs/x --all-checkpoints  # every checkpoint: metrics vs tokens seen

A task file is JSONL, one {"context": "...", "choices": ["...", ...], "label": 0}
per line. "builtin" is the next-line task made from the run's held-out Python
files: pick the true next line of code among four (chance: 25%).

Prints a table and writes JSON (default <out-dir>/eval.json, written
atomically); with --all-checkpoints and matplotlib installed, also
<out-dir>/eval_curves.png. When the JSON is a run's own eval.json, the
run's <out-dir>/report.html is drawn again with its table (run/report.py).
For the lm-evaluation-harness, see nanohlat/serving/harness.py.
"""

from __future__ import annotations

import io
import os
import sys
import time

from nanohlat.run import checkpoint, data, report, runconfig
from nanohlat import device as devicelib
from nanohlat.serving import evaluate, generate
from nanohlat.system import cli, files, flags
from nanohlat.config import DEVICES, UserError
from nanohlat.recipe import check_seed
from nanohlat.system.files import atomic_write, json_text


def parse_args(argv=None):
    p = flags.Parser(description="Evaluate nanohlat checkpoints.")
    p.add_argument("--out-dir", default="out", help="run directory (its latest checkpoint, unless --checkpoint)")
    p.add_argument("--checkpoint", default="", help="a checkpoint directory (overrides --out-dir's latest)")
    p.add_argument("--task", nargs="+", default=["builtin"], metavar="TASK",
                   help="'builtin' (next line of held-out code) and/or JSONL task files")
    p.add_argument("--shots", type=int, default=0, help="solved examples shown before each question")
    p.add_argument("--examples", type=int, default=200, help="size of the built-in task")
    p.add_argument("--all-checkpoints", action="store_true", help="evaluate every saved checkpoint of --out-dir")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per forward pass")
    p.add_argument("--max-batches", type=int, default=16, help="held-out batches (0 = the whole held-out split)")
    p.add_argument("--seed", type=int, default=0, help="seed of the built-in task and few-shot draws")
    p.add_argument("--device", default="auto", choices=DEVICES)
    p.add_argument("--json", default="", help="where to write results (default <out-dir>/eval.json)")
    return p.parse_args(argv)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)     # progress on stderr, the tables on stdout


def check_args(args) -> None:
    for name, low in (("shots", 0), ("examples", 1), ("batch_size", 1), ("max_batches", 0), ("seed", 0)):
        if getattr(args, name) < low:
            raise UserError(f"--{name.replace('_', '-')} must be >= {low}, got {getattr(args, name)}")
    check_seed(args.seed)
    if args.all_checkpoints and args.checkpoint:
        raise UserError("--all-checkpoints evaluates every checkpoint of --out-dir; drop --checkpoint")
    for t in args.task:     # a task file must be text: a binary one is refused before any model loads
        if t != "builtin" and os.path.isfile(t):
            try:
                with open(t, encoding="utf-8") as f:
                    f.read()
            except UnicodeDecodeError:
                raise UserError(f"--task {t!r} is not UTF-8 text; give a JSONL task file") from None
            except OSError as e:
                raise UserError(f"cannot read --task {t!r}: {e.strerror}") from None


def evaluate_checkpoint(path: str, args, dev, cache: dict) -> dict:
    """One checkpoint directory (resolved once, by main) -> one result row (held-out
    metrics and every task)."""
    # checked as it loads (generate.load_model): the run's config (its train section: the windows'
    # seq_len), the model's size, finite weights. An imported model (nanohlat.serving.hf) has no
    # training config: the built-in corpus then.
    model, manifest = generate.load_model(path, dev)
    train = runconfig.train_section(manifest, path)
    cfg = model.cfg
    # the tokenizer by content: each checkpoint holds its own copy of the same file
    tok_id = manifest.get("identity", {}).get("tokenizer_sha256") or manifest["tokenizer"]
    key = (train.get("data", ""), tok_id, train.get("cache_dir", ""))
    if key not in cache:    # all checkpoints of a run share data and tasks: build them once
        ds = data.prepare_data(key[0], manifest["tokenizer"], cfg.vocab_size, key[2], log=log)
        tasks = [evaluate.next_line_task(ds.val_documents, args.examples, args.seed) if t == "builtin"
                 else evaluate.load_task_file(t) for t in args.task]
        cache[key] = ds, tasks
    ds, tasks = cache[key]
    if ds.tokenizer.vocab_size > cfg.vocab_size:
        raise UserError(f"tokenizer {manifest['tokenizer']!r} has {ds.tokenizer.vocab_size} pieces, more than "
                        f"the model's vocab_size {cfg.vocab_size}")
    seq_len = min(train.get("seq_len", cfg.max_seq_len), cfg.max_seq_len)
    t0 = time.time()
    row = {"checkpoint": os.path.abspath(path),
           "step": manifest.get("step", 0), "tokens": manifest.get("tokens", 0), "seq_len": seq_len}
    row.update(evaluate.heldout_metrics(model, ds, seq_len, args.batch_size, args.max_batches, dev.torch_device))
    row["tasks"] = {t.name: evaluate.evaluate_task(model, ds.tokenizer, t, args.shots, args.seed,
                                                   args.batch_size, dev.torch_device) for t in tasks}
    log(f"eval: step {row['step']} done in {time.time() - t0:.1f}s")
    return row


def print_single(row: dict) -> None:
    print(f"checkpoint  {row['checkpoint']}  (step {row['step']:,}, {row['tokens']:,} tokens seen)")
    print(f"held-out    val_loss {row['val_loss']:.4f}   perplexity {row['perplexity']:.2f}   "
          f"bits/byte {row['bits_per_byte']:.4f}   ({row['tokens_scored']:,} tokens in windows of {row['seq_len']})")
    print(f"{'task':<24}{'shots':>6}{'examples':>10}{'acc':>17}{'acc_norm':>17}{'chance':>9}")
    for name, r in row["tasks"].items():
        print(f"{name:<24}{r['shots']:>6}{r['examples']:>10}"
              f"{r['acc']:>9.3f} ± {r['acc_stderr']:.3f}{r['acc_norm']:>9.3f} ± {r['acc_norm_stderr']:.3f}"
              f"{r['chance']:>9.3f}")


def metric_columns(rows: list[dict]) -> list[tuple[str, callable]]:
    cols = [("val_loss", lambda r: r["val_loss"]), ("perplexity", lambda r: r["perplexity"]),
            ("bits/byte", lambda r: r["bits_per_byte"])]
    for name in rows[0]["tasks"]:
        cols += [(f"{name} acc", lambda r, n=name: r["tasks"][n]["acc"]),
                 (f"{name} acc_norm", lambda r, n=name: r["tasks"][n]["acc_norm"])]
    return cols


def print_curves(rows: list[dict]) -> None:
    cols = metric_columns(rows)
    print(f"{'step':>10}{'tokens':>16}" + "".join(f"{c:>{max(12, len(c) + 2)}}" for c, _ in cols))
    for r in rows:
        print(f"{r['step']:>10,}{r['tokens']:>16,}" +
              "".join(f"{f(r):>{max(12, len(c) + 2)}.4f}" for c, f in cols))


def plot_curves(rows: list[dict], path: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")                       # files only, no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    cols = metric_columns(rows)
    ncols = min(3, len(cols))
    nrows = -(-len(cols) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4 * ncols, 3 * nrows), squeeze=False)
    for ax in axes.flat[len(cols):]:
        ax.axis("off")
    tokens = [r["tokens"] for r in rows]
    for ax, (name, f) in zip(axes.flat, cols):
        ax.plot(tokens, [f(r) for r in rows], marker="o")
        ax.set_title(name)
        ax.set_xlabel("tokens seen")
        if name.endswith(("acc", "acc_norm")):
            chance = rows[0]["tasks"][name.split(" ")[0]]["chance"]
            ax.axhline(chance, color="grey", linestyle=":", label="chance")
            ax.legend()
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    atomic_write(path, lambda f: f.write(buffer.getvalue()))   # whole or absent, never through a link
    return True


def write_json(path: str, obj) -> None:
    """Readers see the old file or the whole new one, never a prefix, and a
    failed write leaves no temporary file behind (files.atomic_write)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    atomic_write(path, lambda f: f.write(json_text(obj, indent=2).encode()))   # strict: "NaN", not NaN


def check_json_path(path: str) -> None:
    """Refuse a results path that cannot be written, before the evaluation runs."""
    if os.path.isdir(path):
        raise UserError(f"--json {path!r} is a folder; give a file path, e.g. {os.path.join(path, 'eval.json')!r}")
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):          # write_json creates the missing folders
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise UserError(f"cannot write {path!r}: {parent!r} is a file, not a folder; choose another --json")
    if not os.access(parent, os.W_OK):
        raise UserError(f"cannot write {path!r}: {parent!r} is not writable; choose another --json")
    files.refuse_unless_file(path, "another --json")   # a FIFO, a device, a socket: never replaced by a file


@cli.command
def main(argv=None) -> int:
    args = parse_args(argv)
    check_args(args)
    for t in args.task:     # a bad task file should fail before any model is loaded
        if t != "builtin":
            evaluate.load_task_file(t)
    out = args.json or os.path.join(args.out_dir, "eval.json")
    check_json_path(out)
    if args.all_checkpoints:
        files.refuse_unless_file(os.path.join(args.out_dir, "eval_curves.png"), "another --out-dir")
    # the run's report.html shows eval.json's table: drawn again when eval.json is the run's own
    page = os.path.isfile(os.path.join(args.out_dir, "metrics.jsonl")) and \
        os.path.abspath(out) == os.path.abspath(os.path.join(args.out_dir, "eval.json"))
    if page:
        files.refuse_unless_file(os.path.join(args.out_dir, report.REPORT), "another --out-dir")
    dev = devicelib.get_device(args.device)
    if args.all_checkpoints:   # every path a checkpoint directory, resolved here once
        paths = checkpoint.list_checkpoints(args.out_dir)
        if not paths:
            raise UserError(f"--out-dir {args.out_dir!r} has no saved checkpoints; train first, or give "
                            f"the run directory that holds checkpoints/")
    else:
        paths = [checkpoint.resolve(args.checkpoint or args.out_dir, say_skipped=True)]
    cache: dict = {}
    rows = []
    for p in paths:
        rows.append(evaluate_checkpoint(p, args, dev, cache))
    if args.all_checkpoints:
        print_curves(rows)
    else:
        print_single(rows[0])
    settings = {k: getattr(args, k) for k in ("task", "shots", "examples", "batch_size", "max_batches", "seed")}
    write_json(out, {"settings": settings, "results": rows})
    log(f"eval: wrote {out}")
    if page:
        log(f"eval: wrote {report.write(args.out_dir)} (the run's page, with this table)")
    if args.all_checkpoints:
        png = os.path.join(args.out_dir, "eval_curves.png")
        log(f"eval: wrote {png}" if plot_curves(rows, png) else "eval: pip install matplotlib for eval_curves.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
