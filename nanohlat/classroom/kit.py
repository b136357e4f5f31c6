"""The classroom kit: exercises students implement in the real code, checked automatically.

    python -m nanohlat.classroom list                         # the exercises, in tutorial order
    python -m nanohlat.classroom new DIR [--chapter N | --exercise ID ...]
    python -m nanohlat.classroom check ID [ID ...] | --chapter N | --all
    python -m nanohlat.classroom needs --update              # re-trace what needs what (needs.py)
    python -m nanohlat.classroom bug N DIR                   # the debugging lab: a copy with bug N (lab.py)
    python -m nanohlat.classroom check bugN                  # (in that copy) does it train like one process?
    python -m nanohlat.classroom compare RUN RUN             # two runs' losses and grad norms, step by step
    python -m nanohlat.classroom compare A B --html FILE     # ... and their report pages side by side in FILE
    python -m nanohlat.classroom fault OUT --kills N -- FLAGS # the fault lab: kill a run N times (fault_lab.py)

How it works. The reference code carries *exercise regions*, comment-marked:

    def forward(self, x):
        # exercise Nx: begin
        h = x.float()
        ...
        # exercise Nx: end

`new` copies the repository into DIR and replaces the lines between the
markers with a stub that raises

    NotImplementedError("exercise Nx: <the task>, see tutorial.md section N")

so the reference and the exercises can never drift apart: the exercise *is*
the real code, minus the part the student writes. Everything else runs.

`check` runs an exercise's checks on the code it finds (the student's copy,
or this repository, where every check passes). Each check compares the
student's code with an independent oracle written in
`checks/` (a file per chapter): a dense computation for a parallel layer, the
one-process result for a parallel layout, a hand-written timetable for a
schedule. The verdict names what differs: the first mismatching tensor, its
rank, the index and by how much. Distributed checks run on a few gloo worker
processes on the CPU, seconds each; a check that hangs (a collective called
on one rank only) is stopped after its time limit and reported as such. The
student's code runs in a child process (isolate.py): an exit there is a
failure, and every check has the time limit. `check` grades only the copy it
is run in: outside one it is refused, and a missing exercise file is named.

What a command or check needs: a student copy's command stops at the first
stub it reaches, with one line naming it (nanohlat/system/cli.py:not_done);
which exercises each tutorial command and each check runs through is traced on
the reference (needs.py), printed by `list`, written at the top of a copy's
README.md, and a check that reaches another exercise's stub names every one of
them still a stub in the copy.

The teacher's side (a course plan, typical mistakes, grading) is in
docs/teaching.md.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import time
from dataclasses import dataclass

from nanohlat.system import cli, files, flags

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# What a student copy leaves out: version control, run outputs, caches, virtual environments.
SKIP_DIRS = {".git", "__pycache__", ".pytest_cache", "out", "runs", ".cache", "data_cache",
             "class-copy", "build", "dist"}
SKIP_PREFIXES = (".venv", "venv", ".tox", ".eggs")

LAB_ID = re.compile(r"bug\d+")   # the lab's bugs (lab.py; which exist, the installed nanohlat's lab_bugs.py knows)
BEGIN = re.compile(r"^(\s*)# exercise (\d+[a-z]): begin\s*$")
END = re.compile(r"^\s*# exercise (\d+[a-z]): end\s*$")


@dataclass(frozen=True)
class Exercise:
    id: str          # "4b": chapter 4 of tutorial.md, its second implementation exercise
    task: str        # one line: what to write
    section: str     # where tutorial.md explains it

    @property
    def file(self) -> str:
        """The file its region is in (FILES; tests/classroom/test_exercise_checks.py holds it to the regions)."""
        return next(f for f, ids in FILES.items() if self.id in ids.split())

    @property
    def chapter(self) -> int:
        return int(self.id[:-1])

    def stub_message(self) -> str:
        return f"exercise {self.id}: {self.task}, see tutorial.md section {self.section}"


# In tutorial order. The checks of each id are checks.CHECKS[id] (classroom/checks/__init__.py).
EXERCISES = [
    Exercise("1a", "RMSNorm: x / sqrt(mean(x^2) + eps) * weight, computed in fp32", "1"),
    Exercise("1b", "rotary embeddings: rotate each (x_i, x_{i+D/2}) pair by its position's angle", "1"),
    Exercise("1c", "the KV cache: write each new key/value at its position, return what each token may attend to and the mask", "1"),
    Exercise("3a", "data parallelism: sum a flat gradient buffer over the dp group, bucket by bucket", "3"),
    Exercise("3b", "ZeRO-1: reduce-scatter the gradient buckets so each dp rank keeps its shard", "3"),
    Exercise("3c", "ZeRO-1: all-gather every rank's updated shard into the full flat buffer", "3"),
    Exercise("3d", "ZeRO-2: reduce-scatter a full gradient bucket and add this rank's columns into its shard", "3"),
    Exercise("3e", "ZeRO-3: all-gather a unit's shards into its flat buffers before use, free their storage after", "3"),
    Exercise("4a", "the four conjugate functions: forward and backward of copy, reduce, gather and scatter", "4"),
    Exercise("4b", "column- and row-parallel linear layers", "4"),
    Exercise("4c", "the vocab-parallel cross-entropy, without gathering the logits", "4"),
    Exercise("5a", "the 1F1B order of one pipeline stage: warm-up forwards, then one forward one backward", "5"),
    Exercise("5b", "the exchange plan of a tick: what a stage sends and receives at one boundary", "5"),
    Exercise("5c", "the interleaved 1F1B order of one stage: which micro-batch through which chunk, and when", "5"),
    Exercise("6a", "rank <-> (dp, pp, tp) coordinates, tensor-parallel ranks neighbours", "6"),
    Exercise("6b", "the process groups: every tp, dp and pp group of the mesh", "6"),
    Exercise("7a", "stochastic rounding of fp32 to bf16 with 16 given random bits per element: unbiased, NaN stays NaN", "7"),
    Exercise("7b", "FP8: the saturating scaled cast, the scale that puts a tensor's amax on the format's largest "
                   "value, and each operand's format (E4M3; gradients E5M2)", "7"),
    Exercise("7c", "FP8's block scales: OCP MX's power-of-two (E8M0) scale from a block's amax, and a block's amax "
                   "over the ranks that hold its pieces", "7"),
    Exercise("8a", "resharding: the view of the full tensor that one saved tp part fills (dst, cov)", "8"),
    Exercise("8b", "--async-save at a step's end: finish the save in flight, begin, snapshot, then hand the snapshot "
                   "to a writer thread", "8"),
    Exercise("10a", "top-k routing: each token's k likeliest experts, their probabilities renormalised over the k; "
                    "per sequence the load-balancing loss E sum f_e P_e (f_e counts, no gradient) and the z-loss", "10"),
    Exercise("10b", "the sorted dispatch: sort the choices by expert, each expert's SwiGLU on its slice (swiglu_slices), "
                    "weight, and add each back to its token", "10"),
    Exercise("10c", "the expert-parallel groups: ep, runs of ep neighbouring dp ranks sharing the experts; ep_dp, "
                    "the ranks holding the same ones, over which their gradients are summed", "10"),
    Exercise("11a", "the merge of two partial attention results (o, lse) over disjoint keys: an online softmax in fp32, "
                    "its running max keeping exp() finite", "11"),
    Exercise("11b", "the zigzag split: rank i holds chunks i and 2cp-1-i, each token at its place in the whole "
                    "sequence; shift into (input, target) before splitting", "11"),
    Exercise("11c", "the ring's backward: K/V blocks go round the other way, each with its dK/dV in fp32, "
                    "and a last hop brings each block's dK/dV home", "11"),
]
BY_ID = {e.id: e for e in EXERCISES}
# Where each exercise's region is: `check` names the file when a copy lacks it (it graded the
# reference's code then, from an editable install, and passed).
FILES = {"nanohlat/model.py": "1a 1b", "nanohlat/serving/generate.py": "1c", "nanohlat/data_parallel.py": "3a",
         "nanohlat/zero1.py": "3b 3c", "nanohlat/beyond/zero2.py": "3d", "nanohlat/beyond/zero3.py": "3e",
         "nanohlat/tensor_parallel.py": "4a 4b 4c", "nanohlat/pipeline.py": "5a 5b",
         "nanohlat/beyond/schedules.py": "5c", "nanohlat/mesh.py": "6a 6b", "nanohlat/precision.py": "7a",
         "nanohlat/beyond/fp8_scaling.py": "7b 7c", "nanohlat/run/checkpoint/reshard.py": "8a",
         "nanohlat/run/checkpoint/background.py": "8b", "nanohlat/beyond/moe.py": "10a 10b 10c",
         "nanohlat/beyond/context_parallel.py": "11a 11b 11c"}


# ---------------------------------------------------------------------------
# Regions and student copies
# ---------------------------------------------------------------------------

def _source_files(root: str):
    """Every .py file of the repository below `root`, sorted, skipping copies and caches."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith(SKIP_PREFIXES))
        for name in sorted(filenames):
            if name.endswith(".py"):
                yield os.path.join(dirpath, name)


