"""Every runnable command block of tutorial.md runs, succeeds and prints what
the tutorial shows.

A block is runnable when it is fenced as bash and its first line is
`# runnable`; when its second line is `# continues the block above` it starts
from the runs/ that the runnable block above it left (`CONTINUES`). The ```text block right after it is its transcript: each command
as `$ command`, then what it printed (a transcript without `$` lines is the
output of a block's only command). Each block runs with bash -e in a fresh
directory that links to the repository's scripts and package, so its `runs/`
outputs go to a temporary place, and `python` there is this test's own
interpreter (a venv's too).

What is compared, so the tutorial's figures cannot drift from the code: every
non-blank line of the transcript must appear, in order, in the command's
output (the output may have more lines). A line matches when its words match
and its numbers agree: integers (byte counts, parameter counts, steps) exactly,
decimals (losses, GiB) to within `REL_TOL` (0.1%; why that holds on another
CPU is beside it). The expected lines are read from tutorial.md itself, so
updating a figure there is all a change of output needs.

Which figures another machine changes, and how each is checked:
  * exact everywhere: sizes, byte counts, parameter counts, the comm ledger,
    timetables, plans, ideal bubbles: computed, not trained;
  * losses: another CPU's kernels and thread counts move them by round-off
    only, far inside REL_TOL (measured beside it);
  * figures that turn on near-ties in trained weights, which round-off can
    tip: the speculative demo's counts (`TRAINED`), matched by shape and checked
    against each other on this run (`speculative_problems`), and sampled text
    (`SAMPLED`), checked for its prompt and for more than white space
    (`sample_problems`, `compared_files`); what the comparisons of chapter 9
    claim ("tp 2 printed exactly what one process printed") is re-derived
    here, by the commands themselves;
  * what a run *measures* (times, the pipeline drawn to scale, the measured
    bubble: `MEASURED`), matched by shape only;
  * losses depend on the corpus, which is the running Python's standard
    library: they are compared only under the Python version that tutorial.md
    says its figures were made with (`CORPUS_DEPENDENT`);
  * lines only some machines print (`OPTIONAL`: pictures, which need
    matplotlib; the warning that threads outnumber cores) may be missing.
Where a command fixes `--threads 1`, the test runs it with
$NANOHLAT_TEST_THREADS threads instead when that is set (`with_threads`):
.ci/other-cpu-lane runs this file so, under another CPU's kernels at once.
"""

from __future__ import annotations

import math
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT
from dist_utils import fixed_threads
from nanohlat.classroom import needs
from nanohlat.serving import server as serving

BLOCK = re.compile(r"```bash\n# runnable\n(.*?)```[ \t]*\n(?:\s*\n)*(?:```text\n(.*?)```)?", re.S)
NUMBER = re.compile(r"\d+(?:,\d\d\d)*(?:\.\d+)?")
# Decimals agree to 0.1%. Why that holds on another CPU: kernels that add in
# another order move the tutorial's losses by round-off only, because its runs
# are short (3 to 30 steps at lr 3e-3) or, in chapter 9, stable (300 steps at
# lr 5e-3; at 1e-2 the same run is chaotic: its final loss spread over
# 2.95-3.00 with the kernels below, which is why chapter 9 does not use it).
# Measured on this machine (an AMD EPYC with AVX-512) with other kernels,
# ATEN_CPU_CAPABILITY=avx2 or =default and MKL_CBWR=COMPATIBLE (see
# .ci/other-cpu-lane), and with 3 threads per process, every training command
# of the tutorial: the losses of chapters 1 to 8's fp32 runs moved by at most
# 8e-8 relative, most not at all (Adam's first steps are about lr x sign(g),
# which a last-bit change of g does not move); chapter 7's bf16-sr run by at
# most 1.3e-4 (stochastic rounding can turn a last-bit difference into a whole
# bf16 step of a weight); chapter 9's runs by at most 2.1e-5 (1e-4 at any
# step, over 7 kernel and thread variants); chapter 8's eval table not at all
# (its accuracies could flip only where two choices score alike: the closest
# pair of its 40 examples is 1.4e-3 nats per byte apart). 0.1% is 8 times the
# largest of these, and far less than a change to the training moves a loss.
REL_TOL = 1e-3

