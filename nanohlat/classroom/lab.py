"""The debugging lab (tutorial.md chapter 12): real distributed-training bugs, planted into a copy.

    python -m nanohlat.classroom list                 # the exercises, then the lab's bugs
    python -m nanohlat.classroom bug N DIR            # a copy of the repository with bug N in it
    python -m nanohlat.classroom check bugN           # (inside that copy) does it train like one process?

A bug is a patch: an exact piece of the reference code and what replaces it.
The patches live here, outside the reference code, which stays correct; `bug`
copies the repository (kit.make_copy, no exercise stubbed) and applies one.
What a student gets is what a practitioner would see: the symptom and which
instrument shows it (`Bug.symptom`), never where the defect is.

`check bugN` trains, in the copy it is run in, one process and every layout
the bug affects, at the tiny preset for a few steps, on gloo workers that
the lab starts itself (`evaluate`), and passes only when
  * every layout runs (a layout the copy now refuses is a failure: skipping
    the layout hides the bug, it does not fix it);
  * every layout's per-step losses and gradient norms equal one process's to
    fp32 round-off (REL_TOL, the lab's own figure: a tolerance loosened in
    the code changes nothing here);
  * every row of the comm ledger equals the plan's (where the plan predicts
    it: not for a mixture of experts, whose all-to-alls follow the routing);
  * the bug's targeted check passes: exact resume (`resume`), or that the
    stored weights move by what the fp32 update says (`rounding`).
A hang ends: every collective of the lab's runs waits COLLECTIVE_S seconds at
most, and the verdict names the rank and the line it waited at.

The tests (tests/classroom/test_debugging_lab.py) plant every bug, see its instrument
reveal it, revert the patch (the reference fix) and see `check` pass, and see
a symptom-hiding non-fix (`Bug.nonfix`) fail.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass

REL_TOL = 1e-5          # per-step loss and grad norm against one process (fp32 round-off is ~1e-7)
COLLECTIVE_S = 6.0      # a collective waits this long for its peer, then the run ends naming where
STEPS = 2
BASE = ["--preset", "tiny", "--steps", str(STEPS), "--eval-every", "0", "--no-progress", "--threads", "1",
        "--check-replicas", "1", "--warmup-steps", "1"]
MOE = ["--moe-experts", "4", "--moe-top-k", "2"]


@dataclass(frozen=True)
class Bug:
    n: int
    name: str
    area: str
    level: int                 # 1 easy .. 3 hard: the order chapter 12 takes them in
    file: str
    old: str                   # the reference's text (exactly once in `file`)
    new: str                   # what the bug puts there
    layouts: tuple             # the flags of each layout it affects (beside one process)
    symptom: str               # what a practitioner would see, and which instrument to try
    solution: str              # what was wrong (tutorial.md's solutions; never printed by `bug`)
    base: tuple = ()           # flags every run of it takes, one process included
    targeted: str = ""         # "resume", "rounding" or "" (the comparison with one process is all)
    nonfix: tuple = ()         # (file, old, new): a change that hides the symptom (the tests)
    nonfix_what: str = ""


# The non-fixes a check must fail (they hide a symptom, and the bug stays): the replica check turned
# off, or the layout that shows the bug refused.
REPLICA_CHECK_OFF = dict(nonfix=("nanohlat/run/replicas.py", "    if not every or step % every:\n", "    if True:\n"),
                         nonfix_what="turn the replica check off")


def refuse(condition: str, what: str) -> dict:
    line = "    tp, pp, cp = tcfg.tp, tcfg.pp, tcfg.cp\n"
    return dict(nonfix=("nanohlat/recipe/layouts.py", line,
                        line + f"    if {condition}:\n        raise UserError(\"this layout is not supported\")\n"),
                nonfix_what=what)


BUGS = [
    Bug(1, "dp-mean", "DP", 1, "train.py",
        "runner.run(tokens, targets, 1.0 / tokens_per_step)",
        "runner.run(tokens, targets, 1.0 / (tokens_per_step // mesh.dp))",
        (["--nproc", "2", "--dp", "2"],),
        "At dp 2 the printed loss is about twice one process's, from step 1, and so is the gradient norm "
        "(metrics.jsonl). Compare the first step's loss and grad norm with one process's.",
        "train.py scaled each rank's loss by 1 / its own tokens (tokens_per_step // dp), then global_mean and the "
        "gradient all-reduce summed over dp: dp times the mean. Scale by 1 / the global batch's tokens. (A kindred "
        "public report: verl-project/verl issue 5625, a loss divided by the local token count.)",
        nonfix=("nanohlat/data_parallel.py", 'return comm.all_reduce(comm.all_reduce(x, mesh.pp_group), mesh.grad_group, what="loss")',
                'return comm.all_reduce(comm.all_reduce(x, mesh.pp_group), mesh.grad_group, what="loss") / mesh.dp'),
        nonfix_what="divide the printed loss by dp (the gradients stay dp times too large)"),
    Bug(2, "vocab-pad", "TP", 1, "nanohlat/tensor_parallel.py",
        '    logits = logits.masked_fill(ids >= vocab_size, float("-inf"))\n', "",
        (["--nproc", "2", "--tp", "2"],),
        "With a vocabulary that does not fill its padded size (--vocab-size 500: 512 rows, 256 a tp rank), tp 2's "
        "loss at step 1 is higher than one process's; at --vocab-size 512 the two agree. Compare step 1.",
        "The vocab-parallel cross-entropy did not mask the padded vocabulary rows (ids >= vocab_size) to -inf: "
        "they took probability mass in the softmax's sum. Mask them before the max and the sum.",
        base=("--vocab-size", "500"),
        **refuse("tcfg.tp > 1 and model.vocab_size % 128", "refuse tp 2 with a padded vocabulary (skip the layout)")),
    Bug(3, "zero-norm", "DP/ZeRO", 1, "nanohlat/zero1.py",
        '        return comm.all_reduce(sq, self.group, what="grad norm")', "        return sq",
        (["--nproc", "2", "--dp", "2", "--zero", "1"],),
        "At dp 2 with --zero 1 the loss of step 1 agrees with one process's, its gradient norm does not "
        "(metrics.jsonl's grad_norm). Read the ledger against the plan too.",
        "ZeRO-1's sum of squares was not added up over dp: each rank held a different shard and took its own "
        "shard's norm for the whole model's, so clipping used the wrong norm. All-reduce it over dp.",
        **REPLICA_CHECK_OFF),
    Bug(4, "sp-norm", "TP/SP", 2, "nanohlat/model.py",
        "self.weight = shard_spec._param((dim,), None, 1, sequence_parallel=sequence_parallel)",
        "self.weight = shard_spec._param((dim,), None, 1)",
        (["--nproc", "2", "--tp", "2", "--sequence-parallel"],),
        "tp 2 trains like one process; tp 2 with --sequence-parallel stops after step 1: --check-replicas says a "
        "parameter differs between its tp replicas. Compare the two layouts, then the replica check's verdict.",
        "The RMSNorm gain was not marked sequence-parallel, so its gradient (each tp rank saw only its own tokens) "
        "was never summed over tp: every rank stepped its own partial gradient. Mark it (shard_spec). (The same "
        "defect, reported: NVIDIA/Megatron-LM issue 1446, final_layernorm's gradient differing over tp ranks with "
        "sequence parallelism.)",
        **REPLICA_CHECK_OFF),
    Bug(5, "zero-gather", "DP/ZeRO", 2, "nanohlat/zero1.py",
        "comm.all_gather(shard[a:b].contiguous(), group).view(group.size, b - a)",
        "comm.all_gather(shard[a:b].contiguous(), group).view(group.size, b - a).flip(0)",
        (["--nproc", "2", "--dp", "2", "--zero", "1"],),
        "--zero 1 at dp 2: step 1's loss and grad norm equal one process's, step 2's loss is far off (and the "
        "replica check still passes). The weights after the first update are wrong: bisect the optimizer's phases.",
        "ZeRO-1's all-gather put the shards back in the reverse rank order: every rank got the same, wrong, "
        "weights. Row r of the gathered buffer is rank r's shard.",
        **REPLICA_CHECK_OFF),
    Bug(6, "cp-rotary", "CP", 2, "nanohlat/beyond/context_parallel.py",
        "return self.positions(t)[self.group.rank]",
        "return torch.arange(t)",
        (["--nproc", "2", "--cp", "2", "--cp-attention", "allgather"],),
        "cp 2's loss of step 1 agrees with one process's to 1e-5, its gradient norm differs by about 1e-4 "
        "relative; the ledger equals the plan and the replicas agree.",
        "Under cp the rotary angles used each rank's local positions 0..t-1, not its tokens' places in the "
        "whole sequence (zigzag_positions): rank 1's queries and keys were rotated as if they began the sequence.",
        **refuse("tcfg.cp > 1", "refuse --cp (skip the layout)")),
    Bug(7, "ep-grad", "MoE/EP", 2, "nanohlat/beyond/moe.py",
        "    return [[r(d, p, t) for d in range(j, dp, ep)] for p in range(pp) for t in range(tp) for j in range(ep)]\n",
        "    return [[r(d, p, t) for d in range(i, i + ep)] for p in range(pp) for t in range(tp) for i in range(0, dp, ep)]\n",
        (["--nproc", "2", "--dp", "2", "--ep", "2"],),
        "A mixture at dp 2 trains like one process; at dp 2 with --ep 2 the replica check stops the run after "
        "step 1: an expert's weight differs between ranks it calls ep_dp replicas. Ask which ranks hold which "
        "experts (the ledger has no plan column for a mixture).",
        "The experts' gradients were summed over the ranks of an ep group, which hold DIFFERENT experts, instead "
        "of over ep_dp, the ranks holding the same ones: each expert stepped with another's gradient added.",
        base=tuple(MOE),
        **REPLICA_CHECK_OFF),
    Bug(8, "resume-step", "checkpoints", 2, "nanohlat/run/checkpoint/reshard.py",
        "import_state(opt, lambda n, k: local_flat(n, k).to(device.torch_device), step_count)",
        "import_state(opt, lambda n, k: local_flat(n, k).to(device.torch_device), 0)",
        (["--nproc", "2", "--tp", "2"],),
        "Every layout trains like one process, but a run stopped after step 2 and resumed does not continue like "
        "the run that was never stopped: its step 4 differs (step 3 is the saved weights' loss). Try exact resume "
        "(--stop-after 2, then --resume auto).",
        "The optimizer's step count was not restored on resume: Adam's bias correction started over, so the "
        "first update after a resume was far larger. Restore schedule.optimizer_step.",
        targeted="resume",
        **REPLICA_CHECK_OFF),
    Bug(9, "bf16-rne", "precision", 3, "nanohlat/precision.py",
        "master[p.start:p.stop].copy_(stochastic_round_to_bf16(w[p.start:p.stop], noise=noise))",
        "master[p.start:p.stop].copy_(w[p.start:p.stop].to(master.dtype))",
        (),
        "--precision bf16-sr trains and its replicas agree; but at a small learning rate the loss does not move. "
        "Measure how far the stored weights move in two steps against how far fp32's move: about a quarter as far.",
        "bf16-sr's update was stored with round-to-nearest: an update under half a bf16 gap rounds back to the "
        "old weight, so small updates vanish (HLAT's lesson). Round stochastically: E[round(x)] = x.",
        targeted="rounding",
        **REPLICA_CHECK_OFF),
    Bug(10, "pp-idle", "PP", 3, "nanohlat/pipeline.py",
        "            if act_in is not None or grad_out is not None:\n",
        "            if act_in is not None:\n",
        (["--nproc", "2", "--pp", "2", "--microbatches", "2"],),
        "pp 2 with 2 micro-batches never finishes step 1: no error, no progress, until the collective timeout "
        "ends it. Run it with a short --collective-timeout and read which line each rank waited at.",
        "The last stage skipped the left boundary's exchange in the ticks where it only SENT a gradient: the "
        "exchange is a collective both stages must call, so stage 0 waited for a partner that never came.",
        **refuse("tcfg.pp > 1", "refuse --pp (skip the layout)")),
]
BY_N = {b.n: b for b in BUGS}
BY_NAME = {f"bug{b.n}": b for b in BUGS}

def patched(text: str, old: str, new: str, where: str) -> str:
    """`text` with its one `old` replaced by `new` (the kit's error when it is not there exactly once)."""
    if text.count(old) != 1:
        raise SystemExit(f"error: the lab's patch for {where} found its text {text.count(old)} times, not once: "
                         f"the reference changed; update nanohlat/classroom/lab.py")
    return text.replace(old, new)


def patches_of(bug: Bug, nonfix: bool = False) -> list[tuple[str, str, str]]:
    """(file, old, new) changes that plant `bug` (and its non-fix on top)."""
    return [(bug.file, bug.old, bug.new)] + ([bug.nonfix] if nonfix else [])


def apply(root: str, changes: list) -> dict:
    """{file: new text}: `changes` applied to the files under root."""
    texts: dict = {}
    for f, old, new in changes:
        text = texts.get(f) or open(os.path.join(root, f), encoding="utf-8").read()
        texts[f] = patched(text, old, new, f)
    return texts


def plant(n: int, dest: str) -> str:
    """Plant bug n in the copy at dest (kit.cmd_bug made it) and write its LAB.md. Returns its file."""
    from nanohlat.system import files
    bug = BY_N[n]
    for f, text in apply(dest, patches_of(bug)).items():
        files.write_text(os.path.join(dest, f), text)
    files.write_text(os.path.join(dest, "LAB.md"), brief(bug))
    return bug.file


def brief(bug: Bug) -> str:
    return (f"# The debugging lab, bug {bug.n}: {bug.name} ({bug.area})\n\nThis copy has one bug planted in it "
            f"(tutorial.md chapter 12). What you see:\n\n{bug.symptom}\n\nLayouts it affects, beside one process: "
            f"{'; '.join(' '.join(list(bug.base) + l) for l in bug.layouts) or 'none (one process shows it)'}.\n\n`python -m nanohlat.classroom "
            f"check bug{bug.n}` passes when this copy trains like one process again.\n")


# ---------------------------------------------------------------------------
# Running the copy's training: gloo workers the lab starts (a job = one run)
# ---------------------------------------------------------------------------

class _Patched:
    """A finder serving nanohlat's modules (and train.py) from `root`, with `texts` in place of the files."""

    def __init__(self, root, texts):
        self.root, self.texts = root, {os.path.join(root, f): t for f, t in texts.items()}

    def find_spec(self, name, path=None, target=None):
        import importlib.machinery
        import importlib.util
        if name != "train" and name != "nanohlat" and not name.startswith("nanohlat."):   # (train: _command)
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path if path is not None else [self.root])
        if spec is None or spec.origin not in self.texts:
            return spec
        text = self.texts[spec.origin]
        loader = type("L", (importlib.machinery.SourceFileLoader,), {"get_data": lambda s, p: text.encode()})
        return importlib.util.spec_from_file_location(name, spec.origin, loader=loader(name, spec.origin))


