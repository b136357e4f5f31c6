"""Where the lab runs training: gloo worker processes the grader starts, each running a copy's code.

The grader (lab.py) is the installed nanohlat's; the code it grades is a
student's copy (or, for the one-process reference it compares with, its own
repository). Neither may lend the other a module, so the training runs in
worker processes of their own, as isolate.py runs an exercise's check:

  * a pool of `world` workers, each started with `python -c` (a fresh
    interpreter, in a session of its own: Ctrl-C at the terminal reaches the
    grader only, which ends them, and no worker prints a traceback), joined
    in one gloo group (`serve`);
  * a run (a `Job`: one or more legs of train.py's flags, e.g. a run stopped
    and then resumed) is handed to one worker (one process) or to every
    worker of a pool (several); each worker forgets every nanohlat module and
    imports the job's code afresh, the copy's train.py and nanohlat/ (`load`:
    with `texts`, files replaced in memory, which the tests plant wrong fixes
    with), trains, and says on its own pipe that it is done or why it failed;
  * the grader reads what the run wrote (metrics.jsonl, summary.json, the
    last checkpoint) itself, with its own code (lab.py).

A collective waits COLLECTIVE_S seconds for its peer, then fails naming the
collective and the line of the copy's code that issued it (the comm ledger's
open call); a pool that saw one is ended and a fresh one takes the next
runs. A run still going RUN_LIMIT_S seconds after it started is stopped.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field

COLLECTIVE_S = 10.0     # a collective waits this long for its peer, then the run ends naming where
RUN_LIMIT_S = 150.0     # one run (its legs together), start-up of its workers not included
START_LIMIT_S = 300.0   # a pool's workers to import torch and meet (a busy machine)
GRADER = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BOOT = f"import sys; sys.path[:0] = [{GRADER!r}]; from nanohlat.classroom import lab_workers; lab_workers.serve()"
ENV = "NANOHLAT_LAB_WORKER"   # rank, world, port, the fd it answers on


@dataclass
class Job:
    """One run: `legs` (each train.py's flags without --out-dir; a later leg continues the run in the
    same out-dir, e.g. with --resume auto) of the code at `root` (`texts`: {file: text} in place of
    files there), on `world` processes. `nan_step`: the first leg's step k (from 1) is made
    non-finite (its loss NaN: the update is skipped), a fault the lab injects to test what follows."""
    key: str
    root: str
    legs: list
    world: int = 1
    texts: dict = field(default_factory=dict)
    nan_step: int = 0
    out: str = ""            # its --out-dir (set by Pools.run)

    def signature(self) -> str:
        return json.dumps([self.root, self.legs, self.world, sorted(self.texts.items()), self.nan_step])


# ---------------------------------------------------------------------------
# The worker (a fresh interpreter; BOOT)
# ---------------------------------------------------------------------------

class _Code:
    """A finder serving `train` and nanohlat's modules from `root` only, with `texts` in place of files."""

    def __init__(self, root: str, texts: dict):
        self.root, self.texts = root, {os.path.join(root, f): t for f, t in texts.items()}

    def find_spec(self, name, path=None, target=None):
        import importlib.machinery
        import importlib.util
        if name != "train" and name != "nanohlat" and not name.startswith("nanohlat."):
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path if path is not None else [self.root])
        if spec is None:   # not in this code: never from another nanohlat on the path
            raise ModuleNotFoundError(f"{os.path.join(*name.split('.'))}.py is missing from {self.root}", name=name)
        if spec.origin not in self.texts:
            return spec
        text = self.texts[spec.origin]
        loader = type("L", (importlib.machinery.SourceFileLoader,), {"get_data": lambda s, p: text.encode()})
        return importlib.util.spec_from_file_location(name, spec.origin, loader=loader(name, spec.origin))


def load(root: str, texts: dict):
    """Forget nanohlat and train; import them anew from `root` (`texts` in place). Returns train.py's module."""
    import importlib.util
    for m in [m for m in sys.modules if m == "train" or m == "nanohlat" or m.startswith("nanohlat.")]:
        del sys.modules[m]
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _Code)]
    finder = _Code(root, texts)
    sys.meta_path.insert(0, finder)
    spec = finder.find_spec("train", [root])
    module = importlib.util.module_from_spec(spec)
    sys.modules["train"] = module
    spec.loader.exec_module(module)
    return module


