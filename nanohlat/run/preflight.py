"""Pre-flight: everything `python train.py ...` decides once, before any worker starts.

`main` is train.py's command line. In order, it

  1. parses the flags into (ModelConfig, TrainConfig), once; --plan prints the
     plan and stops here;
  2. refuses a layout that cannot work (recipe.check_layout), values that
     are in range but would break the run later (check_values: buckets too
     small, timeouts the runtime cannot take), a --device this machine lacks,
     and a model or sequence too large for its memory (check_memory), before
     any tokenizer work;
  3. prepares the data: trains the tokenizer and builds the token shards if
     the cache has none (data.prepare_data), and sets the model's vocabulary
     to the tokenizer's (a new vocabulary must split over --tp too);
  4. takes the run lock on out-dir (runlock.py), decides what to resume from
     (checkpoint.find_resume), checks that checkpoint (files, model shape,
     tokenizer and corpus), or with --resume never --overwrite clears the old run;
  5. trains: here (one process), in --nproc local workers (launch.spawn, each
     handed the resolved configuration, dataset and checkpoint), or, under
     torchrun, as this process's rank.

Every refusal is one line on stderr and exit code 2, before any worker starts
and before --overwrite removes anything. Under torchrun every process runs
`main` itself, so each does its own pre-flight once; rank 0 takes the lock and
clears the run. A worker that the launcher restarted after a failure
(--max-restarts) resumes from the newest checkpoint in out-dir, whatever
--resume said (`worker`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys

import torch
import torch.distributed

from nanohlat import recipe
from nanohlat import device as devicelib
from nanohlat.config import UserError
from nanohlat.run import checkpoint, cpu_memory, data, launch, preempt, runlock
from nanohlat.system import cli, flags
from nanohlat.system.files import os_error_message


@cli.command
def main(train, argv: list[str]) -> int:
    """train.py's command line; `train` is train.py:train. Returns the exit code
    (its errors as one line: system/cli.py:command)."""
    lock = None
    try:
        model_cfg, tcfg = recipe.parse_args(argv, flags.Parser)   # (a bad flag: one line, exit 2)
        env = launch.torchrun_env()
        world = env[1] if env else tcfg.nproc
        launch.check_nproc(tcfg.nproc, env)
        if tcfg.plan:
            from nanohlat import plan
            print(plan.search_report(model_cfg, tcfg, world) if tcfg.search else plan.report(model_cfg, tcfg, world))
            if tcfg.html and (not env or env[0] == 0):   # the planner as a page (plan/page.py); torchrun: rank 0's
                from nanohlat.plan import page
                page.write(model_cfg, tcfg, world, argv)
                print(f"wrote {tcfg.html}: the planner as a page")
            return 0
        recipe.check_layout(model_cfg, tcfg, world)   # a bad layout fails before any tokenizer work
        check_values(model_cfg, tcfg)
        tcfg = save_every_auto(model_cfg, tcfg, world, say=not env or env[0] == 0)   # --save-every auto: a number
        if tcfg.zero == 3 and devicelib.resolve_kind(tcfg.device) == "xla":
            raise UserError("--zero 3 is not supported on xla: a step is one traced graph, in which freeing a "
                            "layer's parameters between uses means nothing to the compiler; use --zero 2 (or 1)")
        if model_cfg.moe_experts and not model_cfg.moe_capacity_factor and devicelib.resolve_kind(tcfg.device) == "xla":
            raise UserError("a dropless mixture of experts is not supported on xla: each expert's token count "
                            "is a new shape, a new graph; give --moe-capacity-factor (e.g. 1.25: static shapes)")
        if tcfg.ep > 1 and devicelib.resolve_kind(tcfg.device) == "xla":
            raise UserError(f"--ep {tcfg.ep} is not supported on xla yet (its all-to-alls are tested on cpu and "
                            f"cuda only); on xla train a mixture of experts with its experts replicated, --ep 1")
        if tcfg.cp > 1 and devicelib.resolve_kind(tcfg.device) == "xla":
            raise UserError(f"--cp {tcfg.cp} is not supported on xla yet (--cp-attention {tcfg.cp_attention} is "
                            f"tested on cpu and cuda only); train with --cp 1 there")
        if tcfg.fp8 != "none" and devicelib.resolve_kind(tcfg.device) == "xla":
            raise UserError(f"--fp8 {tcfg.fp8} is not supported on xla yet (its FP8 linears are tested on cpu and "
                            f"cuda only); train without --fp8 there")
        devicelib.check_available(tcfg.device, tcfg.nproc if not env else 1)   # and a missing device
        check_memory(model_cfg, tcfg, world, launch.local_world_size() if env else tcfg.nproc, spawns=not env)
        runlock.check_out_dir(tcfg.out_dir)   # a FIFO or a device where a run writes: refused before any work
        # tokenizer and token shards are built once, here, before any worker starts
        ds = data.prepare_data(tcfg.data, tcfg.tokenizer, model_cfg.vocab_size, tcfg.cache_dir)
        model_cfg = vocab_from(ds, model_cfg, tcfg, world)
        if not env or env[0] == 0:   # one run per out-dir (nanohlat/run/runlock.py), held until we return
            lock = runlock.acquire(tcfg.out_dir)
        # --resume / --out-dir problems are refused here, once, as one line, not in N workers
        restarted = launch.restart_count() > 0
        resume_from = checkpoint.find_resume(tcfg.out_dir, tcfg.resume, tcfg.overwrite, restarted)
        checkpoint.warn_incomplete(tcfg.out_dir)
        if resume_from:
            # manifest, files, model shape; before local workers start, the checksums too
            manifest = checkpoint.check(resume_from, model_cfg,
                                        checksums=not env and (tcfg.nproc > 1 or tcfg.max_restarts > 0))
            checkpoint.check_identity(resume_from, ds.tokenizer.path, ds.fingerprint, tcfg.allow_tokenizer_change)
            checkpoint.note_model_changes(resume_from, manifest, model_cfg)   # (--moe-top-k, ...: a note)
        elif tcfg.resume == "never" and tcfg.overwrite and not restarted and (not env or env[0] == 0):
            checkpoint.clear_run(tcfg.out_dir)          # before any worker writes; under torchrun rank 0 only
        args = (train, model_cfg, tcfg, ds, resume_from)
        if env:
            warning = launch.torchrun_restart_warning()
            if warning and env[0] == 0 and not restarted:
                print(warning, file=sys.stderr)
            worker(*args, restarts_seen=launch.restart_count())   # (this process decided, restarts and all)
            return 0
        if tcfg.nproc == 1 and not tcfg.max_restarts:   # with restarts, a launcher process supervises
            with preempt.catch_signals(until_training=True) as signals:   # (before: at once, run/startup.py)
                train(model_cfg, tcfg, ds, resume_from, join(tcfg))
            return signals.exit_code   # 0, or 143 / 130 after a SIGTERM / Ctrl-C (checkpoint saved)
        return launch.spawn(worker, args, tcfg.nproc, tcfg.max_restarts, tcfg.collective_timeout,
                            progress=tcfg.progress)
    finally:
        if lock:
            lock.release()


MAX_BUCKETS = 10_000            # gradient buckets per flat buffer (collectives per step) at most
TIMEOUTS_S = (1.0, 7 * 86400.0)  # --collective-timeout / --rendezvous-timeout: one second to a week


def check_values(model_cfg: recipe.ModelConfig, tcfg: recipe.TrainConfig) -> None:
    """Values that config.validate accepts (finite, positive) but that would break
    the run later, refused in one line each:
      * --bucket-mb so small that a step's gradient reduction becomes a flood of
        tiny collectives (1e-30: one element each, ~250,000 a step for the tiny
        preset, each with a fixed cost: no step ends, and --collective-timeout never
        fires because every collective makes progress): at most MAX_BUCKETS
        buckets under 1 MB for one rank's gradients;
      * --collective-timeout / --rendezvous-timeout outside TIMEOUTS_S: below a
        second, joining the job (bounded by them) fails and blames MASTER_ADDR;
        far above a week, the runtime's clocks overflow (1e300: OverflowError in
        every worker)."""
    params = model_cfg.num_params() // (tcfg.tp * tcfg.pp)      # about one rank's gradients
    elems = max(1, int(tcfg.bucket_mb * 2**20 / 4))             # as optim.py cuts them (fp32)
    buckets = -(-params // elems)
    if buckets > MAX_BUCKETS and tcfg.bucket_mb < 1:   # (buckets of 1 MB or more: their count is the model's)
        least = min(1.0, math.ceil(params * 4 / MAX_BUCKETS / 2**20 * 1e4) / 1e4)
        raise UserError(f"--bucket-mb {tcfg.bucket_mb:g} cuts a rank's ~{params:,} gradients into {buckets:,} "
                        f"buckets, as many collectives every step (at most {MAX_BUCKETS:,} smaller than 1 MB: "
                        f"each has a fixed cost); give --bucket-mb >= {least:g} (the default is 25)")
    low, high = TIMEOUTS_S
    for name in ("collective_timeout", "rendezvous_timeout"):
        value = getattr(tcfg, name)
        if not low <= value <= high:
            raise UserError(f"--{name.replace('_', '-')} {value:g} is outside [{low:g}, {high:g}] seconds (one "
                            f"second to a week): a shorter one can end the job before every rank has joined, a "
                            f"longer one overflows the runtime's timers")


def save_every_auto(model_cfg: recipe.ModelConfig, tcfg: recipe.TrainConfig, world: int,
                    say: bool = False) -> recipe.TrainConfig:
    """--save-every auto made Young/Daly's interval in steps for this device (plan/failures.py), said in a note."""
    from nanohlat import plan
    tcfg, note = plan.resolve_save_every(model_cfg, tcfg, world, devicelib.resolve_kind(tcfg.device))
    if note and say:
        print(f"note: {note}", file=sys.stderr)
    return tcfg


