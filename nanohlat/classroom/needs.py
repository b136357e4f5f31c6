"""Which exercises each command, tutorial chapter and check runs through: traced, not hand-kept.

In a student copy a command fails at the first exercise stub it reaches, so a
student (and a teacher planning sessions) needs to know, before running
anything, which exercises each command needs. That is measured here on the
reference code: every tutorial.md command that the test suite runs
(tests/repo/test_tutorial.py), and every exercise's check, runs with a tracer
that records which exercise regions it enters. A command *needs* exactly the
exercises whose regions it entered: a stub raises where its region begins,
so each of them alone a stub would stop the command, and in a copy where all
are stubs the student meets them one after another as they fill them in
(no wrapper may catch a stub's error: tests/classroom/test_student_copy.py).

The tracer. A process started with NANOHLAT_EXERCISE_TRACE=FOLDER and
`hook_folder(FOLDER)` first on PYTHONPATH imports the `sitecustomize` written
there (Python imports it at start-up, before any of our code; the launchers'
worker processes inherit both variables, so they are traced too). It
installs an import hook for nanohlat's modules that compiles each file with
every `# exercise Nx: begin` marker line turned into a call that records
"Nx" (the same line, so line numbers stay true; no bytecode is cached). Each
process appends what it reached to FOLDER/hits-PID.txt, tagged with the
label in FOLDER/label at that moment (the command or check running).
Regions in a function that torch.compile traces would break its graph; none
of the traced commands compiles one. What runs in a debugging-lab copy (a
LAB.md beside its nanohlat/: chapter 12's worked example) is not traced: such
a copy stubs no exercise, so its commands need none.

The result is kept in needs.json beside this file, written by
`python -m nanohlat.classroom needs --update` (it runs the tutorial's
blocks and the checks: 11 minutes on two busy cores) and compared with a fresh trace by the tests
that run those anyway (tests/repo/test_tutorial.py per block, tests/classroom/test_exercise_checks.py
for the checks), so it cannot go stale unnoticed.
"""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys

from nanohlat.system import files

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
NEEDS_JSON = os.path.join(HERE, "needs.json")
TRACE_ENV = "NANOHLAT_EXERCISE_TRACE"
UPDATE = "python -m nanohlat.classroom needs --update"

# tests/repo/test_tutorial.py's definition of a runnable block (test_student_copy checks they agree)
BLOCK = re.compile(r"```bash\n# runnable\n(.*?)```", re.S)
CONTINUED = re.compile(r"\\\n\s*")
CHAPTER = re.compile(r"^## (\d+)\. ", re.M)

HOOK = '''\
# Written by nanohlat/classroom/needs.py: records which exercise regions this process enters.
import builtins, importlib.machinery, os, re, sys

_FOLDER = os.environ.get("NANOHLAT_EXERCISE_TRACE")
_BEGIN = re.compile(r"^([ \\t]*)# exercise (\\d+[a-z]): begin[ \\t]*$", re.M)
_SEEN = set()


def _reached(exercise):
    try:
        with open(os.path.join(_FOLDER, "label"), encoding="utf-8") as f:
            label = f.read().strip()
    except OSError:
        label = ""
    if (label, exercise) in _SEEN:
        return
    _SEEN.add((label, exercise))
    with open(os.path.join(_FOLDER, "hits-%d.txt" % os.getpid()), "a", encoding="utf-8") as f:
        f.write("%s\\t%s\\n" % (label, exercise))


class _Loader(importlib.machinery.SourceFileLoader):
    def get_code(self, fullname):   # from the source, never a cached .pyc, and none written
        source = self.get_data(self.path).decode("utf-8")
        source = _BEGIN.sub(lambda m: '%s__nanohlat_reached__("%s")  # exercise %s: begin'
                            % (m.group(1), m.group(2), m.group(2)), source)
        return compile(source, self.path, "exec", dont_inherit=True)


def _in_lab_copy(path):   # a bug's copy (LAB.md beside its nanohlat/) stubs no exercise: it needs none
    at = path.rfind(os.sep + "nanohlat" + os.sep)
    return at >= 0 and os.path.isfile(os.path.join(path[:at], "LAB.md"))


class _Finder:
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name != "nanohlat" and not name.startswith("nanohlat."):
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and type(spec.loader) is importlib.machinery.SourceFileLoader \
                and not _in_lab_copy(spec.loader.path):
            spec.loader = _Loader(spec.loader.name, spec.loader.path)
        return spec


if _FOLDER:
    builtins.__nanohlat_reached__ = _reached
    sys.meta_path.insert(0, _Finder)
'''


