"""The debugging lab (tutorial.md chapter 12): bugs planted into a copy, and the grader that is not the copy's.

    python -m nanohlat.classroom list                     # the exercises, then the lab's bugs
    python -m nanohlat.classroom bug N DIR                # a copy of the repository with bug N in it
    python -m nanohlat.classroom check bugN [--copy DIR]  # grade that copy: does it train like one process?

The bugs, their patches and how each is graded are lab_bugs.py's: the lab's
answer key, which a bug's copy never holds. A copy holds the repository with
one patch applied and a LAB.md saying what a user sees and on which layouts,
ending with an opaque id (`lab_id`) from which the installed grader knows
which bug the copy holds, and that it is this version's.

`check bugN` grades with the installed nanohlat (this file, lab_bugs.py and
the reference code beside them), never with code of the copy: run in a copy,
the copy's own `check` hands the work to the installed one (`hand_off`), and
`check bugN --copy DIR` grades a copy from anywhere, even one whose
nanohlat/classroom/ is gone. The copy's code (its train.py and nanohlat/) runs
only in the lab's worker processes (lab_workers.py). For each of the bug's
cases (lab_bugs.Case: the layouts that show it, their neighbours, the bug's
own probe) it passes only when the copy's run
  * runs (a refusal, a crash or a collective that waits lab_workers.COLLECTIVE_S seconds
    is a failure, named);
  * logs the same steps as the reference's one process with the same flags,
    each loss and grad norm within REL_TOL of it;
  * leaves every parameter within WEIGHT_* of the reference's after the last
    step (the updates themselves, which a printed figure can hide);
  * counts, in its comm ledger, what the reference's plan predicts for its
    first step (multi-process runs without a mixture of experts).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import signal
import subprocess
import sys
import tempfile

from nanohlat.classroom import lab_workers
from nanohlat.classroom.lab_workers import Job

REL_TOL = 1e-5         # per-step loss and grad norm against one process (fp32 layouts agree to ~1e-7)
# Weights after the last step, per parameter, against one process: at most WEIGHT_SHARE of its elements (and
# WEIGHT_FEW at least) further apart than WEIGHT_TOL, none further than WEIGHT_MAX. fp32 layouts agree to
# ~1e-7, but for a gradient element near 0 (|g| ~ Adam's eps) round-off can move Adam's step of lr x g / (|g| +
# eps) by up to 2 lr: a few such elements (one of 32,768 at dp 4) differ by ~1e-4.
WEIGHT_TOL, WEIGHT_MAX, WEIGHT_SHARE, WEIGHT_FEW = 1e-6, 1e-2, 5e-3, 3
STEPS = 2
BASE = ["--preset", "tiny", "--steps", str(STEPS), "--eval-every", "0", "--no-progress", "--threads", "1",
        "--warmup-steps", "1"]
ID_PREFIX = "lab copy id: "
GRADER = lab_workers.GRADER
# flags that choose a layout, not the model or the run: one process's reference leaves them out
LAYOUT_FLAGS = {"--nproc": 1, "--dp": 1, "--tp": 1, "--pp": 1, "--cp": 1, "--ep": 1, "--zero": 1,
                "--sequence-parallel": 0, "--cp-attention": 1, "--microbatches": 1, "--bucket-mb": 1,
                "--no-overlap-grad-reduce": 0, "--stop-after": 1, "--resume": 1}


# ---------------------------------------------------------------------------
# Which bug a copy holds
# ---------------------------------------------------------------------------

def lab_id(bug) -> str:
    """The copy's opaque id of `bug`: a hash of its number and patch. It says nothing without the
    answer key, and a copy made by another version of the lab (another patch) matches no bug here."""
    return hashlib.sha256(f"nanohlat lab|{bug.n}|{bug.file}|{bug.old}|{bug.new}".encode()).hexdigest()[:16]


def brief(bug) -> str:
    """The copy's LAB.md: what a user sees, the layouts that show it and those that do not, the id."""
    lines = [f"# The debugging lab, bug {bug.n}: {bug.title}", "",
             "This copy of nanohlat has one bug planted in it (tutorial.md chapter 12). What you see:", "",
             bug.symptom, "", f"Every run here is `python train.py {' '.join(BASE)}` with these flags"
             + (f" and `{' '.join(bug.base)}`" if bug.base else "") + ":", "",
             "* it shows with: " + "; ".join(c.words() for c in bug.cases if c.shows),
             "* and these train like one process, bug and all: "
             + ("; ".join(c.words() for c in bug.cases if not c.shows) or "none"), "",
             f"`python -m nanohlat.classroom check bug{bug.n}` (in this folder) grades it with the nanohlat you "
             f"installed, not with this copy's code: it passes when every run above trains like one process.",
             "", f"{ID_PREFIX}{lab_id(bug)}", ""]
    return "\n".join(lines)