# Spans of a transcript line that a run measures; they match anything. A
# pattern's group `m`, where it has one, is the span; else the whole match.
MEASURED = [
    re.compile(r"drawn to scale \((?P<m>[\d.]+ ms)"),        # pipeline: the last step's wall time
    re.compile(r"^stage \d+ (?P<m>\|[FBWfb.]*\|)$"),        # pipeline: the step drawn to scale (f, b: odd chunks)
    re.compile(r"bubble: measured (?P<m>[\d.]+)"),          # pipeline: idle fraction, measured
    re.compile(r"; measured (?P<m>[\d.]+) \(idle"),           # pipeline: the same, in the three-bubble line
    re.compile(r"its backward ended at (?P<m>[\d.]+ ms)"),  # dp collectives (--timeline, dp > 1): times
    re.compile(r"^\s+(?:bucket \d+|params \d+|loss|grad norm|\w+ \?)\s+[\w.]+\s+[\d,]+\s+(?P<m>[\d.]+)\s+"
               r"(?:in|after)"),                            # a dp collective: when it was issued,
    re.compile(r"(?:in [FBW]\d+|after the backward)\s+(?P<m>\d.*)$"),           # when complete, the host blocked
    re.compile(r"^\s+(?:[bp](?:\d+|\?)|loss|norm) (?P<m>\|[~w ]*\|)$"),   # a dp collective drawn to scale
    re.compile(r"^(?P<m> +)\^$"),                            # where the backward ends
    re.compile(r"; (?P<m>\d+) known complete when it ended"),   # dp collectives: the summary's measured figures
    re.compile(r"the last seen complete (?P<m>[\d.]+) ms after it ended"),     # the buckets: how long after it
    re.compile(r"(?P<m>[\d.]+) ms (?:blocked (?:on|in) |outside them)"),   # the span after the backward, split
    re.compile(r"(?P<m>[\d.]+ / [\d.]+) ms"),                 # host blocked by the backward's end / after it
    re.compile(r"^(?P<m>[.sx]+\s+\[100%\])$"),               # pytest: its progress line (xla tests run or skip)
    re.compile(r"^(?P<m>\d+ passed.*)$"),                    # pytest: its summary line
    re.compile(r"done in (?P<m>[\d.]+s)"),                  # eval.py: time per checkpoint
    re.compile(r" passed in (?P<m>[\d.]+s.*)"),             # pytest: wall time
    re.compile(r"^warning: (?P<m>\d+ process\(es\) x \d+ thread\(s\) share \d+) CPU core"),   # this machine's cores
    re.compile(r"^checkpoints: \d+ saved in the background \(--async-save\): (?P<m>.*)$"),   # how long each took
]
# The built-in corpus is the running Python's standard library, so losses
# depend on the Python version. tutorial.md names the version its figures were
# made with; under another one these spans, too, are matched by shape only.
CORPUS_DEPENDENT = [
    re.compile(r"loss (?P<m>\d+\.\d+)"),                   # train.py: final loss, val loss
    re.compile(r"^\s*\d+\s+[\d,]+\s+(?P<m>\d+\.\d+\s.*)$"),   # eval.py: a row of the table
]
CORPUS_PYTHON = re.compile(r"made with Python (\d+\.\d+\.\d+)")
# Lines that only some machines print: pictures need matplotlib, an optional
# extra (`pip install -e ".[plot]"`), and the warning that the processes' threads
# outnumber the cores (tools/timeline.py:oversubscription) depends on the core
# count (a 4-core machine runs chapter 5's 4 workers x 1 thread without it).
OPTIONAL = [re.compile(r"\.png\b"), re.compile(r"^warning: .* share .* CPU core\(s\)")]
# Commands whose output is sampled text: one changed bit in the weights (another
# CPU's float rounding) picks other tokens, so their text is not compared (unless
# their stdout goes to a file: then what they print is compared). What is
# checked: a sample.py that prints its text starts with its prompt and goes on
# with more than white space (`sample_problems`); files that `cmp` compares hold
# text (`compared_files`), and the comparison itself ran on this machine.
SAMPLED = ("python sample.py", "cat runs/ch9/")
# Figures that come from the student's own trained weights through argmaxes:
# the speculative-decoding demo's counts. Which drafts the target accepts turns
# on near-ties of two trained models, which another CPU's rounding can tip (at
# lr 1e-2, where the models themselves differ by machine, a ranged from 0.34 to
# 1.00 over ten kernel and thread variants). Matched by shape only; what must
# hold between them on every run is checked by `speculative_problems`.
TRAINED = [
    re.compile(r"^drafts kept: (?P<m>\d+ of \d+ proposed \([\d.]+\); checked up to a round's first rejection: \d+)$"),
    re.compile(r"^per-token acceptance a = accepted / checked = (?P<m>\d+ / \d+ = [\d.]+)$"),
    re.compile(r"^tokens per target pass: measured (?P<m>[\d.]+, formula \(1 - a\^\(k\+1\)\) / \(1 - a\) = [\d.]+) "),
    re.compile(r"min\(k \+ 1, 1 / \(1 - a\)\) = (?P<m>[\d.]+) "),
    re.compile(r"^speculative decoding pays here when c < (?P<m>[\d.]+ = \(\d+ - \d+\) / \d+),"),
    # --fp8-stats: which linears flush most, fractions of a few hundredths of a percent: one element
    # more or less under a scale (round-off in the gradients) reorders them
    re.compile(r"^fp8: the worst linears, flushed: (?P<m>.*); saturated: none$"),
]
# A line continued with a backslash, in a block or in its transcript.
CONTINUED = re.compile(r"\\\n\s*")
# A success line: `... && echo "text"` at the end of a command.
SUCCESS = re.compile(r"&&\s*echo\s+(?P<q>[\"'])(?P<text>.*?)(?P=q)\s*$")
# The speculative-decoding demo's lines, as this machine's run printed them (`speculative_problems`).
SPECULATIVE = {
    "passes": re.compile(r"^speculative: +(?P<n>\d+) tokens, (?P<r>\d+) target passes \+ (?P<d>\d+) draft passes",
                         re.M),
    "kept": re.compile(r"^drafts kept: (?P<a>\d+) of (?P<p>\d+) proposed \((?P<share>[\d.]+)\); checked up to "
                       r"a round's first rejection: (?P<c>\d+)$", re.M),
    "acceptance": re.compile(r"^per-token acceptance a = accepted / checked = (?P<a>\d+) / (?P<c>\d+) = "
                             r"(?P<value>[\d.]+)$", re.M),
    "formula": re.compile(r"^tokens per target pass: measured (?P<measured>[\d.]+), formula \(1 - a\^\(k\+1\)\) / "
                          r"\(1 - a\) = (?P<formula>[\d.]+) with k = (?P<k>\d+) ", re.M),
    "bound": re.compile(r"^whatever the pattern of rejections: 1 <= measured <= min\(k \+ 1, 1 / \(1 - a\)\) = "
                        r"(?P<bound>[\d.]+) ", re.M),
}