def _nan_at(train, step: int) -> None:
    """The loaded code's data_parallel.global_mean (the step's loss, as train.py and its module know it)
    returns NaN at its `step`-th call."""
    import nanohlat.data_parallel as dp   # (the job's code: the finder above serves it)
    real, calls = dp.global_mean, [0]

    def global_mean(x, mesh):
        calls[0] += 1
        out = real(x, mesh)
        return out * float("nan") if calls[0] == step else out
    dp.global_mean = global_mean
    if getattr(train, "global_mean", None) is real:
        train.global_mean = global_mean


def open_call(e: BaseException) -> str:
    """'pp.exchange, issued at nanohlat/pipeline.py:253 (_exchange)': the collective a rank waited in
    and the line of the loaded code that issued it (as the copy's train.py says it, run/launch.py:
    open_collective): the innermost frame of comm.py in e's traceback, or for a started collective
    waited on elsewhere the comm ledger's open call, the last one issued (comm.CommLedger.open). The
    twin of launch.py's open_collective (and _code_path of its code_path), written again on purpose: a
    worker imports no module of the grader's nanohlat, and importing the copy's would let it word its
    own verdict."""
    frames = [f for f, _ in traceback.walk_tb(e.__traceback__)]
    inside = [i for i, f in enumerate(frames) if f.f_code.co_filename.endswith(f"{os.sep}nanohlat{os.sep}comm.py")]
    if inside and inside[0] > 0:
        op, caller = frames[inside[-1]], frames[inside[0] - 1]
        group = op.f_locals.get("group", op.f_locals.get("pair"))
        return (f"{getattr(group, 'name', '?')}.{op.f_code.co_name}, issued at {_code_path(caller.f_code.co_filename)}"
                f":{caller.f_lineno} ({caller.f_code.co_name})")
    for frame in reversed(frames):
        for value in list(frame.f_locals.values()):
            call = getattr(getattr(value, "ledger", None), "open", None)
            if isinstance(call, tuple) and len(call) == 4:
                key, path, line, function = call
                return f"{key} (the last collective it issued), at {_code_path(str(path))}:{line} ({function})"
    return "a collective"


def _code_path(path: str) -> str:
    at = path.rfind(f"{os.sep}nanohlat{os.sep}")
    return path[at + 1:] if at >= 0 else os.path.basename(path)


def where(e: BaseException) -> str:
    """' at FILE:LINE (function)' of the innermost frame of the loaded code (train.py, nanohlat/) in e's
    traceback."""
    tb = [f for f in traceback.extract_tb(e.__traceback__) if f"{os.sep}nanohlat{os.sep}" in f.filename
          and f"{os.sep}classroom{os.sep}lab" not in f.filename or f.filename.endswith(f"{os.sep}train.py")]
    return f" at {_code_path(tb[-1].filename)}:{tb[-1].lineno} ({tb[-1].name})" if tb else ""


def _one_line(e: BaseException, log: str) -> str:
    """What ended a run, in one line: a collective that timed out and where it was issued, a refusal
    (the command's own line), or a crash and the line of the code that raised it."""
    text = str(e).strip()
    if isinstance(e, RuntimeError) and ("Timed out waiting" in text or "before timing out" in text):
        return f"a collective waited {COLLECTIVE_S:g} s for its peer, in {open_call(e)}"
    lines = log.strip().splitlines()
    if isinstance(e, SystemExit) and lines:   # a refusal: the command's own one line
        return lines[-1].removeprefix("error: ")
    first = text.splitlines()[0] if text else ""
    if type(e).__name__ == "UserError":       # the copy's own words for it
        return first
    return f"{type(e).__name__}{': ' + first if first else ''}{where(e)}"


def _no_peak() -> None:
    """The loaded code's CPU peak for MFU, as if measured: a run times matmuls for 2-3 s to find it
    (tools/metrics.py:measure_cpu_peak), most of a lab run, and the lab reads no MFU."""
    import torch
    with contextlib.suppress(ImportError, AttributeError):
        from nanohlat.tools import metrics
        metrics._cpu_peaks[torch.get_num_threads()] = 1e9


def _train(job: dict, rank: int) -> dict:
    train = load(job["root"], job["texts"])
    _no_peak()
    if job["nan_step"]:
        _nan_at(train, job["nan_step"])
    for k, argv in enumerate(job["legs"]):
        if k == 1 and job["nan_step"]:
            train = load(job["root"], job["texts"])   # (the fault is the first leg's only)
            _no_peak()
        from nanohlat import recipe                   # (the job's code, as loaded)
        from nanohlat.run import preflight
        log = io.StringIO()
        try:
            with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
                cfg, tcfg = recipe.parse_args(list(argv) + ["--out-dir", job["out"]])
                train.train(*preflight.inputs(cfg, tcfg, job["world"], rank))
        except BaseException as e:   # noqa: BLE001 - a refusal, a crash, a collective timed out: the verdict
            return {"error": _one_line(e, log.getvalue()), "leg": k}
    return {}