def patched(root: str, changes) -> dict:
    """{file: text}: each (file, old, new) of `changes` applied to the files under root, `old` found
    exactly once (else the lab and the reference disagree: an error naming the file)."""
    texts: dict = {}
    for f, old, new in changes:
        if f not in texts:
            with open(os.path.join(root, f), encoding="utf-8") as fh:
                texts[f] = fh.read()
        text = texts[f]
        if text.count(old) != 1:
            raise RuntimeError(f"the lab's patch of {f} found its text {text.count(old)} times, not once: the "
                               f"reference changed; update nanohlat/classroom/lab_bugs.py")
        texts[f] = text.replace(old, new)
    return texts


def planted(bug, root: str = GRADER) -> dict:
    """{file: text} of the code at root with `bug` planted."""
    return patched(root, [(bug.file, bug.old, bug.new)])


ANSWERS = ("tutorial.md", "<summary>12, the lab's bugs</summary>\n", "</details>")   # where its solutions are


def without_answers(dest: str) -> dict:
    """{file: text}: the files of the copy at `dest` that hold the lab's solutions, with them taken out
    (a bug's copy: tutorial.md's end says what each bug was)."""
    name, begin, end = ANSWERS
    path = os.path.join(dest, name)
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if begin not in text:
        return {}
    a = text.index(begin) + len(begin)
    b = text.index(end, a)
    return {name: text[:a] + "\nNot in a bug's copy: the lab's solutions are in the tutorial.md of the nanohlat that "
                  "wrote it (your teacher's).\n" + text[b:]}


def held_bug(copy: str):
    """The bug the copy at `copy` holds (its LAB.md's id), or a UserError saying why none."""
    from nanohlat.classroom import lab_bugs
    from nanohlat.config import UserError
    path = os.path.join(copy, "LAB.md")
    if not os.path.isfile(path):
        raise UserError(f"{copy} is not a lab copy (no LAB.md): `python -m nanohlat.classroom bug N DIR` writes one")
    with open(path, encoding="utf-8", errors="replace") as f:
        ids = [line.strip()[len(ID_PREFIX):] for line in f if line.strip().startswith(ID_PREFIX)]
    found = [b for b in lab_bugs.BUGS if ids and lab_id(b) == ids[-1]]
    if not found:
        raise UserError(f"{path} names no bug of this lab ({'its id line is gone' if not ids else 'its id is unknown'}"
                        f"): the copy was made by another version of nanohlat or its LAB.md was edited; make a "
                        f"fresh copy with `python -m nanohlat.classroom bug N DIR`")
    return found[0]


# ---------------------------------------------------------------------------
# The runs of a bug's cases
# ---------------------------------------------------------------------------

def without(flags, drop: dict) -> list:
    """`flags` without each flag of `drop` and the values it takes ({flag: how many})."""
    out, skip = [], 0
    for a in flags:
        if skip:
            skip -= 1
        elif a in drop:
            skip = drop[a]
        else:
            out.append(a)
    return out


def one_process(flags) -> list:
    """`flags` without those that choose a layout (LAYOUT_FLAGS), a stop and a resume among them."""
    return without(flags, LAYOUT_FLAGS)


def world_of(flags) -> int:
    return int(flags[flags.index("--nproc") + 1]) if "--nproc" in flags else 1


def case_job(bug, case, root: str, texts: dict, key: str) -> Job:
    """The run of `case` in the code at root (texts in place)."""
    flags = BASE + list(bug.base) + list(case.flags)
    legs = [flags + list(leg) for leg in case.legs] or [flags]
    return Job(key, root, legs, world_of(flags), dict(texts), case.nan_step)