def find_regions(root: str = ROOT) -> dict[str, list[tuple[str, int, int, str]]]:
    """{exercise id: [(file, begin line index, end line index, indent), ...]} (0-based lines)."""
    regions: dict = {}
    for path in _source_files(root):
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
        open_at = None
        for i, line in enumerate(lines):
            m = BEGIN.match(line)
            if m:
                if open_at is not None:
                    raise ValueError(f"{path}:{i + 1}: exercise {m.group(2)} begins inside exercise {open_at[1]}")
                open_at = (i, m.group(2), m.group(1))
                continue
            m = END.match(line)
            if m:
                if open_at is None or open_at[1] != m.group(1):
                    raise ValueError(f"{path}:{i + 1}: 'exercise {m.group(1)}: end' without its begin")
                regions.setdefault(m.group(1), []).append((os.path.relpath(path, root), open_at[0], i, open_at[2]))
                open_at = None
        if open_at is not None:
            raise ValueError(f"{path}:{open_at[0] + 1}: exercise {open_at[1]} has no end marker")
    return regions


def stub_lines(ex: Exercise, indent: str) -> list[str]:
    return [f"{indent}raise NotImplementedError({ex.stub_message()!r})"]


def stub_source(text: str, ids: set[str]) -> str:
    """`text` with the body of every region of `ids` replaced by its stub (markers kept)."""
    lines = text.splitlines()
    out, skipping = [], None
    for line in lines:
        if skipping is None:
            out.append(line)
            m = BEGIN.match(line)
            if m and m.group(2) in ids:
                skipping = m.group(2)
                out.extend(stub_lines(BY_ID[skipping], m.group(1)))
        elif END.match(line):
            out.append(line)
            skipping = None
    return "\n".join(out) + ("\n" if text.endswith("\n") else "")