def serve() -> None:
    """A worker (BOOT): join the pool's gloo group, then run the jobs the grader sends on stdin."""
    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    rank, world, port, fd = map(int, os.environ.pop(ENV).split(","))
    pipe = os.fdopen(fd, "w")
    grader = os.getppid()

    def follow() -> None:   # a worker does not outlive its grader (killed: its pipes close, or not at once)
        while os.getppid() == grader:
            time.sleep(0.5)
        os._exit(1)
    threading.Thread(target=follow, daemon=True).start()
    torch.set_num_threads(1)
    c10d.default_pg_timeout = datetime.timedelta(seconds=COLLECTIVE_S)   # each run's groups (new_group's default)
    if world > 1:   # the pool's own group: its ranks meet within START_LIMIT_S; then, as a run's "world"
        # group (mesh.py takes the default group), a collective of it waits COLLECTIVE_S as the run's own
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=START_LIMIT_S))
        c10d._set_pg_timeout(datetime.timedelta(seconds=COLLECTIVE_S), None)
    pipe.write(json.dumps({"ready": rank}) + "\n")
    pipe.flush()
    from nanohlat import comm   # (the grader's, kept: the jobs' code is imported anew for each)
    everyone = comm.Group("pool", list(range(world)), rank, dist.group.WORLD) if world > 1 else None
    for line in sys.stdin:
        job = json.loads(line)
        if job["world"] > 1:   # every rank starts the run's groups together
            comm.all_reduce(torch.zeros(1), everyone)
        try:
            res = _train(job, rank if job["world"] > 1 else 0)
        except BaseException as e:   # noqa: BLE001 - (the lab's own failure, while reporting one: said, not fatal)
            res = {"error": f"the lab's worker failed ({type(e).__name__}: {e})"}
        pipe.write(json.dumps({"key": job["key"], "rank": rank, **res}) + "\n")
        pipe.flush()
    os._exit(0)   # (the grader is done: leaving the gloo group at exit could wait for the other ranks)


# ---------------------------------------------------------------------------
# The grader's side: pools of workers
# ---------------------------------------------------------------------------

class Pool:
    """`world` workers in one gloo group (serve)."""

    def __init__(self, world: int, scratch: str):
        from nanohlat.run.launch import free_port
        self.world, self.procs, self.pipes, self.buffers = world, [], [], []
        port = free_port()
        for r in range(world):
            read, write = os.pipe()
            env = dict(os.environ, **{ENV: f"{r},{world},{port},{write}"})
            env.pop("PYTHONPATH", None)   # (the grader's path is BOOT's; a copy on it would lend its modules)
            log = open(os.path.join(scratch, f"worker-{world}-{r}-{port}.log"), "wb")
            self.procs.append(subprocess.Popen([sys.executable, "-c", BOOT], cwd=scratch, env=env,
                                               stdin=subprocess.PIPE, stdout=log, stderr=log, pass_fds=(write,),
                                               start_new_session=True))
            log.close()
            os.close(write)
            self.pipes.append(read)
            self.buffers.append(b"")
        self.busy = [None] * world
        try:
            for r in range(world):
                if self.next(r, time.monotonic() + START_LIMIT_S) is None:
                    raise RuntimeError(f"the lab's workers did not start within {START_LIMIT_S:.0f} s")
        except BaseException:   # (Ctrl-C while they start, too: none is left behind)
            self.close()
            raise

    def send(self, r: int, job: Job) -> None:
        self.busy[r] = job.key
        self.procs[r].stdin.write((json.dumps(job.__dict__) + "\n").encode())
        self.procs[r].stdin.flush()

    def next(self, r: int, deadline: float) -> dict | None:
        """Worker r's next message; None when the time is up or it ended."""
        while b"\n" not in self.buffers[r]:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.pipes[r]], [], [], left)[0]:
                return None
            chunk = os.read(self.pipes[r], 1 << 16)
            if not chunk:
                return None
            self.buffers[r] += chunk
        line, _, self.buffers[r] = self.buffers[r].partition(b"\n")
        return json.loads(line)

    def ready(self) -> list[int]:
        """Workers with a message waiting (or ended)."""
        out = [r for r in range(self.world) if b"\n" in self.buffers[r]]
        waiting = [self.pipes[r] for r in range(self.world) if r not in out and self.busy[r]]
        if waiting:
            got = select.select(waiting, [], [], 0.2)[0]
            out += [r for r in range(self.world) if self.pipes[r] in got]
        return out

    def close(self) -> None:
        for p in self.procs:
            with contextlib.suppress(OSError):
                os.killpg(p.pid, signal.SIGKILL)   # (its session: nothing it started stays)
        for p, fd in zip(self.procs, self.pipes):
            p.wait()
            with contextlib.suppress(OSError):
                p.stdin.close()
                os.close(fd)
        self.procs = []


