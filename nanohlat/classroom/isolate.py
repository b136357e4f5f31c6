"""Where `check` runs a student's code: a child process the code cannot end the verdict of.

In the kit's own process a student's `sys.exit(0)` (or `os._exit(0)`) inside
an exercise ended `check` with no verdict printed and exit code 0, a pass in
any script; a loop that never ends hung it, since only the distributed checks
had a time limit. So `kit.cmd_check` runs the checks here instead: `Child`
starts one Python process in the copy (`serve`), hands it exercise ids one
at a time and reads back, on a pipe of its own (the code's prints go to the
terminal as before), that each check started and its verdict. What the code
can do to the child is a failure of its exercise, never a pass:

  * an exit (SystemExit, from sys.exit or exit()) is caught in the child and
    is the verdict, naming where the code called it;
  * an end without a verdict (os._exit, a crash, a kill) is seen by the
    parent as the pipe closing, with the child's exit code;
  * a check still running TIME_LIMIT + SLACK_S seconds after it started is
    stopped (the child and every process it started: its own session) and
    failed as such. The distributed checks stop their gloo ranks at
    TIME_LIMIT themselves (classroom/checks/grading.py:spawn) and name them, so the
    slack lets that verdict arrive first.

After such an end the next exercise gets a fresh child; otherwise one child
runs them all (torch is imported once).

The child grades only its copy: a module of nanohlat that the copy lacks is not
taken from another nanohlat on the path (an editable install of the reference
found every missing file, and the check graded the reference's code and
passed): `CopyOnly` refuses it, naming the file. `kit.cmd_check` refuses to run
outside a copy at all, and names an exercise's missing file before starting.
"""

from __future__ import annotations

import importlib.machinery
import json
import os
import select
import signal
import subprocess
import sys
import time

TIME_LIMIT = float(os.environ.get("NANOHLAT_CHECK_TIME_LIMIT", "120"))   # seconds for one check (a distributed
                                                                            # one's gloo group: start-up included)
SLACK_S = 10.0          # past TIME_LIMIT, for a distributed check to stop its own ranks and name them
START_LIMIT_S = 300.0   # for the child to start (torch's import, on a busy machine)
CHILD = ("from nanohlat.classroom import isolate; isolate.guard(); from nanohlat.classroom import checks, kit; "
         "isolate.serve(checks.run, checks.explain, kit.BY_ID)")
VERDICT_FD_ENV = "NANOHLAT_CHECK_VERDICTS"   # the pipe the child answers on


class CopyOnly:
    """A finder, first on sys.meta_path in the child: a module of nanohlat is imported from the
    copy at `root` or not at all (ModuleNotFoundError naming the file the copy lacks)."""

    def __init__(self, root: str):
        self.root = os.path.realpath(root)

    def find_spec(self, name, path=None, target=None):
        if name != "nanohlat" and not name.startswith("nanohlat."):
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path if path is not None else [self.root])
        where = spec and (spec.origin if spec.has_location else (list(spec.submodule_search_locations or []) or [""])[0])
        if where and os.path.realpath(where).startswith(self.root + os.sep):
            return None          # in the copy: imported the usual way (by the next finder)
        rel = os.path.join(*name.split(".")) + ".py"
        raise ModuleNotFoundError(f"{rel} is missing from this copy ({self.root}); a check grades only the copy "
                                  f"it is run in: restore the file", name=name)


def guard() -> None:
    """(The child, first) nanohlat's modules from the copy in this folder only (CopyOnly)."""
    sys.meta_path.insert(0, CopyOnly(os.getcwd()))