def _load(root: str, texts: dict) -> None:
    """Forget nanohlat and train; import them anew from root, with `texts` (patched files) in place."""
    for m in [m for m in sys.modules if m == "train" or m == "nanohlat" or m.startswith("nanohlat.")]:
        del sys.modules[m]
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _Patched)]
    sys.meta_path.insert(0, _Patched(root, texts))


def _where(e: BaseException) -> str:
    tb = [f for f in traceback.extract_tb(e.__traceback__) if "/nanohlat/" in f.filename and "classroom" not in f.filename]
    if not tb:
        return ""
    at = " at " + ", called from ".join(f"{os.path.relpath(f.filename)}:{f.lineno} ({f.name})" for f in (
        [tb[-1]] + [next((f for f in reversed(tb) if not f.filename.endswith("comm.py")), tb[-1])]
        if tb[-1].filename.endswith("comm.py") else [tb[-1]]))   # a collective: and the line that called it
    return at


def _command(root: str):
    """The copy's train.py, the command the lab runs (as needs.py runs the tutorial's): loaded from its
    file through the finder _load installed (a planted bug there included), not imported from a floor
    above the classroom's (docs/design.md 1)."""
    import importlib.util
    finder = next(f for f in sys.meta_path if isinstance(f, _Patched))
    spec = finder.find_spec("train", [root])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(job: dict, rank: int, world: int, out: str) -> dict:
    train = _command(os.getcwd())
    from nanohlat.run import preflight
    from nanohlat import recipe
    res = {"steps": []}
    for k, argv in enumerate(job["argvs"]):
        w = 1 if "--nproc" not in argv else int(argv[argv.index("--nproc") + 1])
        argv = [a for i, a in enumerate(argv) if a != "--nproc" and (i == 0 or argv[i - 1] != "--nproc")]
        log = io.StringIO()
        try:
            with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
                cfg, tcfg = recipe.parse_args(argv + ["--out-dir", out])
                train.train(*preflight.inputs(cfg, tcfg, w, rank))
        except BaseException as e:   # a refusal (SystemExit), a replica mismatch, a collective timed out
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            if "timed out" in msg.lower() or "timeout" in msg.lower():
                msg = f"a collective waited {COLLECTIVE_S:.0f} s for its peer{_where(e)}"
            res["error"] = f"{msg}{'' if msg.startswith('a collective') else _where(e)}"
            lines = log.getvalue().strip().splitlines()
            if isinstance(e, SystemExit) and lines:
                res["error"] = lines[-1]
            return res
        if k == 0:
            res["ledger"] = [l.strip() for l in log.getvalue().splitlines() if "predicted:" in l]
    if rank == 0:
        with open(os.path.join(out, "metrics.jsonl")) as f:
            res["steps"] = [json.loads(l) for l in f if '"loss"' in l]
        res["weights"] = _weights(out) if job.get("weights") else None
    return res


