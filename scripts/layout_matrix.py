"""The layout matrix: the training losses of many parallel layouts, recorded so
that a refactor can be checked bit for bit after every step.

    python scripts/layout_matrix.py                     # every layout: a table, runs/layout_matrix.json
    python scripts/layout_matrix.py --sample            # the CI sample (~2-3 min on 2 cores), exit 1 if off
    python scripts/layout_matrix.py --out table.json --only tp2_sp,moe_ep2
    python scripts/layout_matrix.py --compare runs/layout_matrix.json   # after a change: which rows moved?
                                                        # (the new table: runs/layout_matrix.new.json)
    python scripts/layout_matrix.py --only ... --plan-vs-measured nanohlat/plan/layout_matrix_measured.json
                                                        # each run's measured bytes beside the plan's: the
                                                        # data the planner page shows (PLAN_VS_MEASURED)

Each layout (LAYOUTS below: name, processes, flags) is one run of exactly

    python train.py --preset tiny [--nproc N] FLAGS --steps 5 --warmup-steps 2 --threads 1 \\
        --eval-every 0 --no-progress --device cpu --out-dir TMP/NAME

(`--preset moe` for the mixture-of-experts rows, which name it in FLAGS), and
its metrics.jsonl gives 5 losses and 5 grad norms, kept as the exact floats
train.py wrote (Python's float repr: reading them back gives the same bits).
Each layout is also compared with its reference: one process with the same
model (preset, shape flags, --precision, --moments, --moe-*), which the tests
say every layout equals up to round-off; the table prints the largest
relative loss difference over the 5 steps. One exception: capacity mode drops
tokens per rank and micro-batch (moe.py), so its losses depend on the layout
by design; capacity at --ep 2 is compared with capacity at dp 2, and dp 2's own
difference from one process is printed but not checked.

The table's digest is a sha256 of every run's name, losses and grad norms in
a fixed text form (`canonical`): two runs of the command on the same code
print the same digest (every process on one thread, fresh out-dirs, a fixed
seed: nothing is left to chance), and a refactor that changes nothing
numerically keeps it. The numbers also depend on torch's version and the CPU
(its kernels choose the summation order): compare digests made on one machine
(the JSON says which: `machine`). --compare names the rows that moved.

Measured on c4e75e5 (torch 2.13 CPU, an Intel Xeon, 2 cores shared with two
other test suites, load 7-10): the full matrix (61 runs) three times, digest
377f17ac9cc5f638f3e418e52e9bfd52bf3b47cebe52f47c137a0cf824059f0c each time (before the 4
moe_cp2 rows were added, which the full matrix now runs too);
22-27 min of wall time for 12-13 min of CPU. Most of that is fixed cost per
process: importing torch (~3.5 s) and measuring the CPU's matmul peak for the
MFU (~1.7 s), against ~0.4 s for 5 steps of tiny; so about 8 min on a quiet
2-core machine (estimated from the CPU time, not measured). --sample: 2.5 min
(70 s of CPU). Every fp32 layout within 2 fp32 ulps of one process's loss (at
most 1.5e-7 relative; the tp rows equal; grad norms within 1e-6), bf16 within
6.8e-5. A planted bug in ring attention's backward (dK without its 1/sqrt(d))
moved cp2_ring's loss by 7.2e-5: beyond the tolerance below, and a new digest.

The tolerance (TOLERANCE: a row's `!` mark, and exit code 1, whether the
sample or the full matrix) is the tests' own: fp32 1e-5 relative per step, as
tests/beyond/test_context_parallel_training.py (LOSS_REL) and tests/beyond/test_moe_with_other_layouts.py check
their layouts (tests/core/test_layouts_equal_one_process.py and test_zero_stages.py allow 2e-5 absolute on
losses near 6, ~3e-6 relative; all of them measured < 1e-6); bf16 in any form
1e-3 relative, as test_moe_with_other_layouts.py's and test_context_parallel_training.py's bf16
layouts (bf16 rounds sums of another order: the layouts really differ, here by
up to 6.8e-5). The sample (SAMPLE) is fp32 only.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 5
# the same for every run: fixed threads (a CPU kernel's summation order can depend on its thread
# count), no evaluation, the CPU. --warmup-steps 2 as the tests' layouts: steps 3-5 decay the lr too
FIXED = ["--steps", str(STEPS), "--warmup-steps", "2", "--threads", "1", "--eval-every", "0", "--no-progress",
         "--device", "cpu"]
TOLERANCE = {"fp32": 1e-5, "bf16": 1e-3}   # max relative loss difference from the reference (docstring)
BUCKETS = "--bucket-mb 0.05"   # ZeRO / dp rows: ~5 gradient buckets, not one (tiny is 1 MB), as test_zero_stages.py

# (name, processes, flags). Flags without --preset train `tiny` (4 layers, 8 heads, 4 kv heads,
# batch 8 x 32 tokens); a row's reference is one process with its model flags (REFERENCE_FLAGS),
# or the row named in REFERENCE. What each group stands for is in the test file its comment names (tests/<floor>/).
LAYOUTS = [
    # -- one process, gradient accumulation; tensor parallelism, sequence parallelism (test_layouts_equal_one_process.py)
    ("one_m4", 1, "--microbatches 4"),
    ("tp2", 2, "--tp 2"),
    ("tp2_sp", 2, "--tp 2 --sequence-parallel"),
    ("tp2_sp_noregather", 2, "--tp 2 --sequence-parallel --no-sp-regather"),
    ("tp4", 4, "--tp 4"),
    # -- data parallelism, every ZeRO stage with and without overlapped reduction (test_zero_stages.py)
    ("dp2", 2, f"--dp 2 {BUCKETS}"),
    ("dp2_nooverlap", 2, f"--dp 2 {BUCKETS} --no-overlap-grad-reduce"),
    ("dp2_z1", 2, f"--dp 2 --zero 1 {BUCKETS} --microbatches 2"),
    ("dp2_z1_nooverlap", 2, f"--dp 2 --zero 1 {BUCKETS} --microbatches 2 --no-overlap-grad-reduce"),
    ("dp2_z2", 2, f"--dp 2 --zero 2 {BUCKETS} --microbatches 2"),
    ("dp2_z2_nooverlap", 2, f"--dp 2 --zero 2 {BUCKETS} --microbatches 2 --no-overlap-grad-reduce"),
    ("dp2_z3", 2, f"--dp 2 --zero 3 {BUCKETS} --check-replicas 1"),
    ("dp2_z3_nooverlap", 2, f"--dp 2 --zero 3 {BUCKETS} --no-overlap-grad-reduce"),
    ("dp4", 4, f"--dp 4 {BUCKETS}"),
    # -- pipeline parallelism, every schedule (test_layouts_equal_one_process.py, test_pipeline_schedule.py)
    ("pp2_afab_m2", 2, "--pp 2 --schedule afab --microbatches 2"),
    ("pp2_1f1b_m4", 2, "--pp 2 --schedule 1f1b --microbatches 4"),
    ("pp2_interleaved_m2", 2, "--pp 2 --schedule interleaved --virtual-stages 2 --microbatches 2"),
    ("pp2_zbh1_m4", 2, "--pp 2 --schedule zb-h1 --microbatches 4"),
    ("pp4_zbh1_m8", 4, "--pp 4 --schedule zb-h1 --microbatches 8"),
    # -- combinations (test_layouts_equal_one_process.py's world 4, test_zero_stages.py's)
    ("tp2_pp2_interleaved_sp", 4, "--tp 2 --pp 2 --schedule interleaved --virtual-stages 2 --sequence-parallel "
                                  "--microbatches 2"),
    ("tp2_pp2_zbh1_sp", 4, "--tp 2 --pp 2 --schedule zb-h1 --sequence-parallel --microbatches 2"),
    ("dp2_pp2_zbh1_z1", 4, f"--dp 2 --pp 2 --schedule zb-h1 --zero 1 {BUCKETS} --microbatches 4"),
    ("dp2_pp2_interleaved_z1", 4, f"--dp 2 --pp 2 --schedule interleaved --virtual-stages 2 --zero 1 {BUCKETS} "
                                  "--microbatches 2"),
    ("dp2_pp2_z2", 4, f"--dp 2 --pp 2 --zero 2 {BUCKETS} --microbatches 2"),
    ("tp2_dp2_sp_z3", 4, f"--tp 2 --dp 2 --sequence-parallel --zero 3 {BUCKETS}"),
    # -- activation checkpointing
    ("tp2_sp_selective", 2, "--tp 2 --sequence-parallel --activation-checkpointing selective"),
    ("pp2_1f1b_full_m2", 2, "--pp 2 --microbatches 2 --activation-checkpointing full"),
    ("dp2_z3_full", 2, f"--dp 2 --zero 3 {BUCKETS} --activation-checkpointing full"),
    # -- precisions (each against one process in the same precision: test_precision.py, test_replicas.py)
    ("tp2_bf16mixed", 2, "--tp 2 --precision bf16-mixed"),
    ("dp2_z1_bf16sr", 2, f"--dp 2 --zero 1 {BUCKETS} --precision bf16-sr"),
    ("dp2_z2_bf16sr_m16", 2, f"--dp 2 --zero 2 {BUCKETS} --precision bf16-sr --moments bf16 --check-replicas 1"),
    ("tp2_sp_bf16", 2, "--tp 2 --sequence-parallel --precision bf16"),
    # -- context parallelism, every algorithm (test_context_parallel_training.py)
    ("cp2_allgather", 2, "--cp 2 --cp-attention allgather"),
    ("cp2_ring", 2, "--cp 2 --cp-attention ring"),
    ("cp2_ulysses", 2, "--cp 2 --cp-attention ulysses"),
    ("cp2_ring_selective", 2, "--cp 2 --cp-attention ring --activation-checkpointing selective"),
    ("cp4_ring", 4, "--cp 4 --cp-attention ring"),
    ("cp2_tp2_sp_ring", 4, "--cp 2 --cp-attention ring --tp 2 --sequence-parallel"),
    ("cp2_pp2_allgather_m2", 4, "--cp 2 --cp-attention allgather --pp 2 --microbatches 2"),
    ("cp2_dp2_z1_ring_m2", 4, f"--cp 2 --cp-attention ring --dp 2 --zero 1 {BUCKETS} --microbatches 2"),
    ("cp2_dp2_z3_ulysses", 4, f"--cp 2 --cp-attention ulysses --dp 2 --zero 3 {BUCKETS} --check-replicas 1"),
    ("cp2_ring_bf16sr", 2, "--cp 2 --cp-attention ring --precision bf16-sr"),
    # -- mixture of experts: 4 experts, top-2, every layer (test_moe_training_and_expert_parallel.py,
    #    test_moe_with_other_layouts.py)
    ("moe_dp2", 2, "--preset moe --dp 2"),
    ("moe_ep2", 2, "--preset moe --ep 2 --check-replicas 1"),
    ("moe_dp4_ep2_z1", 4, f"--preset moe --dp 4 --ep 2 --zero 1 {BUCKETS} --check-replicas 1"),
    ("moe_dp4_ep2_z3", 4, f"--preset moe --dp 4 --ep 2 --zero 3 {BUCKETS} --activation-checkpointing full"),
    ("moe_tp2_sp", 2, "--preset moe --tp 2 --sequence-parallel"),
    ("moe_pp2_1f1b_m2", 2, "--preset moe --pp 2 --schedule 1f1b --microbatches 2"),
    ("moe_pp2_zbh1_m2", 2, "--preset moe --pp 2 --schedule zb-h1 --microbatches 2"),
    ("moe_pp2_interleaved_m2", 2, "--preset moe --pp 2 --schedule interleaved --virtual-stages 2 --microbatches 2"),
    ("moe_ep2_bf16sr", 2, "--preset moe --ep 2 --precision bf16-sr --moments bf16 --check-replicas 1"),
    ("moe_cap_dp2", 2, "--preset moe --dp 2 --moe-capacity-factor 1.25"),
    ("moe_cap_ep2", 2, "--preset moe --ep 2 --moe-capacity-factor 1.25 --check-replicas 1"),
    # -- mixture of experts with context parallelism (test_moe_with_other_layouts.py): --ep from dp x cp
    ("moe_cp2_ring", 2, "--preset moe --cp 2 --cp-attention ring"),
    ("moe_cp2_ep2", 2, "--preset moe --cp 2 --ep 2 --check-replicas 1"),
    ("moe_cp2_tp2_sp", 4, "--preset moe --cp 2 --tp 2 --sequence-parallel"),
    ("moe_cp2_pp2_1f1b_m2", 4, "--preset moe --cp 2 --pp 2 --schedule 1f1b --microbatches 2"),
]
# capacity mode's losses depend on the layout: its ep rows are compared with dp 2, and dp 2's
# difference from one process is printed but not checked (UNCHECKED)
REFERENCE = {"moe_cap_ep2": "moe_cap_dp2"}
UNCHECKED = {"moe_cap_dp2": "capacity: depends on the layout"}
# one of each kind a refactor of the core is most likely to break, fp32 only: 7 layouts and their
# 2 references (one, one:moe)
SAMPLE = ["tp2_sp", "pp2_zbh1_m4", "dp2_z2", "dp2_z3", "cp2_ring", "moe_ep2", "moe_pp2_interleaved_m2"]

# the flags that make a row's reference: the model and its numbers, not the layout
REFERENCE_FLAGS = {"--preset", "--n-layers", "--d-model", "--n-heads", "--n-kv-heads", "--ffn-dim", "--vocab-size",
                   "--max-seq-len", "--batch-size", "--seq-len", "--precision", "--moments"}


def full_flags(flags: str) -> list[str]:
    """A row's flags as train.py gets them (less FIXED and the out-dir): tiny unless it names a preset."""
    argv = flags.split()
    return argv if "--preset" in argv else ["--preset", "tiny"] + argv