def baseline_job(bug, case) -> Job:
    """The reference's run for `case`: one process (or, case.same, the case's own layout), straight to
    its last step."""
    flags = BASE + list(bug.base) + list(case.flags) + (list(case.legs[-1]) if case.legs else [])
    flags = without(flags, {"--stop-after": 1, "--resume": 1}) if case.same else one_process(flags)
    return Job(f"ref:{json.dumps([flags, case.nan_step])}", GRADER, [flags], world_of(flags), {}, case.nan_step)


def read_steps(out: str) -> list[dict] | None:
    """metrics.jsonl's step rows (NaN losses as float NaN); None when there is no such file."""
    path = os.path.join(out, "metrics.jsonl")
    if not os.path.isfile(path):
        return None
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict) and "loss" in row and "step" in row:
                rows.append({**row, **{k: _number(row.get(k)) for k in ("loss", "grad_norm")}})
    return rows


def _number(v) -> float:
    """A figure of metrics.jsonl as a float ("NaN", "Infinity" as written for non-finite ones; NaN for
    what is no number at all)."""
    try:
        return float(v)
    except (TypeError, ValueError):
        return float("nan")


def read_weights(out: str) -> tuple[int | None, dict]:
    """(step, {name: fp32 tensor}) of the run's newest checkpoint, whole (its shards put together by the
    grader's own checkpoint reader); (None, {}) when it saved none that can be read."""
    from nanohlat.config import UserError
    from nanohlat.run import checkpoint
    try:
        shards = checkpoint.ShardSet(checkpoint.resolve(out))
        names = sorted({n for sh in shards.shards.values() for n in sh["model"]})
        return shards.manifest["step"], {n: shards.full(n) for n in names}
    except (UserError, OSError, KeyError, TypeError):
        return None, {}


def ledger_differs(bug, case, out: str) -> str | None:
    """The first row of the run's comm ledger (rank 0, first step) unlike the grader's plan for it."""
    from nanohlat import comm
    from nanohlat.run.build import mesh as build_mesh
    from nanohlat import recipe
    from nanohlat.plan.communication import comm_per_step
    flags = BASE + list(bug.base) + list(case.flags) + (list(case.legs[0]) if case.legs else [])
    world = world_of(flags)
    try:
        with open(os.path.join(out, "summary.json"), encoding="utf-8") as f:
            summary = json.load(f)
    except (OSError, ValueError):
        return "its summary.json is missing or unreadable"
    cfg, tcfg = recipe.parse_args(one_nproc(flags))
    if world == 1 or cfg.moe_experts:   # (a mixture's all-to-alls follow the routing: no plan to hold them to)
        return None
    names = {"payload": "comm_bytes", "wire": "comm_wire_bytes", "padding": "comm_padding_bytes", "calls": "comm_calls"}
    keys = set().union(*(summary.get(v, {}) for v in names.values()))
    measured = {k: {f: summary.get(v, {}).get(k, 0) for f, v in names.items()} for k in keys}
    predicted = comm_per_step(cfg, tcfg, build_mesh(cfg, tcfg, world, 0))
    for k in sorted(set(measured) | set(predicted)):
        m, p = measured.get(k, dict.fromkeys(comm.FIGURES, 0)), predicted.get(k, dict.fromkeys(comm.FIGURES, 0))
        if m != p:
            return (f"the comm ledger's {k} of step 1 on rank 0: " + ", ".join(f"{f} {m[f]:,}" for f in comm.FIGURES)
                    + "; the plan's: " + ", ".join(f"{f} {p[f]:,}" for f in comm.FIGURES))
    return None


def one_nproc(flags) -> list:
    """flags without --nproc N (a worker's own flags)."""
    return [a for i, a in enumerate(flags) if a != "--nproc" and (i == 0 or flags[i - 1] != "--nproc")]


def _steps_said(steps: list) -> str:
    return f"step{'s' if len(steps) > 1 else ''} {', '.join(map(str, steps))}"


def _close(a: float, b: float, tol: float) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)   # (a step both made non-finite)
    return abs(a - b) <= tol * abs(b)