def _weights(out: str):
    """The last checkpoint's model weights, as one fp32 vector (rank 0's files; one process)."""
    import glob
    import torch
    tensors = []
    for path in sorted(glob.glob(os.path.join(out, "checkpoints", "step_*", "shard_*.pt"))):
        model = torch.load(path, map_location="cpu", weights_only=False)["model"]
        tensors += [v.float().flatten() for k, v in sorted(model.items())]
    return torch.cat(tensors) if tensors else None


def _worker(rank, world, port, root, jobs, q, scratch):
    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    os.chdir(root)
    sys.path.insert(0, root)
    torch.set_num_threads(1)
    c10d.default_pg_timeout = datetime.timedelta(seconds=COLLECTIVE_S)   # (new_group's, when none is given)
    # the default group's store waits long (rank 1 waits there while rank 0 runs one process alone);
    # the groups each run makes (mesh.py, through new_group) wait COLLECTIVE_S in a collective
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    from nanohlat import comm   # (no bug plants comm.py: the module held here is the one every job loads)
    everyone = comm.Group("world", list(range(world)), rank, dist.group.WORLD)
    ones = 0
    for job in jobs:
        if job["world"] == 1:   # one process: the workers take turns (two run at once)
            ones += 1
            if (ones - 1) % world != rank:
                continue
        else:   # both ranks start the run's groups together: a one-number all-reduce on the default group
            comm.all_reduce(torch.zeros(1), everyone)
        _load(root, job["texts"])
        out = os.path.join(scratch, job["key"].replace(":", "-"))   # (shared by the job's ranks)
        mine = rank if job["world"] > 1 else 0                      # this worker's rank in the run
        res = _run(job, mine, world, out)
        q.put((mine, job["key"], res))
        if res.get("error", "").startswith("a collective waited") and job["world"] > 1:
            break    # (a rank stuck in a collective: the group is out of step now, the rest is not run)
    dist.destroy_process_group()