def reference_of(flags: str) -> tuple[str, str]:
    """(name, flags) of one process with the same model: REFERENCE_FLAGS and --moe-*, with their values."""
    argv, keep = full_flags(flags), []
    for i, flag in enumerate(argv):
        if flag in REFERENCE_FLAGS or flag.startswith("--moe-"):
            keep += [flag, argv[i + 1]]
    ref = " ".join(keep)   # e.g. "--preset moe --moe-capacity-factor 1.25" -> one:moe,moe-capacity-factor=1.25
    short = ref.replace("--preset tiny", "").replace("--preset ", "").replace(" --", ",").replace("--", "").strip(", ")
    return ("one:" + short.replace(" ", "=") if short else "one"), ref


def plan(names: list[str] | None) -> tuple[list[tuple[str, int, str]], dict[str, str]]:
    """The runs for these layouts (all when None): their references first, then the layouts in
    LAYOUTS' order; and each layout's reference name."""
    rows = {name: (name, nproc, flags) for name, nproc, flags in LAYOUTS}
    unknown = [n for n in names or [] if n not in rows]
    if unknown:
        raise Refused(f"unknown layout(s) {', '.join(unknown)}; the names are: {', '.join(rows)}")
    chosen = [rows[n] for n in rows if names is None or n in names]
    # a reference that is a layout (capacity's dp 2) runs too, as a layout
    chosen += [rows[REFERENCE[n]] for n, _, _ in chosen if n in REFERENCE and rows[REFERENCE[n]] not in chosen]
    refs, runs = {}, {}
    for name, _, flags in chosen:
        if name in REFERENCE:
            refs[name] = REFERENCE[name]
        else:
            refs[name], ref_flags = reference_of(flags)
            runs.setdefault(refs[name], (refs[name], 1, ref_flags))
    return list(runs.values()) + sorted(chosen, key=lambda r: list(rows).index(r[0])), refs