# A runnable block whose second line is this comment starts from what the
# block above it left in runs/ (a reader runs them in order): the test copies
# that block's runs/ into its fresh directory, so a model is trained once.
CONTINUES = "# continues the block above"
_RAN: dict = {}                          # block index -> its directory, once it ran and succeeded


def continues_previous(index: int) -> bool:
    script = BLOCK.findall(tutorial_text())[index][0]
    return script.splitlines()[:1] == [CONTINUES]


def compared_files(commands: list[str]) -> list[tuple[str, list[str]]]:
    """Every file a `cmp A B` of the block compares, with the prompts of the
    sample.py command that wrote it (`> A`): (path, prompts)."""
    segments = []                        # simple commands, also those chained with && ; |
    for command in commands:
        words = []
        for word in shlex.split(command) + ["&&"]:
            if word in ("&&", "||", ";", "|"):
                segments.append(words)
                words = []
            else:
                words.append(word)
    wrote = {}
    for words in segments:
        if words[:2] == ["python", "sample.py"] and ">" in words:
            flags = {w: v for w, v in zip(words, words[1:]) if w.startswith("--")}
            wrote[words[words.index(">") + 1]] = flags
    files = []
    for words in segments:
        if words[:1] == ["cmp"]:
            for path in words[1:3]:
                assert path in wrote, f"`{' '.join(words)}` compares {path}, which no sample.py command of the block wrote"
                files.append((path, wrote[path]))
    return files


def generated_text(text: str, flags: dict, cwd) -> list[str]:
    """The continuation of each prompt in sample.py's output `text` (its
    prompts and `--- prompt i ---` headers removed)."""
    if "--prompt-file" in flags:
        with open(cwd / flags["--prompt-file"]) as f:
            prompts = [line.rstrip("\n").replace("\\n", "\n") for line in f if line.strip()]
        sections = re.split(r"^--- prompt \d+ ---\n", text, flags=re.M)[1:]
        assert len(sections) == len(prompts), text
    else:
        prompts, sections = [flags.get("--prompt", "def ")], [text]
    out = []
    for prompt, section in zip(prompts, sections):
        assert section.startswith(prompt), (prompt, section)
        out.append(section[len(prompt):])
    return out