def weights_differ(saved: tuple, ref: tuple, against: str = "one process's") -> str | None:
    """The first parameter whose values after the last step differ from the reference's by more than
    WEIGHT_* allow (saved, ref: read_weights' (step, weights))."""
    import torch
    (step, mine), (last, ref) = saved, ref
    if step != last or not mine:
        return (f"the run saved no readable checkpoint of its last step, step {last} (its newest: "
                f"{'none' if step is None else f'step {step}'}), so its weights cannot be compared")
    for name in sorted(ref):
        if name not in mine:
            return f"its checkpoint lacks parameter {name}"
        a, b = mine[name], ref[name]
        if a.shape != b.shape:
            return f"parameter {name} is {list(a.shape)}, one process's {list(b.shape)}"
        if not bool(torch.isfinite(a).all()):
            return f"parameter {name} holds NaN or inf"
        diff = (a - b).abs()
        n_far = int((diff > WEIGHT_TOL).sum())
        if bool((diff > WEIGHT_MAX).any()) or n_far > max(WEIGHT_FEW, WEIGHT_SHARE * diff.numel()):
            return (f"after the last step parameter {name} differs from {against} by up to {diff.max().item():.2g} "
                    f"({n_far:,} of {diff.numel():,} elements beyond {WEIGHT_TOL:g})")
    return None


def judge(bug, case, run: dict, ref: dict, refs_weights) -> str | None:
    """None: the copy's run of `case` trains like the reference's (one process, or case.same its own
    layout); else what differs, first: the run failed, its steps, a loss or grad norm, the comm
    ledger, the weights after the last step."""
    name, against = case.words(), "the reference's" if case.same else "one process's"
    if "error" in ref:
        return f"the reference's run for {name} failed ({ref['error']}): the installed nanohlat cannot grade this"
    if "error" in run:
        return f"{name}: {run['error']}"
    mine, one = read_steps(run["out"]), read_steps(ref["out"])
    if case.nan_step and not (len(one) >= case.nan_step and math.isnan(one[case.nan_step - 1]["loss"])):
        return f"the lab could not make step {case.nan_step} of the reference's run non-finite: a bug of the lab"
    want = [r["step"] for r in one]
    if not mine:
        return (f"{name}: no step was logged (metrics.jsonl {'holds none' if mine == [] else 'is missing'}); "
                f"{against} run logs {_steps_said(want)}")
    steps = [r["step"] for r in mine]
    if steps != want:
        return (f"{name}: it logged {_steps_said(steps)}, {against} run {_steps_said(want)}: a run that stops "
                f"early, or logs steps it did not take, trains like no one process")
    for a, b in zip(mine, one):
        for f in ("loss", "grad_norm"):
            if not _close(a[f], b[f], REL_TOL):
                rel = abs(a[f] - b[f]) / abs(b[f]) if b[f] and not math.isnan(a[f] - b[f]) else float("nan")
                return (f"{name}: step {a['step']} {f} {a[f]:.6f}, {against} {b[f]:.6f} "
                        f"(relative difference {rel:.1e} > {REL_TOL:g})")
    ledger = ledger_differs(bug, case, run["out"])
    if ledger:
        return f"{name}: {ledger}"
    differs = weights_differ(read_weights(run["out"]), refs_weights(ref["out"]), against)
    if differs:
        return f"{name}: {differs}, though every step's loss and grad norm agree: the update is not {against}"
    return None


def grade(variants: dict, every=frozenset(), pools=None) -> dict:
    """{tag: verdict (None: passed)} and {(tag, "cases"): [verdict of each case run]} for each
    tag -> (bug, root, texts) of `variants`: the code at root (texts in place) graded for `bug`,
    all in one set of worker pools, the reference's one-process runs first (each run once). A
    tag's later cases are not run once one fails, unless the tag is in `every`."""
    own = pools is None
    pools = pools or lab_workers.Pools()
    weights: dict = {}
    ref_weights = lambda out: weights.setdefault(out, read_weights(out))   # noqa: E731
    try:
        base = {}
        for bug, _, _ in variants.values():
            for case in bug.cases:
                job = baseline_job(bug, case)
                base[job.key] = job
        refs = pools.run(list(base.values()))
        # in rounds: every tag's next case together (the one-process ones side by side)
        pending = {tag: list(bug.cases) for tag, (bug, _, _) in variants.items()}
        verdicts: dict = {tag: [] for tag in variants}
        runs: dict = {}
        while any(pending.values()):
            jobs, which = [], []
            for tag, cases in pending.items():
                if cases:
                    bug, root, texts = variants[tag]
                    case = cases.pop(0)
                    jobs.append(case_job(bug, case, root, texts, f"{tag}:{len(verdicts[tag])}"))
                    which.append((tag, bug, case))
            got = pools.run(jobs)
            for job, (tag, bug, case) in zip(jobs, which):
                v = judge(bug, case, got[job.key], refs[baseline_job(bug, case).key], ref_weights)
                verdicts[tag].append(v)
                runs.setdefault(tag, []).append((got[job.key], refs[baseline_job(bug, case).key]))
                if v is not None and tag not in every:
                    pending[tag] = []
        out: dict = {}
        for tag, vs in verdicts.items():
            out[tag] = next((v for v in vs if v is not None), None)
            out[(tag, "cases")] = vs
            out[(tag, "runs")] = runs.get(tag, [])   # (the copy's run, the reference's) of each case run
        return out
    finally:
        if own:
            pools.__exit__(None, None, None)