def tolerance(flags: str) -> float:
    """The largest relative loss difference allowed from the reference (TOLERANCE, the docstring)."""
    return TOLERANCE["fp32"] if "--precision" not in flags or "--precision fp32" in flags else TOLERANCE["bf16"]


def train(name: str, nproc: int, flags: str, tmp: str, cache: list[str]) -> dict:
    """One `python train.py` run in a fresh out-dir; its per-step losses and grad norms, or its error."""
    out = os.path.join(tmp, name.replace(" ", "_"))
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), *full_flags(flags), *(["--nproc", str(nproc)] * (nproc > 1)),
           *FIXED, *cache, "--out-dir", out]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    result = {"name": name, "nproc": nproc, "flags": flags, "seconds": round(time.perf_counter() - t0, 1)}
    metrics = os.path.join(out, "metrics.jsonl")
    rows = [json.loads(line) for line in open(metrics)] if os.path.isfile(metrics) else []
    rows = [r for r in rows if "loss" in r]
    if done.returncode or [r["step"] for r in rows] != list(range(1, STEPS + 1)):
        tail = "\n".join(done.stdout.strip().splitlines()[-5:])
        return result | {"error": f"exit {done.returncode}, {len(rows)} steps logged:\n{tail}"}
    return result | {"loss": [r["loss"] for r in rows], "grad_norm": [r["grad_norm"] for r in rows]} | record(out)