def rotary_bytes(model_cfg: recipe.ModelConfig) -> int:
    """model.rotary_tables's peak: cos, sin and the angles they come from, (max_seq_len,
    head_dim) fp32 each, about four copies; every rank builds its own."""
    return 4 * 4 * model_cfg.max_seq_len * model_cfg.head_dim


def check_memory(model_cfg: recipe.ModelConfig, tcfg: recipe.TrainConfig, world: int, local: int,
                 spawns: bool) -> None:
    """Refuse, before anything is allocated, a model or sequence that cannot fit:
    the plan's peak per rank (plan/memory.py: weights, optimizer, gradient buffers,
    activations) plus the rotary tables (and on the cpu --async-save's snapshot of a
    shard in host memory: plan/failures.py), against this machine's memory (cpu: all
    `local` ranks share the RAM) or one GPU's (cuda). Only what truly cannot fit is
    refused (the estimate is of what must be held at once, not an upper bound).
    Not checked: xla (memory is the compiler's to plan; --plan shows it), and a cuda
    launcher that spawns workers (asking a GPU its size would make a CUDA context
    in this process, held for the whole run)."""
    from nanohlat import plan
    kind = devicelib.resolve_kind(tcfg.device)
    if kind == "xla" or (kind == "cuda" and spawns and tcfg.nproc > 1):
        return
    per_rank = plan.peak_memory_per_rank(model_cfg, dataclasses.replace(tcfg, device=kind), world) \
        + rotary_bytes(model_cfg) + (plan.snapshot_bytes(model_cfg, tcfg, world) if kind == "cpu" else 0)
    ranks = 1 if kind == "cuda" else max(1, min(local, world))
    refuse_if_too_big(ranks * per_rank, memory_of(kind), f"weights, optimizer, activations and the rotary tables "
                      f"of --max-seq-len {model_cfg.max_seq_len:,}",
                      "choose a smaller --d-model / --n-layers / --max-seq-len / --batch-size, or split it with "
                      "--tp / --pp over more machines (python train.py --plan ... shows the estimate)", ranks)