def tutorial_text() -> str:
    with open(os.path.join(ROOT, "tutorial.md")) as f:
        return f.read()


def runnable_blocks() -> list[tuple[list[str], str | None]]:
    """(commands, transcript or None) for every runnable block, in order."""
    blocks = []
    for script, transcript in BLOCK.findall(tutorial_text()):
        commands = [line.strip() for line in CONTINUED.sub(" ", script).splitlines()
                    if line.strip() and not line.lstrip().startswith("#")]
        blocks.append((commands, transcript or None))
    return blocks


def expected_outputs(commands: list[str], transcript: str) -> list[list[str]]:
    """The transcript's lines, per command of the block."""
    lines = CONTINUED.sub(" ", transcript).splitlines()
    if not any(line.startswith("$ ") for line in lines):
        assert len(commands) == 1, "a transcript without `$ command` lines must belong to a one-command block"
        return [lines]
    shown = [line[2:] for line in lines if line.startswith("$ ")]
    assert shown == commands, f"the transcript shows other commands than the block runs:\n{shown}\n{commands}"
    outputs: list[list[str]] = []
    for line in lines:
        if line.startswith("$ "):
            outputs.append([])
        elif outputs:
            outputs[-1].append(line)
    return outputs


def masked_spans(line: str, patterns: list[re.Pattern]) -> list[tuple[int, int]]:
    spans = []
    for p in patterns:
        for m in p.finditer(line):
            spans.append(m.span("m") if "m" in p.groupindex else m.span())
    return sorted(spans)


def line_pattern(expected: str, masks: list[re.Pattern]) -> re.Pattern:
    """A regex for lines shaped like `expected`: spans of `masks` match anything,
    every number is a group, runs of spaces match any run of spaces."""
    spans = masked_spans(expected, masks)
    parts, pos = [], 0
    for start, end in spans + [(len(expected), len(expected))]:
        for piece in re.split(r"(\s+)", expected[pos:start]):
            if piece.isspace():
                parts.append(r"\s+")
            else:
                last = 0
                for m in NUMBER.finditer(piece):
                    parts.append(re.escape(piece[last:m.start()]) + f"({NUMBER.pattern})")
                    last = m.end()
                parts.append(re.escape(piece[last:]))
        if start < len(expected):
            parts.append(".*?")
        pos = end
    return re.compile(r"\s*" + "".join(parts) + r"\s*")


def numbers_agree(want: str, got: str) -> bool:
    if "." not in want:
        return want == got
    return math.isclose(float(want.replace(",", "")), float(got.replace(",", "")), rel_tol=REL_TOL)


def mismatches(expected: list[str], actual: list[str], masks: list[re.Pattern] = MEASURED) -> list[str]:
    """Transcript lines that the actual output does not print, in order; a line
    printed with other numbers is reported with what was printed instead."""
    problems, i = [], 0
    for want in (line for line in expected if line.strip()):
        pattern = line_pattern(want, masks)
        want_numbers = pattern.fullmatch(want).groups()
        for j in range(i, len(actual)):
            m = pattern.fullmatch(actual[j])
            if m:
                bad = [(w, g) for w, g in zip(want_numbers, m.groups()) if not numbers_agree(w, g)]
                if bad:
                    problems.append(f"expected {want!r}\n     got {actual[j]!r}")
                i = j + 1
                break
        else:
            if not any(p.search(want) for p in OPTIONAL):
                problems.append(f"expected {want!r}\n     not printed (after output line {i})")
    return problems


def run_block(commands: list[str], cwd, trace: str | None = None) -> tuple[int, list[list[str]], str]:
    """Run the block with bash -e -o pipefail (a failing step of a pipe fails the
    block too); (exit code, output lines per command, whole transcript). With
    `trace` (a folder), what each command reaches of the exercise regions is
    recorded there under the command's index (nanohlat/classroom/needs.py)."""
    for name in ("train.py", "sample.py", "eval.py", "nanohlat", "tests", "scripts", "pyproject.toml"):
        os.symlink(os.path.join(ROOT, name), cwd / name)
    bin_dir = cwd / "bin"
    bin_dir.mkdir()
    # `python` in the block = this interpreter. A wrapper, not a symlink: a
    # venv's interpreter started through a link in another folder no longer
    # finds its venv (pyvenv.cfg is looked for next to the path it was started by).
    wrapper = bin_dir / "python"
    wrapper.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} "$@"\n')
    wrapper.chmod(0o755)
    marker = "@@tutorial-command@@"
    script = "".join((needs.label_command(trace, str(i)) + "\n" if trace else "") + f"echo {marker}\n{command}\n"
                     for i, command in enumerate(commands))
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", PYTHONUNBUFFERED="1")
    if trace:
        env = needs.trace_env(trace, env)
    p = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", script], cwd=cwd, env=env, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=600)
    outputs = [chunk.splitlines() for chunk in p.stdout.split(marker + "\n")[1:]]
    return p.returncode, outputs, p.stdout