def stubbed(root: str = ROOT) -> set[str]:
    """The exercises whose code under `root` is (still, in some region) the kit's stub."""
    found = set()
    for ex, regions in find_regions(root).items():
        for rel, begin, end, _ in regions:
            with open(os.path.join(root, rel), encoding="utf-8") as f:
                body = f.read().splitlines()[begin + 1:end]
            if any("raise NotImplementedError(" in line and f"exercise {ex}:" in line for line in body):
                found.add(ex)
    return found


def copy_readme(ids: list[str]) -> str:
    """The section a student copy's README.md opens with: what is a stub, and what needs it."""
    from nanohlat.classroom import needs
    lines = ["# Student copy (nanohlat classroom kit)", "",
             f"In this copy exercises {', '.join(ids)} are stubs for you to write (tutorial.md, the",
             "\"Implement it\" lists; `python -m nanohlat.classroom check ID` grades one). A command",
             "that reaches a stub stops with one line naming it. What runs through which of them",
             "(traced on the reference: nanohlat/classroom/needs.py; `python -m nanohlat.classroom list`):", "",
             "```text"] + needs.summary(needs.load(), only=set(ids)) + ["```", "", "---", ""]
    return "\n".join(lines)


def make_copy(dest: str, ids: list[str], root: str = ROOT, leave_out=None) -> list[str]:
    """Copy the repository to `dest` with the regions of `ids` stubbed, without the files for which
    `leave_out(path relative to root)` is true (a bug's copy leaves out the lab's answers). Returns the
    files changed."""
    regions = find_regions(root)
    missing = [i for i in ids if i not in regions]
    if missing:   # the registry and the code disagree: a bug of the kit, not of the student
        raise SystemExit(f"error: no region in the code for exercise(s) {', '.join(missing)}")

    def ignore(directory, names):
        return [n for n in names if n in SKIP_DIRS or n.startswith(SKIP_PREFIXES) or n.endswith(".egg-info")
                or os.path.abspath(os.path.join(directory, n)) == os.path.abspath(dest)
                or leave_out is not None and leave_out(os.path.relpath(os.path.join(directory, n), root))]

    shutil.copytree(root, dest, ignore=ignore)
    changed = sorted({r[0] for i in ids for r in regions[i]})
    for rel in changed:
        path = os.path.join(dest, rel)
        with open(path, encoding="utf-8") as f:
            text = f.read()
        files.write_text(path, stub_source(text, set(ids)))   # a fresh file: a link there is not followed
    readme = os.path.join(dest, "README.md")
    if ids and os.path.isfile(readme):
        with open(readme, encoding="utf-8") as f:
            text = f.read()
        files.write_text(readme, copy_readme(ids) + text)
    for path in _source_files(dest):   # a copy that does not even compile would blame the student
        with open(path, encoding="utf-8") as f:
            source = f.read()
        try:
            compile(source, path, "exec")
        except SyntaxError as e:
            shutil.rmtree(dest)
            raise SystemExit(f"error: {os.path.relpath(path, dest)}:{e.lineno} of the source does not compile "
                             f"({e.msg}); fix the repository first (no copy written)")
    return changed