class Pools:
    """Runs jobs: a pool per world size, started when first needed; one multi-process run at a time,
    one-process runs side by side on the idle workers. Use as a context manager (the end kills them)."""

    def __init__(self):
        self.scratch = tempfile.mkdtemp(prefix="nanohlat-lab-")
        self.pools: dict[int, Pool] = {}
        self.done: dict[str, dict] = {}      # signature -> result ({} or {"error"}, and "out")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for pool in self.pools.values():
            pool.close()
        shutil.rmtree(self.scratch, ignore_errors=True)

    def pool(self, world: int) -> Pool:
        if world not in self.pools or not self.pools[world].procs:
            self.pools[world] = Pool(world, self.scratch)
        return self.pools[world]

    def run(self, jobs: list[Job]) -> dict[str, dict]:
        """{key: {"out": the run's out-dir, "error": why it failed (absent: it ran)}} for every job;
        a job run before with the same code and flags is not run again."""
        todo, results = [], {}
        for j in jobs:
            sig = j.signature()
            if sig in self.done:
                results[j.key] = self.done[sig]
            elif sig not in [s for s, _ in todo]:
                j.out = os.path.join(self.scratch, f"run{len(self.done) + len(todo)}")
                todo.append((sig, j))
        ones = [(s, j) for s, j in todo if j.world == 1]
        self._ones(ones)
        for s, j in todo:
            if j.world > 1:
                self.done[s] = self._many(j)
        return {j.key: self.done[j.signature()] for j in jobs}

    def _ones(self, todo: list) -> None:
        """One-process jobs on the workers of a 2-worker pool, two at a time."""
        waiting = list(todo)
        while waiting:
            pool, started, broken = self.pool(2), {}, False
            while (waiting or started) and not broken:
                for r in range(pool.world):
                    if r not in started and waiting:
                        s, j = waiting.pop(0)
                        pool.send(r, Job(**{**j.__dict__, "world": 1}))
                        started[r] = (s, j, time.monotonic())
                for r in pool.ready():
                    s, j, started_at = started.pop(r)
                    msg = pool.next(r, time.monotonic() + 1)
                    pool.busy[r] = None
                    if msg is None:   # (os._exit, a crash, a kill: the pool is one worker short)
                        self.done[s] = {"out": j.out, "error": "the process running it ended without a word"}
                        broken = True
                    else:
                        self.done[s] = {"out": j.out, "took": time.monotonic() - started_at,
                                        **({"error": msg["error"]} if "error" in msg else {})}
                for r, (s, j, t0) in list(started.items()):
                    if time.monotonic() - t0 > RUN_LIMIT_S:
                        self.done[s] = {"out": j.out, "error": f"did not finish within {RUN_LIMIT_S:.0f} s"}
                        del started[r]
                        broken = True
            if broken:
                pool.close()
                waiting = [(s, j) for s, j, _ in started.values()] + waiting

    def _many(self, j: Job) -> dict:
        """A job on every worker of a pool of its size: {"out", "error": every rank's, one part each}."""
        pool = self.pool(j.world)
        t0 = time.monotonic()
        for r in range(j.world):
            pool.send(r, j)
        deadline = time.monotonic() + RUN_LIMIT_S
        errors, ended = {}, False
        for r in range(j.world):
            msg = pool.next(r, deadline)
            if msg is None:
                ended = True
                errors.setdefault(r, f"did not finish within {RUN_LIMIT_S:.0f} s" if time.monotonic() >= deadline
                                  else "the worker ended without a word")
                continue
            if "error" in msg:
                errors[r] = msg["error"]
        for r in range(j.world):
            pool.busy[r] = None
        if ended or any(e.startswith("a collective waited") for e in errors.values()):
            pool.close()   # a rank may still wait, or the group is out of step: a fresh pool for the next run
        if not errors:
            return {"out": j.out, "took": time.monotonic() - t0}
        said: dict = {}   # each distinct error once, with the ranks that said it
        for r, e in sorted(errors.items()):
            said.setdefault(e, []).append(r)
        return {"out": j.out, "took": time.monotonic() - t0, "ranks": errors,
                "error": "; ".join(f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {e}"
                                   for e, rs in said.items())}