def test_the_tutorial_has_runnable_blocks_with_transcripts():
    blocks = runnable_blocks()
    assert len(blocks) >= 8
    assert all(transcript for _, transcript in blocks), "every runnable block is followed by a ```text transcript"


def test_python_in_a_block_is_this_interpreter_with_its_packages(tmp_path):
    rc, outputs, out = run_block(['python -c "import sys; print(sys.prefix); print(sys.executable)"'], tmp_path)
    assert rc == 0, out
    assert outputs[0][0] == sys.prefix           # a venv stays a venv


def test_a_changed_figure_is_caught():
    """The comparison itself: figures that differ fail, measured ones do not."""
    want = ["done: 5 steps, final loss 6.0602, val loss 5.9415; metrics in runs/x/metrics.jsonl",
            "  dp.all_reduce                 1,001,732      1,001,732",
            "bubble: measured 0.73 of the step (idle + communication), formula (p-1)/(m+p-1) = 0.27"]
    same = ["some warning", "done: 5 steps, final loss 6.0603, val loss 5.9415; metrics in runs/x/metrics.jsonl",
            "  dp.all_reduce  1,001,732  1,001,732",
            "bubble: measured 0.51 of the step (idle + communication), formula (p-1)/(m+p-1) = 0.27"]
    assert mismatches(want, same) == []
    assert len(mismatches(want, [same[1].replace("6.0603", "6.1602")] + same[2:])) == 1
    assert len(mismatches(want, [same[1], same[2].replace("1,001,732", "1,001,736", 1), same[3]])) == 1
    assert len(mismatches(want, [same[1], same[2], same[3].replace("0.27", "0.31")])) == 1
    assert len(mismatches(want, same[2:])) == 1      # the loss line is missing
    assert mismatches(want + ["eval: wrote runs/x/eval_curves.png"], same) == []   # no matplotlib here
    # the warning about threads outnumbering cores: other counts, or none on a machine with more cores
    warned = ["warning: 4 process(es) x 1 thread(s) share 2 CPU core(s): the measured timeline mostly shows"]
    assert mismatches(warned, ["warning: 4 process(es) x 2 thread(s) share 6 CPU core(s): the measured timeline "
                               "mostly shows"]) == []
    assert mismatches(warned + want[:1], same[1:2]) == []
    other_corpus = [same[1].replace("6.0603", "5.1379")] + same[2:]
    assert len(mismatches(want, other_corpus)) == 1
    assert mismatches(want, other_corpus, MEASURED + CORPUS_DEPENDENT) == []


SPECULATIVE_OUTPUT = """\
target 0.25M parameters, draft 0.16M; greedy, k = 4; times are the best of 5 runs
target alone: 48 tokens, 48 target passes, 0.100 s
draft alone:  48 tokens, 48 draft passes, 0.050 s
speculative:  48 tokens, 22 target passes + 84 draft passes, 0.200 s
drafts kept: 26 of 84 proposed (0.31); checked up to a round's first rejection: 47
per-token acceptance a = accepted / checked = 26 / 47 = 0.55
tokens per target pass: measured 2.18, formula (1 - a^(k+1)) / (1 - a) = 2.12 with k = 4 (the formula assumes ...)
whatever the pattern of rejections: 1 <= measured <= min(k + 1, 1 / (1 - a)) = 2.24 (a pass ends at its first rejection)
same tokens as the target alone: yes"""