GiB = 2**30


def memory_of(kind: str) -> tuple[int, str] | None:
    """(bytes, who has them) one process on device `kind` can fill: one GPU's memory
    on cuda, this machine's RAM on cpu; None when unknown (xla, a system that does not say)."""
    if kind == "cuda":
        return torch.cuda.get_device_properties(0).total_memory, "this GPU has"
    if kind != "cpu":
        return None
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine has"
    except (ValueError, OSError, AttributeError):   # (not every system says)
        return None


def refuse_if_too_big(need: int, memory: tuple[int, str] | None, holds: str, advice: str, ranks: int = 1) -> None:
    """check_memory's refusal, one line: `need` bytes (of `ranks` ranks, saying what
    they `hold`) against `memory` (memory_of), with what to do."""
    if memory is None or need <= memory[0]:
        return
    have, where = memory
    each = f" ({ranks} ranks of {need / ranks / GiB:,.1f} GiB)" if ranks > 1 else ""
    raise UserError(f"this model does not fit: it needs about {need / GiB:,.1f} GiB{each} ({holds}), {where} "
                    f"{have / GiB:,.1f} GiB; {advice}")


def vocab_from(ds, model_cfg: recipe.ModelConfig, tcfg: recipe.TrainConfig, world: int) -> recipe.ModelConfig:
    """The model's vocabulary is the tokenizer's (a given --tokenizer may differ from
    --vocab-size); a changed one is checked again, and must split over --tp too."""
    if ds.tokenizer.vocab_size == model_cfg.vocab_size:
        return model_cfg
    model_cfg = dataclasses.replace(model_cfg, vocab_size=ds.tokenizer.vocab_size)
    model_cfg.validate()
    recipe.check_layout(model_cfg, tcfg, world)
    return model_cfg