# ---------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------

def select(args) -> list[str]:
    if getattr(args, "all", False):
        return [e.id for e in EXERCISES]
    if args.chapter is not None:
        ids = [e.id for e in EXERCISES if e.chapter == args.chapter]
        if not ids:
            usage_error(f"no exercises in chapter {args.chapter}; chapters: "
                        f"{', '.join(sorted({str(e.chapter) for e in EXERCISES}, key=int))}")
        return ids
    ids = args.ids or []
    unknown = [i for i in ids if i not in BY_ID and not LAB_ID.fullmatch(i)]
    if unknown:
        usage_error(f"unknown exercise {', '.join(unknown)}; `python -m nanohlat.classroom list` shows them all (and the lab's bugs, bugN)")
    return ids


def usage_error(message: str):
    """A command line the kit cannot act on: one line, exit code 2 (1 is a check that failed)."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def cmd_list() -> int:
    from nanohlat.classroom import needs
    regions = find_regions()
    for e in EXERCISES:
        where = ", ".join(sorted({r[0] for r in regions.get(e.id, [])})) or "(no region!)"
        print(f"{e.id:>4}  {e.task}  [{where}]")
    print("\nWhat runs through which exercise (a command stops at the first stub it reaches; traced on the "
          "reference code, nanohlat/classroom/needs.py):")
    print("\n".join(needs.summary(needs.load())))
    from nanohlat.classroom import lab
    print("\n".join(lab.list_lines()))
    return 0


def missing_first(ex: str, verdict: str) -> str:
    """A check's "not done yet" verdict with every other exercise it runs through
    that is still a stub here (needs.json's trace of the checks), not only the first."""
    from nanohlat.classroom import needs
    first = re.match(r"not done yet: exercise \S+ needs exercise (\d+[a-z]) first", verdict)
    here = stubbed()     # ROOT: the code being checked (the student's copy)
    others = {d for d in needs.load()["checks"].get(ex, []) if d != ex and d in here}
    if first:
        others.add(first.group(1))
    if not others:
        return verdict
    others = needs.order(others)
    names = f"exercise{'s' if len(others) > 1 else ''} {needs.names(others)}"
    head = f"not done yet: exercise {ex} needs {names} first" if first else verdict + f"; it also needs {names}"
    return f"{head} (still stubs here: `python -m nanohlat.classroom check {' '.join(others)}`)"


def cmd_new(args) -> int:
    dest = os.path.abspath(args.dir)
    if os.path.lexists(dest) and not os.path.isdir(dest):   # a file, a FIFO, a device: never written over
        what = files.not_a_file(os.path.realpath(dest)) or ("a link" if os.path.islink(dest) else "a file")
        print(f"error: {args.dir} is {what}, not a folder; choose a new folder", file=sys.stderr)
        return 2
    if os.path.exists(dest) and os.listdir(dest):
        print(f"error: {args.dir} exists and is not empty; choose a new folder", file=sys.stderr)
        return 2
    if os.path.isdir(dest):
        os.rmdir(dest)   # an empty folder: copytree makes it anew
    ids = select(args) if (args.chapter is not None or args.ids) else [e.id for e in EXERCISES]
    changed = make_copy(dest, ids)
    print(f"wrote a student copy to {args.dir}: exercises {', '.join(ids)} to implement, in {', '.join(changed)}")
    print(f"then: cd {args.dir} && python -m nanohlat.classroom check {ids[0]}   (or check --all)")
    return 0


def cmd_bug(args) -> int:
    """`bug N DIR`: a whole copy of the repository (no exercise stubbed, without the lab's answers)
    with bug N planted, and its LAB.md. Refused before anything is written where this nanohlat is
    itself a copy (a bug's, or a student's), whose code is not the reference."""
    if not os.path.isfile(os.path.join(ROOT, "nanohlat", "classroom", "lab_bugs.py")) \
            or os.path.isfile(os.path.join(ROOT, "LAB.md")) or stubbed():
        usage_error(f"the nanohlat running is a copy ({ROOT}), not the repository: `bug` plants into the reference "
                    f"code; run it with the nanohlat you installed, outside any copy")
    from nanohlat.classroom import lab, lab_bugs
    if args.n not in lab_bugs.BY_N:
        usage_error(f"no bug {args.n}; the lab's bugs are {', '.join(str(b.n) for b in lab_bugs.LAB)} "
                    f"(`python -m nanohlat.classroom list`)")
    dest = os.path.abspath(args.dir)
    if os.path.islink(dest):
        target = os.path.realpath(dest)
        what = ("an empty folder" if os.path.isdir(target) and not os.listdir(target) else
                "a folder" if os.path.isdir(target) else "a file" if os.path.exists(target) else "nothing (broken)")
        usage_error(f"{args.dir} is a link (to {what}): the copy is written only into a new folder, never through "
                    f"a link; give the folder itself or a new path")
    if os.path.lexists(dest) and not (os.path.isdir(dest) and not os.listdir(dest)):
        usage_error(f"{args.dir} exists and is not an empty folder; choose a new folder")
    if os.path.isdir(dest):
        os.rmdir(dest)
    bug = lab_bugs.BY_N[args.n]
    try:
        planted = lab.planted(bug)   # (before any file is written)
    except RuntimeError as e:        # a patch that no longer applies: the lab's error, not the user's
        print(f"error: {e}", file=sys.stderr)
        return 1
    make_copy(dest, [], leave_out=lab_bugs.left_out)   # the whole repository, no exercise stubbed
    for rel, text in {**planted, **lab.without_answers(dest)}.items():
        files.write_text(os.path.join(dest, rel), text)
    files.write_text(os.path.join(dest, "LAB.md"), lab.brief(bug))
    print(f"wrote a copy with bug {args.n} planted to {args.dir}; what you see: {args.dir}/LAB.md")
    print(f"then: cd {args.dir} && python -m nanohlat.classroom check bug{args.n}")
    return 0


def check_here() -> None:
    """`check` grades the copy it is run in: this folder must be one (or the repository), and the
    nanohlat running it that copy's (usage_error otherwise). Outside a copy it graded whatever
    nanohlat Python found, an installed reference, and passed."""
    here = os.getcwd()
    if not os.path.isfile(os.path.join(here, "nanohlat", "classroom", "kit.py")):
        usage_error(f"{here} is not a copy of nanohlat (no nanohlat/classroom/ here): check grades the copy it "
                    f"is run in; cd into your copy's top folder (`python -m nanohlat.classroom new DIR` makes one)")
    if os.path.realpath(here) != os.path.realpath(ROOT):
        usage_error(f"the nanohlat running is {ROOT}, not the copy here ({here}): check grades only the copy it is "
                    f"run in; run it there with no PYTHONPATH pointing elsewhere")


def file_missing(ex: Exercise) -> str | None:
    """The verdict when the copy lacks the exercise's file (or a folder stands in its place)."""
    path = os.path.join(ROOT, ex.file)
    if os.path.isfile(path):
        return None
    what = "a folder stands in its place" if os.path.isdir(path) else "it is not there"
    return (f"{ex.file}, the file of exercise {ex.id}, is missing from this copy ({what}): nothing of yours to "
            f"check; restore it (`python -m nanohlat.classroom new DIR --exercise {ex.id}` writes a fresh copy)")


def cmd_check(args) -> int:
    ids = select(args)
    if not ids:
        print("error: name an exercise (e.g. `check 4b`), --chapter N or --all", file=sys.stderr)
        return 2
    bugs = [i for i in ids if LAB_ID.fullmatch(i)]
    if bugs:
        return check_lab(bugs, args.copy) if len(bugs) == len(ids) else \
            usage_error("check the lab's bugs on their own: `check bugN` (exercises and bugs live in different copies)")
    if args.copy:
        usage_error("--copy is the lab's (`check bugN --copy DIR`); an exercise is checked in its copy's folder")
    check_here()
    from nanohlat.classroom import isolate, needs
    failed = []
    child = isolate.Child(ROOT)   # the student's code runs there: its exit or endless loop is a FAIL
    try:
        for i in ids:
            ex = BY_ID[i]
            start = time.perf_counter()
            needs.set_label(f"check {i}")      # (only while needs.py traces the checks)
            verdict = file_missing(ex) or child.run(i)
            if verdict is not None and verdict.startswith("not done yet"):
                verdict = missing_first(i, verdict)
            took = time.perf_counter() - start
            status = "pass" if verdict is None else "FAIL"
            print(f"exercise {i:>4}  {status}  ({took:.1f} s)  {ex.task}", flush=True)
            if verdict is not None:
                failed.append(i)
                for line in verdict.splitlines():
                    print(f"              {line}", flush=True)
    finally:
        child.close()
    print(f"{len(ids) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


def check_lab(names: list[str], copy: str | None) -> int:
    """`check bugN [--copy DIR]`: the installed nanohlat grades the lab copy (this folder, or DIR). Run
    by a copy's own nanohlat, it hands the work over (lab.hand_off): a copy's code never grades itself."""
    from nanohlat.classroom import lab
    where = os.path.abspath(copy or os.getcwd())
    if not os.path.isdir(where):
        usage_error(f"{copy} is not a folder: give the lab copy's folder (`bug N DIR` wrote it)")
    if not os.path.isfile(os.path.join(where, "LAB.md")):
        usage_error(f"{where} is not a lab copy (no LAB.md): `python -m nanohlat.classroom bug N DIR` writes one; "
                    f"run check there, or give it with --copy DIR")
    if len(names) > 1:
        usage_error(f"a lab copy holds one bug: check one of {', '.join(names)}")
    if os.path.realpath(where) == os.path.realpath(ROOT):   # this nanohlat IS the copy
        return lab.hand_off(names[0], where)
    start = time.perf_counter()
    verdict = lab.check(names[0], where)
    print(f"{names[0]:>13}  {'pass' if verdict is None else 'FAIL'}  ({time.perf_counter() - start:.1f} s)  graded by "
          f"the nanohlat in {lab.GRADER}: trains like one process on every layout of {where}/LAB.md", flush=True)
    if verdict is not None:
        print(f"              {verdict}", flush=True)
    print(f"{int(verdict is None)} passed, {int(verdict is not None)} failed")
    return 0 if verdict is None else 1


@cli.command
def main(argv=None) -> int:
    p = flags.Parser(prog="python -m nanohlat.classroom", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="the exercises, in tutorial order")
    n = sub.add_parser("new", help="write a student copy of the repository with exercise stubs")
    n.add_argument("dir")
    n.add_argument("--chapter", type=int, default=None, help="only this chapter's exercises")
    n.add_argument("--exercise", dest="ids", action="append", help="only this exercise (repeatable)")
    c = sub.add_parser("check", help="check exercises on the code in the current folder")
    c.add_argument("ids", nargs="*")
    c.add_argument("--chapter", type=int, default=None)
    c.add_argument("--all", action="store_true")
    c.add_argument("--copy", default=None, help="(the lab: check bugN) the lab copy to grade; default: this folder")
    b = sub.add_parser("bug", help="the debugging lab: write a copy of the repository with bug N planted")
    b.add_argument("n", type=int)
    b.add_argument("dir")
    cmp_ = sub.add_parser("compare", help="two runs' per-step losses and grad norms, and where they first differ")
    cmp_.add_argument("runs", nargs=2)
    cmp_.add_argument("--html", default="", metavar="FILE",
                      help="also write the two runs' report pages side by side to FILE (one HTML file, no network)")
    f = sub.add_parser("fault", help="the fault lab: kill a run again and again, lost work against Young/Daly's")
    f.add_argument("out", help="a folder for the lab's two runs (reference/, faulted/)")
    f.add_argument("--kills", type=int, default=20, help="kill -9s of a random rank at random steps (default 20)")
    f.add_argument("--gap", type=float, default=6.0, help="the mean gap between kills, in steps (exponential)")
    f.add_argument("--seed", type=int, default=0, help="the seed of the kills' steps and ranks")
    f.add_argument("--fault", action="append", default=[], help="another fault after the kills (run/faults.py's "
                   "kinds: hang:rank=R:step=S, slow:rank=R:seconds=X, disk-full:rank=R:step=S, ...)")
    u = sub.add_parser("needs", help="re-trace which exercises each tutorial command and check needs (minutes)")
    u.add_argument("--update", action="store_true", required=True, help="rewrite nanohlat/classroom/needs.json")
    argv, train = list(sys.argv[1:] if argv is None else argv), []
    if argv[:1] == ["fault"] and "--" in argv:   # the fault lab: train.py's flags follow --
        argv, train = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    args = p.parse_args(argv)
    if args.cmd == "list":
        return cmd_list()
    if args.cmd == "needs":
        from nanohlat.classroom import needs
        return needs.update([e.id for e in EXERCISES])
    if args.cmd == "new":
        return cmd_new(args)
    if args.cmd == "bug":
        return cmd_bug(args)
    if args.cmd == "compare":
        from nanohlat.classroom import lab
        return lab.compare(*args.runs, html=args.html)
    if args.cmd == "fault":
        from nanohlat.classroom import fault_lab
        return fault_lab.run(args.out, args.kills, args.gap, args.seed, args.fault, train, ROOT)
    return cmd_check(args)


if __name__ == "__main__":
    sys.exit(main())