def test_the_speculative_check_catches_figures_that_cannot_be_one_run():
    """The check itself: a consistent demo passes, each inconsistency fails, and
    so do an acceptance of 1 (no rejection to see) and a missing line."""
    assert speculative_problems(SPECULATIVE_OUTPUT) == []
    for old, new in [("22 target passes", "21 target passes"),        # tokens != accepted + passes
                     ("= 26 / 47 = 0.55", "= 26 / 47 = 0.56"),
                     ("measured 2.18", "measured 2.30"),
                     ("= 2.12 with", "= 2.18 with"),
                     ("= 2.24 (a pass", "= 2.50 (a pass"),
                     ("+ 84 draft passes", "+ 80 draft passes"),
                     ("first rejection: 47", "first rejection: 26")]:       # a = 1
        assert speculative_problems(SPECULATIVE_OUTPUT.replace(old, new)), (old, new)
    no_bound = "\n".join(line for line in SPECULATIVE_OUTPUT.splitlines() if not line.startswith("whatever"))
    assert speculative_problems(no_bound)


def test_sampled_text_must_start_with_its_prompt_and_say_something():
    command = 'python sample.py --out-dir runs/ch1 --prompt "def " --max-new-tokens 30'
    assert sample_problems(command, ["def Ix0_ bselfFa. 0_(ymmc.tyx c_  sed"]) == []
    assert sample_problems(command, ["class Ix0_"])
    assert sample_problems(command, ["def ", "   "])


def test_a_fixed_thread_count_follows_the_environment(monkeypatch):
    ch9 = 'python train.py --preset tiny --threads 1 --out-dir runs/ch9 && python sample.py --threads 1'
    bench = "python -m nanohlat.bench --generate --preset tiny --batch-size 4 --threads 1"
    monkeypatch.delenv("NANOHLAT_TEST_THREADS", raising=False)
    assert with_threads([ch9, bench]) == [ch9, bench]
    monkeypatch.setenv("NANOHLAT_TEST_THREADS", "3")
    assert with_threads([ch9, bench]) == [ch9.replace("--threads 1", "--threads 3"), bench]
    monkeypatch.setenv("NANOHLAT_TEST_THREADS", "0")
    with pytest.raises(ValueError, match="at least 1"):
        with_threads([ch9])


def test_compared_sample_files_must_hold_text(tmp_path):
    """The check itself: chapter 9's comparisons are found, and white space is told from text."""
    found = [path for commands, _ in runnable_blocks() for path, _ in compared_files(commands)]
    assert found == ["runs/ch9/one.txt", "runs/ch9/tp2.txt", "runs/ch9/alone.txt", "runs/ch9/batched.txt"]
    chained = ["python sample.py --prompt 'x = ' > a.txt && python sample.py > b.txt && cmp a.txt b.txt && echo same"]
    assert compared_files(chained) == [("a.txt", {"--prompt": "x = "}), ("b.txt", {})]
    (tmp_path / "p.txt").write_text("def \nimport os\\nimport sys\n")
    batched = "--- prompt 1 ---\ndef \n   \n--- prompt 2 ---\nimport os\nimport sys.path\n"
    assert [t.strip() for t in generated_text(batched, {"--prompt-file": "p.txt"}, tmp_path)] == ["", ".path"]
    assert generated_text("def   \n", {}, tmp_path) == ["  \n"]


@pytest.mark.parametrize("index", range(len(runnable_blocks())))
@pytest.mark.slow
def test_tutorial_block_runs_and_prints_its_transcript(index, tmp_path, tmp_path_factory):
    commands, transcript = runnable_blocks()[index]
    made_with = CORPUS_PYTHON.search(tutorial_text())
    assert made_with, "tutorial.md says which Python version its figures were made with"
    masks = MEASURED + TRAINED + ([] if made_with.group(1) == platform.python_version() else CORPUS_DEPENDENT)
    if continues_previous(index):        # start from the runs/ the block above left
        above = _RAN.get(index - 1)
        if above is None:                # that block's test did not run (or failed): run it, unchecked
            above = tmp_path_factory.mktemp(f"block{index - 1}")
            rc, _, out = run_block(with_threads(runnable_blocks()[index - 1][0]), above)
            assert rc == 0, f"block {index - 1}, which block {index} continues, failed:\n{out[-6000:]}"
        shutil.copytree(above / "runs", tmp_path / "runs", symlinks=True)
    trace = tmp_path / ".trace"
    trace.mkdir()
    rc, outputs, out = run_block(with_threads(commands), tmp_path, trace=str(trace))
    if rc == 0:
        _RAN[index] = tmp_path
    assert rc == 0, f"block {index} failed:\n{commands}\n{out[-6000:]}"
    problems = []
    for command, expected, actual in zip(commands, expected_outputs(commands, transcript), outputs):
        if not command.startswith(SAMPLED) or ">" in command:
            problems += [f"$ {command}\n  {p}" for p in mismatches(expected, actual, masks)]
        else:
            problems += [f"$ {command}\n  {p}" for p in sample_problems(command, actual)]
        if command.startswith("python -m nanohlat.serving"):
            problems += [f"$ {command}\n  {p}" for p in speculative_problems("\n".join(actual))]
    assert not problems, ("tutorial.md shows other output than the commands print (fix the code or the "
                          "transcript):\n" + "\n".join(problems) + f"\n\nwhole output:\n{out[-6000:]}")
    # a comparison of generated text proves something only when there is text: not white space alone
    for path, flags in compared_files(commands):
        with open(tmp_path / path) as f:
            for i, continuation in enumerate(generated_text(f.read(), flags, tmp_path)):
                assert continuation.strip(), f"block {index}: {path} compares white space (prompt {i + 1})"
    compare_needs(index, commands, needs.read_hits(str(trace)))