# a run's config.json, less what names this machine's folders, and its summary.json (rank 0's measured bytes)
PATHS = ("out_dir", "data", "tokenizer", "cache_dir", "tokenizer_path")


def record(out: str) -> dict:
    """{"config": ..., "summary": ...} of the run in `out` (for --plan-vs-measured), whichever it wrote."""
    kept = {}
    for name in ("config", "summary"):
        path = os.path.join(out, name + ".json")
        if os.path.isfile(path):
            with open(path) as f:
                kept[name] = json.load(f)
    if "config" in kept:
        kept["config"] = {k: v for k, v in kept["config"].items() if k not in PATHS}
        kept["config"]["train"] = {k: v for k, v in kept["config"]["train"].items() if k not in PATHS}
    return kept


def max_rel_diff(got: list[float], ref: list[float]) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(got, ref))


def canonical(results: dict) -> str:
    """The table as text, one line per run in name order: name, losses, grad norms, each float
    as its repr (the shortest decimal that reads back to the same bits). Its sha256 is the digest."""
    return "".join(f"{n}\t{' '.join(map(repr, r['loss']))}\t{' '.join(map(repr, r['grad_norm']))}\n"
                   if "loss" in r else f"{n}\tFAILED\n" for n, r in sorted(results.items()))


def table(results: dict, refs: dict) -> tuple[str, dict[str, str]]:
    """The printed table, and what is wrong with each row beyond its tolerance or that failed."""
    width = max(len(n) for n in results)
    lines = [f"{'layout':<{width}}  {'nproc':>5}  {'max rel loss diff':>17}  flags", "-" * (width + 60)]
    bad = {}
    for name, r in results.items():
        if "error" in r:
            bad[name] = r["error"]
            cell, note = "FAILED", r["error"].splitlines()[-1]
        elif name not in refs:
            cell, note = "(reference)", ""
        elif "loss" not in results[refs[name]]:
            bad[name] = f"its reference {refs[name]} failed"
            cell, note = "no reference", ""
        else:
            diff, tol = max_rel_diff(r["loss"], results[refs[name]]["loss"]), tolerance(r["flags"])
            cell = f"{diff:.2e}" + (" !" if diff > tol and name not in UNCHECKED else "  ")
            note = UNCHECKED.get(name) or (f"vs {refs[name]}" if not refs[name].startswith("one") else "")
            if diff > tol and name not in UNCHECKED:
                bad[name] = f"loss {diff:.2e} relative from {refs[name]}'s, beyond {tol:g}"
        lines.append(f"{name:<{width}}  {r['nproc']:>5}  {cell:>17}  {r['flags']}" + (f"   ({note})" if note else ""))
    return "\n".join(lines), bad