def check(name: str, copy: str) -> str | None:
    """`check bugN` of the copy at `copy` (graded by this nanohlat): None, or what fails."""
    from nanohlat.classroom import lab_bugs
    from nanohlat.config import UserError
    held = held_bug(copy)
    n = int(name[3:])
    if n not in lab_bugs.BY_N:
        raise UserError(f"there is no {name}; the lab's bugs are {', '.join(f'bug{b.n}' for b in lab_bugs.LAB)}")
    if held.n != n:
        raise UserError(f"{copy} holds bug {held.n} (its LAB.md), not bug {n}: `check bug{held.n}` grades it")
    if os.path.realpath(copy) == os.path.realpath(GRADER):
        raise UserError(f"{copy} is the nanohlat grading it: grade a copy with the installed nanohlat, not "
                        f"with the copy itself")
    return grade({name: (held, copy, {})})[name]


# ---------------------------------------------------------------------------
# In a copy: the installed nanohlat grades it
# ---------------------------------------------------------------------------

def hand_off(name: str, copy: str) -> int:
    """`check bugN` run by a copy's own kit: the installed nanohlat grades the copy, in a process
    started outside the copy (so that Python imports the installed package, not the copy's).
    Returns its exit code; Ctrl-C reaches it, which says the one line."""
    env = dict(os.environ)
    keep = [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
            if p and os.path.realpath(p) != os.path.realpath(copy)]
    env["PYTHONPATH"] = os.pathsep.join(keep)
    probe = subprocess.run([sys.executable, "-c", "import nanohlat, os; print(os.path.dirname(os.path.dirname("
                            "os.path.abspath(nanohlat.__file__))))"], cwd=tempfile.gettempdir(), env=env,
                           capture_output=True, text=True)
    installed = probe.stdout.strip()
    if probe.returncode != 0 or not installed:
        print(f"error: no installed nanohlat to grade with: the lab grades a copy with the nanohlat you installed, "
              f"never with the copy's code; install the repository the copy came from (`pip install -e PATH`) or "
              f"run `python -m nanohlat.classroom check {name} --copy {copy}` in that repository's folder",
              file=sys.stderr)
        return 2
    if os.path.realpath(installed) == os.path.realpath(copy):
        print(f"error: the nanohlat installed is this copy ({copy}): the lab grades a copy with another nanohlat; "
              f"install the repository the copy came from (`pip install -e PATH`)", file=sys.stderr)
        return 2
    # Ctrl-C reaches both: the grader says its one line, this process nothing (a handler, not SIG_IGN,
    # which the grader would inherit: an ignored signal stays ignored across exec)
    old = signal.signal(signal.SIGINT, lambda *_: None)
    try:
        return subprocess.run([sys.executable, "-m", "nanohlat.classroom", "check", name, "--copy", copy],
                              cwd=tempfile.gettempdir(), env=env).returncode
    finally:
        signal.signal(signal.SIGINT, old)


# ---------------------------------------------------------------------------
# compare RUN RUN
# ---------------------------------------------------------------------------