def with_threads(commands: list[str]) -> list[str]:
    """The commands as the test runs them: where a training or serving command
    fixes `--threads 1`, dist_utils.fixed_threads() threads instead (1 unless
    NANOHLAT_TEST_THREADS says otherwise: .ci/run's lane with another count; the
    figures must hold for it too). The bench's measured rates are left alone."""
    n = fixed_threads()
    return [c if c.startswith("python -m nanohlat.bench") else re.sub(r"(--threads) 1\b", rf"\g<1> {n}", c)
            for c in commands]


def sample_problems(command: str, actual: list[str]) -> list[str]:
    """What is checked of a sample.py command that prints sampled text: it starts
    with its prompt (sample.py streams the prompt, then the new tokens) and goes
    on with more than white space. The tokens themselves differ by machine."""
    words = shlex.split(command)
    if words[:2] != ["python", "sample.py"] or "--prompt" not in words:
        return []
    prompt, text = words[words.index("--prompt") + 1], "\n".join(actual)
    if not text.startswith(prompt):
        return [f"the sampled text does not start with its prompt {prompt!r}: {text[:200]!r}"]
    if not text[len(prompt):].strip():
        return [f"nothing but white space follows the prompt {prompt!r}: {text!r}"]
    return []


def speculative_problems(printed: str) -> list[str]:
    """The speculative-decoding demo's figures come from this machine's trained
    weights, so they are checked against each other, not against tutorial.md:
    every relation here holds exactly on any run (serving/server.py). The
    acceptance is strictly between 0 and 1 (else the lesson is invisible); a
    pass yields its accepted drafts + 1 (tokens = accepted + passes) and stops at
    its first rejection (rejections = checked - accepted <= passes); one draft
    pass per proposal; the measured tokens per pass, the formula and the bound
    are what those counts give, and 1 <= measured <= the bound."""
    found = {name: p.search(printed) for name, p in SPECULATIVE.items()}
    missing = [name for name, m in found.items() if not m]
    if missing:
        return [f"the speculative demo printed no {', '.join(missing)} line(s):\n{printed}"]
    g = {name: {k: (float(v) if "." in v else int(v)) for k, v in m.groupdict().items()} for name, m in found.items()}
    n, passes, draft_passes = g["passes"]["n"], g["passes"]["r"], g["passes"]["d"]
    accepted, proposed, checked, k = g["kept"]["a"], g["kept"]["p"], g["kept"]["c"], g["formula"]["k"]
    problems = []
    if not 0 < accepted < checked:
        problems.append(f"per-token acceptance {accepted} / {checked} is not between 0 and 1")
        return problems
    a = accepted / checked
    claims = [
        ("the acceptance line repeats the counts", (g["acceptance"]["a"], g["acceptance"]["c"]) == (accepted, checked)),
        ("tokens = accepted drafts + target passes", n == accepted + passes),
        ("rejections (checked - accepted) <= target passes", checked - accepted <= passes),
        ("accepted <= checked <= proposed <= k x passes", accepted <= checked <= proposed <= k * passes),
        ("one draft pass per proposed draft", draft_passes == proposed),
        ("a = accepted / checked", f"{a:.2f}" == f"{g['acceptance']['value']:.2f}"),
        ("the share kept = accepted / proposed", f"{accepted / proposed:.2f}" == f"{g['kept']['share']:.2f}"),
        ("measured tokens per pass = tokens / passes", f"{n / passes:.2f}" == f"{g['formula']['measured']:.2f}"),
        ("the formula's value at this a and k",
         f"{serving.tokens_per_pass_formula(a, k):.2f}" == f"{g['formula']['formula']:.2f}"),
        ("the bound's value at this a and k", f"{serving.tokens_per_pass_bound(a, k):.2f}" == f"{g['bound']['bound']:.2f}"),
        ("1 <= measured tokens per pass <= the bound", 1 <= n / passes <= serving.tokens_per_pass_bound(a, k)),
    ]
    problems += [f"not true of the printed figures: {claim}\n{printed}" for claim, holds in claims if not holds]
    return problems