def compare(results: dict, old: dict) -> list[str]:
    """The runs of this table whose losses or grad norms are not those of an earlier table's runs `old`
    (or that it lacks). Only these runs: a --sample or --only table compares with its rows of the full one."""
    numbers = lambda r: (r.get("loss"), r.get("grad_norm"))
    return [n for n in results if n not in old or numbers(old[n]) != numbers(results[n]) or "loss" not in results[n]]


def machine() -> dict:
    """What the numbers depend on besides the code and the flags: torch's CPU kernels (their
    summation order is the version's and the CPU's: an AVX-512 CPU sums 16 wide, AVX2 8)."""
    cpu = platform.processor()
    if os.path.isfile("/proc/cpuinfo"):
        cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                   cpu)
    return {"torch": importlib.metadata.version("torch"), "python": platform.python_version(), "cpu": cpu}


DEFAULT_OUT = os.path.join(ROOT, "runs", "layout_matrix.json")
# the layouts whose measured bytes the repository ships (nanohlat/plan/layout_matrix_measured.json): one of each
# strategy and ZeRO stage, every schedule but afab, cp and a mixture's ep (and their references, one process)
PLAN_VS_MEASURED = ["tp2_sp", "dp2", "dp2_z1", "dp2_z2", "dp2_z3", "pp2_1f1b_m4", "pp2_zbh1_m4",
                    "tp2_pp2_interleaved_sp", "cp2_ring", "cp2_dp2_z1_ring_m2", "moe_ep2", "moe_pp2_interleaved_m2"]