def worker(train, model_cfg, tcfg, ds, resume_from: str | None, restarts_seen: int = 0) -> dict:
    """What each launched process runs (train.py --nproc N, or a torchrun rank
    after its pre-flight): `train` on this rank, its errors as one line (exit 2).
    `restarts_seen`: the launcher's restart count when `resume_from` was decided;
    workers it restarted since (--max-restarts) go on from the newest checkpoint."""
    rank, world, local_rank = launch.torchrun_env()
    launch.note_worker_pid(rank)   # for the launcher's stuck-rank watch
    try:
        if launch.restart_count() > restarts_seen:   # restarted after a failure: the newest checkpoint
            resume_from = checkpoint.find_resume(tcfg.out_dir, tcfg.resume, tcfg.overwrite, restarted=True)
        # SIGTERM / first Ctrl-C once training: finish the step, save, exit 143 / 130 (before: at once, run/startup.py)
        with preempt.catch_signals(until_training=True) as signals:
            dev = join(tcfg, rank, world, local_rank, launch.local_world_size())
            summary = train(model_cfg, tcfg, ds, resume_from, dev, rank, world)
    except UserError as e:
        launch.report_error(str(e))
        sys.exit(2)
    except OSError as e:
        launch.report_error(os_error_message(e))
        sys.exit(2)
    except KeyboardInterrupt:   # the second Ctrl-C: now (leaving a process group to the interpreter's
        launch.hard_exit(130)   # exit can wait seconds for the peers, gloo); nothing is saved
    except Exception as e:
        launch.worker_stub(e)   # an exercise stub of a student copy: its one line, exit 2
        if isinstance(e, RuntimeError) and launch.is_collective_timeout(e):
            # a peer made no progress for --collective-timeout seconds: one line, exit 1 (a run-time
            # failure; 2 is for inputs the user can fix). hard_exit: tearing down a process group that
            # is still waiting on a stuck peer can hang or abort, and there is nothing left to save.
            launch.report_error(launch.collective_timeout_message(rank, world, tcfg.collective_timeout, e))
            launch.hard_exit(1)
        # a crash (a bug): its one-line cause for the launcher, then its traceback, exit 1
        launch.report_error(launch.crash_line(e))
        raise
    # Leave the job cleanly: a process group still alive at interpreter exit can abort
    # it (gloo: "terminate called without an active exception", SIGABRT, ~1 run in 5)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    if signals.exit_code:
        sys.exit(signals.exit_code)
    return summary


def join(tcfg, rank: int = 0, world: int = 1, local_rank: int = 0, local_world: int = 1) -> devicelib.Device:
    """This process's place in the job, before train() runs on it: its device (cpu, cuda or xla:
    device.py; with trn1's rounding mode for --precision), its seeds, CPU threads and CPU memory, and with
    world > 1 the process group, joined within --rendezvous-timeout. Returns the device."""
    dev = devicelib.get_device(tcfg.device, local_rank, tcfg.precision)   # precision: trn1's rounding mode
    dev.manual_seed(tcfg.seed)   # torch's generators and, on xla, the device's own (a resume restores them)
    if dev.kind == "cpu":
        devicelib.set_cpu_threads(tcfg.threads or max(1, (os.cpu_count() or 1) // local_world))
        cpu_memory.keep_freed_memory()   # what a step frees stays for the next (cpu_memory.py)
    if world > 1 and not torch.distributed.is_initialized():
        with launch.rendezvous_deadline(tcfg.rendezvous_timeout, rank, world, on_timeout=runlock.release_all):
            dev.init_process_group(rank, world, tcfg.collective_timeout)
    return dev


def inputs(model_cfg: recipe.ModelConfig, tcfg: recipe.TrainConfig, world: int = 1, rank: int = 0) -> tuple:
    """(model_cfg, tcfg, ds, resume_from, dev, rank, world): train()'s inputs for a caller that has its
    configuration already and calls train() itself (the tests, a notebook), in each of its processes
    (rank `rank` of `world`, all on this machine): the layout checked, the data opened (silently), what
    to resume from, and this process joined to the job (`join`). None of `main`'s other checks, and
    no run lock."""
    recipe.check_layout(model_cfg, tcfg, world)
    tcfg = save_every_auto(model_cfg, tcfg, world)
    ds = data.prepare_data(tcfg.data, tcfg.tokenizer, model_cfg.vocab_size, tcfg.cache_dir, log=lambda *a: None)
    restarted = launch.restart_count() > 0
    resume_from = checkpoint.find_resume(tcfg.out_dir, tcfg.resume, tcfg.overwrite, restarted)
    return model_cfg, tcfg, ds, resume_from, join(tcfg, rank, world, rank, world), rank, world