def compare_needs(index: int, commands: list[str], hits: dict[str, set[str]]) -> None:
    """What each command of block `index` reached of the exercise regions, against
    nanohlat/classroom/needs.json (the classroom kit's map of what needs what).
    With NANOHLAT_NEEDS_RECORD=FILE it is appended there instead (`needs --update`)."""
    chapter = needs.tutorial_blocks(ROOT)[index][0]
    reached = [needs.order(hits.get(str(i), set())) for i in range(len(commands))]
    record = os.environ.get("NANOHLAT_NEEDS_RECORD")
    if record:
        import json
        with open(record, "a", encoding="utf-8") as f:
            for command, ids in zip(commands, reached):
                f.write(json.dumps({"chapter": chapter, "command": command, "needs": ids}) + "\n")
        return
    data = needs.load()
    stale = [f"$ {c}\n  reached {' '.join(ids) or 'no exercise'}; needs.json says "
             f"{' '.join(needs.stored(data, chapter, c) or []) if needs.stored(data, chapter, c) is not None else '(not listed)'}"
             for c, ids in zip(commands, reached) if needs.stored(data, chapter, c) != ids]
    assert not stale, ("nanohlat/classroom/needs.json is out of date (run `" + needs.UPDATE + "`: it runs "
                       "the tutorial's blocks and the checks, 11 minutes on two busy cores):\n" + "\n".join(stale))


def success_commands() -> list[str]:
    """Every runnable command that ends by printing a success line."""
    return [c for commands, _ in runnable_blocks() for c in commands if SUCCESS.search(c)]


def run_with_failing_steps(command: str, cwd, step: str) -> str:
    """`command` with each of its `python ...` steps replaced by `step`, run by a
    shell that goes on after a failure (as a pasted command would be), after
    every file it names was written with the same partial output (what earlier
    lines that failed midway would leave). Its output."""
    replaced = re.sub(r"\bpython\s[^>&|]*", step + " ", command)
    for path in re.findall(r"\bruns/[\w/-]+\.\w+", command):   # files, not --out-dir folders
        os.makedirs(cwd / os.path.dirname(path), exist_ok=True)
        (cwd / path).write_text("def \n")
    p = subprocess.run(["bash", "-c", replaced], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, timeout=60)
    return p.stdout


def test_a_success_line_is_printed_only_when_every_step_succeeded(tmp_path):
    """The tutorial's `... && echo "it worked"` commands chain every step they
    depend on: with those steps failing (exit 2 after printing what a streaming
    sample.py prints first, the prompt), no success line; with them succeeding
    alike, the line (so the test is not vacuous)."""
    commands = success_commands()
    assert commands, "the tutorial has commands that print a success line"
    for command in commands:
        text = SUCCESS.search(command).group("text")
        assert re.search(r"\bpython\s", command), (
            f"{command!r} prints {text!r} but runs none of the steps it checks: chain them with && "
            f"in the same command")
        out = run_with_failing_steps(command, tmp_path, "sh -c 'echo def; exit 2'")
        assert text not in out, f"{command!r} printed its success line after its steps failed:\n{out}"
        out = run_with_failing_steps(command, tmp_path, "sh -c 'echo def'")
        assert text in out, f"{command!r} did not print {text!r} when its steps succeeded alike:\n{out}"


def test_the_success_check_catches_an_unchained_command(tmp_path):
    """The check itself: the old form, steps on their own lines and `cmp && echo`, is caught."""
    old = 'cmp runs/ch9/one.txt runs/ch9/tp2.txt && echo "tp 2 printed exactly what one process printed"'
    assert not re.search(r"\bpython\s", old)
    out = run_with_failing_steps(old, tmp_path, "sh -c 'echo def; exit 2'")
    assert "tp 2 printed exactly" in out      # what a student saw: success after two failed runs