def write_plan_vs_measured(path: str, results: dict, where: dict, argv: list[str]) -> None:
    """Each run that wrote its config.json and summary.json, with the plan's figures for that config
    (nanohlat/plan/measured.py; a test recomputes them, so the file cannot go stale unnoticed)."""
    from nanohlat.plan import measured
    from nanohlat.system import files
    runs = {name: {"nproc": r["nproc"], "flags": r["flags"], "config": r["config"], "summary": r["summary"],
                   "planned": measured.planned(r["config"])}
            for name, r in sorted(results.items()) if "config" in r and "summary" in r}
    command = " ".join(["python", "scripts/layout_matrix.py"] + [a for a in argv])
    files.write_text(path, json.dumps({"command": command, "machine": where, "steps": STEPS, "runs": runs},
                                      indent=1) + "\n")


class Refused(Exception):
    """A path or a name the script cannot use: one line, exit 2, before any run."""


def same_file(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b) or (os.path.exists(a) and os.path.exists(b)
                                                          and os.path.samefile(a, b))


def read_baseline(path: str) -> dict:
    """The --compare table, read whole before any run (a run never writes over what it compares with)."""
    try:
        with open(path) as f:
            table = json.load(f)
    except (OSError, ValueError) as e:
        raise Refused(f"--compare {path!r} cannot be read as a layout matrix JSON ({type(e).__name__}: "
                      f"{e.strerror if isinstance(e, OSError) else e}); give the JSON an earlier run wrote") from None
    if not isinstance(table, dict) or not isinstance(table.get("runs"), dict):
        raise Refused(f"--compare {path!r} is JSON but not a layout matrix table (no 'runs'); give the JSON an "
                      f"earlier run wrote")
    return table


def out_path(out: str | None, baseline: str) -> str:
    """Where the table goes: --out, checked now (a folder, a FIFO, a folder that cannot be made there
    refused before ~25 minutes of runs); never the --compare baseline. Without --out the default,
    unless that is the baseline: then its sibling NAME.new.json."""
    if out is None:
        out = DEFAULT_OUT
        if baseline and same_file(out, baseline):
            out = os.path.splitext(out)[0] + ".new.json"
    elif baseline and same_file(out, baseline):
        raise Refused(f"--out {out!r} is the --compare baseline: the new table would replace the one it is "
                      f"compared with; give another --out (or leave it out: {DEFAULT_OUT} or, when that is the "
                      f"baseline, its .new.json sibling)")
    from nanohlat.config import UserError
    from nanohlat.system import files
    try:
        files.refuse_unless_file(out, "another --out")
    except UserError as e:
        raise Refused(str(e)) from None
    folder = os.path.dirname(os.path.abspath(out))
    existing = folder
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
        raise Refused(f"--out {out!r}: {existing!r} is {'not a folder' if not os.path.isdir(existing) else 'not writable'}"
                      f"; choose another --out")
    return out


def main(argv=None) -> int:
    """The command line: one line and exit code 2 for what it cannot use (before any run), 130 after Ctrl-C."""
    try:
        return _main(argv)
    except Refused as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:   # (the train.py run in flight gets it too, and stops)
        print("interrupted", file=sys.stderr)
        return 130