def serve(run, explain, exercises: dict) -> None:
    """The child (CHILD: run, explain and exercises are checks.run, checks.explain and kit.BY_ID):
    exercise ids on stdin, one a line; on the pipe VERDICT_FD_ENV names, one JSON line per event:
    {"ready": 1}, {"check": name} as each check starts, {"verdict": text or null}."""
    pipe = os.fdopen(int(os.environ.pop(VERDICT_FD_ENV)), "w")

    def say(**event) -> None:
        pipe.write(json.dumps(event) + "\n")
        pipe.flush()
    say(ready=1)
    for line in sys.stdin:
        ex, running = exercises[line.strip()], {}
        try:
            verdict = run(ex, on_start=lambda name: (running.update(name=name), say(check=name)))
        except SystemExit as e:   # the code called sys.exit: an exit is its verdict
            at = explain(e).rpartition(" at ")[2]
            verdict = (f"exercise {ex.id}'s code exited (sys.exit({e.code!r}), at {at}) during "
                       f"{running.get('name', 'its check')}: an exit ends no check with a pass")
        sys.stdout.flush()
        sys.stderr.flush()
        say(verdict=verdict)


class Child:
    """The parent's side: `run(id)` -> that exercise's verdict (None: it passed). `close()` at the end."""

    def __init__(self, root: str):
        self.root, self.proc, self.pipe, self.buffer = root, None, -1, b""

    def _start(self) -> str | None:
        read, write = os.pipe()
        env = dict(os.environ, **{VERDICT_FD_ENV: str(write)})
        sys.stdout.flush()
        self.proc = subprocess.Popen([sys.executable, "-c", CHILD], cwd=self.root, env=env, stdin=subprocess.PIPE,
                                     pass_fds=(write,), start_new_session=True)
        os.close(write)
        self.pipe, self.buffer = read, b""
        event = self._next(time.monotonic() + START_LIMIT_S)
        if event is None or "ready" not in event:
            return self._lost(event, "starting", START_LIMIT_S)
        return None

    def run(self, ex_id: str) -> str | None:
        if self.proc is None:
            failed = self._start()
            if failed:
                return failed
        sys.stdout.flush()
        self.proc.stdin.write(f"{ex_id}\n".encode())
        self.proc.stdin.flush()
        name, deadline = "its checks", time.monotonic() + START_LIMIT_S
        while True:
            event = self._next(deadline)
            if event is None or "verdict" not in event and "check" not in event:
                return self._lost(event, name, TIME_LIMIT + SLACK_S)
            if "verdict" in event:
                return event["verdict"]
            name, deadline = event["check"], time.monotonic() + TIME_LIMIT + SLACK_S

    def _next(self, deadline: float) -> dict | None:
        """The child's next event; None when the time is up; {} when the pipe closed (the child ended)."""
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.pipe], [], [], left)[0]:
                return None
            chunk = os.read(self.pipe, 65536)
            if not chunk:
                return {}
            self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        return json.loads(line)

    def _lost(self, event: dict | None, name: str, limit: float) -> str:
        """The verdict when the child gave none: it ended (event {}), or ran out of time (None)."""
        if event is None:
            self.close(kill=True)
            if name == "starting":
                return f"the process running the checks did not start within {limit:.0f} s; it was stopped"
            return (f"{name} did not finish within {limit:.0f} s: the code never returned (a loop that does not "
                    f"end?) and was stopped")
        try:
            code = self.proc.wait(timeout=10)   # (the pipe closed: the child is ending)
        except subprocess.TimeoutExpired:       # (it closed the pipe, and goes on)
            self.close(kill=True)
            return f"the check ended without a verdict: its process closed the verdict pipe during {name}; stopped"
        self.close()
        how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        if name == "starting":
            return f"the process running the checks ended ({how}) before it started: see the error above"
        return (f"the check ended without a verdict: the process running it exited ({how}) during {name}; the "
                f"code called os._exit or was killed, and an exit ends no check with a pass")

    def close(self, kill: bool = False) -> None:
        """End the child (at once: `kill`; else once it has seen its input end) and everything it
        started (its session), if it is still there."""
        if self.proc is None:
            return
        if self.proc.poll() is None and not kill:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)   # (a forkserver or gloo ranks it left behind)
        except OSError:
            pass
        self.proc.wait()
        os.close(self.pipe)
        self.proc, self.pipe = None, -1