# ---------------------------------------------------------------------------
# Tracing
# ---------------------------------------------------------------------------

def hook_folder(folder: str) -> str:
    """Write the tracer (HOOK, as the module Python imports at start-up) into folder/hook; returns that folder."""
    hook = os.path.join(folder, "hook")
    os.makedirs(hook, exist_ok=True)
    with open(os.path.join(hook, "sitecustomize.py"), "w", encoding="utf-8") as f:
        f.write(HOOK)
    return hook


def trace_env(folder: str, env: dict | None = None) -> dict:
    """`env` (default os.environ) with the tracer on, recording into `folder`."""
    env = dict(os.environ if env is None else env)
    env[TRACE_ENV] = folder
    env["PYTHONPATH"] = os.pathsep.join([hook_folder(folder)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def set_label(label: str) -> None:
    """Tag what traced processes reach from now on (the check about to run); no-op untraced."""
    folder = os.environ.get(TRACE_ENV)
    if folder:
        with open(os.path.join(folder, "label"), "w", encoding="utf-8") as f:
            f.write(label)


def label_command(folder: str, label: str) -> str:
    """The shell line that tags what follows in a traced script."""
    import shlex
    return f"printf %s {shlex.quote(label)} > {shlex.quote(os.path.join(folder, 'label'))}"


def read_hits(folder: str) -> dict[str, set[str]]:
    """{label: exercises reached} from every traced process's hits file."""
    hits: dict[str, set[str]] = {}
    for path in sorted(glob.glob(os.path.join(folder, "hits-*.txt"))):
        with open(path, encoding="utf-8") as f:
            for line in f:
                label, _, exercise = line.rstrip("\n").partition("\t")
                hits.setdefault(label, set()).add(exercise)
    return hits


# ---------------------------------------------------------------------------
# The tutorial's commands
# ---------------------------------------------------------------------------

def tutorial_blocks(root: str = ROOT) -> list[tuple[int, list[str]]]:
    """(chapter, commands) for every runnable block of tutorial.md, in order."""
    with open(os.path.join(root, "tutorial.md"), encoding="utf-8") as f:
        text = f.read()
    starts = [(m.start(), int(m.group(1))) for m in CHAPTER.finditer(text)]
    blocks = []
    for m in BLOCK.finditer(text):
        chapter = max((c for pos, c in starts if pos < m.start()), default=0)
        blocks.append((chapter, [line.strip() for line in CONTINUED.sub(" ", m.group(1)).splitlines()
                                 if line.strip() and not line.lstrip().startswith("#")]))
    return blocks


def tutorial_commands(root: str = ROOT) -> list[tuple[int, str]]:
    """(chapter, command) for every command of tutorial.md's runnable blocks, in order."""
    return [(chapter, c) for chapter, commands in tutorial_blocks(root) for c in commands]


def stored(data: dict, chapter: int, command: str) -> list[str] | None:
    """What needs.json says (chapter, command) needs; None if it does not list it."""
    for entry in data["commands"]:
        if entry["chapter"] == chapter and entry["command"] == command:
            return entry["needs"]
    return None


def kind(command: str) -> str | None:
    """What a command runs, for the summaries: 'train.py --nproc N', 'sample.py',
    'python -m nanohlat.serving', ...; None for a shell step (cmp, printf)."""
    words = command.split()
    if not words or words[0] != "python":
        return None
    if words[1:2] == ["-m"]:
        name = f"python -m {words[2]}"
    elif words[1:2] == ["-c"]:
        return None
    else:
        name = words[1]
    if "--plan" in words:
        return f"{name} --plan"
    nproc = words[words.index("--nproc") + 1] if "--nproc" in words[:-1] else "1"
    return f"{name} --nproc N" if nproc != "1" else name


# ---------------------------------------------------------------------------
# The stored map
# ---------------------------------------------------------------------------

def load(path: str = NEEDS_JSON) -> dict:
    """{"commands": [{"chapter", "command", "needs"}], "checks": {id: [ids]}}; empty without the file."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        return {"commands": [], "checks": {}}


def order(ids) -> list[str]:
    """Exercise ids in tutorial order (kit.EXERCISES's): by chapter, then letter."""
    return sorted(set(ids), key=lambda i: (int(i[:-1]), i[-1]))


def by_chapter(data: dict) -> dict[int, dict[str, list[str]]]:
    """{chapter: {command kind: exercises its commands of that kind need}}."""
    out: dict[int, dict[str, set[str]]] = {}
    for entry in data["commands"]:
        k = kind(entry["command"])
        if k is not None:
            out.setdefault(entry["chapter"], {}).setdefault(k, set()).update(entry["needs"])
    return {c: {k: order(v) for k, v in kinds.items()} for c, kinds in sorted(out.items())}


def chapter_needs(data: dict) -> dict[int, list[str]]:
    """{chapter: every exercise its runnable commands need}."""
    return {c: order(i for ids in kinds.values() for i in ids) for c, kinds in by_chapter(data).items()}


def summary(data: dict, only: set[str] | None = None) -> list[str]:
    """The map as text lines: per chapter, what its commands need; per check, the
    other exercises it runs through. `only`: show just these exercises (a copy's stubs)."""
    keep = (lambda ids: [i for i in ids if i in only]) if only is not None else (lambda ids: ids)
    lines = []
    for chapter, kinds in by_chapter(data).items():
        parts = [f"{k} needs {' '.join(keep(ids))}" for k, ids in kinds.items() if keep(ids)]
        lines.append(f"  chapter {chapter}: " + ("; ".join(parts) if parts else "nothing"))
    checks = [(ex, keep([d for d in deps if d != ex])) for ex, deps in data["checks"].items()]
    checks = [(ex, deps) for ex, deps in checks if deps and (only is None or ex in only)]
    if checks:
        lines.append("  checks that run through other exercises: "
                     + "; ".join(f"{ex} needs {' '.join(deps)}" for ex, deps in checks))
    return lines


def names(ids: list[str]) -> str:
    """"1a, 1b and 4b"."""
    return ", ".join(ids[:-1]) + f" and {ids[-1]}" if len(ids) > 1 else "".join(ids)


CHAPTER_SENTENCE = "In a whole-class copy (every exercise a stub) this chapter's commands need exercises {}."


def check_sentence(data: dict) -> str:
    """The checks that run through other exercises, as docs/teaching.md states it."""
    parts = []
    for ex, deps in data["checks"].items():
        others = [d for d in deps if d != ex]
        if others:
            parts.append(f"{ex}'s check runs through {names(others)}")
    return "; ".join(parts) + "."


# ---------------------------------------------------------------------------
# Updating needs.json
# ---------------------------------------------------------------------------

def update(exercises: list[str], root: str = ROOT) -> int:
    """Trace the tutorial's runnable blocks (through tests/repo/test_tutorial.py, which
    records what each command reached when NANOHLAT_NEEDS_RECORD names a file)
    and the checks (`check --all`), and rewrite needs.json."""
    import tempfile
    with tempfile.TemporaryDirectory(prefix="nanohlat-needs-") as tmp:
        record = os.path.join(tmp, "commands.jsonl")
        env = dict(os.environ, NANOHLAT_NEEDS_RECORD=record)
        print("tracing tutorial.md's runnable blocks (tests/repo/test_tutorial.py) ...", file=sys.stderr)
        p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "tests/repo/test_tutorial.py", "-k",
                            "runs_and_prints"], cwd=root, env=env)
        if p.returncode != 0:
            print("error: the tutorial's blocks did not all pass; fix them first", file=sys.stderr)
            return 1
        with open(record, encoding="utf-8") as f:
            commands = [json.loads(line) for line in f]
        print("tracing the checks (python -m nanohlat.classroom check --all) ...", file=sys.stderr)
        folder = os.path.join(tmp, "checks")
        os.makedirs(folder)
        p = subprocess.run([sys.executable, "-m", "nanohlat.classroom", "check", "--all"], cwd=root,
                           env=trace_env(folder))
        if p.returncode != 0:
            print("error: the reference does not pass every check; fix it first", file=sys.stderr)
            return 1
        checks = check_needs(read_hits(folder), exercises)
    position = {c: i for i, c in enumerate(tutorial_commands(root))}
    commands.sort(key=lambda e: position.get((e["chapter"], e["command"]), len(position)))
    data = {"about": f"generated by `{UPDATE}` (nanohlat/classroom/needs.py); checked by tests/repo/test_tutorial.py "
                     f"and tests/classroom/test_exercise_checks.py",
            "commands": commands, "checks": checks}
    path = os.path.join(root, "nanohlat", "classroom", "needs.json")
    files.write_text(path, json.dumps(data, indent=1) + "\n")      # atomic, never through a link
    print(f"wrote {path}: {len(commands)} commands, {len(checks)} checks", file=sys.stderr)
    return 0


def check_needs(hits: dict[str, set[str]], exercises: list[str]) -> dict[str, list[str]]:
    """{exercise: exercises its check reached}, for each of `exercises`, from hits
    labelled 'check ID' (kit.cmd_check)."""
    return {ex: order(hits.get(f"check {ex}", set())) for ex in exercises}