def _main(argv=None) -> int:
    sys.path.insert(0, ROOT)
    from nanohlat.system.flags import Parser   # (a flag it cannot read: one line, exit 2)
    p = Parser(prog="scripts/layout_matrix.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--sample", action="store_true", help=f"only {', '.join(SAMPLE)} (and their references)")
    p.add_argument("--only", default="", help="comma-separated layout names (and their references)")
    p.add_argument("--out", default=None, help=f"the JSON to write (default {os.path.relpath(DEFAULT_OUT)}; with "
                                              f"--compare of that file, its .new.json sibling)")
    p.add_argument("--cache-dir", default="", help="train.py's --cache-dir for every run (default: its own, "
                                                   "~/.cache/nanohlat; the tests pass theirs); relative to this "
                                                   "folder")
    p.add_argument("--compare", default="", help="an earlier JSON, never written: list the runs whose numbers "
                                                 "differ, exit 1 if any")
    p.add_argument("--plan-vs-measured", default="", metavar="FILE",
                   help="also write each run's measured bytes (rank 0's summary.json) beside the plan's for its "
                        "config.json: the data `train.py --plan --html` shows (the repository ships "
                        "nanohlat/plan/layout_matrix_measured.json, made with --only "
                        f"{','.join(PLAN_VS_MEASURED)})")
    args = p.parse_args(argv)
    names = SAMPLE if args.sample else [n for n in args.only.split(",") if n] or None
    runs, refs = plan(names)
    # every path before the first run: the baseline read whole, --out checked, --cache-dir made absolute
    # (the runs start in the repository's root: a relative one meant a folder there, not here)
    baseline = read_baseline(args.compare) if args.compare else None
    out = out_path(args.out, args.compare)
    versus = out_path(args.plan_vs_measured, "") if args.plan_vs_measured else ""
    cache = os.path.abspath(args.cache_dir) if args.cache_dir else ""
    if cache and os.path.exists(cache) and not os.path.isdir(cache):
        raise Refused(f"--cache-dir {args.cache_dir!r} is not a folder; give a folder (it is made if missing)")
    where = machine()
    print(f"torch {where['torch']}, python {where['python']}, {where['cpu']}")
    print(f"{len(runs)} runs ({len(refs)} layouts, {len(runs) - len(refs)} references) of {STEPS} steps; "
          f"each: python train.py FLAGS {' '.join(FIXED)} --out-dir TMP/NAME", flush=True)
    t0 = time.perf_counter()
    results = {}
    with tempfile.TemporaryDirectory(prefix="layout-matrix-") as tmp:
        for run in runs:
            r = results[run[0]] = train(*run, tmp, ["--cache-dir", cache] if cache else [])
            print(f"  {r['name']:<28} {r['seconds']:6.1f} s" + ("  FAILED" if "error" in r else ""), flush=True)
    seconds = time.perf_counter() - t0
    text, bad = table(results, refs)
    digest = hashlib.sha256(canonical(results).encode()).hexdigest()
    print(f"\n{text}\n\n{len(results)} runs in {seconds:.0f} s; tolerance (max relative loss difference from "
          f"the reference): fp32 {TOLERANCE['fp32']:g}, bf16 {TOLERANCE['bf16']:g}")
    for name, why in bad.items():
        print(f"{name}: {why}")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    from nanohlat.system import files   # (whole or absent, and never written through a link)
    files.write_text(out, json.dumps({"digest": digest, "machine": where, "steps": STEPS, "fixed_flags": FIXED,
                                      "tolerance": TOLERANCE, "seconds": round(seconds), "references": refs,
                                      "runs": results}, indent=1))
    print(f"wrote {out}" + (f" (the baseline {args.compare} is left as it was)" if args.compare else ""))
    if versus:
        write_plan_vs_measured(versus, results, where, argv if argv is not None else sys.argv[1:])
        print(f"wrote {versus}: the plan beside what each run measured")
    changed = compare(results, baseline["runs"]) if args.compare else []
    if args.compare:
        print(f"against {args.compare}: " + (f"{len(changed)} run(s) differ: {', '.join(changed)}" if changed
                                             else "every run's losses and grad norms bit for bit the same"))
    print(f"table digest: {digest}")
    return 1 if bad or changed else 0


if __name__ == "__main__":
    sys.exit(main())