def evaluate(root: str, jobs: list, world: int = 2, limit_s: float = 120.0) -> dict:
    """Run `jobs` ({key, world, argvs, texts}) on `world` gloo workers in `root`: {key: result}.
    A result: {"steps": metrics.jsonl's rows (rank 0), "ledger": its rows unlike the plan, "error": ...}."""
    import hashlib
    import queue as queue_mod
    import torch.multiprocessing as mp
    sign = lambda j: hashlib.sha256(json.dumps([j["world"], j["argvs"], sorted(j["texts"].items()),   # noqa: E731
                                                bool(j.get("weights"))]).encode()).hexdigest()
    first: dict = {}   # a job's signature -> the key of the first job that runs the same code the same way
    same = {j["key"]: first.setdefault(sign(j), j["key"]) for j in jobs}   # (each is run once)
    every = jobs   # (one-process runs first: two at a time, one on each worker)
    jobs = sorted([j for j in jobs if same[j["key"]] == j["key"]], key=lambda j: j["world"])
    sys.path.insert(0, root)
    from nanohlat.run.launch import free_port, start_method
    ctx = mp.get_context(start_method())
    q = ctx.Queue()
    port = free_port()
    scratch = tempfile.mkdtemp(prefix="nanohlat-lab-")
    procs = [ctx.Process(target=_worker, args=(r, world, port, root, jobs, q, scratch), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    got: dict = {}
    deadline = time.monotonic() + limit_s
    want = sum(1 if j["world"] == 1 else world for j in jobs)
    n = 0
    try:
        while n < want and time.monotonic() < deadline and any(p.is_alive() for p in procs) or not q.empty():
            try:
                rank, key, res = q.get(timeout=0.3)
            except queue_mod.Empty:
                continue
            n += 1
            if rank == 0 or "error" in res:
                cur = got.setdefault(key, {})
                if "error" in res:   # every rank's, on one line (a hang: where each one waited)
                    cur["error"] = "; ".join(filter(None, [cur.get("error"), f"rank {rank}: {res['error']}"]))
                cur.update({k: v for k, v in res.items() if k != "error"})
    finally:
        for p in procs:
            p.join(timeout=2)
            if p.is_alive():
                p.kill()
        shutil.rmtree(scratch, ignore_errors=True)
    late = time.monotonic() >= deadline
    for j in jobs:
        got.setdefault(j["key"], {"error": f"did not finish within {limit_s:.0f} s" if late else
                                  "not run: a run before it failed"})
    return {j["key"]: got[same[j["key"]]] for j in every}


# ---------------------------------------------------------------------------
# The verdict
# ---------------------------------------------------------------------------

def jobs_for(bug: Bug, texts: dict, tag: str = "") -> list:
    """The runs that grade `bug`: one process, each affected layout; the targeted check's."""
    base = BASE + list(bug.base)
    jobs = [dict(key=f"{tag}{bug.n}:1", world=1, argvs=[base], texts=texts)]
    for k, lay in enumerate(bug.layouts):
        jobs.append(dict(key=f"{tag}{bug.n}:L{k}", world=2, argvs=[base + lay], texts=texts))
    if bug.targeted == "resume":   # 4 steps straight, and stopped after 2 then resumed (step 4: resumed weights)
        lay = base + bug.layouts[0] + ["--steps", "4"]
        jobs.append(dict(key=f"{tag}{bug.n}:R4", world=2, texts=texts, argvs=[lay]))
        jobs.append(dict(key=f"{tag}{bug.n}:R", world=2, texts=texts,
                         argvs=[lay + ["--stop-after", "2"], lay + ["--resume", "auto"]]))
    if bug.targeted == "rounding":
        small = ["--lr", "1e-5", "--min-lr", "1e-5", "--steps", "2", "--warmup-steps", "0"]
        still = ["--lr", "1e-30", "--min-lr", "1e-30"]   # (far under any gap: the weights as initialised)
        for name, prec in (("fp32", ["--precision", "fp32"]), ("sr", ["--precision", "bf16-sr"]),
                           ("fp32-0", ["--precision", "fp32"] + still), ("sr-0", ["--precision", "bf16-sr"] + still)):
            jobs.append(dict(key=f"{tag}{bug.n}:{name}", world=1, weights=True, texts=texts,
                             argvs=[BASE + small + prec]))
    return jobs


def verdict(bug: Bug, got: dict, tag: str = "") -> str | None:
    """None (the copy trains like one process, and the targeted check passes), else what differs."""
    one = got[f"{tag}{bug.n}:1"]
    if "error" in one:
        return f"one process: {one['error']}"
    for k, lay in enumerate(bug.layouts):
        name = " ".join(lay)
        r = got[f"{tag}{bug.n}:L{k}"]
        if "error" in r:
            return f"{name}: {r['error']}"
        if len(r["steps"]) != len(one["steps"]):
            return f"{name}: {len(r['steps'])} steps logged, one process {len(one['steps'])}"
        for a, b in zip(r["steps"], one["steps"]):
            for f in ("loss", "grad_norm"):
                if abs(a[f] - b[f]) > REL_TOL * abs(b[f]):
                    return (f"{name}: step {a['step']} {f} {a[f]:.6f}, one process {b[f]:.6f} "
                            f"(relative difference {abs(a[f] - b[f]) / abs(b[f]):.1e} > {REL_TOL:g})")
        if r.get("ledger"):
            return f"{name}: the comm ledger differs from the plan: {r['ledger'][0]}"
    if bug.targeted == "resume":
        r, whole = got[f"{tag}{bug.n}:R"], got[f"{tag}{bug.n}:R4"]
        if "error" in r or "error" in whole:
            return f"resume: {r.get('error') or whole['error']}"
        a, b = r["steps"][-1], whole["steps"][-1]
        if a["step"] != b["step"] or abs(a["loss"] - b["loss"]) > REL_TOL * abs(b["loss"]):
            return (f"exact resume: stopped after step 2 and resumed, step {a['step']} loss {a['loss']:.6f}; "
                    f"never stopped {b['loss']:.6f}")
    if bug.targeted == "rounding":
        w = {k: got[f"{tag}{bug.n}:{k}"] for k in ("fp32", "sr", "fp32-0", "sr-0")}
        for k, r in w.items():
            if "error" in r or r.get("weights") is None:
                return f"rounding ({k}): {r.get('error', 'no checkpoint written')}"
        moved_sr = (w["sr"]["weights"] - w["sr-0"]["weights"]).abs().mean().item()
        moved_fp = (w["fp32"]["weights"] - w["fp32-0"]["weights"]).abs().mean().item()
        if not 0.8 < moved_sr / moved_fp < 1.25:
            return (f"rounding: 2 steps at lr 1e-5 moved the bf16-sr weights by {moved_sr:.3g} on average, the fp32 "
                    f"ones by {moved_fp:.3g} (ratio {moved_sr / moved_fp:.2f}; unbiased rounding gives ~1)")
    return None


def check(name: str, root: str) -> str | None:
    """`check bugN` in the copy at root: the verdict on the code as it is there."""
    bug = BY_NAME[name]
    jobs = jobs_for(bug, {})
    return verdict(bug, evaluate(root, jobs))


def compare(a: str, b: str) -> int:
    """`compare RUN RUN`: two runs' per-step losses and gradient norms side by side (their
    metrics.jsonl), and the first step where they differ by more than REL_TOL. 0: they agree."""
    rows = []
    for run in (a, b):
        path = os.path.join(run, "metrics.jsonl")
        if not os.path.isfile(path):
            print(f"error: {path} is not there; give two runs' --out-dir folders", file=sys.stderr)
            return 2
        with open(path, encoding="utf-8") as f:
            rows.append({r["step"]: r for r in map(json.loads, f) if "loss" in r})
    print(f"A: {a}, B: {b}")
    print("step      loss A      loss B   grad norm A   grad norm B")
    first = None
    for step in sorted(set(rows[0]) & set(rows[1])):
        x, y = rows[0][step], rows[1][step]
        bad = [f for f in ("loss", "grad_norm") if abs(x[f] - y[f]) > REL_TOL * abs(y[f])]
        first = first or (bad and (step, bad))
        print(f"{step:>4}  {x['loss']:>10.6f}  {y['loss']:>10.6f}  {x['grad_norm']:>12.6f}  {y['grad_norm']:>12.6f}"
              + ("  <- differs" if bad else ""))
    if first:
        print(f"first difference: step {first[0]}, {' and '.join(first[1])} (more than {REL_TOL:g} relative)")
        return 1
    print(f"the same at every step, to {REL_TOL:g} relative")
    return 0


def list_lines() -> list[str]:
    out = ["", "The debugging lab (tutorial.md chapter 12): `python -m nanohlat.classroom bug N DIR` plants bug N "
           "in a copy; `check bugN` there grades it"]
    for b in sorted(BUGS, key=lambda b: (b.level, b.n)):
        out.append(f"  bug{b.n:<3} {b.area:<12} level {b.level}  {b.name:<12} {b.symptom.split('. ')[0].rstrip('.')}.")
    return out