def compare(a: str, b: str, html: str = "") -> int:
    """`compare RUN RUN [--html FILE]`: two runs' per-step losses and gradient norms side by side (their
    metrics.jsonl), and the first step where they differ by more than REL_TOL (a NaN is a
    difference). 0: the same steps, agreeing; 1: they differ; 2: they cannot be compared.
    With `html`, also the two runs' report pages side by side in that file (run/report.py:compare_page)."""
    from nanohlat.config import UserError
    if html:
        check_page_path(html)
    rows = []
    for run in (a, b):
        path = os.path.join(run, "metrics.jsonl")
        if not os.path.isfile(path):
            raise UserError(f"{path} is not there; give two runs' --out-dir folders")
        got = {}
        with open(path, encoding="utf-8", errors="replace") as f:
            for i, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except ValueError:
                    raise UserError(f"{path}:{i} is not a metrics record (not JSON): the file is damaged; "
                                    f"compare runs that train.py wrote") from None
                if isinstance(row, dict) and "loss" in row and "step" in row:
                    try:
                        got[int(row["step"])] = {f: float(row[f]) for f in ("loss", "grad_norm")}
                    except (KeyError, TypeError, ValueError):
                        raise UserError(f"{path}:{i} is not a metrics record (its step, loss or grad_norm is "
                                        f"not a number): the file is damaged") from None
        if not got:
            raise UserError(f"{path} holds no step: the run logged none (did it train?); nothing to compare")
        rows.append(got)
    if sorted(rows[0]) != sorted(rows[1]):
        raise UserError(f"the runs logged different steps ({_steps(rows[0])} in {a}, {_steps(rows[1])} in {b}): "
                        f"compare runs of the same --steps (and --resume'd runs by the steps both have)")
    print(f"A: {a}, B: {b}")
    print("step      loss A      loss B   grad norm A   grad norm B")
    first = None
    for step in sorted(rows[0]):
        x, y = rows[0][step], rows[1][step]
        bad = [f for f in ("loss", "grad_norm") if not (abs(x[f] - y[f]) <= REL_TOL * abs(y[f]))]   # (NaN: bad)
        first = first or (bad and (step, bad))
        print(f"{step:>4}  {x['loss']:>10.6f}  {y['loss']:>10.6f}  {x['grad_norm']:>12.6f}  {y['grad_norm']:>12.6f}"
              + ("  <- differs" if bad else ""))
    if first:
        print(f"first difference: step {first[0]}, {' and '.join(first[1])} (more than {REL_TOL:g} relative, or NaN)")
    else:
        print(f"the same at every step, to {REL_TOL:g} relative")
    if html:
        from nanohlat.run import report
        from nanohlat.system import files
        files.write_text(html, report.compare_page(a, b))   # atomic, never through a link
        print(f"wrote {html}: both runs' reports side by side (A left, B right)")
    return 1 if first else 0


def check_page_path(path: str) -> None:
    """Refuse, before anything is read, a --html path a page cannot be written to: a folder,
    a FIFO or a device (files.refuse_unless_file), a folder that does not exist."""
    from nanohlat.config import UserError
    from nanohlat.system import files
    if os.path.isdir(path):
        raise UserError(f"--html {path!r} is a folder; give a file path, e.g. {os.path.join(path, 'compare.html')!r}")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise UserError(f"--html {path!r}: its folder {parent!r} does not exist; make it or choose another --html")
    files.refuse_unless_file(path, "another --html")


def _steps(rows: dict) -> str:
    s = sorted(rows)
    return f"steps {s[0]}-{s[-1]}" if s == list(range(s[0], s[-1] + 1)) and len(s) > 1 else \
        "step " + ", ".join(map(str, s)) if len(s) == 1 else "steps " + ", ".join(map(str, s))


def list_lines() -> list[str]:
    """`list`'s lab section: each bug by what a user sees (where it is, never)."""
    try:
        from nanohlat.classroom import lab_bugs
    except ImportError:   # (a bug's copy: the lab's bugs are the installed nanohlat's)
        return ["", "The debugging lab: this is a bug's copy (LAB.md); the installed nanohlat lists the bugs"]
    out = ["", "The debugging lab (tutorial.md chapter 12): `python -m nanohlat.classroom bug N DIR` plants bug N "
           "in a copy; `check bugN` there grades it"]
    for b in sorted(lab_bugs.LAB, key=lambda b: (b.level, b.n)):
        out.append(f"  bug{b.n:<3} {b.area:<12} level {b.level}  {b.title}")
    return out
